"""The C++ decode-attention kernel against the PyTorch decode path it replaces on CPU."""

from __future__ import annotations

import os
import time

import pytest
import torch

from gpu_worker import attention, native
from gpu_worker.attention import torch_backend
from gpu_worker.kv_cache import LayerKV
from tests.worker_fixtures import HAS_BF16_PREFILL_KERNEL, needs_bf16_prefill_kernel


def test_the_kernel_builds_here() -> None:
    # The machines the suite runs on have a compiler and ninja (a dependency): a kernel that
    # does not build is a failure, not a reason to skip; the cause is in the log.
    assert native.kernels() is not None


def random_decode_case(
    dtype: torch.dtype, head_dim: int, group_size: int, block_size: int, seed: int
) -> tuple[torch.Tensor, ...]:
    """q (a strided view, as the model passes it), caches, block tables and context lengths.

    Blocks are shuffled, so no table is contiguous; the last two rows are padding (the
    scratch block, context length 1), and one real row has a context of a single token.
    """
    generator = torch.Generator().manual_seed(seed)
    batch, kv_heads, width = 7, 2, 5
    heads = kv_heads * group_size
    num_blocks = batch * width
    scratch = num_blocks
    shape = (kv_heads, num_blocks + 1, block_size, head_dim)
    k_cache = torch.randn(shape, generator=generator).to(dtype)
    v_cache = torch.randn(shape, generator=generator).to(dtype)
    tables = torch.randperm(num_blocks, generator=generator).view(batch, width)
    lens = torch.randint(1, width * block_size + 1, (batch,), generator=generator)
    lens[0], lens[1] = 1, width * block_size
    tables[-2:], lens[-2:] = scratch, 1
    qk = torch.randn(batch, heads + kv_heads, head_dim, generator=generator).to(dtype)
    return qk[:, :heads], k_cache, v_cache, tables, lens


