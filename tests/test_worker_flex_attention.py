"""FlexAttention, the CUDA attention backend, run eagerly on the CPU: it must agree with the
PyTorch reference on what a serving step gives it, read the cache in place, and hand the
compiled kernel block lists that cover exactly what its mask lets each query see."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounter
from torch.nn.attention.flex_attention import create_mask

from gpu_worker import kernel_choice, kernels
from gpu_worker.attention import (
    FULL,
    QUERY_BLOCK,
    FlexAttention,
    HybridAttention,
    LayerAttention,
    TorchAttention,
    flex_backend,
    metadata_for,
    torch_backend,
)
from gpu_worker.kernel_choice import Shapes, attention_case, run_decode, run_prefill
from tests.worker_fixtures import (
    Chunk,
    blocks_for,
    make_plan,
    make_runner,
    max_diff,
    random_prompt,
)

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

CPU = torch.device("cpu")
TOLERANCE = 1e-5


def shapes(block_size: int = 4) -> Shapes:
    """Grouped-query attention, 3 query heads per key/value head, of head_dim 64."""
    return Shapes(6, 2, 64, 128, 256, block_size, torch.float32, CPU, torch.float32)


# Plain layers, sliding windows shorter than the contexts, and Gemma 2's soft-capping.
LAYERS = [FULL, LayerAttention(window=9), LayerAttention(scale=0.3, window=50, softcap=1.5)]
LAYER_IDS = ["full", "window", "window-softcap"]


@pytest.mark.parametrize("layer", LAYERS, ids=LAYER_IDS)
@pytest.mark.parametrize("block_size", [4, 16])
def test_decode_matches_the_reference_over_ragged_contexts_and_shuffled_tables(block_size, layer):
    # attention_case shuffles every block of the cache among the tables; contexts differ.
    case = attention_case(shapes(block_size), batch=7, chunk=8, start=40)
    case.layer = layer
    # Contexts that fill their last block exactly, or hold one token, too.
    case.lens[:3] = [block_size * 3, 1, block_size + 1]
    got, want = run_decode(FlexAttention(), case), run_decode(TorchAttention(), case)
    assert got.shape == want.shape == (7, 6, 64)
    assert max_diff(got, want) < TOLERANCE


def test_a_block_behind_one_rows_window_serves_another_row():
    """The service frees the blocks wholly behind a sequence's window, leaving them in its
    table, and another sequence may take them (service.engine.block_manager.drop_before)."""
    case = attention_case(shapes(), batch=3, chunk=8, start=40)
    case.lens[:2] = [12, 40]
    stale = int(case.tables[1, 0])  # behind row 1's window: positions 31..39 are seen
    case.tables[0, 2] = stale  # row 0's positions 8..11, in its window
    case.layer = LayerAttention(window=9)
    got, want = run_decode(FlexAttention(), case), run_decode(TorchAttention(), case)
    assert max_diff(got, want) < TOLERANCE


@pytest.mark.parametrize("layer", LAYERS, ids=LAYER_IDS)
@pytest.mark.parametrize(("start", "chunk"), [(0, 37), (21, 37), (130, 300), (256, 128)])
def test_a_prefill_chunk_attends_over_its_cached_prefix_and_itself_causally(start, chunk, layer):
    case = attention_case(shapes(), batch=2, chunk=chunk, start=start)
    case.layer = layer
    got, want = run_prefill(FlexAttention(), case), run_prefill(TorchAttention(), case)
    assert got.shape == want.shape == (chunk, 6, 64)
    assert max_diff(got, want) < TOLERANCE


def test_it_never_gathers_the_cache(monkeypatch):
    case = attention_case(shapes(), batch=5, chunk=40, start=30)
    expected = run_decode(TorchAttention(), case), run_prefill(TorchAttention(), case)

    def gathers(*args, **kwargs):
        raise AssertionError("FlexAttention gathered the cache")

    for copier in ("_decode_gather", "_gather", "_rows_of", "_gathered_decode_attention"):
        monkeypatch.setattr(torch_backend, copier, gathers)
    backend = FlexAttention()
    assert max_diff(run_decode(backend, case), expected[0]) < TOLERANCE
    assert max_diff(run_prefill(backend, case), expected[1]) < TOLERANCE


def test_an_8_bit_cache_is_refused_so_the_chooser_passes_over_it():
    case = attention_case(Shapes(6, 2, 64, 128, 256, 4, torch.float32, CPU, torch.int8))
    with pytest.raises(RuntimeError, match="8-bit"):
        run_decode(FlexAttention(), case)


def test_it_is_offered_on_cuda_only_beside_the_reference():
    cuda = kernels.attention_candidates(torch.device("cuda"), torch.bfloat16, 64)
    assert [c.name for c in cuda][:2] == ["torch", "flex"]  # TritonAttention may follow
    cpu = kernels.attention_candidates(CPU, torch.bfloat16, 64)
    assert "flex" not in [c.name for c in cpu]


def test_the_chooser_prefers_it_to_the_gathering_reference(monkeypatch):
    chosen_with = {}

    def pick(candidates, name, check, workload, preferred, timer):
        chosen_with["preferred"] = preferred
        return candidates[0], []

    monkeypatch.setattr(kernel_choice, "pick", pick)
    kernel_choice.choose_attention([TorchAttention(), FlexAttention()], shapes())
    preferred = chosen_with["preferred"]
    assert preferred(FlexAttention())
    assert not preferred(TorchAttention())
    assert not preferred(HybridAttention(None))  # its prefill gathers


def block_coverage(mask) -> tuple[torch.Tensor, torch.Tensor]:
    """(listed, whole) [B, tiles, cache blocks]: the blocks the compiled kernel visits for
    each query tile, and those it visits without applying the mask_mod."""
    batch, _, tiles, _ = mask.kv_indices.shape
    blocks = mask.seq_lengths[1] // mask.BLOCK_SIZE[1]
    listed = torch.zeros(batch, tiles, blocks, dtype=torch.int32)
    whole = torch.zeros(batch, tiles, blocks, dtype=torch.int32)
    for counts, indices, into in (
        (mask.kv_num_blocks, mask.kv_indices, listed),
        (mask.full_kv_num_blocks, mask.full_kv_indices, whole),
    ):
        for b in range(batch):
            for m in range(tiles):
                for block in indices[b, 0, m, : counts[b, 0, m]].tolist():
                    into[b, m, block] += 1
    return listed, whole


def assert_blocks_match_the_mask(mask) -> None:
    """What the compiled kernel computes (listed blocks masked, whole ones not) is what the
    mask_mod allows, which is what the eager reference computes."""
    batch = mask.kv_indices.shape[0]
    q_len, kv_len = mask.seq_lengths
    q_block, kv_block = mask.BLOCK_SIZE
    dense = create_mask(mask.mask_mod, batch, 1, q_len, kv_len, device="cpu")[:, 0]
    listed, whole = block_coverage(mask)
    assert int((listed + whole).max()) <= 1, "a block is visited twice by one tile"
    for b in range(batch):
        for q in range(q_len):
            visible_blocks = dense[b, q].view(-1, kv_block).any(dim=1)
            visited = (listed + whole)[b, q // q_block].bool()
            assert torch.equal(visible_blocks & ~visited, torch.zeros_like(visited)), (b, q)
            whole_blocks = whole[b, q // q_block].bool()
            assert bool(dense[b, q].view(-1, kv_block)[whole_blocks].all()), (b, q)


def test_decode_block_lists_cover_exactly_what_each_row_sees():
    case = attention_case(shapes(), batch=6, chunk=8, start=20)
    case.lens[:2] = [12, 1]
    seqs = list(range(6))
    meta = metadata_for(
        [1] * 6,
        [case.lens[s] - 1 for s in seqs],
        case.tables,
        torch.zeros(6, dtype=torch.long),
        case.kv.k,
        case.group_size,
        FlexAttention(),
    )
    padded = meta.decode.prepared
    assert padded.batch == 8  # 6 rows padded to the ladder's rung; the 2 extra see nothing
    mask = padded.mask
    assert_blocks_match_the_mask(mask)
    # One row sees ceil(len / block_size) blocks, all but a partial last one whole.
    assert mask.full_kv_num_blocks[:2, 0, 0].tolist() == [3, 0]
    assert mask.kv_num_blocks[:2, 0, 0].tolist() == [0, 1]
    assert mask.full_kv_num_blocks[6:].sum() == mask.kv_num_blocks[6:].sum() == 0


@pytest.mark.parametrize("window", [None, 9, 150])
@pytest.mark.parametrize(("start", "chunk"), [(0, 130), (21, 300)])
def test_prefill_block_lists_cover_exactly_what_each_query_tile_sees(start, chunk, window):
    case = attention_case(shapes(), batch=1, chunk=chunk, start=start)
    meta = metadata_for(
        [chunk],
        [start],
        case.chunk_table[None],
        torch.zeros(chunk, dtype=torch.long),
        case.kv.k,
        case.group_size,
        FlexAttention(),
        LayerAttention(window=window),
    )
    mask = meta.prefills[0].prepared
    assert_blocks_match_the_mask(mask)
    if window == 9:  # a tile visits only the blocks its window reaches
        listed, _ = block_coverage(mask)
        assert int(listed.sum(-1).max()) <= -(-(QUERY_BLOCK + 9) // 4) + 1


def test_decode_block_lists_start_where_each_rows_window_does():
    case = attention_case(shapes(), batch=6, chunk=8, start=20)
    case.lens[:2] = [12, 1]
    meta = metadata_for(
        [1] * 6,
        [n - 1 for n in case.lens],
        case.tables,
        torch.zeros(6, dtype=torch.long),
        case.kv.k,
        case.group_size,
        FlexAttention(),
        LayerAttention(window=6),
    )
    mask = meta.decode.prepared.mask
    assert_blocks_match_the_mask(mask)
    # Positions 6..11 (blocks 1 and 2) for a context of 12; position 0 for a context of 1.
    assert mask.kv_num_blocks[:2, 0, 0].tolist() == [2, 1]
    assert mask.full_kv_num_blocks.sum() == 0


def test_a_mixed_step_of_the_model_matches_the_reference(tiny_llama_dir, monkeypatch):
    """Through the runner: a prefill chunk at a cached offset beside decode rows, whose
    tables are padded with the scratch block to the step's width."""
    offered = kernels.attention_candidates

    def with_flex(device, dtype, head_dim, layers=(FULL,)):
        return [*offered(device, dtype, head_dim, layers), FlexAttention()]

    monkeypatch.setattr(kernels, "attention_candidates", with_flex)
    logits = {}
    decoding = [(0, 30, list(range(8))), (1, 10, [20, 21, 22]), (2, 1, [30])]
    for name in ("torch", "flex"):
        runner = make_runner(
            tiny_llama_dir,
            kernels=f"attention={name},layer_ops=torch,matmul=aten",
            kernel_cache="",
        )
        prompt = random_prompt(30, seed=1)
        runner.step_logits(make_plan([Chunk(0, prompt[:17], 0, list(range(8)))]))
        runner.step_logits(make_plan([Chunk(1, random_prompt(9, 2), 0, [20, 21, 22])]))
        plan = make_plan(
            [
                Chunk(1, [5], 9, [20, 21, 22]),
                Chunk(0, prompt[17:], 17, list(range(8))),
                Chunk(2, random_prompt(1, 3), 0, [30]),
            ]
        )
        # Then a decode-only step of three rows, which the decode runner pads to four.
        decodes = make_plan([Chunk(i, [6], start, table) for i, start, table in decoding])
        logits[name] = torch.cat([runner.step_logits(plan), runner.step_logits(decodes)])
    assert logits["flex"].isfinite().all()
    assert max_diff(logits["flex"], logits["torch"]) < 1e-4


