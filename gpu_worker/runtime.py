"""Starting a worker: named steps, each timed, ending in a ModelRunner and its handshake.

    config    the device, the dtype and the model's config file
    kernels   the kernel choice (measured, or read from the kernel cache)
    weights   the checkpoint read and the model built (each weight shape's matmul call sizes
              checked, or recalled from the kernel cache where this machine checked them)
    draft model  speculative decoding's draft model, where there is one, built as the model
    profile   CUDA only: the largest steps run on a one-block cache, for their peak activations
    cache     the KV cache sized and allocated (zeroed: its pages are touched here)
    graphs    CUDA only: every decode graph captured

The handshake's `startup` gives each step's seconds, so a slow start says where it went.

Each rank of a tensor-parallel group (gpu_worker.worker_group) runs these steps on its
shard: rank 0 chooses the kernels and every rank takes its choice, the block count is the
least any rank can hold, and rank 0's handshake lists every rank.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from gpu_worker import kernel_choice, kv_cache, linear, lora, memory
from gpu_worker.checkpoint import load_quantized, load_weights
from gpu_worker.device import free_memory_bytes, resolve_device, resolve_dtype
from gpu_worker.draft_model import Drafter
from gpu_worker.graphs import DecodeRunner, graph_capturer
from gpu_worker.kernels import Kernels, quant_kernels
from gpu_worker.kv_cache import KVCache
from gpu_worker.kv_connector import make_connector
from gpu_worker.kv_groups import KVGroups
from gpu_worker.kv_staging import allocate_arena
from gpu_worker.lora import LoraSlots
from gpu_worker.mixed_graphs import MixedGraphs, piece_capturer, static_records
from gpu_worker.model import Model
from gpu_worker.model_config import ModelConfig
from gpu_worker.protocol import (
    QUANTIZATIONS,
    Handshake,
    WorkerConfig,
    block_size_for,
    parse_kernel_pins,
)
from gpu_worker.recurrent_state import RecurrentState
from gpu_worker.runner import ModelRunner
from gpu_worker.sampler import Sampler
from gpu_worker.step_inputs import PlanLimits
from gpu_worker.tensor_parallel import NO_SHARD, check_shardable
from gpu_worker.warm_up import warm_up

if TYPE_CHECKING:
    from gpu_worker.worker_group import Group


class Stopwatch:
    """Seconds per named start-up step, in the order they ran."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.steps: dict[str, float] = {}

    @contextmanager
    def step(self, name: str) -> Iterator[None]:
        began = time.perf_counter()
        try:
            yield
        finally:
            self.steps[name] = round(time.perf_counter() - began, 3)

    def total(self) -> float:
        return round(time.perf_counter() - self.started, 3)


# The call sizes each weight shape was checked on (gpu_worker.linear), kept per machine in
# the kernel cache: only a first start on a machine pays for the probes.
ROW_SIZES_SECTION = "row_sizes"


def check(config: WorkerConfig) -> ModelConfig:
    """The model's config, after the refusals that need no weights: ValueError, saying
    why, where this worker config cannot serve it."""
    _check_worker_config(config)
    model_config = ModelConfig.from_dir(Path(config.model_dir))
    check_shardable(model_config, config.tensor_parallel_size, config.quantization)
    _check_recurrent(config, model_config)
    return model_config


def _check_recurrent(config: WorkerConfig, model_config: ModelConfig) -> None:
    """What a model with linear-attention layers (a recurrent state per sequence,
    gpu_worker.recurrent_state) cannot be served with, each refusal naming the feature."""
    if model_config.linear_attention is None:
        return
    refused = {
        "a draft model (speculative decoding: a rejected draft cannot be taken back out of "
        "the recurrent state)": config.draft_model_dir is not None,
        "tensor parallelism (the linear-attention layers are not split across ranks)": (
            config.tensor_parallel_size > 1
        ),
        "a KV transfer engine (disaggregated prefill: the recurrent state is not "
        "transferred)": config.kv_transfer_engine is not None,
    }
    for feature, asked in refused.items():
        if asked:
            raise ValueError(
                f"{model_config.architecture} has linear-attention layers, which are not "
                f"served with {feature}"
            )


