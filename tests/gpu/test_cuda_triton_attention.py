"""TritonAttention's kernels compiled for a CUDA device: the chooser's own check against the
PyTorch reference (decode and prefill), a decode row's bits whatever its batch and table
width, a mixed step's chunks in one prefill launch against the reference and alone, and
captures in a CUDA graph replayed over other contexts and chunks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpu_worker.attention import (
    FULL,
    DecodeGroup,
    LayerAttention,
    TorchAttention,
    metadata_for,
    paged_attention,
)
from gpu_worker.kernel_choice import (
    Shapes,
    attention_case,
    check_attention,
    run_decode,
    run_prefill,
)

pytestmark = pytest.mark.cuda

CUDA = torch.device("cuda")
LAYERS = [FULL, LayerAttention(window=700), LayerAttention(scale=0.3, window=50, softcap=1.5)]


def backend():
    from gpu_worker.attention.triton_backend import TritonAttention

    return TritonAttention()


@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("start", [100, 2500])  # 3 segments of 128 keys at most; 16
def test_it_passes_the_choosers_check(block_size, dtype, start):
    # 3 query heads per key/value head; 32 decode rows over shuffled tables.
    shapes = Shapes(24, 8, 64, 1536, 4096, block_size, dtype, CUDA, dtype)
    case = attention_case(shapes, batch=32, chunk=200, start=start)
    reference = TorchAttention()
    expected = run_decode(reference, case), run_prefill(reference, case)
    assert check_attention(backend(), case, expected) is None


@pytest.mark.parametrize("layer", LAYERS, ids=["full", "window", "window-softcap"])
@pytest.mark.parametrize("group", [1, 4, 7])
@pytest.mark.parametrize("head_dim", [64, 256])  # Gemma's 256: 32-key tiles, 2 to a block
def test_decode_matches_the_reference_in_every_kind_of_layer(layer, group, head_dim):
    bf16 = torch.bfloat16
    shapes = Shapes(2 * group, 2, head_dim, 1536, 4096, 64, bf16, CUDA, bf16)
    case = attention_case(shapes, batch=9, chunk=8, start=1500)
    case.layer = layer
    got, want = run_decode(backend(), case), run_decode(TorchAttention(), case)
    assert (got.float() - want.float()).abs().max().item() < 2e-2


@pytest.mark.parametrize("head_dim", [64, 128])  # 128-key tiles over 8 blocks; 64 over 4
@pytest.mark.parametrize("longest", [128, 2304])  # one segment (no merge); up to 16
def test_a_rows_bits_depend_on_neither_its_batch_nor_its_table_width(head_dim, longest):
    shapes = Shapes(32, 8, head_dim, 1536, 4096, 16, torch.bfloat16, CUDA, torch.bfloat16)
    case = attention_case(shapes, batch=16, chunk=8, start=longest)
    generator = torch.Generator().manual_seed(1)
    case.lens = [longest, 1, *torch.randint(1, longest, (14,), generator=generator).tolist()]
    attention = backend()
    batch = run_decode(attention, case)
    for row in (0, 1, 7, 15):  # each alone at its own width: one segment or several
        assert torch.equal(run_decode(attention, case, [row])[0], batch[row])
    lens = torch.tensor(case.lens, device=CUDA)
    tables = case.tables[:, : -(-longest // 16)].to(CUDA)
    for width in (2 * tables.shape[1], 300):  # the short case's merge runs where it had none
        group = DecodeGroup(slice(None), F.pad(tables, (0, width - tables.shape[1])), lens)
        assert torch.equal(attention.decode(case.q_decode, case.kv, group), batch)


def test_a_captured_decode_replays_over_other_contexts():
    shapes = Shapes(32, 8, 128, 1536, 4096, 16, torch.bfloat16, CUDA, torch.bfloat16)
    case = attention_case(shapes, batch=8, chunk=8, start=1000)
    attention, width = backend(), case.tables.shape[1]
    q = case.q_decode.clone()
    tables = case.tables.to(CUDA).clone()
    lens = torch.ones(8, dtype=torch.long, device=CUDA)  # captured over one-token contexts
    group = DecodeGroup(slice(None), tables, lens)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compiles and warms up outside the graph
        attention.decode(q, case.kv, group)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attention.decode(q, case.kv, group)
    lens.copy_(torch.tensor(case.lens))
    graph.replay()
    eager = DecodeGroup(slice(None), case.tables[:, :width].to(CUDA), lens.clone())
    assert torch.equal(out, attention.decode(q, case.kv, eager))
    reference = run_decode(TorchAttention(), case)
    assert (out.float() - reference.float()).abs().max().item() < 2e-2


def mixed_step(layer: LayerAttention, head_dim: int = 128, group: int = 4):
    """A step of chunks after a cached prefix (their keys already in the cache) beside
    decode rows: (case, counts, starts, q)."""
    bf16 = torch.bfloat16
    shapes = Shapes(8 * group, 8, head_dim, 1536, 4096, 16, bf16, CUDA, bf16)
    case = attention_case(shapes, batch=6, chunk=8, start=1000)
    case.layer = layer
    counts = [300, 1, 77, 1, 512, 5]
    starts = [length - count for length, count in zip(case.lens, counts, strict=True)]
    generator = torch.Generator().manual_seed(2)
    q = torch.randn((sum(counts), 8 * group, head_dim), generator=generator).to(CUDA, bf16)
    return case, counts, starts, q


def attend_step(attention, case, counts, starts, q):
    meta = metadata_for(
        counts,
        starts,
        case.tables,
        torch.zeros(q.shape[0], dtype=torch.long, device=CUDA),
        case.kv.k,
        case.group_size,
        attention,
        case.layer,
    )
    kv_rows = q[:, : case.kv.k.shape[0]]  # unread: every chunk's own K/V is in the cache
    return meta, paged_attention(q, kv_rows, kv_rows, case.kv, meta)


@pytest.mark.parametrize("layer", LAYERS, ids=["full", "window", "window-softcap"])
@pytest.mark.parametrize(("head_dim", "group"), [(64, 1), (128, 4), (128, 8), (256, 7)])
def test_a_mixed_steps_chunks_in_one_launch_match_the_reference(layer, head_dim, group):
    case, counts, starts, q = mixed_step(layer, head_dim, group)
    _, got = attend_step(backend(), case, counts, starts, q)
    _, want = attend_step(TorchAttention(), case, counts, starts, q)
    assert (got.float() - want.float()).abs().max().item() < 2e-2


def test_a_chunk_has_the_same_bits_alone_as_among_others():
    case, counts, starts, q = mixed_step(LayerAttention(window=700))
    attention = backend()
    meta, step = attend_step(attention, case, counts, starts, q)
    for chunk in meta.prefills:
        rows = chunk.rows
        alone = attention.prefill(q[rows], q[rows], q[rows], case.kv, chunk)
        assert torch.equal(alone.flatten(1), step[rows])


def test_a_captured_prefill_replays_over_other_chunks():
    from gpu_worker.attention.triton_varlen import chunks_on, paged_prefill

    case, _, _, q = mixed_step(FULL)
    tables = case.tables[:3].to(CUDA)
    captured = chunks_on(CUDA, [0, 1, 2], [1, 1, 1], [0, 0, 0], tables)  # one-token chunks
    out = torch.zeros_like(q)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compiles and warms up outside the graph
        paged_prefill(q, case.kv.k, case.kv.v, captured, FULL, out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_prefill(q, case.kv.k, case.kv.v, captured, FULL, out)
    rows, lengths = [0, 300, 600], [300, 300, 296]  # fills q's 896 rows
    replayed = chunks_on(
        CUDA, rows, lengths, [case.lens[s] - n for s, n in enumerate(lengths)], tables
    )
    for static, value in zip(
        (captured.cu_q, captured.rows, captured.starts),
        (replayed.cu_q, replayed.rows, replayed.starts),
        strict=True,
    ):
        static.copy_(value)
    graph.replay()
    eager = torch.zeros_like(q)
    paged_prefill(q, case.kv.k, case.kv.v, replayed, FULL, eager)
    assert torch.equal(out, eager)


@pytest.mark.parametrize("layer", LAYERS, ids=["full", "window", "window-softcap"])
def test_a_prompts_rows_have_the_same_bits_however_it_is_cut_into_chunks(layer):
    # Cut at 37 queries, no multiple of a query tile's: a row's place in its tile moves,
    # and with it the key tiles the tile walks, which the row does not see.
    from gpu_worker.attention.triton_varlen import chunks_on, paged_prefill

    case, _, _, q = mixed_step(layer)
    tables, start = case.tables[:1].to(CUDA), case.lens[0] - 300
    whole, cut = torch.zeros_like(q[:300]), torch.zeros_like(q[:300])
    paged_prefill(
        q[:300], case.kv.k, case.kv.v, chunks_on(CUDA, [0], [300], [start], tables), layer, whole
    )
    pieces = chunks_on(CUDA, [0, 37], [37, 263], [start, start + 37], tables.expand(2, -1))
    paged_prefill(q[:300], case.kv.k, case.kv.v, pieces, layer, cut)
    assert torch.equal(cut, whole)
