"""A step plan's rows read as columns, for the scheduler's tests."""

from __future__ import annotations

from typing import Any

from gpu_worker.protocol import NewSeq, StepPlan


def column(plan: StepPlan, name: str) -> list[Any]:
    """Each row's `name` (a Row field), or [] when no row has one (all empty or None)."""
    values = [getattr(row, name) for row in plan.rows]
    return values if any(values) else []


class HeldTables:
    """What a worker holds once it has applied each plan (gpu_worker.seq_table's rules):
    every sequence's tables, by KV group, and its introduction."""

    def __init__(self, num_groups: int = 1) -> None:
        self.num_groups = num_groups
        self.tables: dict[int, list[list[int]]] = {}
        self.introduced: dict[int, NewSeq] = {}

    def apply(self, plan: StepPlan) -> None:
        for seq_id in plan.finished:
            self.tables.pop(seq_id, None)
            self.introduced.pop(seq_id, None)
        for new in plan.new:
            assert new.seq_id not in self.tables, f"sequence {new.seq_id} introduced twice"
            self.tables[new.seq_id] = [[] for _ in range(self.num_groups)]
            self.introduced[new.seq_id] = new
        for row in plan.rows:
            assert row.seq_id in self.tables, f"sequence {row.seq_id} was never introduced"
            at = row.blocks_at
            for g, table in enumerate(self.tables[row.seq_id]):
                at = len(table) if at is None else at
                assert at <= len(table), "blocks that leave a gap in a table"
                del table[at:]
                if row.blocks:
                    table += row.blocks[g]
