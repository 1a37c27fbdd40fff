"""The worker's step: a StepPlan applied to the sequences' table, its inputs, the forward
pass, sampling, the result.

The parts it runs with (model, cache, decode graphs, sampler) are built once by
gpu_worker.runtime, which starts the worker; a runner only runs steps.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Iterator

import torch

from gpu_worker.attention import AttentionMetadata, build_metadata
from gpu_worker.draft_model import Drafter, asks_draft_model
from gpu_worker.faults import DeviceFault, is_device_fault
from gpu_worker.graphs import DecodeRunner
from gpu_worker.kv_cache import KVCache
from gpu_worker.kv_connector import KvConnector
from gpu_worker.kv_ranks import GroupTransfers, RankNews
from gpu_worker.mixed_graphs import MixedGraphs
from gpu_worker.model import Model
from gpu_worker.protocol import POOL_LAST, Handshake, StepPlan, StepResult, TokenLogprobs
from gpu_worker.recurrent_state import RecurrentState, StateStep
from gpu_worker.sampler import Logits, Sampler, decode_bitmask, row_index, token_logprobs
from gpu_worker.seq_table import PlanLimits, SeqTable
from gpu_worker.speculation import Verification
from gpu_worker.step_inputs import StepInputs

PROMPT_ROWS = 64  # prompt positions whose log-probabilities are computed at once


class ModelRunner:
    def __init__(
        self,
        model: Model,
        cache: KVCache,
        decode_runner: DecodeRunner,
        sampler: Sampler,
        limits: PlanLimits,
        handshake: Handshake | None = None,
        drafter: Drafter | None = None,
        mixed: MixedGraphs | None = None,
        state: RecurrentState | None = None,
    ) -> None:
        self.model = model
        self.cache = cache
        self.decode_runner = decode_runner
        self.sampler = sampler
        self.limits = limits
        self.handshake = handshake  # what the worker answered at init (gpu_worker.runtime)
        self.table = SeqTable(limits, model.device)  # what the worker holds of each sequence
        self.drafter = drafter  # speculative decoding with a draft model (its drafts)
        if drafter is not None:  # its cache is laid out as this one: the same tables
            drafter.runner.table = self.table
        self.mixed = mixed  # mixed steps from graphs, whole or piecewise (CUDA)
        self.kv: KvConnector | None = None  # disaggregated prefill/decode's transfers
        self.transfers = GroupTransfers(model.shard.world_size)  # its ranks', on rank 0
        # the linear-attention layers' states, a row per slot of the table (runs eagerly)
        self.state = state
        if state is not None:
            self.table.slot_given = state.give

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        """Runs one step; a failure comes back as a result with `error` set, except one
        that leaves the device unusable: that raises DeviceFault (gpu_worker.faults)."""
        started = time.perf_counter()
        self._submit_pulls(plan)
        try:
            result = self.run(plan)
            result.step_ms = (time.perf_counter() - started) * 1000
            if plan.stages:  # the rows' K/V is written: gathered before the result names it
                self._stage(plan)
        except Exception as exc:
            result = StepResult(step_id=plan.step_id, error=_step_error(exc))
        if self.kv is not None:
            news = self._transfer_news(plan)
            result.pulls_done, result.notices, result.reading = (
                news.done,
                news.notices,
                news.reading,
            )
        return result

    def _stage(self, plan: StepPlan) -> None:
        if self.kv is None:
            raise ValueError("the plan stages K/V; this worker has no transfer engine")
        self.kv.stage(plan.stages)

    @torch.inference_mode()
    def follow(self, plan: StepPlan) -> str | None:
        """A follower rank's part of a step (gpu_worker.follower): the plan applied to its
        table as rank 0 applies it, every collective `run` makes on rank 0, in its order
        (_forward_and_logits), and nothing sampled. The step's error, as `execute`
        reports it; None when it ran. Its transfers as rank 0's (`execute`)."""
        self._submit_pulls(plan)
        error = None
        try:
            inputs = self.inputs(plan)
            _, hidden = self._forward_and_logits(inputs, Verification.of(inputs))
            if hidden is not None:
                for _ in self._prompt_logit_chunks(inputs, hidden):
                    pass
            if plan.stages:  # its shard of the prompts rank 0 stages, at the same offsets
                self._stage(plan)
        except Exception as exc:
            error = _step_error(exc)
        if self.kv is not None:
            self._transfer_news(plan)  # its part of rank 0's gather
        return error

    def _submit_pulls(self, plan: StepPlan) -> None:
        """This rank's part of the plan's pulls, started before the forward pass, which
        never waits for them."""
        if self.kv is not None:
            self.kv.submit(plan.pulls, self.model.shard.rank)

    def _transfer_news(self, plan: StepPlan) -> RankNews:
        """The pulls ended and the notices received since the last news: the connector's
        alone; in a tensor-parallel group, on the steps that await news, those complete on
        every rank (gpu_worker.kv_ranks), on rank 0 (nothing on the others)."""
        assert self.kv is not None
        shard = self.model.shard
        if shard.world_size == 1:
            return RankNews.of(self.kv.poll_done(), self.kv.poll_notices())
        self.transfers.forget(plan.forgotten)
        if not plan.transfer_news:
            return RankNews()
        news = shard.gather_object(RankNews.of(self.kv.poll_done(), self.kv.poll_notices()))
        return self.transfers.combine(news) if news else RankNews()

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> StepResult:
        """One step; raises where execute reports."""
        inputs = self.inputs(plan)
        if not plan.rows:  # it only told the worker what to forget
            return StepResult(step_id=plan.step_id)
        if asks_draft_model(plan):
            if self.drafter is None:
                raise ValueError("the plan asks for a draft model's drafts; this worker has none")
            plan = self.drafter.fill(plan)
            inputs = StepInputs.of(plan, self.table)
            self._begin_lora(inputs)
        verification = Verification.of(inputs)
        self.table.histories.count_step(plan)
        logits, hidden = self._forward_and_logits(inputs, verification)
        prompt_logprobs: list[TokenLogprobs | None] = []
        pooled: list[str | None] = []
        if hidden is not None and any(row.prompt_targets for row in plan.rows):
            prompt_logprobs = self._prompt_logprobs(inputs, hidden)
        if hidden is not None and any(inputs.pooling):
            pooled = self._pooled(inputs, hidden)
        seq_ids = [plan.rows[i].seq_id for i in inputs.sampled]
        tokens, logprobs = self._sample(inputs, logits, seq_ids, verification)
        return StepResult(
            step_id=plan.step_id,
            seq_ids=seq_ids,
            tokens=tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            pooled=pooled,
        )

    def _sample(
        self,
        inputs: StepInputs,
        logits: Logits,
        seq_ids: list[int],
        verification: Verification | None,
    ) -> tuple[list[list[int]], TokenLogprobs | None]:
        """The tokens each sampled sequence takes (one, or its kept drafts and one), and
        their logprobs when any asks."""
        sampled = inputs.sampled
        bitmasks = _bitmasks(inputs.plan, sampled)
        if verification is not None:
            return self._verify(inputs, logits, seq_ids, verification, bitmasks)
        histories = self.table.histories
        history = histories.rows(seq_ids) if len(histories) else None
        output = self.sampler.sample(
            logits, inputs.sampling(), inputs.ends(sampled), bitmasks, history
        )
        return [[token] for token in output.tokens], output.logprobs

    def _verify(
        self,
        inputs: StepInputs,
        logits: Logits,
        seq_ids: list[int],
        verification: Verification,
        bitmasks: list[torch.Tensor | None] | None,
    ) -> tuple[list[list[int]], TokenLogprobs | None]:
        """_sample's tokens for a step with drafts; the histories count the kept drafts."""
        histories = self.table.histories
        tracking = len(histories) > 0
        drafts = verification.drafts
        history = histories.drafted_rows(seq_ids, drafts) if tracking else None
        tokens, logprobs = verification.sample(
            self.sampler, logits, inputs.sampling(), bitmasks, history
        )
        if tracking:
            kept = [row[:-1] for row in tokens]
            histories.keep(seq_ids, kept, verification.draft_starts)
        return tokens, logprobs

    def _forward_and_logits(
        self, inputs: StepInputs, verification: Verification | None
    ) -> tuple[Logits, torch.Tensor | None]:
        """The sampling rows' logits, and the final hidden state of every token where a
        row reads more than its sampling rows (prompt logprobs, pooling, drafts), as rank
        0 and its followers compute them: the collectives' order (the forward's, the
        sampled rows' logits'; then each prompt-logprob chunk's) is this one."""
        plan = inputs.plan
        wants_prompt = any(row.prompt_targets for row in plan.rows)
        if not (wants_prompt or any(inputs.pooling) or verification is not None):
            return self.logits(inputs), None
        hidden = self.forward(inputs)
        return self._sampled_logits(inputs, hidden, verification), hidden

    @torch.inference_mode()
    def step_logits(self, plan: StepPlan) -> torch.Tensor:
        """Runs one step without sampling: float32 logits of the sampling sequences."""
        logits = self.logits(self.inputs(plan))
        # A float32 graph's dense logits are its output buffer, which the next step rewrites.
        return logits.dense().clone()

    @torch.inference_mode()
    def inputs(self, plan: StepPlan) -> StepInputs:
        """The plan's adapters loaded, the plan applied to the table (ValueError for one
        that does not fit it), and its facts."""
        lora = self.model.lora
        if plan.adapters:
            if lora is None:
                raise ValueError("the plan loads LoRA adapters; this worker has no slots")
            # before `new`, whose adapters they may be; never a slot a sequence still runs on
            lora.load_all(plan.adapters, self.table.adapter_slots_held(plan.finished))
        self.table.apply(plan)
        inputs = StepInputs.of(plan, self.table)
        self._begin_lora(inputs)
        return inputs

    def _begin_lora(self, inputs: StepInputs) -> None:
        if self.model.lora is not None:
            self.model.lora.begin(inputs.adapter_of_token)

    @property
    def _eager_lora(self) -> bool:
        """The running step has adapted tokens: it runs eagerly, as the graphs were
        captured without their deltas."""
        return self.model.lora is not None and self.model.lora.step is not None

    @torch.inference_mode()
    def logits(self, inputs: StepInputs) -> Logits:
        """The sampling sequences' logits."""
        sampled = inputs.sampled
        if not inputs.num_seqs:
            return Logits(torch.empty((0, self.model.config.vocab_size), device=self.model.device))
        if inputs.decode_only and self.state is None and not self._eager_lora:
            logits = self.decode_runner.run(inputs)
            if len(sampled) == inputs.num_seqs:
                return logits
            return logits.select(row_index(sampled, self.model.device))
        return self._sampled_logits(inputs, self.forward(inputs))

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """The final hidden state of every row of a step (any mix of rows): eagerly, or from
        the mixed steps' graphs where they were captured."""
        device = self.model.device
        input_ids = torch.tensor(inputs.plan.input_ids, device=device)
        positions = inputs.positions.to(device, non_blocking=True)
        if self.state is not None:
            step = self._state_step(inputs)
            layers, metas = self.cache.layers, self.metadata(inputs)
            return self.model.forward(input_ids, positions, layers, metas, step)
        if self.mixed is not None and not self._eager_lora:
            return self.mixed.forward(inputs, input_ids, positions, self.metadata)
        return self.model.forward(input_ids, positions, self.cache.layers, self.metadata(inputs))

    def _state_step(self, inputs: StepInputs) -> StateStep:
        """The step's rows in the recurrent states (ValueError for a row that does not
        continue its sequence's state)."""
        assert self.state is not None
        plan = inputs.plan
        return StateStep.of(
            self.state,
            [seq.slot for seq in inputs.seqs],
            [row.start_pos for row in plan.rows],
            plan.num_tokens,
            [bool(row.drafts) for row in plan.rows],
        )

    def metadata(self, inputs: StepInputs) -> list[AttentionMetadata]:
        """The step's attention records, one per KV group."""
        model, cache = self.model, self.cache
        return [
            build_metadata(
                inputs, group, cache.like, model.config.group_size, model.kernels.attention, kind
            )
            for group, kind in enumerate(model.group_attention)
        ]

    def _sampled_logits(
        self, inputs: StepInputs, hidden: torch.Tensor, verification: Verification | None = None
    ) -> Logits:
        """Logits at each sampling sequence's last row; at its last k + 1 rows for a
        sequence with k drafts."""
        rows = inputs.last_rows(inputs.sampled) if verification is None else verification.rows
        return self.model.logits(hidden[rows.to(self.model.device)])

    def _prompt_logprobs(
        self, inputs: StepInputs, hidden: torch.Tensor
    ) -> list[TokenLogprobs | None]:
        """Each prompt target's log-probability (and alternatives) from the position before
        it (_prompt_logit_chunks)."""
        results: list[TokenLogprobs | None] = [
            TokenLogprobs() if row.prompt_targets else None for row in inputs.plan.rows
        ]
        for i, part, logits in self._prompt_logit_chunks(inputs, hidden):
            top = inputs.seqs[i].sampling.prompt_logprobs or 0
            wanted = torch.tensor(part, device=logits.device)
            found = results[i]
            assert found is not None
            found.extend(token_logprobs(logits, wanted, [top] * len(part)))
        return results

    def _prompt_logit_chunks(
        self, inputs: StepInputs, hidden: torch.Tensor
    ) -> Iterator[tuple[int, list[int], torch.Tensor]]:
        """(sequence, targets, their dense logits), PROMPT_ROWS positions at a time: a whole
        chunk's float32 logits would take chunk x vocab x 4 bytes at once. On a follower
        rank the logits are of its vocabulary slice, computed for rank 0."""
        for i, row in enumerate(inputs.plan.rows):
            targets = row.prompt_targets
            if not targets:
                continue
            first = int(inputs.first_rows[i])
            for offset in range(0, len(targets), PROMPT_ROWS):
                part = targets[offset : offset + PROMPT_ROWS]
                rows = hidden[first + offset : first + offset + len(part)]
                yield i, part, self.model.logits(rows).dense()

    def _pooled(self, inputs: StepInputs, hidden: torch.Tensor) -> list[str | None]:
        """Each pooling row's vector (StepInputs.pooling) in float64: sums of float32
        values in float64 keep the same bits however the prompt was cut into chunks."""
        results: list[str | None] = []
        for i, kind in enumerate(inputs.pooling):
            if kind is None:
                results.append(None)
                continue
            first = int(inputs.first_rows[i])
            rows = hidden[first : first + inputs.plan.rows[i].num_tokens].double()
            vector = rows[-1] if kind == POOL_LAST else rows.sum(0)
            data = vector.cpu().numpy().astype("<f8").tobytes()
            results.append(base64.b64encode(data).decode())
        return results


def _step_error(exc: Exception) -> str:
    """The text a failed step reports; raises DeviceFault instead where the failure leaves
    the worker unusable (a sticky device error, a lost tensor-parallel rank)."""
    if isinstance(exc, DeviceFault):
        raise exc
    error = f"{type(exc).__name__}: {exc}"
    if is_device_fault(exc):
        raise DeviceFault(error) from exc
    return error


def _bitmasks(plan: StepPlan, sampled: list[int]) -> list[torch.Tensor | None] | None:
    """The sampled rows' grammar masks (structured output); None when no row has one."""
    masks = [plan.rows[i].bitmask for i in sampled]
    if all(mask is None for mask in masks):
        return None
    return [None if text is None else decode_bitmask(text) for text in masks]
