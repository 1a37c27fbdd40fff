"""A decode step's integers, built on the host in one buffer and sent in one copy.

A decode-only step needs three integers per row on the device: its input token, its
position and its row of the worker's block tables (SeqTable: the tables never leave the
device). They are written with numpy into one [3, batch] host buffer, padding rows
included (token 0 at position 0 in the tables' PAD_SLOT row, which names only the scratch
block: the one padding rule of gpu_worker.step_inputs), and go to the device in a single
copy; on CUDA the buffer is pinned and the copy asynchronous, straight into a captured
graph's static input (gpu_worker.graphs). Everything else a decode step derives from them
(each row's tables, cache slots and context lengths) is computed on the device, inside the
graph where one replays.

The buffer is rewritten each step, so the previous step's copy must have left it first:
an event recorded after each copy is waited on before the buffer is written again.
"""

from __future__ import annotations

import torch

from gpu_worker.seq_table import PAD_SLOT
from gpu_worker.step_inputs import StepInputs

STAGED = 3  # rows of the buffer: input ids, positions, table rows


class DecodeStaging:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pinned = device.type == "cuda"
        self._host = torch.empty((STAGED, 0), dtype=torch.long)
        self._sent = torch.cuda.Event() if self._pinned else None

    def stage(self, inputs: StepInputs, batch: int) -> torch.Tensor:
        """[3, batch] on the host: the step's rows, then padding rows."""
        if self._sent is not None:
            self._sent.synchronize()
        if self._host.shape[1] < batch:
            self._host = torch.empty((STAGED, batch), dtype=torch.long, pin_memory=self._pinned)
        host = self._host[:, :batch]
        rows = inputs.num_seqs
        values = host.numpy()
        values[0, :rows] = inputs.plan.input_ids
        values[1, :rows] = inputs.plan.start_pos
        values[2, :rows] = [seq.slot for seq in inputs.seqs]
        values[:, rows:] = [[0], [0], [PAD_SLOT]]
        return host

    def send(self, host: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
        """`host` (stage's) on the device: copied into `into` where given (a graph's static
        input), else into a new tensor; on the CPU `host` itself where `into` is None."""
        if self._sent is None:
            return host if into is None else into.copy_(host)
        if into is None:
            into = torch.empty_like(host, device=self.device)
        into.copy_(host, non_blocking=True)
        self._sent.record()
        return into


def gather_tables(
    held: torch.Tensor, rows: torch.Tensor, width: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The tables [G, B, width] of `rows` (table rows, on the device) from the worker's
    held tables [G, slots, W]: one gather."""
    return torch.index_select(held[:, :, :width], 1, rows, out=out)