def start(config: WorkerConfig, group: Group | None = None) -> ModelRunner:
    """The worker's runner, its handshake attached (rank 0's), or this rank's of `group`;
    raises when the worker cannot serve."""
    clock = Stopwatch()
    with clock.step("config"):
        place = _place(config, group)
    with clock.step("kernels"):
        choice = _choose_kernels(config, place, group)
    with clock.step("weights"):
        model_dir, quantization = Path(config.model_dir), config.quantization
        model = _load_model(
            config, model_dir, place.model_config, quantization, place, choice.kernels, group
        )
    _add_lora_slots(config, place.model_config, model, clock)  # before the cache is sized
    draft = None
    if config.draft_model_dir is not None:
        with clock.step("draft model"):
            draft = _load_draft(config, place, choice.kernels)
    state = None
    if place.model_config.linear_attention is not None:
        # before the cache is sized: the memory measured free then excludes it
        with clock.step("recurrent state"):
            slots = config.max_num_seqs + 1  # a row per running sequence, and the padding row
            state = RecurrentState(model.config, model.dtype, model.device, slots)
    arena = _allocate_staging(config, place, model, clock)  # before the cache is sized
    reserved = 0
    if place.device.type == "cuda":
        with clock.step("profile"):
            reserved = _activation_reserve(
                model, config, place.block_size, place.cache_dtype, state
            )
    with clock.step("cache"):
        caches = _allocate_caches(config, place, model, draft, reserved, group)
    decode_runner, mixed = _graph_runners(config, place, model, caches)
    # Before the handshake: a capture while serving would stall the steps around it.
    with clock.step("graphs"):
        graphs = decode_runner.capture_all()
        graphs["mixed"] = mixed.capture_all()
        memory.release_cached(place.device)
    runner = _runner(config, place, model, caches, decode_runner, mixed, state)
    _connect_kv(config, runner, clock, arena)
    ranks = _ranks(group, place.device, runner)
    warmed = None
    kernels, device = model.kernels, place.device
    if kernels.attention.compiles(device) or kernels.layer_ops.compiles(device):
        with clock.step("warm-up"), _trials(state):  # compiles before serving, as the captures
            warmed = warm_up(runner, config.max_num_batched_tokens)
    runner.handshake = _handshake(config, place, runner, clock, choice, graphs, warmed, ranks)
    return runner


