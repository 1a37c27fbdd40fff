"""FlexAttention, the CUDA backend: PyTorch's FlexAttention compiled through Triton, over
the whole cache seen as one long key sequence.

A block mask built from the block tables lists, for each query block, the cache blocks it
reads (its sequence's, in order), so decode rows and prefill chunks read K/V in place, each
byte once per query tile, and nothing is gathered: no temporary outside the KV budget.
Blocks every query of a tile sees whole skip the mask; in the others a mask_mod maps a
cache slot back to its position in the sequence. On a CPU FlexAttention runs eagerly,
densely over every cache slot: a reference that tests the masks, not a kernel to serve with.

What is compiled, and how often (Inductor picks its kernel by shape, see `kernel_options`):
- decode: one graph per static batch of the bucket ladder (gpu_worker.buckets) and kind of
  layer. Rows are padded to the ladder (padding rows see no key), so Inductor's
  flex-decoding kernel serves every decode step, in CUDA graphs, eager and mixed steps
  alike, and what the kernel chooser timed is what serves. Only the table width varies,
  marked dynamic: one graph covers every context;
- prefill: a few graphs per kind of layer, every length dynamic: the first length seen
  (the block mask's constant, specialised until a second turns it dynamic), one query
  tile or several, and Inductor's guards of its kernel choice (below 128 queries or not).
  A chunk forces the main kernel: the decoding kernel's tiles (BLOCK_M =
  next_pow2(chunk * group)) fit no config for a chunk of 2-127 tokens of a model whose
  query heads per KV head are a power of two (NoValidChoicesError), and a chunk has the
  rows to fill the main kernel's tiles anyway.
Past COMPILE_LIMIT graphs of either, dynamo would fall back to running FlexAttention
eagerly, densely over the whole cache (out of memory on a real one): it fails the step
instead, saying so.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from gpu_worker.attention.base import (
    QUERY_BLOCK,
    AttentionBackend,
    DecodeGroup,
    LayerAttention,
    PrefillChunk,
)
from gpu_worker.buckets import on_ladder
from gpu_worker.kv_cache import LayerKV

# Graphs per compiled function: the ladder's rungs up to 256 rows (13), for each kind of
# layer (Gemma's 2) and cache shape (the chooser's, the profile's, the worker's) fit.
COMPILE_LIMIT = 96
MIN_WIDTH = 2  # a table one block wide would be specialised, a graph of its own


@dataclass(slots=True)
class PaddedDecode:
    """The decode rows' mask, over a batch padded to the ladder."""

    mask: BlockMask
    batch: int


