"""The linear-attention layers' state per sequence, beside the paged KV (issue 53).

A Gated DeltaNet layer (gpu_worker.linear_attention) keeps no K/V: each sequence carries a
short convolution's last inputs [conv_dim, kernel - 1] and a recurrent state [value_heads,
key_dim, value_dim] instead. They live here, a row per sequence slot: the row of the
SeqTable's block tables the sequence was given (the same index), grown as that table
grows, and zeroed when a slot is (re)given to a sequence (SeqTable.slot_given). The conv
state is in the model's dtype; the recurrent state in float32, as transformers keeps it
(its torch_chunk_gated_delta_rule computes in float32 and returns the state so).

A sequence's state is its whole history: a step row must start where the state stands, so
every sequence starts at position 0 (a prefix-cache hit cannot be resumed: the state at
the hit's end was never saved), and the service preempts by recomputing from position 0,
as it does for the KV. `StateStep.of` checks this for every row, and refuses drafted rows:
a rejected draft cannot be taken back out of a recurrent state.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from gpu_worker.model_config import LinearAttention, ModelConfig

__all__ = ["RecurrentState", "StateStep"]

MIN_SLOTS = 8  # rows allocated at first, doubled as the table grows


class RecurrentState:
    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        slots: int = 0,
        checked: bool = True,
    ) -> None:
        """`slots` allocated at once (more as the table grows); `checked`: each row must
        continue its sequence's state (StateStep.of), except in trial steps."""
        linear = config.linear_attention
        assert linear is not None
        self.linear: LinearAttention = linear
        self.dtype = dtype
        self.device = device
        self.layers = [i for i in range(config.num_hidden_layers) if config.is_linear(i)]
        self.conv: dict[int, torch.Tensor] = {}  # layer -> [slots, conv_dim, kernel - 1]
        self.recurrent: dict[int, torch.Tensor] = {}  # layer -> [slots, heads, k_dim, v_dim]
        self.positions: list[int] = []  # each slot's next position (host)
        self.checked = checked
        self._allocate(slots)

    @property
    def num_slots(self) -> int:
        return len(self.positions)

    @property
    def bytes_per_slot(self) -> int:
        """What one sequence's state holds, over every linear-attention layer."""
        linear = self.linear
        conv = linear.conv_dim * (linear.conv_kernel - 1) * self.dtype.itemsize
        recurrent = linear.value_heads * linear.key_dim * linear.value_dim * 4
        return len(self.layers) * (conv + recurrent)

    def give(self, slot: int) -> None:
        """Slot `slot` starts a sequence: grown to hold it, zeroed, at position 0."""
        if slot >= self.num_slots:
            self._allocate(max(MIN_SLOTS, 2 * self.num_slots, slot + 1))
        for layer in self.layers:
            self.conv[layer][slot].zero_()
            self.recurrent[layer][slot].zero_()
        self.positions[slot] = 0

    @contextmanager
    def trials(self) -> Iterator[None]:
        """The start-up's trial steps, whose rows start anywhere: unchecked meanwhile (their
        slots are zeroed when given again)."""
        self.checked = False
        try:
            yield
        finally:
            self.checked = True

    @torch.inference_mode(False)  # they outlive the step that grows them
    def _allocate(self, slots: int) -> None:
        """`slots` rows per layer, the held ones copied."""
        linear, held = self.linear, self.num_slots
        for layer in self.layers:
            conv = torch.zeros(
                (slots, linear.conv_dim, linear.conv_kernel - 1),
                dtype=self.dtype,
                device=self.device,
            )
            recurrent = torch.zeros(
                (slots, linear.value_heads, linear.key_dim, linear.value_dim),
                dtype=torch.float32,
                device=self.device,
            )
            if held:
                conv[:held] = self.conv[layer]
                recurrent[:held] = self.recurrent[layer]
            self.conv[layer], self.recurrent[layer] = conv, recurrent
        self.positions += [0] * (slots - held)


@dataclass(slots=True)
class StateStep:
    """What a step's linear-attention layers need: its rows of several tokens (prompt
    chunks), each computed by the chunked form, and its single-token rows, batched
    through the recurrent form."""

    state: RecurrentState
    chunks: list[tuple[int, int, int]]  # (first token, tokens, slot) of each longer row
    decode_tokens: torch.Tensor  # [D] the single-token rows' tokens in the batch (device)
    decode_slots: torch.Tensor  # [D] their slots (device)

    @classmethod
    def of(
        cls,
        state: RecurrentState,
        slots: list[int],
        starts: list[int],
        counts: list[int],
        drafted: list[bool],
    ) -> StateStep:
        """The step of rows at `slots` adding `counts` tokens from `starts`; ValueError,
        before any state changes, for a row that does not continue its state. The slots'
        positions advance: the step is to run."""
        for slot, start, is_drafted in zip(slots, starts, drafted, strict=True):
            if is_drafted:
                raise ValueError(
                    "speculative drafts are not served with linear-attention layers: a "
                    "rejected draft cannot be taken back out of the recurrent state"
                )
            if state.checked and start != state.positions[slot]:
                raise ValueError(
                    f"a row starts at position {start}, but its sequence's recurrent state "
                    f"stands at {state.positions[slot]}: a linear-attention model's sequence "
                    "starts at 0 and continues where it stopped (no prefix-cache hits)"
                )
        chunks, decode_tokens, decode_slots = [], [], []
        first = 0
        for slot, start, count in zip(slots, starts, counts, strict=True):
            if count == 1:
                decode_tokens.append(first)
                decode_slots.append(slot)
            else:
                chunks.append((first, count, slot))
            state.positions[slot] = start + count
            first += count
        index = torch.tensor([decode_tokens, decode_slots], dtype=torch.long)
        index = index.to(state.device, non_blocking=True)
        return cls(state, chunks, index[0], index[1])
