"""The batch sizes a decode step is padded to: one ladder for the graphs (gpu_worker.graphs)
and for the kernels compiled per static batch (FlexAttention's decode), so that the shapes
either ever sees are few and known before serving."""

from __future__ import annotations

from collections.abc import Iterator

_SMALL_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)


def ladder() -> Iterator[int]:
    """1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, ... without end."""
    yield from _SMALL_BUCKETS
    size = _SMALL_BUCKETS[-1]
    while True:
        is_power_of_two = size & (size - 1) == 0
        size = size * 3 // 2 if is_power_of_two else size * 4 // 3
        yield size


def batch_buckets(max_num_seqs: int) -> list[int]:
    """The ladder's sizes below max_num_seqs, then max_num_seqs itself."""
    buckets: list[int] = []
    for size in ladder():
        if size >= max_num_seqs:
            return [*buckets, max_num_seqs]
        buckets.append(size)
    raise AssertionError("the ladder has no end")


def on_ladder(rows: int) -> int:
    """The smallest size of the ladder that holds `rows`."""
    return next(size for size in ladder() if size >= rows)


def smallest_fitting(n: int, buckets: list[int]) -> int | None:
    return next((b for b in buckets if b >= n), None)