class FlexAttention(AttentionBackend):
    name = "flex"
    row_invariant = False
    windows = True
    softcap = True
    any_width = True

    def __init__(self, compiler: Any = None) -> None:
        """`compiler`: torch.compile's backend, so that a test can run the compiled path on
        a CPU; by default the path is compiled with Inductor on CUDA and eager elsewhere."""
        self.compiler = compiler

    def compiles(self, device: torch.device) -> bool:
        return self.compiler is not None or device.type == "cuda"

    def decode_group(
        self, group: DecodeGroup, cache_like: torch.Tensor, group_size: int
    ) -> DecodeGroup:
        block_size, cache_blocks = cache_like.shape[2], cache_like.shape[1]
        batch = on_ladder(group.context_lens.shape[0])
        tables = padded_tables(group.block_tables, batch, cache_blocks)
        # A padding row's context is empty: it sees nothing, and no block is listed for it.
        lens = F.pad(group.context_lens, (0, batch - group.context_lens.shape[0]))[:, None]
        mask = paged_block_mask(
            tables,
            lens[:, 0] - 1,
            (lens + block_size - 1) // block_size,
            lens // block_size,
            1,
            cache_like,
            group.layer.window,
        )
        group.prepared = PaddedDecode(mask, batch)
        return group

    def prefill_chunk(
        self, chunk: PrefillChunk, table: torch.Tensor, cache_like: torch.Tensor
    ) -> PrefillChunk:
        device, block_size = cache_like.device, cache_like.shape[2]
        count = chunk.context_len - chunk.start
        # Query tile m holds the chunk's queries [m * QUERY_BLOCK, (m + 1) * QUERY_BLOCK).
        firsts = chunk.start + torch.arange(0, count, QUERY_BLOCK)
        lasts = torch.clamp(firsts + QUERY_BLOCK, max=chunk.context_len) - 1
        chunk.prepared = paged_block_mask(
            padded_tables(table[None].to(device, non_blocking=True), 1, cache_like.shape[1]),
            torch.tensor([chunk.start], device=device),
            (lasts // block_size + 1)[None].to(device, non_blocking=True),
            ((firsts + 1) // block_size)[None].to(device, non_blocking=True),
            count,
            cache_like,
            chunk.layer.window,
        )
        return chunk

    def decode(self, q: torch.Tensor, kv: LayerKV, group: DecodeGroup) -> torch.Tensor:
        padded: PaddedDecode = group.prepared
        rows = q.shape[0]
        # A new tensor: a view's strides (a mixed step's rows of q) would be a graph apiece.
        queries = q.new_zeros((padded.batch, *q.shape[1:]))
        queries[:rows] = q
        attend = self._attend("decode", q.device)
        out = _flex(attend, queries[:, :, None], kv, padded.mask, group.layer, "decode")
        return out[:rows, :, 0]

    def prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: LayerKV, chunk: PrefillChunk
    ) -> torch.Tensor:
        """The chunk's own K/V are read back from the cache, where they already are."""
        queries = q.transpose(0, 1).contiguous()[None]
        attend = self._attend("prefill", q.device)
        return _flex(attend, queries, kv, chunk.prepared, chunk.layer, "prefill")[0].transpose(0, 1)

    def _attend(self, kind: str, device: torch.device) -> Callable[..., torch.Tensor]:
        if self.compiler is None and device.type != "cuda":
            return flex_attention
        return compiled(kind, self.compiler or "inductor")


def padded_tables(tables: torch.Tensor, batch: int, cache_blocks: int) -> torch.Tensor:
    """tables [B, W] -> [batch, max(W, MIN_WIDTH)], padded with `cache_blocks`, a block
    that is in no cache: the mask places it at no position, so no query sees it."""
    rows, width = tables.shape
    return F.pad(tables, (0, max(0, MIN_WIDTH - width), 0, batch - rows), value=cache_blocks)


def paged_block_mask(
    tables: torch.Tensor,
    q_first: torch.Tensor,
    counts: torch.Tensor,
    full: torch.Tensor,
    q_len: int,
    cache_like: torch.Tensor,
    window: int | None = None,
) -> BlockMask:
    """The block mask of `q_len` queries per sequence over the cache seen as one key sequence.

    tables [B, W]: each sequence's cache blocks; q_first [B]: the absolute position of its
    first query (query i sits at q_first + i and sees positions up to it); counts and full
    [B, tiles]: how many of its blocks query tile m sees at all, and how many whole (the
    first ones). Tensor ops only, so that a CUDA graph can capture it.

    Every table must be at least MIN_WIDTH wide (`padded_tables`).

    The mask_mod finds a cache slot's position through the block's index in the tables:
    a block sits at one index in every table that holds it (its keys are rotated for those
    positions; a shared prefix block is shared at its place), the scratch block aside,
    which holds nothing anyone sees, and the blocks behind a row's window.

    With a sliding `window`, a query also sees no key `window` or more positions before
    it: no block is listed whole then (the mask_mod drops the keys behind the window), and
    a tile's list starts at the first block its first query's window reaches.
    """
    batch, width = tables.shape
    cache_blocks, block_size = cache_like.shape[1], cache_like.shape[2]
    first = full  # a tile's partly visible blocks follow its whole ones in the table
    if window is not None:
        tiles = torch.arange(counts.shape[1], device=tables.device)
        lowest = (q_first[:, None] + QUERY_BLOCK * tiles - window + 1).clamp(min=0)
        first = torch.minimum(lowest // block_size, counts)
        full = torch.zeros_like(full)
    columns = torch.arange(width, device=tables.device)
    index_of = torch.zeros(cache_blocks + 1, dtype=torch.long, device=tables.device)
    placed = tables
    if window is not None:
        # Blocks wholly behind a row's window may have gone to other sequences (the
        # service frees them; the table keeps their places): they place nothing.
        behind = (q_first - window + 1).clamp(min=0) // block_size
        placed = torch.where(columns < behind[:, None], cache_blocks, tables)
    index_of.scatter_(0, placed.reshape(-1), columns.repeat(batch))
    in_order = tables[:, None, :].expand(-1, counts.shape[1], -1)
    partial = in_order.gather(2, (first[..., None] + columns).clamp(max=width - 1))

    def visible(
        b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
    ) -> torch.Tensor:
        block = kv_idx // block_size
        index = index_of[block]
        position = index * block_size + kv_idx % block_size
        seen = (tables[b, index] == block) & (position <= q_first[b] + q_idx)
        if window is None:
            return seen
        return seen & (position > q_first[b] + q_idx - window)

    mask = BlockMask.from_kv_blocks(
        _per_tile(counts - first),
        _per_tile(partial),
        _per_tile(full),
        _per_tile(in_order),
        BLOCK_SIZE=(QUERY_BLOCK, block_size),
        mask_mod=visible,
        seq_lengths=(q_len, cache_blocks * block_size),
        compute_q_blocks=False,
    )
    # The tables' width shapes only these: marked dynamic, one compiled graph serves them
    # all. Softly ("maybe"): were a lowering to need a width's value, that width would be
    # compiled on its own (counted against COMPILE_LIMIT) instead of failing the compile.
    for table in (tables, mask.kv_indices, mask.full_kv_indices):
        if table is not None:  # BlockMask's full lists are optional; given here
            torch._dynamo.maybe_mark_dynamic(table, table.dim() - 1)
    return mask


def _per_tile(t: torch.Tensor) -> torch.Tensor:
    """[B, tiles, ...] -> the [B, heads=1, tiles, ...] int32 layout of a BlockMask."""
    return t[:, None].to(torch.int32).contiguous()


def _flex(
    attend: Callable[..., torch.Tensor],
    q: torch.Tensor,
    kv: LayerKV,
    mask: BlockMask,
    layer: LayerAttention,
    kind: str,
) -> torch.Tensor:
    """q [B, heads, n, d] over the whole cache under `mask` -> [B, heads, n, d]."""
    if kv.quantized:
        raise RuntimeError("FlexAttention reads a cache of the model's dtype, not 8-bit codes")
    kv_heads, _, block_size, head_dim = kv.k.shape
    on_cuda = q.device.type == "cuda"
    if on_cuda and block_size % 16:
        raise RuntimeError("FlexAttention on CUDA needs a block size that is a multiple of 16")
    keys, values = (t.view(1, kv_heads, -1, head_dim) for t in (kv.k, kv.v))
    with torch._dynamo.config.patch(
        recompile_limit=COMPILE_LIMIT, fail_on_recompile_limit_hit=True
    ):
        try:
            return attend(
                q,
                keys,
                values,
                block_mask=mask,
                score_mod=None if layer.softcap is None else _softcap_mod(layer.softcap),
                scale=layer.scale_for(head_dim),
                enable_gqa=q.shape[1] != kv_heads,
                kernel_options=kernel_options(kind, block_size, q.device) if on_cuda else None,
            )
        except torch._dynamo.exc.FailOnRecompileLimitHit as exc:
            raise RuntimeError(
                f"FlexAttention's {kind} compiled {COMPILE_LIMIT} graphs: a shape the "
                "worker does not bound reached it"
            ) from exc


@functools.cache
def _softcap_mod(cap: float) -> Any:
    """Gemma 2's soft-capping as a score_mod (applied before the mask, as transformers)."""

    def capped(
        score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor
    ) -> torch.Tensor:
        return torch.tanh(score / cap) * cap

    return capped


# One function per kind: dynamo keeps its graphs, and counts them, per code object.
def _decode_attention(*args: Any, **kwargs: Any) -> torch.Tensor:
    return flex_attention(*args, **kwargs)


def _prefill_attention(*args: Any, **kwargs: Any) -> torch.Tensor:
    return flex_attention(*args, **kwargs)


@functools.cache
def compiled(kind: str, compiler: Any) -> Callable[..., torch.Tensor]:
    """The compiled FlexAttention of `kind`: decode static but for the tables' width (its
    batch is a rung of the ladder), prefill dynamic (its chunks have any length)."""
    function = _decode_attention if kind == "decode" else _prefill_attention
    return torch.compile(function, backend=compiler, fullgraph=True, dynamic=kind == "prefill")


def compile_count() -> int:
    """How many graphs dynamo has compiled for FlexAttention in this process, so far."""
    return sum(
        len(torch._dynamo.eval_frame._debug_get_cache_entry_list(function.__code__))
        for function in (_decode_attention, _prefill_attention)
    )


def kernel_options(kind: str, block_size: int, device: torch.device) -> dict[str, Any]:
    """What Inductor is told beyond its defaults.

    A key tile must divide a cache block (Triton's tiles are 16 wide at least). A prefill
    chunk forces the main kernel (see the module's doc). The decoding kernel's loads are
    pipelined in 3 stages on GPUs with asynchronous copies (sm_80 on): PyTorch 2.13 means
    to on sm_90 but its heuristic overwrites that with 1 stage for every GPU but sm_110.
    """
    options: dict[str, Any] = {"BLOCK_N": math.gcd(64, block_size)}
    if kind == "prefill":
        options["FORCE_USE_FLEX_ATTENTION"] = True
    elif device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0):
        options["num_stages"] = 3
    return options
