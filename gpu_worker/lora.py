"""LoRA adapter slots and the batched delta each adapted linear adds.

Slots. WorkerConfig.max_loras slots are allocated at start, each holding every target
module of every layer: per (layer, module) one A buffer [slots, max_rank, in] and one B
buffer [slots, out, max_rank], in the model's dtype, zero beyond an adapter's rank. A
StepPlan's `adapters` load into them (gpu_worker.lora_files reads and checks the files)
before its new sequences are introduced; a NewSeq's adapter name resolves to its slot
then (SeqTable's adapter column: -1 for the base).

The scale is kept per slot (a float on the host), not folded into B: PEFT computes
B(A x) * scale, and multiplying B by the scale first would round B's entries (in
bfloat16) where PEFT rounds nothing, so the delta would differ from PEFT's by more than
the order of summation. An adapter's own rank is kept too: the CPU path multiplies by
A[:rank] and B[:, :rank], the shapes PEFT multiplies by.

The delta. A step's adapted tokens are sorted by slot once (LoraStep), each slot present
being one segment of them; each adapted linear (qkv, o_proj, gate_up, down: the fused
ones take each part's delta into that part's columns) gathers its input's adapted rows,
and per segment and part computes (x A^T) B^T * scale: a pair of matmuls per slot
present, never a loop per row. A step without adapted rows has no LoraStep and costs
nothing. On the CPU the delta is computed in float64 and rounded to the model's dtype:
whatever order a library's matmul sums a segment in (it may depend on how many rows share
the call), the rounding to float32 or bfloat16 loses it, so a row's bits do not depend on
the other adapters' rows beside it. On CUDA one Triton kernel pair does every segment
(gpu_worker.triton_lora, shrink then expand, float32 accumulation), and a step with
adapted rows runs eagerly: the decode and mixed graphs are captured without LoRA.

Under tensor parallelism each rank holds its slice of every adapter as of the base
weights (gpu_worker.tensor_parallel): the column-parallel q/k/v and gate/up keep their B's
rows of the rank's heads or features (A whole), the row-parallel o_proj and down keep
their A's columns (B whole): B(A_r x_r) is then the rank's partial sum of the delta, which
the all-reduce after the linear adds up with the base's. The models whose layers are not
plain q/k/v/o and gate/up/down (mixtures of experts, linear attention, Gemma 4's shared
K/V) are refused at start (`check_supported`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu_worker.lora_files import LoraAdapter, module_shape, read_adapter
from gpu_worker.model_config import ModelConfig
from gpu_worker.protocol import AdapterLoad
from gpu_worker.tensor_parallel import COLUMNS, NO_SHARD, ROWS, Shard

# the model's fused linears and the PEFT modules whose deltas fill their columns, in order
FUSED_PARTS = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
BASE = -1  # the adapter slot of a sequence that runs the base model
ROW_PARALLEL = ("o_proj", "down_proj")  # split by input features: each rank's A columns


def check_supported(config: ModelConfig) -> None:
    """ValueError naming why this model cannot serve LoRA adapters."""
    family = config.family
    if config.moe is not None or family.linear_attention is not None or family.gemma4:
        raise ValueError(
            f"LoRA adapters are not supported for {config.architecture}: its layers are not "
            "plain q/k/v/o and gate/up/down projections"
        )


@dataclass(slots=True)
class LoraStep:
    """A step's adapted tokens sorted by slot: `tokens` [N] (device) their rows in the
    step, `slots` [N] (device) their slots, `segments` (slot, first, end) over them."""

    tokens: torch.Tensor
    slots: torch.Tensor
    segments: list[tuple[int, int, int]]

    @classmethod
    def of(cls, adapter_of_token: torch.Tensor | None, device: torch.device) -> LoraStep | None:
        """From each token's slot [T] (host; None or all BASE: no step)."""
        if adapter_of_token is None:
            return None
        order = torch.argsort(adapter_of_token, stable=True)
        slots = adapter_of_token[order]
        first = int(torch.searchsorted(slots, 0))
        if first == len(slots):
            return None
        tokens, slots = order[first:], slots[first:]
        present, counts = torch.unique_consecutive(slots, return_counts=True)
        ends = torch.cumsum(counts, 0).tolist()
        starts = [0, *ends[:-1]]
        segments = list(zip(present.tolist(), starts, ends, strict=True))
        on_device = torch.cat([tokens, slots]).to(device, non_blocking=True)
        return cls(on_device[: len(tokens)], on_device[len(tokens) :], segments)