@pytest.fixture
def fresh_dynamo():
    """Dynamo keeps compiled graphs per code object for the whole process: counts start at 0."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.usefixtures("fresh_dynamo")
def test_decode_compiles_once_per_rung_of_the_ladder_whatever_the_contexts():
    """Its batch is static (the decoding kernel needs that), so rows are padded to a rung;
    the tables' width is dynamic, so one graph serves every context."""
    counter = CompileCounter()
    compiled = FlexAttention(compiler=counter)
    case = attention_case(shapes(), batch=8, chunk=8, start=40)
    for rows, lens in [(3, [1, 5, 9]), (4, [40, 2, 7, 13]), (3, [33, 20, 1]), (8, [40] * 8)]:
        case.lens[:rows] = lens
        seqs = list(range(rows))
        got = run_decode(compiled, case, seqs)
        assert got.shape == (rows, 6, 64)
        assert max_diff(got, run_decode(TorchAttention(), case, seqs)) < TOLERANCE
    assert counter.frame_count == 2  # rungs 4 and 8: tables 1 to 10 blocks wide in both
    assert flex_backend.compile_count() == 2


@pytest.mark.usefixtures("fresh_dynamo")
def test_prefill_compiles_once_per_tile_count_class_for_any_chunk_length():
    """Chunks of 2-127 tokens (those Inductor's decoding kernel cannot take) and longer ones,
    at cached offsets: lengths are dynamic. Three graphs: the first length dynamo sees
    (a constant of the block mask, specialised until a second one turns it dynamic), then
    one for a single query tile and one for several."""
    counter = CompileCounter()
    compiled = FlexAttention(compiler=counter)
    for start, chunk in [
        (0, 2),
        (0, 3),
        (21, 17),
        (5, 33),
        (0, 127),
        (40, 128),
        (3, 129),
        (9, 300),
    ]:
        case = attention_case(shapes(), batch=1, chunk=chunk, start=start)
        got = run_prefill(compiled, case)
        assert max_diff(got, run_prefill(TorchAttention(), case)) < TOLERANCE, (start, chunk)
    assert counter.frame_count == 3


