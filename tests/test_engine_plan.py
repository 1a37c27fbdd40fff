"""The plan builder (service.engine.plan): each sequence introduced to the worker once, its
rows carrying only what changed, what the worker holds mirrored exactly (checked by
applying every plan as the worker does, tests.plan_columns.HeldTables), and a plan whose
size does not grow with the contexts."""

from __future__ import annotations

import dataclasses

import torch

from gpu_worker.protocol import encode_frame, to_message
from gpu_worker.seq_table import PlanLimits, SeqTable
from policies.base import Decision
from service.engine.block_manager import BlockManager
from service.engine.request import SamplingParams
from service.engine.scheduler import ScheduleOutput, Scheduler
from service.engine.speculation import SpeculativeConfig
from tests.plan_columns import HeldTables
from tests.scheduler_helpers import make_request, make_scheduler, sampled_result


def planned(sched: Scheduler, schedule: list[tuple[int, int]]) -> ScheduleOutput:
    sched.policy.next = Decision(schedule=schedule)  # type: ignore[attr-defined]
    out = sched.schedule(now=0.0)
    assert out.plan is not None
    return out


def held_as_scheduled(sched: Scheduler, worker: HeldTables) -> None:
    """The worker's tables, once it applied the plans, are the block manager's."""
    for request in sched.running:
        if request.seq_id in worker.tables:
            assert worker.tables[request.seq_id][0] == sched.blocks.table(request.seq_id)


def test_a_sequence_is_introduced_once_and_each_row_adds_only_its_new_blocks():
    sched, _ = make_scheduler(num_blocks=16, block_size=4, max_tokens=8)
    request = make_request(0, 10, max_tokens=8)
    sched.add(request)
    worker = HeldTables()
    sent: list[list[int]] = []
    for schedule in ([(0, 4)], [(0, 4)], [(0, 2)], [(0, 1)], [(0, 1)], [(0, 1)]):
        out = planned(sched, schedule)
        worker.apply(out.plan)  # type: ignore[arg-type]
        held_as_scheduled(sched, worker)
        (row,) = out.plan.rows  # type: ignore[union-attr]
        sent.append(row.blocks[0] if row.blocks else [])
        assert [n.seq_id for n in out.plan.new] == ([0] if len(sent) == 1 else [])  # type: ignore[union-attr]
        sched.update(out, sampled_result(out))
    table = sched.blocks.table(0)
    # positions 0-3, 4-7, 8-9, then decodes at 10, 11 (block 2) and 12 (block 3)
    assert sent == [table[:1], table[1:2], table[2:3], [], [], [table[3]]]
    assert worker.introduced[0].prompt_len == 10


def test_blocks_given_back_after_rejected_drafts_are_written_again_where_the_table_ends():
    spec = SpeculativeConfig(num_speculative_tokens=4)
    sched, _ = make_scheduler(num_blocks=32, block_size=4, max_tokens=64, speculative=spec)
    request = make_request(0, 9, max_tokens=30, pattern=[1, 2, 3])
    request.params = SamplingParams(max_tokens=30)
    sched.add(request)
    worker = HeldTables()
    out = planned(sched, [(0, 9)])
    worker.apply(out.plan)  # type: ignore[arg-type]
    sched.update(out, _taking(out, [1]))
    trimmed = 0
    for _ in range(6):
        out = planned(sched, [(0, 1)])
        worker.apply(out.plan)  # type: ignore[arg-type]
        held_as_scheduled(sched, worker)
        (row,) = out.plan.rows  # type: ignore[union-attr]
        if row.drafts:
            before = len(sched.blocks.table(0))
            sched.update(out, _taking(out, [9]))  # every draft rejected: blocks given back
            trimmed += before - len(sched.blocks.table(0))
        else:
            sched.update(out, _taking(out, [1]))
    assert trimmed > 0  # the case this test is about happened
    out = planned(sched, [(0, 1)])
    worker.apply(out.plan)  # type: ignore[arg-type]
    held_as_scheduled(sched, worker)


def _taking(out: ScheduleOutput, tokens: list[int]):
    result = sampled_result(out)
    result.tokens = [tokens]
    return result


