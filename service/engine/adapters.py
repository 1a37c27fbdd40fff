"""LoRA adapters on the service's side: the registry of names and the worker's slots.

The registry (AdapterRegistry) maps a served adapter's name to its PEFT directory
(adapter_config.json, adapter_model.safetensors), each validated when it is registered
against the base model's config.json and --max-lora-rank, without torch: the safetensors
header holds every tensor's shape. A fault is an AdapterError naming the field.

The slots (AdapterSlots) mirror the worker's --max-loras slots: an adapter gets a slot when
a sequence using it is admitted and no slot holds it (a free slot, else the least recently
used one no running sequence uses), and the step's plan carries the AdapterLoad before the
NewSeq naming it. When every slot is busy with other adapters the sequence is not admitted
this step (it waits, it never fails). A new worker holds no adapter: `reset`.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpu_worker.protocol import AdapterLoad

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
MAX_HEADER_BYTES = 100 * 1024 * 1024  # a safetensors header past this is not an adapter's
# the adapted linears and the base model's widths of their (input, output)
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_TENSOR_NAME = re.compile(r".*\.layers\.(\d+)\.\w+\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")


class AdapterError(ValueError):
    """An adapter that cannot be served: `field` names what does not fit."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True, slots=True)
class Adapter:
    name: str
    path: str
    rank: int


@dataclass(frozen=True, slots=True)
class BaseShapes:
    """What an adapter's tensors are checked against: the base model's layers and widths."""

    num_layers: int
    widths: dict[str, tuple[int, int]]  # target module -> (in, out)

    @classmethod
    def of_model(cls, model_dir: Path) -> BaseShapes:
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
        config = config.get("text_config", config)
        hidden, heads = config["hidden_size"], config["num_attention_heads"]
        head_dim = config.get("head_dim") or hidden // heads
        kv = config.get("num_key_value_heads", heads) * head_dim
        inter = config["intermediate_size"]
        widths = {
            "q_proj": (hidden, heads * head_dim),
            "k_proj": (hidden, kv),
            "v_proj": (hidden, kv),
            "o_proj": (heads * head_dim, hidden),
            "gate_proj": (hidden, inter),
            "up_proj": (hidden, inter),
            "down_proj": (inter, hidden),
        }
        return cls(config["num_hidden_layers"], widths)


class AdapterRegistry:
    """The adapters served, by name; each validated once, when registered."""

    def __init__(self, base: BaseShapes, max_rank: int) -> None:
        self.base = base
        self.max_rank = max_rank
        self.by_name: dict[str, Adapter] = {}

    def register(self, name: str, path: str) -> Adapter:
        adapter = Adapter(name, path, validate_adapter(Path(path), self.base, self.max_rank))
        self.by_name[name] = adapter
        return adapter

    def unregister(self, name: str) -> bool:
        return self.by_name.pop(name, None) is not None

    def get(self, name: str) -> Adapter | None:
        return self.by_name.get(name)

    @property
    def names(self) -> list[str]:
        return sorted(self.by_name)


def registry_at_start(
    model_dir: Path, max_rank: int, modules: list[tuple[str, str]]
) -> AdapterRegistry:
    """The registry of --lora-modules, each validated; an AdapterError names the module."""
    registry = AdapterRegistry(BaseShapes.of_model(model_dir), max_rank)
    for name, path in modules:
        try:
            registry.register(name, path)
        except AdapterError as exc:
            raise AdapterError(f"--lora-modules {name}: {exc}", exc.field) from None
    return registry


def validate_adapter(path: Path, base: BaseShapes, max_rank: int) -> int:
    """The rank of the PEFT adapter at `path` once it is known to fit the base model."""
    config = _adapter_config(path)
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterError(f"{ADAPTER_CONFIG}: 'r' must be a positive integer", "r")
    if rank > max_rank:
        raise AdapterError(
            f"{ADAPTER_CONFIG}: 'r' is {rank}, above this server's --max-lora-rank {max_rank}",
            "r",
        )
    _check_targets(config.get("target_modules"))
    for name, shape in _tensor_shapes(path / ADAPTER_WEIGHTS).items():
        _check_tensor(name, shape, rank, base)
    return rank