@pytest.mark.usefixtures("fresh_dynamo")
def test_a_shape_past_the_compile_limit_fails_loudly_instead_of_running_densely(monkeypatch):
    monkeypatch.setattr(flex_backend, "COMPILE_LIMIT", 1)
    compiled = FlexAttention(compiler=CompileCounter())
    case = attention_case(shapes(), batch=8, chunk=8, start=40)
    run_decode(compiled, case, [0, 1, 2, 3])
    with pytest.raises(RuntimeError, match="decode compiled 1 graphs"):
        run_decode(compiled, case, list(range(8)))


def test_kernel_options_force_the_main_kernel_for_chunks_and_pipeline_decode(monkeypatch):
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert flex_backend.kernel_options("prefill", 64, cuda) == {
        "BLOCK_N": 64,
        "FORCE_USE_FLEX_ATTENTION": True,
    }
    assert flex_backend.kernel_options("decode", 64, cuda) == {"BLOCK_N": 64, "num_stages": 3}
    assert flex_backend.kernel_options("decode", 16, cpu) == {"BLOCK_N": 16}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    assert flex_backend.kernel_options("decode", 48, cuda) == {"BLOCK_N": 16}


@pytest.mark.usefixtures("fresh_dynamo")
def test_the_warm_up_compiles_every_shape_serving_reaches_before_the_handshake(
    tiny_llama_dir, monkeypatch
):
    counter = CompileCounter()
    offered = kernels.attention_candidates

    def with_compiled_flex(device, dtype, head_dim, layers=(FULL,)):
        return [*offered(device, dtype, head_dim, layers), FlexAttention(compiler=counter)]

    monkeypatch.setattr(kernels, "attention_candidates", with_compiled_flex)
    runner = make_runner(
        tiny_llama_dir,
        kernels="attention=flex,layer_ops=torch,matmul=aten",
        kernel_cache="",
        max_num_batched_tokens=200,
    )
    assert "warm-up" in runner.handshake.startup
    # Chunks of 2, 3, 127, 128, 129 and 200 tokens, one mixed step, a decode step per bucket.
    assert runner.handshake.warm_up["steps"] == 7 + len(runner.decode_runner.buckets)
    compiled_at_start = counter.frame_count
    # Chunks of other lengths at other offsets, decode batches of every size, mixed steps.
    first, table = random_prompt(150, seed=4), blocks_for(0, 151)
    steps = [
        [Chunk(0, first[:10], 0, table)],
        # 140 tokens (two query tiles) beside 50
        [Chunk(0, first[10:], 10, table), Chunk(1, random_prompt(50, 5), 0, blocks_for(40, 50))],
        [Chunk(i, [3], 10 + i, blocks_for(60 + 10 * i, 30)) for i in range(5)],
        [Chunk(i, [3], 20 + i, blocks_for(60 + 10 * i, 30)) for i in range(11)],
        [Chunk(0, [7], 150, table), Chunk(12, random_prompt(9, 6), 0, blocks_for(180, 9))],
    ]
    for seqs in steps:
        assert runner.step_logits(make_plan(seqs)).isfinite().all()
    assert counter.frame_count == compiled_at_start
