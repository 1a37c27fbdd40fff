"""The KV cache's groups of layers: which layers share a block table, and in which of the
cache's tensors (its slots) each layer keeps its K/V.

A model whose layers all attend alike (all of them full, or all in one window) has one
group of all its layers, each in a slot of its own: a block holds block_size positions in
every layer, as it always did. A hybrid model (Gemma 2 and 3: windowed layers beside full
ones) is split as vLLM's hybrid KV cache manager splits it: the layers of each kind into
groups of one size, the fewest layers of a kind (or the most, when the kinds' counts lie
within 25%). The i-th layer of every group keeps its K/V in slot i, so a block id names
block_size positions of one group's layers, and every group takes its blocks from the one
pool. The service keeps a table per group for each sequence; a windowed group's gives its
blocks back as the window moves on, while a full group's keeps them all.

Gemma 3 270M has 3 full layers and 15 windowed ones (512 positions): one group of 3 full
layers, 5 of 3 windowed, in 3 slots. A sequence of n blocks' worth of tokens holds n blocks
of the full group and about 5 x 33 of the windowed ones (block_size 16), where a cache with
a block for all 18 layers would hold 6n blocks of the same size.

A layer that reads another layer's K/V (Gemma 4's last num_kv_shared_layers) is in no group
and allocates nothing: it attends in its source's group, over its source's slot.
A linear-attention layer (Qwen3-Next, Qwen3.5) is in no group either and allocates no
blocks: its state is a recurrent one per sequence (gpu_worker.recurrent_state). It is named
group 0's slot 0, which it never reads.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpu_worker.model_config import ModelConfig


@dataclass(frozen=True, slots=True)
class KVGroups:
    windows: tuple[int | None, ...]  # each group's sliding window, None for full attention
    layers: tuple[tuple[int, ...], ...]  # each group's layers: its i-th keeps K/V in slot i
    sources: tuple[int, ...] = ()  # the layer whose K/V each layer reads (ModelConfig.kv_source)

    @classmethod
    def of(cls, config: ModelConfig) -> KVGroups:
        """Full groups first (group 0 is one whenever the model has a full layer)."""
        by_window: dict[int | None, list[int]] = {}
        owners = [
            i
            for i in range(config.num_hidden_layers)
            if config.kv_source(i) == i and not config.is_linear(i)
        ]
        for layer in owners:
            by_window.setdefault(config.window_of(layer), []).append(layer)
        sources = tuple(config.kv_source(i) for i in range(config.num_hidden_layers))
        if len(by_window) == 1:
            (window, layers), *_ = by_window.items()
            return cls((window,), (tuple(layers),), sources)
        counts = [len(layers) for layers in by_window.values()]
        size = max(counts) if max(counts) < 1.25 * min(counts) else min(counts)
        windows, groups = [], []
        for window in sorted(by_window, key=lambda w: (w is not None, w or 0)):
            layers = by_window[window]
            for start in range(0, len(layers), size):
                windows.append(window)
                groups.append(tuple(layers[start : start + size]))
        return cls(tuple(windows), tuple(groups), sources)

    @property
    def num_slots(self) -> int:
        return max(len(layers) for layers in self.layers)

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    def group_of(self, layer: int) -> int:
        """The group whose records `layer` reads (0 for a layer in none: linear attention)."""
        source = self._source(layer)
        return next((g for g, layers in enumerate(self.layers) if source in layers), 0)

    def slot_of(self, layer: int) -> int:
        group = self.layers[self.group_of(layer)]
        source = self._source(layer)
        return group.index(source) if source in group else 0

    def _source(self, layer: int) -> int:
        return self.sources[layer] if self.sources else layer