def test_a_preempted_sequence_is_forgotten_then_introduced_again():
    sched, _ = make_scheduler(num_blocks=4, block_size=4, max_tokens=64)
    a, b = make_request(0, 8, max_tokens=20), make_request(1, 4, max_tokens=20)
    sched.add(a)
    sched.add(b)
    worker = HeldTables()
    for schedule in ([(0, 8), (1, 4)], [(1, 1)], [(1, 1)], [(1, 1)]):
        out = planned(sched, schedule)
        worker.apply(out.plan)  # type: ignore[arg-type]
        sched.update(out, sampled_result(out))
    out = planned(sched, [(0, 1)])  # a needs a third block: b is preempted
    assert [r.seq_id for r in out.preempted] == [1] and out.plan.finished == [1]  # type: ignore[union-attr]
    worker.apply(out.plan)  # type: ignore[arg-type]
    assert sorted(worker.tables) == [0]
    sched.update(out, sampled_result(out))
    sched.remove(a)  # its end goes with the next plan
    out = planned(sched, [(1, 8)])
    assert out.plan.finished == [0] and [n.seq_id for n in out.plan.new] == [1]  # type: ignore[union-attr]
    worker.apply(out.plan)  # type: ignore[arg-type]
    held_as_scheduled(sched, worker)


def test_a_new_worker_is_told_of_nothing_it_never_held():
    sched, _ = make_scheduler(num_blocks=16, block_size=4, max_tokens=16, max_seqs=1)
    running, waiting = make_request(0, 6), make_request(1, 5)
    sched.add(running)
    sched.add(waiting)
    out = planned(sched, [(0, 6)])
    sched.update(out, sampled_result(out))
    sched.remove(running)  # as the engine fails what ran on a worker that died
    sched.replace_blocks(BlockManager(16, 4, 0.0))
    worker = HeldTables()  # the new worker
    out = planned(sched, [(1, 5)])
    assert out.plan.finished == [] and [n.seq_id for n in out.plan.new] == [1]  # type: ignore[union-attr]
    worker.apply(out.plan)  # type: ignore[arg-type]
    held_as_scheduled(sched, worker)


def decode_plan_bytes(context: int, batch: int = 64) -> int:
    """The frame of a decode step of `batch` sequences each `context` tokens long, in the
    middle of a block (no row gains one)."""
    block = 16
    blocks = batch * (context // block + 2)
    sched, _ = make_scheduler(
        num_blocks=blocks, block_size=block, max_tokens=context, max_seqs=batch
    )
    for seq_id in range(batch):
        sched.add(make_request(seq_id, context - 1, max_tokens=4))
        out = planned(sched, [(seq_id, context - 1)])
        sched.update(out, sampled_result(out))
    out = planned(sched, [(seq_id, 1) for seq_id in range(batch)])
    assert out.decode_seqs == batch and not any(row.blocks for row in out.plan.rows)  # type: ignore[union-attr]
    return len(encode_frame(to_message("step", out.plan)))


def test_a_decode_plan_does_not_grow_with_the_contexts():
    at_8k, at_4k, at_256 = (decode_plan_bytes(n) for n in (8190, 4094, 254))
    assert at_8k == at_4k
    # at 256 each row's position has one digit fewer: nothing else differs
    assert at_8k - at_256 == 64
    assert at_8k < 64 * 512  # less than a byte per block id of the tables the worker holds


def test_a_sequences_adapter_reaches_the_workers_table():
    """A per-sequence fact written once: its field of NewSeq, the table's column."""
    sched, _ = make_scheduler(num_blocks=16, block_size=4, max_tokens=16)
    request = make_request(0, 6)
    request.params = dataclasses.replace(request.params, adapter="support-bot")
    sched.add(request)
    out = planned(sched, [(0, 6)])
    table = SeqTable(PlanLimits(4, 16, vocab_size=256, max_model_len=64), torch.device("cpu"))
    table.adapter_slot_of = {"support-bot": 2}.__getitem__  # the worker's LoRA slots' names
    table.apply(out.plan)  # type: ignore[arg-type]
    assert table.seq(0).adapter == "support-bot" and table.seq(0).adapter_slot == 2