def decode_both_ways(
    q, k_cache, v_cache, tables, lens, layer=attention.FULL
) -> tuple[torch.Tensor, torch.Tensor]:
    group_size = q.shape[1] // k_cache.shape[0]
    kv = LayerKV(k_cache, v_cache)

    def run(backend: attention.AttentionBackend) -> torch.Tensor:
        rows = attention.DecodeGroup(slice(None), tables, lens, layer=layer)
        group = backend.decode_group(rows, k_cache, group_size)
        return backend.decode(q, kv, group)

    return run(attention.NativeAttention(native.kernels())), run(attention.TorchAttention())


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("head_dim", [64, 128, 40])  # 40: the scalar loops
@pytest.mark.parametrize("group_size", [1, 3])
@pytest.mark.parametrize("block_size", [16, 5])  # 5: kernel steps of 4 rows straddle blocks
def test_kernel_matches_pytorch_decode(dtype, tolerance, head_dim, group_size, block_size):
    case = random_decode_case(dtype, head_dim, group_size, block_size, seed=head_dim + block_size)
    got, expected = decode_both_ways(*case)
    assert got.dtype == dtype and got.shape == case[0].shape
    torch.testing.assert_close(got.float(), expected.float(), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("head_dim", [64, 40])  # 40: the scalar loops
@pytest.mark.parametrize("window", [1, 7, 16, 100])  # 100: past every context
def test_kernel_attends_within_a_sliding_window(dtype, tolerance, head_dim, window):
    """Each row sees its last `window` tokens, which start mid-block (block size 5)."""
    case = random_decode_case(dtype, head_dim, 3, 5, seed=window)
    layer = attention.LayerAttention(scale=0.2, window=window)
    got, expected = decode_both_ways(*case, layer=layer)
    torch.testing.assert_close(got.float(), expected.float(), atol=tolerance, rtol=tolerance)
    if window < 25:  # the window bites: the whole context would give other values
        whole, _ = decode_both_ways(*case, layer=attention.LayerAttention(scale=0.2))
        assert not torch.allclose(got[1].float(), whole[1].float(), atol=tolerance)


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("head_dim", [64, 40])  # 40: the scalar loops
@pytest.mark.parametrize("window", [None, 7])
def test_kernel_soft_caps_the_scores(dtype, tolerance, head_dim, window):
    """Gemma 2's cap * tanh(score / cap), before the softmax and the window's mask; a cap
    of 2 bites on these scores (a large scale spreads them past it)."""
    case = random_decode_case(dtype, head_dim, 3, 5, seed=head_dim)
    layer = attention.LayerAttention(scale=0.5, window=window, softcap=2.0)
    got, expected = decode_both_ways(*case, layer=layer)
    torch.testing.assert_close(got.float(), expected.float(), atol=tolerance, rtol=tolerance)
    uncapped, _ = decode_both_ways(*case, layer=attention.LayerAttention(0.5, window))
    assert not torch.allclose(got[1].float(), uncapped[1].float(), atol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seq", [0, 1, 4])  # a thread's first task, and later ones: the
# bfloat16 kernel reads the next task's table to prefetch its rows while it runs this one
def test_kernel_rejects_a_block_outside_the_cache(dtype, seq):
    q, k_cache, v_cache, tables, lens = random_decode_case(dtype, 64, 3, 16, seed=0)
    last_block = (int(lens[seq]) - 1) // 16
    tables[seq, last_block] = k_cache.shape[1]
    kernel = native.kernels().paged_decode_attention
    with pytest.raises(RuntimeError, match="outside the cache"):
        kernel(q, k_cache, v_cache, tables, lens, 0.125)


def random_prefill_case(
    num_queries: int, start: int, group_size: int, head_dim: int, block_size: int, seed: int
):
    """One sequence's chunk whose K/V are already in shuffled cache blocks, as the model
    leaves them before attending; q is a strided view, as the model passes it."""
    generator = torch.Generator().manual_seed(seed)
    kv_heads = 2
    heads = kv_heads * group_size
    context = start + num_queries
    num_blocks = -(-context // block_size) + 3
    shape = (kv_heads, num_blocks, block_size, head_dim)
    k_cache = torch.randn(shape, generator=generator).to(torch.bfloat16)
    v_cache = torch.randn(shape, generator=generator).to(torch.bfloat16)
    table = torch.randperm(num_blocks, generator=generator)[: -(-context // block_size)]
    qkv = torch.randn(num_queries, heads + 2 * kv_heads, head_dim, generator=generator)
    q, k, v = qkv.to(torch.bfloat16).split([heads, kv_heads, kv_heads], dim=1)
    positions = torch.arange(start, context)
    slots = table[positions // block_size] * block_size + positions % block_size
    k_cache.view(kv_heads, -1, head_dim)[:, slots] = k.transpose(0, 1)
    v_cache.view(kv_heads, -1, head_dim)[:, slots] = v.transpose(0, 1)
    cache_rows = None
    if start > 0:
        cache_rows = (torch.arange(kv_heads)[:, None] * num_blocks + table).reshape(-1)
    chunk = attention.PrefillChunk(
        rows=slice(0, num_queries),
        start=start,
        context_len=context,
        block_table=table,
        prepared=torch_backend.TorchChunk(
            cache_rows, torch_backend.causal_tile(torch.bfloat16, torch.device("cpu"))
        ),
    )
    return q, k, v, k_cache, v_cache, chunk


def test_the_prefill_kernel_serves_bfloat16_where_the_cpu_has_avx512_bf16():
    # the kernel is registered only where it does
    cpu = torch.device("cpu")
    assert attention.NativeAttention.serves(cpu, torch.bfloat16, 64) == HAS_BF16_PREFILL_KERNEL
    assert not attention.NativeAttention.serves(cpu, torch.float32, 64)
    assert not attention.NativeAttention.serves(cpu, torch.bfloat16, 40)


@pytest.mark.parametrize(
    ("num_queries", "start", "group_size", "head_dim", "block_size"),
    [
        (1, 0, 3, 64, 16),  # a one-token chunk
        (37, 3, 3, 64, 16),  # an odd context: the last value pair is half empty
        (100, 0, 1, 64, 16),
        (64, 50, 3, 128, 16),
        (33, 17, 3, 32, 5),  # blocks of 5 tokens: query and key blocks straddle them
        (70, 0, 5, 64, 16),  # a group larger than one pass over the values takes
        (300, 900, 3, 64, 16),  # several query blocks over a long cached prefix
    ],
)
@needs_bf16_prefill_kernel
def test_prefill_kernel_matches_the_pytorch_path(
    num_queries, start, group_size, head_dim, block_size
):
    q, k, v, k_cache, v_cache, chunk = random_prefill_case(
        num_queries, start, group_size, head_dim, block_size, seed=num_queries + start
    )
    kernel = native.kernels().paged_prefill_attention
    got = kernel(q, k_cache, v_cache, chunk.block_table, start, head_dim**-0.5)
    expected = torch_backend._blocked_prefill_attention(q, k, v, LayerKV(k_cache, v_cache), chunk)
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)


@needs_bf16_prefill_kernel
def test_prefill_kernel_rejects_a_block_outside_the_cache():
    q, _, _, k_cache, v_cache, chunk = random_prefill_case(20, 10, 3, 64, 16, seed=1)
    table = chunk.block_table.clone()
    table[1] = k_cache.shape[1]
    kernel = native.kernels().paged_prefill_attention
    with pytest.raises(RuntimeError, match="outside the cache"):
        kernel(q, k_cache, v_cache, table, 10, 0.125)


def test_sources_flags_and_cpu_get_their_own_build_and_checkouts_share_it(tmp_path, monkeypatch):
    here = native.build_directory()
    assert here == native.build_directory() and here.name.startswith("cadence_native_")
    assert (here / "cadence_native.so").exists()  # the one this process loaded
    monkeypatch.setattr(native, "CFLAGS", [*native.CFLAGS[:1], "-march=x86-64-v3"])
    assert native.build_directory() != here
    monkeypatch.undo()
    # the same cache on a CPU that lacks one extension: `-march=native` means less there
    flags = native.cpu_flags().split()
    assert flags, "no instruction-set flags in /proc/cpuinfo"
    monkeypatch.setattr(native, "cpu_flags", lambda: " ".join(flags[:-1]))
    assert native.build_directory() != here
    monkeypatch.undo()
    copy = tmp_path / "csrc"
    copy.mkdir()
    for source in native.SOURCES[0].parent.iterdir():
        (copy / source.name).write_bytes(source.read_bytes())
    monkeypatch.setattr(native, "SOURCES", [copy / s.name for s in native.SOURCES])
    assert native.build_directory() == here  # another checkout, same text: the same build
    staged = native.staged_sources(here)  # compiled from the build's own copies
    assert [path.parent for path in staged] == [here / "src"] * len(staged)
    assert all(path.read_bytes() == (copy / path.name).read_bytes() for path in staged)
    (copy / native.SOURCES[0].name).write_bytes(b"// changed\n")
    assert native.build_directory() != here  # other text: another build


def test_a_lock_left_by_a_killed_build_is_removed_and_a_live_one_kept(tmp_path):
    assert not native.clear_stale_lock(tmp_path)
    lock = tmp_path / "lock"
    lock.touch()
    assert not native.clear_stale_lock(tmp_path) and lock.exists()
    old = time.time() - native.STALE_LOCK_SECONDS - 1
    os.utime(lock, (old, old))
    assert native.clear_stale_lock(tmp_path) and not lock.exists()


# gpt-oss's layers: full, and windowed (a window that starts mid-block and cuts the chunks)
SINK_LAYERS = {
    "full": attention.LayerAttention(sinks=True),
    "window": attention.LayerAttention(window=20, sinks=True),
}
SINK_STEP = ((37, 0), (20, 50), (1, 0), (1, 44), (1, 89))  # (new tokens, start) per row


def step_with_sinks(dtype: torch.dtype, group_size: int, seed: int):
    """A mixed step (a chunk at 0, one after a cached prefix, decode rows of 1 to 90 tokens
    of context) over shuffled cache blocks that already hold every new token's K/V; q is
    a strided view; the sinks are near the rows' log-sum-exps, so each takes a real share."""
    generator = torch.Generator().manual_seed(seed)
    kv_heads, head_dim, block_size = 2, 64, 16
    heads, width = kv_heads * group_size, 6
    num_blocks = len(SINK_STEP) * width
    shape = (kv_heads, num_blocks, block_size, head_dim)
    kv = LayerKV(*(torch.randn(shape, generator=generator).to(dtype) for _ in "kv"))
    tables = torch.randperm(num_blocks, generator=generator).view(len(SINK_STEP), width)
    slots = torch.cat(
        [
            tables[seq, positions // block_size] * block_size + positions % block_size
            for seq, (count, start) in enumerate(SINK_STEP)
            for positions in [torch.arange(start, start + count)]
        ]
    )
    k, v = (cache.view(kv_heads, -1, head_dim)[:, slots].transpose(0, 1) for cache in (kv.k, kv.v))
    tokens = len(slots)
    q = torch.randn(tokens, heads + kv_heads, head_dim, generator=generator).to(dtype)[:, :heads]
    sinks = (3 + 2 * torch.randn(heads, generator=generator)).to(dtype)
    return q, k, v, kv, tables, slots, sinks


def attend_step_with_sinks(backend, layer, q, k, v, kv, tables, slots, sinks) -> torch.Tensor:
    counts, starts = [c for c, _ in SINK_STEP], [s for _, s in SINK_STEP]
    group_size = q.shape[1] // kv.k.shape[0]
    meta = attention.metadata_for(counts, starts, tables, slots, kv.k, group_size, backend, layer)
    return attention.paged_attention(q, k, v, kv, meta, sinks)


SINK_CASES = [  # (backend, dtype, layer): the chunk kernel has no windows
    ("native-rows", torch.float32, "full"),
    ("native-rows", torch.float32, "window"),
    ("native-rows", torch.bfloat16, "window"),
    pytest.param("native", torch.bfloat16, "full", marks=needs_bf16_prefill_kernel),
    ("hybrid", torch.float32, "full"),
    ("hybrid", torch.bfloat16, "window"),
]


@pytest.mark.parametrize(("backend_name", "dtype", "layer"), SINK_CASES)
def test_the_kernels_add_attention_sinks_as_pytorch_does(backend_name, dtype, layer):
    """gpt-oss: each row's head sink joins its softmax, in decode rows and chunks' rows
    alike; float32 to 1e-5 of TorchAttention's sink path, bfloat16 as the kernels' other
    tests; and where the backend claims row invariance, a chunk's row has the bits of the
    same token decoded."""
    layers = (SINK_LAYERS[layer],)
    backend = {b.name: b for b in kernels_offered(dtype, layers)}[backend_name]
    step = step_with_sinks(dtype, group_size=3, seed=len(layer))
    got = attend_step_with_sinks(backend, SINK_LAYERS[layer], *step)
    want = attend_step_with_sinks(attention.TorchAttention(), SINK_LAYERS[layer], *step)
    without = attend_step_with_sinks(
        attention.TorchAttention(), SINK_LAYERS[layer], *step[:-1], None
    )
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert (want.float() - without.float()).abs().max() > 10 * tolerance  # the sinks count
    torch.testing.assert_close(got.float(), want.float(), atol=tolerance, rtol=tolerance)
    if backend.row_invariant:
        assert_chunk_rows_decode_alike(backend, SINK_LAYERS[layer], got, *step)


def kernels_offered(dtype, layers):
    from gpu_worker import kernels

    return kernels.attention_candidates(torch.device("cpu"), dtype, 64, layers)


def assert_chunk_rows_decode_alike(backend, layer, got, q, k, v, kv, tables, slots, sinks):
    """Rows of the second chunk (positions 50..69), decoded alone: the same bits."""
    rows = [37, 45, 56]  # its first, a middle and its last
    positions = [50 + row - 37 for row in rows]
    group_size = q.shape[1] // kv.k.shape[0]
    meta = attention.metadata_for(
        [1] * len(rows),
        positions,
        tables[[1] * len(rows)],
        slots[rows],
        kv.k,
        group_size,
        backend,
        layer,
    )
    decoded = attention.paged_attention(q[rows], k[rows], v[rows], kv, meta, sinks)
    assert torch.equal(decoded, got[rows])
