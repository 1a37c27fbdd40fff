"""The worker's model against transformers, and the paged-attention invariants."""

from __future__ import annotations

import json

import pytest
import torch

from gpu_worker.attention import torch_backend
from gpu_worker.protocol import SamplingSpec, StepPlan
from tests.worker_fixtures import (
    BLOCK_SIZE,
    QWEN_EXPERTS,
    Chunk,
    blocks_for,
    generate_greedy,
    hf_model,
    make_runner,
    max_diff,
    plan_for,
    random_prompt,
    sampled,
    save_tiny_model,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

YARN_ROPE = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
VARIANTS = {
    "llama": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "qwen2-bias": ("qwen2", {}),
    "llama3-rope": ("llama", {"rope_scaling": LLAMA3_ROPE, "rope_theta": 500000.0}),
    "linear-rope": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
    "yarn-rope": ("llama", {"rope_scaling": YARN_ROPE}),
    "head-dim-32": ("llama", {"head_dim": 32}),
}
# The other families (tests.worker_fixtures.ARCHITECTURE_KINDS: windows shorter than the
# prompts, several experts per token), each checked with the kernels the worker picks for it.
ARCHITECTURES = {
    "qwen3-yarn": ("qwen3", {"rope_scaling": {**YARN_ROPE, "beta_fast": 8.0, "beta_slow": 2.0}}),
    "mistral-window": ("mistral", {}),
    "gemma3": ("gemma3", {}),
    "gemma2-softcap": ("gemma2", {}),
    "phi3-longrope": ("phi3", {}),  # serves 256 positions > 48: the long factors
    "phi3-longrope-short": ("phi3", {"max_position_embeddings": 48}),
    "mixtral": ("mixtral", {}),
    "qwen3-moe": ("qwen3_moe", {}),
    "qwen2-moe-shared": ("qwen2_moe", {}),
    "smollm3-nope": ("smollm3", {}),
    "gpt-oss-sinks": ("gpt_oss", {}),
    "gemma4-shared-kv": ("gemma4", {}),
    "qwen3-next": ("qwen3_next", {}),
    "qwen3-next-moe": ("qwen3_next_moe", {}),
    "qwen3.5": ("qwen3_5", {}),
    "qwen3.5-moe": ("qwen3_5_moe", {}),
    "gemma4-moe": (
        "gemma4",
        {
            "enable_moe_block": True,
            "num_experts": 5,
            "top_k_experts": 2,
            "moe_intermediate_size": 24,
        },
    ),
}
# The hybrid linear-attention families (a recurrent state per sequence): 32 greedy tokens,
# and a forced preemption instead of a prefix-cache hit, which they cannot resume.
LINEAR_ATTENTION = ("qwen3-next", "qwen3-next-moe", "qwen3.5", "qwen3.5-moe")
# A family's prompts, where they differ: longrope matches transformers within one factor set.
PROMPT_LENGTHS = {"phi3-longrope": (49, 90), "phi3-longrope-short": (1, 5, 37, 48)}
ARCH_KV_MEMORY = float(4 * 1024 * 1024)  # three layers, and the checks' block ids up to 730


def tolerance(reference: torch.Tensor) -> float:
    return 1e-4 * max(1.0, reference.abs().max().item())


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant_dir(request, tmp_path_factory):
    kind, overrides = VARIANTS[request.param]
    return save_tiny_model(tmp_path_factory.mktemp(request.param), kind, **overrides)


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def architecture(request, tiny_models):
    """(name, model directory, runner with the kernels chosen for it, transformers' model)."""
    kind, overrides = ARCHITECTURES[request.param]
    path = tiny_models(kind, **overrides)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one_torch_thread is function-scoped
    try:
        runner = make_runner(path, kv_memory=ARCH_KV_MEMORY)
    finally:
        torch.set_num_threads(threads)
    return request.param, path, runner, hf_model(path)


@pytest.fixture(params=["native-rows", "hybrid", "torch-blocked", "torch-flash"])
def prefill_path(request, monkeypatch) -> str:
    """The attention backends float32 offers on a CPU (kernels pins for make_runner).

    Tiny test contexts stay under FLASH_MIN_CONTEXT; the flash path runs them too."""
    if request.param == "torch-flash":
        monkeypatch.setattr(torch_backend, "FLASH_MIN_CONTEXT", 0)
    return "attention=" + request.param.removesuffix("-blocked").removesuffix("-flash")


@pytest.fixture(params=["native", "torch"])
def layer_ops_path(request) -> str:
    """CPUs run the fused C++ layer ops; the PyTorch ones (what CUDA runs) are checked too."""
    return "layer_ops=" + request.param


def test_prefill_logits_match_transformers(variant_dir, prefill_path, layer_ops_path):
    runner = make_runner(variant_dir, kernels=f"{prefill_path},{layer_ops_path}")
    check_prefill_logits(runner, hf_model(variant_dir), (1, 5, 37, 150))


def check_prefill_logits(runner, hf, lengths) -> None:
    for seq_id, length in enumerate(lengths):
        prompt = random_prompt(length, seed=length)
        with torch.no_grad():
            reference = hf(torch.tensor([prompt])).logits[0, -1]
        table = blocks_for(seq_id * 40, length)
        logits = runner.step_logits(plan_for(runner, [Chunk(seq_id, prompt, 0, table)]))[0]
        assert max_diff(logits, reference) < tolerance(reference), f"prompt length {length}"


def test_token_by_token_logits_match_transformers_at_every_position(variant_dir, layer_ops_path):
    """Chunks of one token: each step attends only to K/V earlier steps left in the cache."""
    runner = make_runner(variant_dir, kernels=layer_ops_path)
    check_token_by_token_logits(runner, hf_model(variant_dir), 40)


def check_token_by_token_logits(runner, hf, length: int, first: int = 0) -> None:
    """Positions from `first` on, after a prefill of the ones before."""
    prompt = random_prompt(length, seed=3)
    with torch.no_grad():
        reference = hf(torch.tensor([prompt])).logits[0, first:]
    table = blocks_for(0, len(prompt))
    if first:
        runner.execute(plan_for(runner, [Chunk(0, prompt[:first], 0, table, sample=False)]))
    rows = [
        runner.step_logits(plan_for(runner, [Chunk(0, [token], pos, table)]))[0]
        for pos, token in enumerate(prompt[first:], start=first)
    ]
    assert max_diff(torch.stack(rows), reference) < tolerance(reference)


def test_architecture_logits_match_transformers(architecture):
    """A prompt's last logits, every position decoded token by token, and greedy decoding,
    past each window (gpt-oss's sinks on the C++ kernels, the row-invariant choice)."""
    name, _, runner, hf = architecture
    if name == "gpt-oss-sinks":
        assert runner.model.kernels.attention.name == "native-rows"
    check_prefill_logits(runner, hf, PROMPT_LENGTHS.get(name, (1, 5, 37, 90)))
    first = PROMPT_LENGTHS.get(name, (0,))[0] - 1
    check_token_by_token_logits(runner, hf, first + 30, first=max(first, 0))
    steps = 32 if name in LINEAR_ATTENTION else 16
    check_greedy_decoding(runner, hf, random_prompt(max(12, first + 1), seed=7), steps)


@pytest.mark.parametrize(
    "architecture",
    [name for name in ARCHITECTURES if name != "phi3-longrope-short"],  # 48 tokens: too few
    indirect=True,
)
def test_architecture_chunked_batched_and_prefix_cached(architecture, one_torch_thread):
    name, _, runner, _ = architecture
    check_chunked_prefill(runner)
    check_mixed_batch(runner)
    if name in LINEAR_ATTENTION:
        check_preempted_recompute(runner)
        check_prefix_hit_refused(runner)
    else:
        check_prefix_cache(runner)


@pytest.mark.parametrize(
    "name",
    [
        "mistral-window",
        "gemma3",
        "gemma2-softcap",
        "mixtral",
        "qwen3-moe",
        "qwen2-moe-shared",
        "smollm3-nope",
        "gpt-oss-sinks",
        "gemma4-shared-kv",
    ],
)
def test_architecture_rows_keep_their_bits_batched_and_chunked_in_bfloat16(
    name, tiny_models, one_torch_thread
):
    """Where a row-invariant attention serves (the decode kernel's windows, Gemma 2's
    soft-capping and gpt-oss's sinks too), a row's bfloat16 logits are the same bits beside
    other sequences and in chunks of any size: the experts' routing and matmuls
    (gpu_worker.moe) keep the claim."""
    kind, overrides = ARCHITECTURES[name]
    runner = make_runner(tiny_models(kind, **overrides), dtype="bfloat16", kv_memory=ARCH_KV_MEMORY)
    assert runner.model.kernels.attention.row_invariant
    check_mixed_batch(runner)
    check_chunked_prefill(runner)


def test_attention_sinks_through_the_cpu_flash_path(tiny_models, monkeypatch, one_torch_thread):
    """gpt-oss's full layers on PyTorch's flash kernel (every context long enough here):
    over a chunk alone, and merged with a cached prefix, each row weighted by its sink."""
    monkeypatch.setattr(torch_backend, "FLASH_MIN_CONTEXT", 0)
    kind, overrides = ARCHITECTURES["gpt-oss-sinks"]
    path = tiny_models(kind, **overrides)
    runner = make_runner(path, kv_memory=ARCH_KV_MEMORY, kernels="attention=torch")
    check_prefill_logits(runner, hf_model(path), (5, 37))
    check_prefix_cache(runner)


def test_chunked_prefill_equals_unchunked(tiny_llama_dir, prefill_path):
    check_chunked_prefill(make_runner(tiny_llama_dir, kernels=prefill_path))


def check_chunked_prefill(runner) -> None:
    """Bit for bit where the attention claims row invariance: recompute after a
    preemption (chunks of any size, one token each among them) gives the decoded bits."""
    exact = claims_row_invariance(runner)
    prompt = random_prompt(100, seed=5)
    whole_table = blocks_for(0, len(prompt) + 20)
    whole = runner.step_logits(plan_for(runner, [Chunk(0, prompt, 0, whole_table)]))[0]
    whole_tokens = generate_greedy(runner, prompt, steps=12)
    for index, chunk_size in enumerate((1, 3, 7, 16, 64)):
        table = blocks_for(100 * (index + 1), len(prompt))
        start = 0
        while start < len(prompt):
            piece = prompt[start : start + chunk_size]
            last = start + len(piece) == len(prompt)
            plan = plan_for(runner, [Chunk(1, piece, start, table, sample=last)])
            logits = runner.step_logits(plan)
            start += len(piece)
        assert max_diff(logits[0], whole) < tolerance(whole), f"chunk size {chunk_size}"
        assert torch.equal(logits[0], whole) or not exact, f"chunk size {chunk_size}"
    # Decoding after a chunked prefill continues the same greedy sequence.
    table = blocks_for(700, len(prompt) + 20)
    tokens = []
    for start in range(0, len(prompt), 7):
        piece = prompt[start : start + 7]
        result = runner.execute(plan_for(runner, [Chunk(2, piece, start, table)]))
    tokens += sampled(result)
    while len(tokens) < len(whole_tokens):
        position = len(prompt) + len(tokens) - 1
        tokens += sampled(
            runner.execute(plan_for(runner, [Chunk(2, [tokens[-1]], position, table)]))
        )
    assert tokens == whole_tokens


def test_a_sequence_is_the_same_alone_and_in_a_mixed_batch(tiny_llama_dir, prefill_path):
    check_mixed_batch(make_runner(tiny_llama_dir, kernels=prefill_path))


def check_mixed_batch(runner) -> None:
    """Bit for bit where the attention claims row invariance (the matmuls and the experts'
    routing keep it: gpu_worker.linear, gpu_worker.moe)."""
    target = random_prompt(30, seed=11)
    # Alone: the first 20 tokens, then a chunk of 10 at position 20.
    alone_table = blocks_for(0, 40)
    runner.execute(plan_for(runner, [Chunk(0, target[:20], 0, alone_table, sample=False)]))
    alone = runner.step_logits(plan_for(runner, [Chunk(0, target[20:], 20, alone_table)]))[0]

    # In a batch: other sequences are decoding and prefilling (first and later chunks) at
    # the same step, in different blocks, placed before and after the target.
    other = random_prompt(25, seed=12)
    decoding = random_prompt(17, seed=13)
    tables = {name: blocks_for(base, 40) for name, base in (("t", 100), ("o", 200), ("d", 300))}
    warmup = plan_for(
        runner,
        [
            Chunk(1, target[:20], 0, tables["t"], sample=False),
            Chunk(2, other[:9], 0, tables["o"], sample=False),
            Chunk(3, decoding, 0, tables["d"]),
        ],
    )
    assert runner.execute(warmup).error is None
    mixed = plan_for(
        runner,
        [
            Chunk(3, [7], 17, tables["d"]),
            Chunk(2, other[9:], 9, tables["o"]),
            Chunk(1, target[20:], 20, tables["t"]),
            Chunk(4, random_prompt(6, seed=14), 0, blocks_for(400, 6)),
        ],
    )
    logits = runner.step_logits(mixed)
    assert max_diff(logits[2], alone) < tolerance(alone)
    if claims_row_invariance(runner):
        assert torch.equal(logits[2], alone)


def claims_row_invariance(runner) -> bool:
    """The attention claims it, and no linear-attention layer (gpu_worker.linear_attention
    claims none) serves beside it."""
    return runner.model.kernels.attention.row_invariant and runner.state is None


def check_prefix_cache(runner) -> None:
    """A prompt whose first blocks another sequence computed (the service's prefix cache
    hands them over in its block table) gets the logits of a prefill from scratch."""
    prompt = random_prompt(37, seed=31)
    table = blocks_for(500, len(prompt))
    whole = runner.step_logits(plan_for(runner, [Chunk(50, prompt, 0, table)]))[0]
    shared = 5  # full blocks, past the tiny models' windows
    start = shared * BLOCK_SIZE
    cached_table = table[:shared] + blocks_for(600, len(prompt) - start)
    cached = runner.step_logits(plan_for(runner, [Chunk(51, prompt[start:], start, cached_table)]))[
        0
    ]
    assert max_diff(cached, whole) < tolerance(whole)


def check_preempted_recompute(runner) -> None:
    """A sequence preempted while decoding (finished, then introduced again from position
    0 with its prompt and the tokens it took, recomputed beside another sequence's decode)
    continues with the tokens it would have taken unpreempted."""
    prompt = random_prompt(21, seed=41)
    expected = generate_greedy(runner, prompt, steps=12, seq_id=60)
    table = blocks_for(800, len(prompt) + 12)
    tokens = sampled(runner.execute(plan_for(runner, [Chunk(61, prompt, 0, table)])))
    for _ in range(4):
        position = len(prompt) + len(tokens) - 1
        step = plan_for(runner, [Chunk(61, [tokens[-1]], position, table)])
        tokens += sampled(runner.execute(step))
    runner.execute(StepPlan(1, [], [], finished=[61]))  # preempted: its state is gone
    neighbour = Chunk(62, random_prompt(9, seed=42), 0, blocks_for(900, 9))
    history = prompt + tokens
    recompute = [Chunk(61, history[:-1], 0, blocks_for(840, len(prompt) + 12)), neighbour]
    result = runner.execute(plan_for(runner, recompute))
    assert sampled(result)[0] == tokens[-1]  # the recompute's last row predicts it again
    table = blocks_for(840, len(prompt) + 12)
    while len(tokens) < len(expected):
        position = len(prompt) + len(tokens) - 1
        tokens += sampled(
            runner.execute(plan_for(runner, [Chunk(61, [tokens[-1]], position, table)]))
        )
    assert tokens == expected


def check_prefix_hit_refused(runner) -> None:
    """A new sequence that would start past position 0 (a prefix-cache hit) is refused,
    naming why: the recurrent state at the hit's end was never saved."""
    result = runner.execute(plan_for(runner, [Chunk(63, [5, 6], 8, blocks_for(950, 10))]))
    assert result.error is not None and "recurrent state stands at 0" in result.error


@pytest.mark.parametrize("name", ["llama", "qwen3.5-moe"])
def test_decodes_in_a_mixed_batch_match_decoding_alone(name, tiny_models):
    """Three decode rows among prefill chunks, two steps running: a hybrid model's decode
    rows run the recurrent form batched, each on (and into) its own sequence's state."""
    kind, overrides = ARCHITECTURES.get(name, (name, {}))
    runner = make_runner(tiny_models(kind, **overrides), kv_memory=ARCH_KV_MEMORY)
    prompts = [random_prompt(n, seed=20 + n) for n in (9, 14, 23)]
    decoded = (5, 6)  # the tokens each sequence decodes, a step each
    alone = []
    for i, prompt in enumerate(prompts):
        table = blocks_for(10 * i, 30)
        runner.execute(plan_for(runner, [Chunk(i, prompt, 0, table, sample=False)]))
        steps = [Chunk(i, [token], len(prompt) + t, table) for t, token in enumerate(decoded)]
        alone.append([runner.step_logits(plan_for(runner, [step]))[0] for step in steps])
    # Same decodes, interleaved with prefill chunks (non-contiguous decode rows).
    for i, prompt in enumerate(prompts):
        table = blocks_for(100 + 10 * i, 30)
        runner.execute(plan_for(runner, [Chunk(10 + i, prompt, 0, table, sample=False)]))
    for t, token in enumerate(decoded):
        chunks = []
        for i, prompt in enumerate(prompts):
            table = blocks_for(100 + 10 * i, 30)
            chunks.append(Chunk(10 + i, [token], len(prompt) + t, table))
            neighbour = random_prompt(4, seed=i + 10 * t)
            chunks.append(Chunk(20 + i, neighbour, 0, blocks_for(200 + 10 * i, 4)))
        logits = runner.step_logits(plan_for(runner, chunks))
        for i in range(len(prompts)):
            assert max_diff(logits[2 * i], alone[i][t]) < tolerance(alone[i][t])


def test_greedy_decoding_equals_transformers_generate(variant_dir):
    check_greedy_decoding(make_runner(variant_dir), hf_model(variant_dir), random_prompt(12, 7), 32)


def check_greedy_decoding(runner, hf, prompt: list[int], steps: int) -> None:
    with torch.no_grad():
        generated = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=steps,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
    assert generate_greedy(runner, prompt, steps=steps) == generated


def test_bfloat16_logits_stay_close_to_float32(tiny_llama_dir):
    float32 = make_runner(tiny_llama_dir)
    bfloat16 = make_runner(tiny_llama_dir, dtype="bfloat16")
    assert bfloat16.handshake.dtype == "bfloat16"
    prompt = random_prompt(50, seed=9)
    plan = plan_for(float32, [Chunk(0, prompt, 0, blocks_for(0, 60))])
    reference = float32.step_logits(plan)[0]
    logits = bfloat16.step_logits(plan)[0]
    assert torch.isfinite(logits).all()
    # bfloat16 keeps 8 bits of mantissa: a few percent of the logit scale.
    assert max_diff(logits, reference) < 0.05 * reference.abs().max().item()
    spec = SamplingSpec(logprobs=True)
    decode = plan_for(bfloat16, [Chunk(0, [4], 50, blocks_for(0, 60), spec=spec)])
    result = bfloat16.execute(decode)
    assert len(sampled(result)) == 1
    assert result.logprobs is not None and result.logprobs.logprobs[0] <= 0


def test_experts_stacked_as_transformers_holds_them_load_as_one_per_expert(tiny_models, tmp_path):
    """A Qwen3.5-MoE checkpoint whose experts are stacked (mlp.experts.gate_up_proj and
    down_proj, transformers 5's layout) serves the logits of the same weights kept one
    tensor per expert."""
    from safetensors.torch import load_file, save_file

    kind, overrides = ARCHITECTURES["qwen3.5-moe"]
    per_expert = tiny_models(kind, **overrides)
    weights = load_file(per_expert / "model.safetensors")
    for layer in range(4):
        block = f"model.layers.{layer}.mlp.experts."
        gate_up, down = [], []
        for e in range(QWEN_EXPERTS["num_experts"]):
            gate, up = (weights.pop(f"{block}{e}.{p}_proj.weight") for p in ("gate", "up"))
            gate_up.append(torch.cat([gate, up]))
            down.append(weights.pop(f"{block}{e}.down_proj.weight"))
        weights[block + "gate_up_proj"] = torch.stack(gate_up)
        weights[block + "down_proj"] = torch.stack(down)
    save_file(weights, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((per_expert / "config.json").read_text())
    plan_prompt = [Chunk(0, random_prompt(20, seed=4), 0, blocks_for(0, 20))]
    expected = make_runner(per_expert, kv_memory=ARCH_KV_MEMORY)
    runner = make_runner(tmp_path, kv_memory=ARCH_KV_MEMORY)
    logits = runner.step_logits(plan_for(runner, plan_prompt))
    assert torch.equal(logits, expected.step_logits(plan_for(expected, plan_prompt)))


def test_a_hybrid_model_in_bfloat16_matches_transformers_bfloat16(tiny_models, one_torch_thread):
    """Qwen3-Next's layers in bfloat16 (the recurrent state kept in float32): a chunked
    prompt, then decode steps beside another sequence's chunk, within a few bfloat16 steps
    of transformers' logits in bfloat16 (both are far from float32's in this tiny model:
    its experts' choices flip)."""
    from transformers import AutoModelForCausalLM

    kind, overrides = ARCHITECTURES["qwen3-next-moe"]
    path = tiny_models(kind, **overrides)
    runner = make_runner(path, dtype="bfloat16", kv_memory=ARCH_KV_MEMORY)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    prompt, table = random_prompt(40, seed=9), blocks_for(0, 48)
    with torch.no_grad():
        reference = hf(torch.tensor([[*prompt, 5, 6]])).logits[0, 39:42].float()
    runner.execute(plan_for(runner, [Chunk(0, prompt[:30], 0, table, sample=False)]))
    steps = [[Chunk(0, prompt[30:], 30, table)]] + [
        [Chunk(0, [token], position, table), Chunk(1, prompt[:9], 0, blocks_for(60, 9))]
        for position, token in ((40, 5), (41, 6))
    ]
    for chunks, expected in zip(steps, reference, strict=True):
        logits = runner.step_logits(plan_for(runner, chunks))[0]
        assert max_diff(logits, expected) < 0.03 * expected.abs().max().item()


def test_prompt_logprobs_over_chunks_equal_transformers_log_softmax(tiny_llama_dir):
    """`echo`: each prompt token's log-probability and top alternatives, chunk by chunk
    (PROMPT_ROWS positions at a time), beside a sequence that wants none."""
    hf = hf_model(tiny_llama_dir)
    runner = make_runner(tiny_llama_dir)
    prompt = random_prompt(150, seed=21)
    with torch.no_grad():
        reference = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)
    spec = SamplingSpec(prompt_logprobs=3)
    table = blocks_for(0, len(prompt))
    neighbour = random_prompt(20, seed=22)
    alone = runner.step_logits(plan_for(runner, [Chunk(9, neighbour, 0, blocks_for(60, 20))]))[0]
    found: list[float] = []
    top_ids: list[list[int]] = []
    for start, end in ((0, 100), (100, 150)):
        targets = prompt[start + 1 : min(end + 1, len(prompt))]
        plan = plan_for(
            runner,
            [
                Chunk(
                    0,
                    prompt[start:end],
                    start,
                    table,
                    sample=end == len(prompt),
                    spec=spec,
                    prompt_targets=targets,
                ),
                Chunk(9, neighbour, 0, blocks_for(60, 20)),
            ],
        )
        result = runner.execute(plan)
        assert result.error is None and result.prompt_logprobs[1] is None
        chunk = result.prompt_logprobs[0]
        assert chunk is not None and len(chunk) == len(targets)
        found += chunk.logprobs
        top_ids += chunk.top_ids
        assert sampled(result)[-1] == int(alone.argmax())  # the neighbour samples as alone
    expected = reference[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    assert max_diff(torch.tensor(found), expected) < 1e-4
    assert top_ids == reference[:-1].topk(3, dim=-1).indices.tolist()


@pytest.mark.parametrize(
    ("kind", "architecture"),
    [
        ("gemma3", "Gemma3ForConditionalGeneration"),
        ("gemma4", "Gemma4ForConditionalGeneration"),
        ("qwen3_5", "Qwen3_5ForConditionalGeneration"),
    ],
)
def test_a_multimodal_checkpoint_serves_its_text_model(kind, architecture, tiny_models, tmp_path):
    """model_type gemma3, gemma4 or qwen3_5: the text_config's decoder, its weights under
    model.language_model (the vision tower's are left unread), gives the text model's
    logits."""
    from safetensors.torch import load_file, save_file

    text_dir = tiny_models(kind)
    text_config = json.loads((text_dir / "config.json").read_text())
    config = {
        "architectures": [architecture],
        "model_type": kind,
        "text_config": {k: v for k, v in text_config.items() if k != "architectures"},
        "vision_config": {"model_type": "siglip_vision_model"},
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    weights = {
        name.replace("model.", "model.language_model.", 1): tensor
        for name, tensor in load_file(text_dir / "model.safetensors").items()
    }
    weights["model.vision_tower.patch_embedding.weight"] = torch.ones(4, 4)
    save_file(weights, tmp_path / "model.safetensors")
    text_runner = make_runner(text_dir)
    plan = plan_for(text_runner, [Chunk(0, random_prompt(30, seed=4), 0, blocks_for(0, 30))])
    expected = text_runner.step_logits(plan)
    runner = make_runner(tmp_path)
    assert runner.handshake.architecture == architecture
    assert torch.equal(runner.step_logits(plan), expected)