class LoraSlots:
    def __init__(
        self,
        config: ModelConfig,
        slots: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        shard: Shard = NO_SHARD,
    ) -> None:
        """`config`: the checkpoint's (every rank's adapters are read whole and sliced)."""
        self.config = config
        self.max_rank = max_rank
        self.device = device
        self.shard = shard
        # (layer, module) -> A [slots, max_rank, in], B [slots, out, max_rank]
        self.a: dict[tuple[int, str], torch.Tensor] = {}
        self.b: dict[tuple[int, str], torch.Tensor] = {}
        for layer in range(config.num_hidden_layers):
            for parts in FUSED_PARTS.values():
                for module in parts:
                    out, inp = self._local_shape(layer, module)
                    key = (layer, module)
                    self.a[key] = torch.zeros((slots, max_rank, inp), dtype=dtype, device=device)
                    self.b[key] = torch.zeros((slots, out, max_rank), dtype=dtype, device=device)
        self.names: list[str | None] = [None] * slots
        self.ranks = [0] * slots
        self.scales = [0.0] * slots
        self.modules: list[set[str]] = [set() for _ in range(slots)]
        self.scale_tensor = torch.zeros(slots, dtype=torch.float32, device=device)
        self.step: LoraStep | None = None  # the running step's adapted tokens
        self.kernels = _triton_kernels() if device.type == "cuda" else None

    def _local_shape(self, layer: int, module: str) -> tuple[int, int]:
        out, inp = module_shape(self.config, layer, module)
        if module in ROW_PARALLEL:
            return out, self.shard.local(inp)
        return self.shard.local(out), inp

    @property
    def num_slots(self) -> int:
        return len(self.names)

    @property
    def bytes_per_slot(self) -> int:
        buffers = [*self.a.values(), *self.b.values()]
        return sum(t[0].numel() * t.element_size() for t in buffers)

    def slot_of(self, name: str) -> int:
        """The slot holding adapter `name`; ValueError where none does (a plan error)."""
        try:
            return self.names.index(name)
        except ValueError:
            raise ValueError(f"adapter {name!r} is loaded in no slot of this worker") from None

    def load_all(self, loads: list[AdapterLoad], busy: set[int]) -> None:
        """Each load in turn; ValueError before any where one would replace the adapter
        of a `busy` slot (one that a sequence the worker holds runs with)."""
        for load in loads:
            if load.slot in busy:
                raise ValueError(
                    f"adapter slot {load.slot} holds {self.names[load.slot]!r}, which a "
                    f"running sequence uses; {load.name!r} cannot replace it"
                )
        for load in loads:
            self.load(load)

    def load(self, load: AdapterLoad) -> None:
        """Reads and checks the adapter, then replaces slot `load.slot`'s contents with it
        (nothing changes where the files are refused)."""
        if not 0 <= load.slot < self.num_slots:
            raise ValueError(f"adapter slot {load.slot} is not in 0..{self.num_slots - 1}")
        adapter = read_adapter(load.path, self.config, self.max_rank)
        self._write(load.slot, adapter)
        for slot, name in enumerate(self.names):  # a name is one slot's
            if name == load.name:
                self.names[slot] = None
        self.names[load.slot] = load.name

    def _write(self, slot: int, adapter: LoraAdapter) -> None:
        rank = adapter.rank
        for key, a in self.a.items():
            b = self.b[key]
            a[slot].zero_()
            b[slot].zero_()
            if key in adapter.weights:
                lora_a, lora_b = adapter.weights[key]
                if key[1] in ROW_PARALLEL:
                    lora_a = self.shard.slice(lora_a, COLUMNS)
                else:
                    lora_b = self.shard.slice(lora_b, ROWS)
                a[slot, :rank].copy_(lora_a)
                b[slot, :, :rank].copy_(lora_b)
        self.ranks[slot], self.scales[slot] = rank, adapter.scale
        self.modules[slot] = adapter.modules
        self.scale_tensor[slot] = adapter.scale

    def begin(self, adapter_of_token: torch.Tensor | None) -> None:
        """The step whose tokens have these slots (StepInputs.adapter_of_token) runs next."""
        self.step = LoraStep.of(adapter_of_token, self.device)

    def add_(self, layer: int, linear: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out` (linear's base output for input x) plus each adapted token's delta."""
        step = self.step
        if step is None:
            return out
        if self.kernels is not None:
            return self._add_triton(layer, linear, x, out, step)
        rows = x.index_select(0, step.tokens).double()
        delta = torch.zeros((rows.shape[0], out.shape[1]), dtype=torch.float64, device=x.device)
        for slot, first, end in step.segments:
            rank, scale = self.ranks[slot], self.scales[slot]
            column = 0
            for module in FUSED_PARTS[linear]:
                b = self.b[(layer, module)][slot, :, :rank]
                if module in self.modules[slot]:
                    a = self.a[(layer, module)][slot, :rank]
                    shrunk = rows[first:end] @ a.double().T
                    delta[first:end, column : column + b.shape[0]] = (shrunk @ b.double().T) * scale
                column += b.shape[0]
        # a token's row is read, added to and written back: index_add_ is the same sum, but
        # in bfloat16 on a CPU it takes milliseconds a call
        adapted = out.index_select(0, step.tokens)
        adapted += delta.to(out.dtype)
        return out.index_copy_(0, step.tokens, adapted)

    def _add_triton(
        self, layer: int, linear: str, x: torch.Tensor, out: torch.Tensor, step: LoraStep
    ) -> torch.Tensor:
        assert self.kernels is not None and out.stride(1) == 1  # the kernels' row layout
        shrink, expand = self.kernels
        x = x.contiguous()
        column = 0
        for module in FUSED_PARTS[linear]:
            a, b = self.a[(layer, module)], self.b[(layer, module)]
            shrunk = shrink(x, a, step.tokens, step.slots)
            expand(shrunk, b, self.scale_tensor, step.tokens, step.slots, out, column)
            column += b.shape[1]
        return out


def _triton_kernels() -> tuple:
    from gpu_worker.triton_lora import lora_expand, lora_shrink

    return lora_shrink, lora_expand
