"""The worker's model runtime: load once, then execute one BatchPlan per step."""

from __future__ import annotations

import gc
import math
import os
import time
from pathlib import Path

import torch

from gpu_worker import kernel_choice, kv_cache, memory
from gpu_worker.attention import build_metadata
from gpu_worker.checkpoint import load_weights
from gpu_worker.device import free_memory_bytes, resolve_device, resolve_dtype
from gpu_worker.faults import DeviceFault, is_device_fault
from gpu_worker.graphs import (
    DecodeRunner,
    decode_forward,
    graph_capturer,
    graph_widths,
    padded_inputs,
)
from gpu_worker.kv_cache import KVCache
from gpu_worker.model import Model
from gpu_worker.model_config import ModelConfig
from gpu_worker.protocol import (
    BatchPlan,
    Handshake,
    StepResult,
    TokenLogprobs,
    WorkerConfig,
    parse_kernel_pins,
)
from gpu_worker.sampler import Logits, Sampler, decode_bitmask, token_logprobs

PROMPT_ROWS = 64  # prompt positions whose log-probabilities are computed at once


class ModelRunner:
    def __init__(self, worker_config: WorkerConfig) -> None:
        started = time.perf_counter()
        self.worker_config = worker_config
        _check_worker_config(worker_config)
        self.device = resolve_device(worker_config.device)
        self.dtype = resolve_dtype(worker_config.dtype)
        model_dir = Path(worker_config.model_dir)
        self.model_config = ModelConfig.from_dir(model_dir)
        block_size = worker_config.block_size
        context_limit = self.model_config.context_limit
        max_blocks_per_seq = -(-context_limit // block_size)

        cache_dtype = kv_cache.cache_dtype(worker_config.kv_cache_dtype, self.dtype)
        shapes = kernel_choice.Shapes.of(
            self.model_config, block_size, self.dtype, self.device, cache_dtype
        )
        cache_file = worker_config.kernel_cache
        self.kernel_choice = kernel_choice.choose(
            shapes,
            parse_kernel_pins(worker_config.kernels),
            Path(cache_file) if cache_file else None,
        )
        self.model = self._load_model(model_dir, context_limit)
        num_blocks = self._count_blocks(cache_dtype, max_blocks_per_seq)
        self.cache = kv_cache.allocate(
            self.model_config, num_blocks, block_size, cache_dtype, self.device
        )
        # A sequence can never outgrow the whole cache.
        self.max_model_len = min(context_limit, num_blocks * block_size)
        self.decode_runner = DecodeRunner(
            self.model,
            self.cache,
            max_num_seqs=worker_config.max_num_seqs,
            max_blocks_per_seq=max_blocks_per_seq,
            capturer=graph_capturer(self.model, self.cache, worker_config.use_cuda_graphs),
        )
        self.sampler = Sampler(worker_config.seed, self.device)
        # Before the handshake: a capture while serving would stall the steps around it.
        graphs = self.decode_runner.capture_all()
        memory.release_cached(self.device)
        self.handshake = Handshake(
            model_name=model_dir.resolve().name,
            architecture=self.model_config.architecture,
            vocab_size=self.model_config.vocab_size,
            max_model_len=self.max_model_len,
            num_layers=self.model_config.num_hidden_layers,
            num_kv_heads=self.model_config.num_key_value_heads,
            head_dim=self.model_config.head_dim,
            dtype=worker_config.dtype,
            device=str(self.device),
            block_size=block_size,
            num_blocks=num_blocks,
            kv_bytes=self.cache.bytes,
            kv_cache_dtype=str(cache_dtype).removeprefix("torch."),
            decode_buckets=self.decode_runner.buckets,
            pid=os.getpid(),
            load_seconds=round(time.perf_counter() - started, 3),
            kernels=self.kernel_choice.report(),
            graphs=graphs,
        )

    def _load_model(self, model_dir: Path, context_limit: int) -> Model:
        weights = load_weights(model_dir, self.dtype, self.device)
        # The rope tables cover the whole context limit of the model.
        model = Model(
            self.model_config,
            weights,
            max_positions=context_limit,
            dtype=self.dtype,
            device=self.device,
            kernels=self.kernel_choice.kernels,
        )
        del weights
        gc.collect()
        return model

    def _count_blocks(self, cache_dtype: torch.dtype, max_blocks_per_seq: int) -> int:
        config = self.worker_config
        free, reserved = self._memory_for_cache(cache_dtype, max_blocks_per_seq)
        return kv_cache.count_blocks(
            config.kv_memory,
            free,
            kv_cache.block_bytes(self.model_config, config.block_size, cache_dtype),
            max_useful_blocks=max_blocks_per_seq * config.max_num_seqs,
            reserved_bytes=reserved,
        )

    def _memory_for_cache(
        self, cache_dtype: torch.dtype, max_blocks_per_seq: int
    ) -> tuple[int, int]:
        """Free memory, and the activations to keep out of the cache: profiled on CUDA,
        none on a CPU (see gpu_worker.memory)."""
        if self.device.type != "cuda":
            return free_memory_bytes(self.device), 0
        mixed, decode = self._profile_peaks(cache_dtype, max_blocks_per_seq)
        graphs = self.worker_config.use_cuda_graphs
        reserved = kv_cache.activation_reserve(mixed, decode, graphs=graphs)
        return memory.settled_free_bytes(self.device), reserved

    def _profile_peaks(self, cache_dtype: torch.dtype, max_blocks_per_seq: int) -> tuple[int, int]:
        """Peak activations of the largest mixed step and of the largest captured decode
        step, run on a one-block cache that is gone when this returns."""
        block_size = self.worker_config.block_size
        cache = kv_cache.allocate(self.model_config, 1, block_size, cache_dtype, self.device)
        width = graph_widths(max_blocks_per_seq, block_size)[-1]
        mixed = memory.peak_bytes(self.device, lambda: self.profile_mixed(cache))
        decode = memory.peak_bytes(self.device, lambda: self.profile_decode(cache, width))
        return mixed, decode

    def profile_mixed(self, cache: KVCache) -> None:
        """The largest mixed step the worker accepts, sampled the costliest way, on `cache`
        (any cache with a block 0)."""
        config, limit = self.worker_config, self.model_config.context_limit
        lengths = memory.profile_lengths(config.max_num_batched_tokens, config.max_num_seqs, limit)
        plan = memory.profile_plan(lengths, cache.block_size, limit)
        hidden, first_rows = self._forward_mixed(plan, cache)
        sampled = list(range(len(lengths)))
        logits = self._sampled_logits(plan, sampled, hidden, first_rows)
        ends = [s + n for s, n in zip(plan.start_pos, lengths, strict=True)]
        # Its own sampler: the worker's random stream must not depend on the profile.
        Sampler(config.seed, self.device).sample(logits, plan.sampling, ends)

    def profile_decode(self, cache: KVCache, width: int) -> None:
        """The largest decode batch, every row reading a table `width` blocks wide, on `cache`."""
        batch, bs = self.worker_config.max_num_seqs, cache.block_size
        position = min(width * bs, self.model_config.context_limit) - 1
        inputs = padded_inputs(
            cache, self.device, [0] * batch, [position] * batch, [[0] * width] * batch, batch, width
        )
        decode_forward(self.model, cache, *inputs)

    def execute(self, plan: BatchPlan) -> StepResult:
        """Runs one step; a failure comes back as a result with `error` set, except one
        that leaves the device unusable: that raises DeviceFault (gpu_worker.faults)."""
        started = time.perf_counter()
        try:
            result = self._execute(plan)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            if is_device_fault(exc):
                raise DeviceFault(error) from exc
            return StepResult(step_id=plan.step_id, error=error)
        result.step_ms = (time.perf_counter() - started) * 1000
        return result

    def _execute(self, plan: BatchPlan) -> StepResult:
        self._check(plan)
        sampled = [i for i, wanted in enumerate(plan.sample) if wanted]
        prompt_logprobs: list[TokenLogprobs | None] = []
        if plan.prompt_targets:
            hidden, first_rows = self._forward_mixed(plan, self.cache)
            logits = self._sampled_logits(plan, sampled, hidden, first_rows)
            prompt_logprobs = self._prompt_logprobs(plan, hidden, first_rows)
        else:
            logits = self._logits(plan, sampled)
        output = self.sampler.sample(
            logits,
            [plan.sampling[i] for i in sampled],
            [plan.start_pos[i] + plan.num_tokens[i] for i in sampled],
            _bitmasks(plan, sampled),
        )
        return StepResult(
            step_id=plan.step_id,
            seq_ids=[plan.seq_ids[i] for i in sampled],
            tokens=output.tokens,
            logprobs=output.logprobs,
            prompt_logprobs=prompt_logprobs,
        )

    def step_logits(self, plan: BatchPlan) -> torch.Tensor:
        """Runs one step without sampling: float32 logits of the sampling sequences."""
        self._check(plan)
        logits = self._logits(plan, [i for i, wanted in enumerate(plan.sample) if wanted])
        # A float32 graph's dense logits are its output buffer, which the next step rewrites.
        return logits.dense().clone()

    def _check(self, plan: BatchPlan) -> None:
        check_plan(
            plan,
            block_size=self.cache.block_size,
            num_blocks=self.cache.num_blocks,
            vocab_size=self.model_config.vocab_size,
            max_model_len=self.max_model_len,
        )

    def _logits(self, plan: BatchPlan, sampled: list[int]) -> Logits:
        if not plan.seq_ids:
            return Logits(torch.empty((0, self.model_config.vocab_size), device=self.device))
        if plan.is_decode_only:
            logits = self.decode_runner.run(plan.input_ids, plan.start_pos, plan.block_tables)
            return logits.select(sampled) if len(sampled) < len(plan.seq_ids) else logits
        hidden, first_rows = self._forward_mixed(plan, self.cache)
        return self._sampled_logits(plan, sampled, hidden, first_rows)

    def _sampled_logits(
        self, plan: BatchPlan, sampled: list[int], hidden: torch.Tensor, first_rows: torch.Tensor
    ) -> Logits:
        counts = torch.tensor(plan.num_tokens)
        last_rows = (first_rows + counts - 1)[sampled].to(self.device)
        return self.model.logits(hidden[last_rows])

    def _prompt_logprobs(
        self, plan: BatchPlan, hidden: torch.Tensor, first_rows: torch.Tensor
    ) -> list[TokenLogprobs | None]:
        """Each prompt target's log-probability (and alternatives) from the position before
        it, PROMPT_ROWS positions at a time: a whole chunk's float32 logits would take
        chunk x vocab x 4 bytes at once."""
        results: list[TokenLogprobs | None] = []
        for i, targets in enumerate(plan.prompt_targets):
            if not targets:
                results.append(None)
                continue
            top = plan.sampling[i].prompt_logprobs or 0
            found = TokenLogprobs()
            first = int(first_rows[i])
            for offset in range(0, len(targets), PROMPT_ROWS):
                part = targets[offset : offset + PROMPT_ROWS]
                rows = hidden[first + offset : first + offset + len(part)]
                logits = self.model.logits(rows).dense()
                wanted = torch.tensor(part, device=logits.device)
                found.extend(token_logprobs(logits, wanted, [top] * len(part)))
            results.append(found)
        return results

    def _forward_mixed(self, plan: BatchPlan, cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """The final hidden state of every token of the plan, and each sequence's first row."""
        bs = cache.block_size
        counts = torch.tensor(plan.num_tokens)
        starts = torch.tensor(plan.start_pos)
        first_rows = torch.cumsum(counts, 0) - counts
        seq_of_token = torch.repeat_interleave(torch.arange(len(plan.num_tokens)), counts)
        offsets = torch.arange(plan.total_tokens) - first_rows[seq_of_token]
        positions = starts[seq_of_token] + offsets
        width = max(len(t) for t in plan.block_tables)
        scratch = cache.scratch_block
        tables = torch.tensor([t + [scratch] * (width - len(t)) for t in plan.block_tables])
        slots = tables[seq_of_token, positions // bs] * bs + positions % bs

        device = self.device
        slots = slots.to(device, non_blocking=True)
        meta = build_metadata(
            plan.num_tokens,
            plan.start_pos,
            tables,
            slots,
            cache.like,
            self.model_config.group_size,
            self.model.kernels.attention,
        )
        hidden = self.model.forward(
            torch.tensor(plan.input_ids, device=device),
            positions.to(device, non_blocking=True),
            cache.layers,
            meta,
        )
        return hidden, first_rows


def _bitmasks(plan: BatchPlan, sampled: list[int]) -> list[torch.Tensor | None] | None:
    """The sampled rows' grammar masks (structured output); None when no row has one."""
    if not plan.token_bitmasks:
        return None
    masks = [plan.token_bitmasks[i] for i in sampled]
    return [None if text is None else decode_bitmask(text) for text in masks]


def _check_worker_config(config: WorkerConfig) -> None:
    if config.block_size < 1:
        raise ValueError(f"block_size must be at least 1, got {config.block_size}")
    if config.max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be at least 1, got {config.max_num_seqs}")


def check_plan(
    plan: BatchPlan, *, block_size: int, num_blocks: int, vocab_size: int, max_model_len: int
) -> None:
    """Cheap consistency checks (per sequence, not per token); ValueError says what is wrong."""
    count = len(plan.seq_ids)
    for name in ("num_tokens", "start_pos", "block_tables", "sample", "sampling"):
        if len(getattr(plan, name)) != count:
            raise ValueError(f"plan has {count} seq_ids but {len(getattr(plan, name))} {name}")
    if plan.token_bitmasks and len(plan.token_bitmasks) != count:
        raise ValueError(f"plan has {count} seq_ids but {len(plan.token_bitmasks)} token_bitmasks")
    if len(set(plan.seq_ids)) != count:
        raise ValueError("plan lists a sequence more than once")
    for seq_id, tokens, start, table in zip(
        plan.seq_ids, plan.num_tokens, plan.start_pos, plan.block_tables, strict=True
    ):
        _check_sequence(seq_id, tokens, start, len(table), block_size, max_model_len)
    if sum(plan.num_tokens) != len(plan.input_ids):
        raise ValueError(
            f"num_tokens add up to {sum(plan.num_tokens)} but input_ids has {len(plan.input_ids)}"
        )
    used = [block for table in plan.block_tables for block in table]
    if used and (min(used) < 0 or max(used) >= num_blocks):
        raise ValueError(f"block ids must lie in 0..{num_blocks - 1}, got {min(used)}..{max(used)}")
    if plan.input_ids and (min(plan.input_ids) < 0 or max(plan.input_ids) >= vocab_size):
        raise ValueError(f"token ids must lie in 0..{vocab_size - 1}")
    if plan.prompt_targets:
        _check_prompt_targets(plan, vocab_size)


def _check_prompt_targets(plan: BatchPlan, vocab_size: int) -> None:
    if len(plan.prompt_targets) != len(plan.seq_ids):
        raise ValueError(
            f"plan has {len(plan.seq_ids)} seq_ids but {len(plan.prompt_targets)} prompt_targets"
        )
    for seq_id, targets, tokens in zip(
        plan.seq_ids, plan.prompt_targets, plan.num_tokens, strict=True
    ):
        if targets is None:
            continue
        if len(targets) > tokens:
            raise ValueError(
                f"sequence {seq_id} has {len(targets)} prompt targets for {tokens} positions"
            )
        if targets and (min(targets) < 0 or max(targets) >= vocab_size):
            raise ValueError(f"prompt targets must lie in 0..{vocab_size - 1}")


def _check_sequence(
    seq_id: int, tokens: int, start: int, table_len: int, block_size: int, max_model_len: int
) -> None:
    if tokens < 1:
        raise ValueError(f"sequence {seq_id} has {tokens} tokens; each needs at least one")
    if start < 0:
        raise ValueError(f"sequence {seq_id} starts at negative position {start}")
    end = start + tokens
    if end > max_model_len:
        raise ValueError(
            f"sequence {seq_id} reaches {end} tokens, beyond max_model_len {max_model_len}"
        )
    if table_len * block_size < end:
        raise ValueError(
            f"sequence {seq_id} needs {math.ceil(end / block_size)} blocks for {end} tokens "
            f"but its block table has {table_len}"
        )
