"""Read a model's weights from model.safetensors or a sharded safetensors index, and a GGUF
conversion's quantized weights from quantized.safetensors.

A tensor-parallel rank reads its weights as StoredTensors: each is read only when the
model takes it, and then only the rank's slice of it, so that a rank's memory (its GPU's
included) never holds the whole checkpoint of a model split because one device cannot."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from gpu_worker import mxfp4
from gpu_worker.protocol import QUANTIZED_WEIGHTS
from gpu_worker.quant import QuantWeight, kind_of

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """The weights are missing, incomplete or unreadable."""


def weight_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files that hold the weights, or a clear error when there are none."""
    root = Path(model_dir)
    if not root.is_dir():
        raise CheckpointError(f"model directory {root} does not exist")
    single = root / SINGLE_FILE
    if single.is_file():
        return [single]
    index = root / INDEX_FILE
    if index.is_file():
        return _files_from_index(index)
    raise CheckpointError(f"no {SINGLE_FILE} or {INDEX_FILE} in {root}")


class StoredTensor:
    """A checkpoint tensor not read yet: its shape, and what of it the model takes (the
    few tensor methods gpu_worker.tensor_parallel.Shard.slice and the WeightTaker call),
    each read from the file when called."""

    __slots__ = ("_handle", "_stored", "shape")

    def __init__(self, handle: Any, name: str) -> None:
        self._handle = handle  # the open file, which the slice reads from
        self._stored = handle.get_slice(name)
        self.shape = torch.Size(self._stored.get_shape())

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        return self._stored[(slice(None),) * dim + (slice(start, start + length),)]

    def __getitem__(self, rows: slice) -> torch.Tensor:
        return self._stored[rows]

    def new_zeros(self, shape: tuple[int, ...]) -> torch.Tensor:
        return self._stored[0:0].new_zeros(shape)

    def to(self, device: torch.device | str, dtype: torch.dtype) -> torch.Tensor:
        return self._stored[:].to(device=device, dtype=dtype)


def load_weights(
    model_dir: str | Path,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    *,
    on_use: bool = False,
    packed_mxfp4: bool = False,
) -> dict[str, Any]:
    """All tensors of the checkpoint, converted to `dtype` and placed on `device`; with
    `on_use`, StoredTensors, read (and converted by the taker) as the model takes them.
    MXFP4 weights (uint8 NAME_blocks and NAME_scales) come dequantized, as NAME, or with
    `packed_mxfp4` as they are stored (the WeightTaker's mxfp4_experts takes them)."""
    weights: dict[str, Any] = {}
    packed: dict[str, torch.Tensor] = {}
    for path in weight_files(model_dir):
        try:
            if on_use:
                handle = safe_open(str(path), framework="pt", device="cpu")
                weights.update({name: StoredTensor(handle, name) for name in handle.keys()})  # noqa: SIM118
                continue
            with safe_open(str(path), framework="pt", device="cpu") as handle:
                for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    tensor = handle.get_tensor(name)
                    if name.endswith((mxfp4.BLOCKS, mxfp4.SCALES)) and tensor.dtype == torch.uint8:
                        packed[name] = tensor
                    else:
                        weights[name] = tensor.to(device=device, dtype=dtype)
        except (SafetensorError, OSError, RuntimeError) as exc:
            raise CheckpointError(f"cannot read {path}: {exc}") from exc
    try:
        if packed_mxfp4:
            mxfp4.pairs(packed)
            weights.update(packed)
        else:
            dense = mxfp4.dequantize_all(packed, dtype)
            weights.update({name: tensor.to(device) for name, tensor in dense.items()})
    except ValueError as exc:
        raise CheckpointError(f"{Path(model_dir).name}: {exc}") from exc
    return weights


def load_quantized(model_dir: str | Path, device: torch.device) -> dict[str, QuantWeight]:
    """The weights QUANTIZED_WEIGHTS holds, by name: q8 where the values are int8, q4 or q5
    where they are uint8 (gpu_worker.quant.kind_of), the group from the scales' width."""
    path = Path(model_dir) / QUANTIZED_WEIGHTS
    if not path.is_file():
        raise CheckpointError(
            f"{Path(model_dir).name} has no {QUANTIZED_WEIGHTS}: quantization 'gguf' serves a "
            "model converted from a GGUF file"
        )
    try:
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            unserved = (handle.metadata() or {}).get("unserved")
            names = list(handle.keys())
            tensors = {name: handle.get_tensor(name).to(device) for name in names}
    except (SafetensorError, OSError, RuntimeError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from exc
    if unserved:
        raise CheckpointError(f"no quantized kernel serves these weights' types: {unserved}")
    weights = {}
    for key in [k for k in tensors if k.endswith(".values")]:
        name = key.removesuffix(".values")
        values, scales = tensors[key], tensors[name + ".scales"]
        kind = kind_of(values)
        group = values.shape[1] // scales.shape[1]
        weights[name] = QuantWeight(kind, values, scales, tensors.get(name + ".mins"), group)
    return weights


def _files_from_index(index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{index} is not a valid safetensors index: {exc}") from exc
    files = [index.parent / name for name in sorted(set(weight_map.values()))]
    missing = [str(f.name) for f in files if not f.is_file()]
    if missing:
        raise CheckpointError(f"{index} names shard files that are missing: {', '.join(missing)}")
    return files