def _adapter_config(path: Path) -> dict[str, Any]:
    try:
        config = json.loads((path / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    except OSError as exc:
        raise AdapterError(
            f"{ADAPTER_CONFIG} cannot be read: {exc.strerror}", "lora_path"
        ) from None
    except ValueError as exc:
        raise AdapterError(f"{ADAPTER_CONFIG} is not JSON: {exc}", ADAPTER_CONFIG) from None
    if not isinstance(config, dict):
        raise AdapterError(f"{ADAPTER_CONFIG} is not a JSON object", ADAPTER_CONFIG)
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{ADAPTER_CONFIG}: 'peft_type' must be LORA", "peft_type")
    return config


def _check_targets(targets: Any) -> None:
    if isinstance(targets, str):
        targets = [targets]
    if not isinstance(targets, list) or not targets:
        raise AdapterError(
            f"{ADAPTER_CONFIG}: 'target_modules' must list modules", "target_modules"
        )
    unknown = [t for t in targets if t not in TARGET_MODULES]
    if unknown:
        raise AdapterError(
            f"{ADAPTER_CONFIG}: 'target_modules' names {unknown}; cadence adapts "
            f"{', '.join(TARGET_MODULES)}",
            "target_modules",
        )


def _tensor_shapes(weights: Path) -> dict[str, list[int]]:
    """Each tensor's shape, read from the safetensors header alone."""
    try:
        with weights.open("rb") as file:
            (size,) = struct.unpack("<Q", file.read(8))
            if size > MAX_HEADER_BYTES:
                raise ValueError("header too large")
            header = json.loads(file.read(size))
    except OSError as exc:
        raise AdapterError(
            f"{ADAPTER_WEIGHTS} cannot be read: {exc.strerror}", ADAPTER_WEIGHTS
        ) from None
    except (ValueError, struct.error) as exc:
        raise AdapterError(
            f"{ADAPTER_WEIGHTS} is not a safetensors file ({exc})", ADAPTER_WEIGHTS
        ) from None
    if not isinstance(header, dict):
        raise AdapterError(f"{ADAPTER_WEIGHTS} has no tensor table", ADAPTER_WEIGHTS)
    return {name: entry["shape"] for name, entry in header.items() if name != "__metadata__"}


def _check_tensor(name: str, shape: list[int], rank: int, base: BaseShapes) -> None:
    found = _TENSOR_NAME.match(name)
    if found is None:
        raise AdapterError(f"{ADAPTER_WEIGHTS}: tensor {name!r} is not a LoRA A or B weight", name)
    layer, module, kind = int(found[1]), found[2], found[3]
    if layer >= base.num_layers or module not in base.widths:
        raise AdapterError(
            f"{ADAPTER_WEIGHTS}: tensor {name!r} names no layer or module of the base model", name
        )
    width_in, width_out = base.widths[module]
    expected = [rank, width_in] if kind == "A" else [width_out, rank]
    if list(shape) != expected:
        raise AdapterError(
            f"{ADAPTER_WEIGHTS}: tensor {name!r} has shape {list(shape)}, the base model "
            f"and r={rank} want {expected}",
            name,
        )


@dataclass(slots=True)
class _Slot:
    name: str
    path: str
    last_used: int  # AdapterSlots.clock when a sequence last took it (least recently used)


@dataclass(slots=True)
class AdapterSlots:
    """The worker's adapter slots, as the service fills them (module docstring)."""

    count: int
    slots: list[_Slot | None] = field(init=False)
    loads: list[AdapterLoad] = field(default_factory=list)  # for the next plan
    clock: int = 0

    def __post_init__(self) -> None:
        self.slots = [None] * self.count

    def reset(self) -> None:
        """A new worker: every slot is empty (adapters load again on demand)."""
        self.slots = [None] * self.count
        self.loads.clear()

    def acquire(self, name: str, path: str, in_use: Iterable[str]) -> bool:
        """A slot holds adapter `name` (from `path`) for a sequence being admitted, loaded
        by the next plan if need be; False when every slot holds another adapter a sequence
        still uses."""
        self.clock += 1
        busy = set(in_use)
        for slot in self.slots:
            if slot is not None and slot.name == name:
                if slot.path == path:
                    slot.last_used = self.clock
                    return True
                if slot.name in busy:  # reloaded from elsewhere: its old users finish first
                    return False
        index = self._free_slot(busy, name)
        if index is None:
            return False
        self.slots[index] = _Slot(name, path, self.clock)
        self.loads.append(AdapterLoad(index, name, path))
        return True

    def take_loads(self) -> list[AdapterLoad]:
        loads, self.loads = self.loads, []
        return loads

    def held(self) -> list[str]:
        return [slot.name for slot in self.slots if slot is not None]

    def _free_slot(self, busy: set[str], name: str) -> int | None:
        """An empty slot, else the one a stale copy of `name` or the least recently used
        adapter no sequence uses holds."""
        stale = [i for i, s in enumerate(self.slots) if s is not None and s.name == name]
        empty = [i for i, s in enumerate(self.slots) if s is None]
        if stale or empty:
            return (stale + empty)[0]
        idle = [(s.last_used, i) for i, s in enumerate(self.slots) if s and s.name not in busy]
        return min(idle)[1] if idle else None