@dataclass(frozen=True, slots=True)
class _Placement:
    """What the config step resolves: the model's config, where the worker computes, and
    its cache's block size and dtype."""

    model_config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    block_size: int
    cache_dtype: torch.dtype

    @property
    def max_blocks_per_seq(self) -> int:
        """A table's blocks for the model's whole context (one KV group's)."""
        return -(-self.model_config.context_limit // self.block_size)


@dataclass(slots=True)
class _Caches:
    """What the cache step allocates."""

    cache: KVCache
    drafter: Drafter | None  # with the draft model's cache, over the same blocks
    max_model_len: int  # a sequence can never outgrow the whole cache


def _place(config: WorkerConfig, group: Group | None) -> _Placement:
    """The model's config, once this worker config is known to serve it, and where."""
    model_config = check(config)
    device, dtype = resolve_device(config.device), resolve_dtype(config.dtype)
    if group is not None:
        device = group.place(device)
    if device.type == "cpu" and config.cpu_threads is not None:
        torch.set_num_threads(config.cpu_threads)
    block_size = block_size_for(config.block_size, device.type)
    cache_dtype = kv_cache.cache_dtype(config.kv_cache_dtype, dtype)
    if device.type == "cuda":
        _refuse_on_cuda(config, cache_dtype in kv_cache.KV_CACHE_DTYPES.values())
    return _Placement(model_config, device, dtype, block_size, cache_dtype)


def _refuse_on_cuda(config: WorkerConfig, eight_bit_cache: bool) -> None:
    """What cadence's CUDA kernels do not serve yet: PyTorch's reference would, several
    times slower than the model's own dtype, so the worker refuses rather than serve it
    slowly unasked (issue 52)."""
    if eight_bit_cache:
        raise ValueError(
            f"kv_cache_dtype {config.kv_cache_dtype} is not served on CUDA yet: cadence's "
            "CUDA attention and cache-write kernels read and write the model's dtype only; "
            "use --kv-cache-dtype auto"
        )
    for name in ("quantization", "draft_quantization"):
        if getattr(config, name) != "none":
            raise ValueError(
                f"{name} {getattr(config, name)} is not served on CUDA yet: its matmul "
                "kernels are the CPU's; serve the weights in --dtype (quantization none)"
            )


def _allocate_caches(
    config: WorkerConfig,
    place: _Placement,
    model: Model,
    draft: Model | None,
    reserved: int,
    group: Group | None,
) -> _Caches:
    """The KV cache of as many blocks as the memory left holds (on a group, the least any
    rank's holds), and the draft model's beside it."""
    # A rank's cache holds its KV heads (model.config is its view). On a CPU the ranks
    # share the host's memory: sized by the whole model's block, the group's caches
    # take together what one worker's would. A GPU's memory is its rank's own.
    sizing = place.model_config if place.device.type == "cpu" else model.config
    configs = [sizing] if draft is None else [sizing, draft.config]
    groups = KVGroups.of(place.model_config)
    num_blocks = _count_blocks(
        config,
        place.block_size,
        configs,
        place.device,
        place.cache_dtype,
        reserved,
        place.max_blocks_per_seq * groups.num_groups,
    )
    if group is not None:
        num_blocks = group.least(num_blocks)
    shape = (num_blocks, place.block_size, place.cache_dtype, place.device)
    cache = kv_cache.allocate(model.config, *shape)
    drafter = None
    if draft is not None:
        drafter = Drafter(runner_on(draft, kv_cache.allocate(draft.config, *shape), config))
    max_model_len = min(*(c.context_limit for c in configs), num_blocks * place.block_size)
    return _Caches(cache, drafter, max_model_len)


def _graph_runners(
    config: WorkerConfig, place: _Placement, model: Model, caches: _Caches
) -> tuple[DecodeRunner, MixedGraphs]:
    """The decode steps' runner and the mixed steps' graphs, not captured yet."""
    cache = caches.cache
    decode_runner = DecodeRunner(
        model,
        cache,
        max_num_seqs=config.max_num_seqs,
        max_blocks_per_seq=place.max_blocks_per_seq,
        capturer=graph_capturer(model, cache, config.use_cuda_graphs),
    )
    capturer = piece_capturer(model, config.use_cuda_graphs)
    records = None
    if capturer is not None:  # as wide as the worker's tables (SeqTable)
        held_width = -(-caches.max_model_len // place.block_size)
        tokens, seqs = config.max_num_batched_tokens, config.max_num_seqs
        records = static_records(model, cache, tokens, seqs, held_width)
    mixed = MixedGraphs(model, cache, config.max_num_batched_tokens, capturer, records)
    return decode_runner, mixed


def _runner(
    config: WorkerConfig,
    place: _Placement,
    model: Model,
    caches: _Caches,
    decode_runner: DecodeRunner,
    mixed: MixedGraphs,
    state: RecurrentState | None,
) -> ModelRunner:
    model_config, cache = place.model_config, caches.cache
    groups = KVGroups.of(model_config).num_groups
    limits = PlanLimits(
        place.block_size, cache.num_blocks, model_config.vocab_size, caches.max_model_len, groups
    )
    sampler = Sampler(config.seed, place.device)
    runner = ModelRunner(
        model,
        cache,
        decode_runner,
        sampler,
        limits,
        drafter=caches.drafter,
        mixed=mixed,
        state=state,
    )
    if model.lora is not None:
        runner.table.adapter_slot_of = model.lora.slot_of
    return runner


def _add_lora_slots(
    config: WorkerConfig, model_config: ModelConfig, model: Model, clock: Stopwatch
) -> None:
    """With max_loras: the LoRA adapters' slots, every buffer allocated (this rank's
    slices of them), ValueError where the model cannot serve adapters."""
    if config.max_loras <= 0:
        return
    lora.check_supported(model_config)
    with clock.step("lora slots"):
        model.lora = LoraSlots(
            model_config,
            config.max_loras,
            config.max_lora_rank,
            model.dtype,
            model.device,
            model.shard,
        )


def _allocate_staging(
    config: WorkerConfig, place: _Placement, model: Model, clock: Stopwatch
) -> torch.Tensor | None:
    """With a KV transfer engine and kv_staging_tokens: the staging arena
    (gpu_worker.kv_staging), of whole blocks."""
    if config.kv_transfer_engine is None or config.kv_staging_tokens <= 0:
        return None
    with clock.step("kv staging"):
        blocks = -(-config.kv_staging_tokens // place.block_size)
        per_block = kv_cache.block_bytes(model.config, place.block_size, place.cache_dtype)
        return allocate_arena(blocks, per_block, place.device)


def _connect_kv(
    config: WorkerConfig, runner: ModelRunner, clock: Stopwatch, arena: torch.Tensor | None
) -> None:
    """With a KV transfer engine (disaggregated prefill and decode): the runner's
    connector, its cache (and staging arena) registered for peers to read. Each rank of a
    group has its own, for its shard of the cache (gpu_worker.kv_ranks)."""
    if config.kv_transfer_engine is None:
        return
    with clock.step("kv transfer"):
        runner.kv = make_connector(
            config.kv_transfer_engine, config.kv_transfer_host, config.kv_transfer_timeout
        )
        runner.kv.register(runner.cache, arena)


def _handshake(
    config: WorkerConfig,
    place: _Placement,
    runner: ModelRunner,
    clock: Stopwatch,
    choice: kernel_choice.Choice,
    graphs: dict[str, Any],
    warmed: dict[str, Any] | None,
    ranks: list[dict[str, Any]],
) -> Handshake:
    """What the worker answers at init: the model, its cache, and how start-up went."""
    model_config, draft_dir, kv = place.model_config, config.draft_model_dir, runner.kv
    return Handshake(
        model_name=Path(config.model_dir).resolve().name,
        architecture=model_config.architecture,
        vocab_size=model_config.vocab_size,
        max_model_len=runner.limits.max_model_len,
        num_layers=model_config.num_hidden_layers,
        num_kv_heads=model_config.num_key_value_heads,
        head_dim=model_config.head_dim,
        dtype=config.dtype,
        device=str(place.device),
        block_size=place.block_size,
        num_blocks=runner.cache.num_blocks,
        kv_bytes=sum(rank["kv_bytes"] for rank in ranks),
        kv_cache_dtype=str(place.cache_dtype).removeprefix("torch."),
        decode_buckets=runner.decode_runner.buckets,
        pid=os.getpid(),
        load_seconds=clock.total(),
        kernels=choice.report(),
        graphs=graphs,
        warm_up=warmed,
        startup=clock.steps,
        kv_group_windows=list(KVGroups.of(model_config).windows),
        recurrent_state_bytes=0 if runner.state is None else runner.state.bytes_per_slot,
        quantization=_quantization_text(config.quantization, runner.model),
        draft_model=None if draft_dir is None else Path(draft_dir).resolve().name,
        ranks=ranks,
        kv_transfer_address=None if kv is None else kv.address,
        kv_tensor_addresses=[] if kv is None else kv.addresses,
        kv_block_bytes=0 if kv is None else kv.block_bytes,
        kv_staging_address=None if kv is None else kv.staging_address,
        kv_staging_blocks=0 if kv is None else kv.staging_blocks,
    )


def _ranks(group: Group | None, device: torch.device, runner: ModelRunner) -> list[dict]:
    """Each rank's facts for the handshake, on rank 0 ([] on the others); on a CPU with its
    threads; with a KV transfer engine where its connector serves its shard."""
    mine: dict[str, Any] = {"rank": 0, "pid": os.getpid(), "device": str(device)}
    mine["kv_bytes"] = runner.cache.bytes
    if device.type == "cpu":
        mine["threads"] = torch.get_num_threads()
    if runner.kv is not None:
        mine["kv_transfer_address"] = runner.kv.address
        mine["kv_tensor_addresses"] = runner.kv.addresses
        mine["kv_staging_address"] = runner.kv.staging_address
    if group is None:
        return [mine]
    return group.gather({**mine, "rank": group.rank})


def _check_worker_config(config: WorkerConfig) -> None:
    if config.block_size is not None and config.block_size < 1:
        raise ValueError(f"block_size must be at least 1, got {config.block_size}")
    if config.max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be at least 1, got {config.max_num_seqs}")
    for name in ("quantization", "draft_quantization"):
        value = getattr(config, name)
        if value not in QUANTIZATIONS:
            raise ValueError(f"{name} must be one of {', '.join(QUANTIZATIONS)}, not {value!r}")
    if config.tensor_parallel_size > 1 and config.draft_model_dir is not None:
        raise ValueError(
            "a draft model is not split across ranks: speculate with a draft model at "
            "tensor parallel size 1, or with n-gram drafts at any size"
        )
    local = config.tensor_parallel_size_local
    if local is not None and not 1 <= local <= config.tensor_parallel_size:
        raise ValueError(
            f"tensor_parallel_size_local must be 1 to {config.tensor_parallel_size}, got {local}"
        )
    if config.collective_timeout <= 0:
        raise ValueError(f"collective_timeout must be positive, got {config.collective_timeout}")


def _quantization_text(quantization: str, model: Model) -> str:
    """The handshake's: the quantization, and the kernel serving it."""
    if quantization == "none":
        return quantization
    kernel = "native" if model.kernels.quant_matmul is not None else "reference"
    return f"{quantization} ({kernel} kernel)"


def _choose_kernels(
    config: WorkerConfig, place: _Placement, group: Group | None
) -> kernel_choice.Choice:
    """Measured (or recalled) on rank 0; the other ranks take its choice, so that every
    rank runs the same kernels."""
    shapes = kernel_choice.Shapes.of(
        place.model_config, place.block_size, place.dtype, place.device, place.cache_dtype
    )
    if group is not None and group.rank > 0:
        return kernel_choice.Choice(kernel_choice.named(shapes, group.share(None)))
    cache_file = config.kernel_cache
    choice = kernel_choice.choose(
        shapes, parse_kernel_pins(config.kernels), Path(cache_file) if cache_file else None
    )
    if group is not None:
        group.share(choice.kernels.names())
    return choice


def _load_model(
    config: WorkerConfig,
    model_dir: Path,
    model_config: ModelConfig,
    quantization: str,
    place: _Placement,
    kernels: Kernels,
    group: Group | None = None,
) -> Model:
    """The model (this rank's shard of it) on its device; the matmul call sizes this
    machine checked before are recalled from the kernel cache, and the new ones recorded
    there (by rank 0 alone: the ranks' shapes are alike)."""
    cache_file = Path(config.kernel_cache) if config.kernel_cache else None
    linear.recall_checked_sizes(kernel_choice.recall(cache_file, ROW_SIZES_SECTION))
    # A rank of a group reads its slices only, as the model takes them.
    dtype, device = place.dtype, place.device
    # MXFP4 experts stay packed on the CPU, for the quantized matmul (gpu_worker.mxfp4);
    # on CUDA they are dequantized: its matmuls are not the CPU's kernels.
    cpu = device.type == "cpu"
    weights = load_weights(model_dir, dtype, device, on_use=group is not None, packed_mxfp4=cpu)
    quantized = load_quantized(model_dir, device) if quantization == "gguf" else None
    if quantization != "none" or cpu:
        kernels = dataclasses.replace(kernels, quant_matmul=quant_kernels(device))
    # The rope tables cover the whole context limit of the model.
    model = Model(
        model_config,
        weights,
        max_positions=model_config.context_limit,
        dtype=dtype,
        device=device,
        kernels=kernels,
        quantization=quantization,
        quantized=quantized,
        shard=NO_SHARD if group is None else group.shard,
    )
    del weights
    gc.collect()
    if group is None or group.rank == 0:
        kernel_choice.record(cache_file, ROW_SIZES_SECTION, linear.checked_sizes())
    return model


def _load_draft(config: WorkerConfig, place: _Placement, kernels: Kernels) -> Model:
    """The draft model (gpu_worker.draft_model); ValueError where it cannot draft for the
    target: another vocabulary, or a cache of several KV groups (its tables are the
    target's group 0's)."""
    assert config.draft_model_dir is not None
    model_dir, target = Path(config.draft_model_dir), place.model_config
    draft = ModelConfig.from_dir(model_dir)
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"the draft model's vocabulary has {draft.vocab_size} tokens, the model's "
            f"{target.vocab_size}: a draft model must share the model's tokenizer"
        )
    if KVGroups.of(draft).num_groups > 1 or KVGroups.of(target).num_groups > 1:
        raise ValueError("a draft model needs both models to attend over one KV group")
    return _load_model(config, model_dir, draft, config.draft_quantization, place, kernels)


def _count_blocks(
    config: WorkerConfig,
    block_size: int,
    model_configs: list[ModelConfig],
    device: torch.device,
    cache_dtype: torch.dtype,
    reserved: int,
    max_blocks_per_seq: int,
) -> int:
    """On CUDA after the profile (gpu_worker.memory); on a CPU a share of MemAvailable.
    `max_blocks_per_seq` counts every KV group's. A block holds the K/V of each model
    (the draft model's beside the model's)."""
    free = memory.settled_free_bytes(device) if device.type == "cuda" else free_memory_bytes(device)
    return kv_cache.count_blocks(
        config.kv_memory,
        free,
        sum(kv_cache.block_bytes(c, block_size, cache_dtype) for c in model_configs),
        max_useful_blocks=max_blocks_per_seq * config.max_num_seqs,
        reserved_bytes=reserved,
    )


def _activation_reserve(
    model: Model,
    config: WorkerConfig,
    block_size: int,
    cache_dtype: torch.dtype,
    state: RecurrentState | None = None,
) -> int:
    """The activations to keep out of the cache on CUDA (see gpu_worker.memory): the peaks
    of the largest mixed step and of the largest captured decode step, run on a one-block
    cache that is gone when this returns (and on the worker's recurrent `state`, already
    allocated: not counted twice)."""
    cache = kv_cache.allocate(model.config, 1, block_size, cache_dtype, model.device)
    probe = runner_on(model, cache, config, state)
    width = probe.decode_runner.widths[-1]  # the widest table a captured graph reads
    with _trials(state):
        mixed = memory.peak_bytes(model.device, lambda: profile_mixed(probe, config))
        decode = memory.peak_bytes(model.device, lambda: profile_decode(probe, config, width))
    return kv_cache.activation_reserve(mixed, decode, graphs=config.use_cuda_graphs)


def runner_on(
    model: Model, cache: KVCache, config: WorkerConfig, state: RecurrentState | None = None
) -> ModelRunner:
    """A runner over `cache`, with its own sampler: the worker's random stream must not
    depend on the profile. A model with linear-attention layers runs on `state`, or on a
    state of its own, unchecked: the trial steps' rows start anywhere."""
    limit = model.config.context_limit
    groups = KVGroups.of(model.config).num_groups
    limits = PlanLimits(cache.block_size, cache.num_blocks, model.config.vocab_size, limit, groups)
    decodes = DecodeRunner(
        model,
        cache,
        max_num_seqs=config.max_num_seqs,
        max_blocks_per_seq=-(-limit // cache.block_size),
    )
    if state is None and model.config.linear_attention is not None:
        state = RecurrentState(model.config, model.dtype, model.device, checked=False)
    sampler = Sampler(config.seed, model.device)
    return ModelRunner(model, cache, decodes, sampler, limits, state=state)


def _trials(state: RecurrentState | None) -> AbstractContextManager[None]:
    """The start-up's trial steps on the worker's recurrent state (profile, warm-up): their
    rows start past position 0, so the state's rows are not checked meanwhile."""
    return nullcontext() if state is None else state.trials()


def profile_mixed(runner: ModelRunner, config: WorkerConfig) -> None:
    """The largest mixed step the worker accepts, sampled the costliest way, on the runner's
    cache (any cache with a block 0)."""
    limit = runner.model.config.context_limit
    lengths = memory.profile_lengths(config.max_num_batched_tokens, config.max_num_seqs, limit)
    bs, groups = runner.cache.block_size, runner.limits.num_groups
    runner.run(memory.profile_plan(lengths, bs, limit, groups))


def profile_decode(runner: ModelRunner, config: WorkerConfig, width: int) -> None:
    """The largest decode batch, every row reading a table `width` blocks wide."""
    batch, bs = config.max_num_seqs, runner.cache.block_size
    position = min(width * bs, runner.model.config.context_limit) - 1
    plan = memory.decode_profile_plan(batch, position, width, runner.limits.num_groups)
    runner.logits(runner.inputs(plan))
