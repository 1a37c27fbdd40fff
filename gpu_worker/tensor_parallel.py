"""Tensor parallelism inside the model: which slice of each weight a rank keeps, and the
collectives that put the slices' results back together.

Megatron-LM's split, as vLLM and nano-vllm make it, for N ranks:
- q, k and v by head groups: rank r takes the query heads [r H/N, (r+1) H/N) and the KV
  heads likewise, so it attends with its own heads and its KV cache holds only theirs;
  gate and up by rows (the MLP's features). Each part is sliced before the parts are
  fused: N equal pieces of a fused [q; k; v] would give rank 0 all of q and no k.
- o_proj and down by columns: each rank's product is a partial sum of the whole output,
  and an all-reduce adds them up (two per layer).
- the embedding and the LM head by vocabulary, tied ones by the one slice: a lookup of an
  id another rank holds gives zeros, and an all-reduce puts each row together (exactly: a
  row plus zeros); the LM head's logits are gathered to rank 0, which alone samples.
- norms (Gemma's included) whole on every rank.
A forward pass thus makes 2L + 1 all-reduces (each an all-gather summed in rank order,
Shard.all_reduce says why); the logits one gather (float32), or in
bfloat16 a gather, the broadcast of rank 0's top ids and a gather of their exact logits.
A collective that fails (a rank exited, or did not answer within the group's timeout)
raises GroupFault: the group is unusable, and the worker exits (gpu_worker.faults).

The vocabulary is padded to a multiple of N, as vLLM's VocabParallelEmbedding pads it,
rather than required to divide: a gather takes slices of one shape, and a vocabulary of
32,000 tokens (Llama 2's) should not refuse TP=3 over one padding row. The padding rows
are zeros; no token id reaches them (a plan's ids lie below the vocabulary) and rank 0
drops their logits before anything reads them.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from gpu_worker.faults import GroupFault
from gpu_worker.model_config import ModelConfig
from gpu_worker.quant import ACTIVATION_GROUP


@dataclass(frozen=True, slots=True)
class Split:
    """How a weight is cut between the ranks: "whole" (every rank keeps all of it), "rows"
    (output features), "columns" (input features) or "vocab" (rows by token id, padded).
    `parts`: a fused weight's parts' sizes along its rows, each cut alike (Phi-3's
    qkv_proj); () for a weight of one part."""

    kind: str
    parts: tuple[int, ...] = ()


WHOLE = Split("whole")
ROWS = Split("rows")
COLUMNS = Split("columns")
VOCAB = Split("vocab")


def fused_rows(*parts: int) -> Split:
    """The rows of a weight the checkpoint holds fused from parts of these sizes."""
    return Split("rows", parts)


@dataclass(frozen=True, slots=True)
class Shard:
    """One rank's part of a model split over `world_size` ranks of the process group
    `group` (None: torch.distributed's default group). With one rank (NO_SHARD) every
    weight is whole and no collective runs."""

    rank: int = 0
    world_size: int = 1
    group: dist.ProcessGroup | None = None

    @classmethod
    def of(cls, group: dist.ProcessGroup | None = None) -> Shard:
        """This process's shard of `group`, torch.distributed already initialised."""
        return cls(dist.get_rank(group), dist.get_world_size(group), group)

    def local(self, count: int) -> int:
        """This rank's share of `count` heads or features (check_shardable: they divide)."""
        return count // self.world_size

    def local_config(self, config: ModelConfig) -> ModelConfig:
        """`config` as this rank's attention and KV cache see it: its query and KV heads.
        The other sizes stay the checkpoint's."""
        if self.world_size == 1:
            return config
        return dataclasses.replace(
            config,
            num_attention_heads=self.local(config.num_attention_heads),
            num_key_value_heads=self.local(config.num_key_value_heads),
        )

    def vocab_slice(self, vocab_size: int) -> tuple[int, int]:
        """(first token id, rows) of this rank's embedding and LM head: the vocabulary
        padded to a multiple of the ranks, an equal number of rows each."""
        rows = -(-vocab_size // self.world_size)
        return self.rank * rows, rows

    def slice(self, tensor: torch.Tensor, split: Split) -> torch.Tensor:
        """This rank's part of `tensor`, a tensor of its own (`tensor` itself when whole)."""
        if self.world_size == 1 or split.kind == "whole":
            return tensor
        if split.kind == "vocab":
            return self._vocab_rows(tensor)
        dim = {"rows": 0, "columns": 1}[split.kind]
        sizes = split.parts or (tensor.shape[dim],)
        starts = itertools.accumulate((0, *sizes[:-1]))
        pieces = [
            tensor.narrow(dim, start + self.rank * self.local(size), self.local(size))
            for start, size in zip(starts, sizes, strict=True)
        ]
        return torch.cat(pieces, dim)

    def _vocab_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        start, rows = self.vocab_slice(tensor.shape[0])
        held = tensor[start : start + rows]
        padding = tensor.new_zeros((rows - held.shape[0], *tensor.shape[1:]))
        return torch.cat((held, padding))

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` summed over the ranks, in place; returned for chaining.

        Summed here, in rank order in float32, from an all-gather of the parts, rather than
        by torch.distributed's all_reduce: a ring all-reduce (gloo's, NCCL's) sums each
        chunk of the flat tensor starting at another rank, so from three ranks on an
        element's order of summation follows its place in the tensor, and a row's bits
        would depend on its batch company (seen in bfloat16 at 3 ranks: 0.03 apart). The
        parts are rounded once, as TP=1's matmul rounds its sum once."""
        if self.world_size == 1:
            return tensor
        parts = tensor.new_empty((self.world_size * tensor.shape[0], *tensor.shape[1:]))
        with _collective("all-reduce"):
            _all_gather_single(parts, tensor.contiguous(), group=self.group)
        parts = parts.view(self.world_size, *tensor.shape)
        total = parts[0].float()  # a float32 part is itself: the gathered copy, summed into
        for part in parts[1:]:
            total += part
        return tensor.copy_(total)

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's `tensor`, in place on every rank; returned for chaining."""
        if self.world_size > 1:
            with _collective("broadcast"):
                dist.broadcast(tensor, group=self.group, group_src=0)
        return tensor

    def gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `tensor` (one shape on all), in rank order, on rank 0; [] on the
        others."""
        if self.world_size == 1:
            return [tensor]
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)] if self.rank == 0 else []
        with _collective("gather"):
            dist.gather(tensor, parts or None, group=self.group, group_dst=0)
        return parts

    def gather_object(self, value: Any) -> list[Any]:
        """Every rank's picklable `value`, in rank order, on rank 0; [] on the others
        (a step's KV transfer news, gpu_worker.kv_ranks)."""
        if self.world_size == 1:
            return [value]
        found: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        with _collective("gather"):
            dist.gather_object(value, found, group=self.group, group_dst=0)
        return found or []

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """The [S, vocab] logits on rank 0, from each rank's [S, rows] of its vocabulary
        slice (the padding dropped); None on the others."""
        parts = self.gather(logits)
        if not parts:
            return None
        return torch.cat(parts, dim=1)[:, :vocab_size].contiguous()

    def gather_held(
        self, values: torch.Tensor, ids: torch.Tensor, vocab_size: int
    ) -> torch.Tensor | None:
        """On rank 0, for each token id of `ids` [S, k], the value the rank holding its
        row put in `values` [S, k] (each rank's right only for its own ids); None on the
        others."""
        parts = self.gather(values)
        if not parts:
            return None
        holders = ids // self.vocab_slice(vocab_size)[1]
        return torch.stack(parts).gather(0, holders.unsqueeze(0))[0]


NO_SHARD = Shard()


def _all_gather_single(output: torch.Tensor, tensor: torch.Tensor, group: Any) -> None:
    """torch 2.13's all_gather_single; all_gather_into_tensor, its older name, warns there
    at every call."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, tensor, group=group)


@contextmanager
def _collective(name: str) -> Iterator[None]:
    try:
        yield
    except RuntimeError as exc:
        raise GroupFault(f"a tensor-parallel {name} failed: {exc}") from exc


def check_shardable(config: ModelConfig, world_size: int, quantization: str = "none") -> None:
    """ValueError, saying why, where `world_size` ranks cannot split this model."""
    if world_size < 1:
        raise ValueError(f"tensor parallel size must be at least 1, got {world_size}")
    if world_size == 1:
        return
    if config.moe is not None:
        raise ValueError(
            f"tensor parallelism does not split a mixture of experts ({config.architecture}); "
            "serve it with tensor parallel size 1"
        )
    if config.family.gemma4:
        raise ValueError(
            "tensor parallelism does not split Gemma 4's per-layer inputs and shared K/V yet; "
            "serve it with tensor parallel size 1"
        )
    if quantization == "gguf":
        raise ValueError(
            "tensor parallelism does not split a GGUF conversion's quantized weights; "
            "serve them with tensor parallel size 1, or quantize with int8 or int4"
        )
    _check_divisible(config, world_size)
    if quantization != "none":
        _check_quantized_widths(config, world_size, quantization)


def _check_divisible(config: ModelConfig, world_size: int) -> None:
    sizes = {
        "attention heads": config.num_attention_heads,
        "key/value heads": config.num_key_value_heads,
        "intermediate size": config.intermediate_size,
    }
    uneven = [f"{size} {name}" for name, size in sizes.items() if size % world_size]
    if not uneven:
        return
    fitting = [
        str(n)
        for n in range(1, config.num_key_value_heads + 1)
        if all(size % n == 0 for size in sizes.values())
    ]
    raise ValueError(
        f"tensor parallel size {world_size} does not divide the model's {', '.join(uneven)}: "
        "each rank takes an equal share of the heads, the key/value heads and the MLP's "
        f"features; sizes that fit this model: {', '.join(fitting)}"
    )


def _check_quantized_widths(config: ModelConfig, world_size: int, quantization: str) -> None:
    """A quantized weight's rows go in groups of ACTIVATION_GROUP columns: the column-split
    matmuls' slices must hold whole groups."""
    widths = {
        "o_proj": config.num_attention_heads // world_size * config.head_dim,
        "down_proj": config.intermediate_size // world_size,
    }
    for name, width in widths.items():
        if width % ACTIVATION_GROUP:
            raise ValueError(
                f"at tensor parallel size {world_size} each rank's {name} has {width} input "
                f"columns, not a multiple of {ACTIVATION_GROUP}: {quantization} quantizes "
                f"weights in groups of {ACTIVATION_GROUP} columns"
            )
