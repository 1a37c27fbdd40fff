"""The decoder over a paged KV cache, for every family FAMILIES lists (Llama 2/3, SmolLM2,
TinyLlama, Mistral, Qwen2/3, Gemma 2/3/4, Phi-3, SmolLM3, the hybrid Qwen3-Next and Qwen3.5,
and the Mixtral, Qwen and gpt-oss mixtures of experts).

One forward pass takes the flattened tokens of a whole mixed batch (prefill chunks and
decode tokens, [T] ids at [T] absolute positions) and returns hidden states [T, hidden];
the LM head runs separately, only on the rows that sample a token.

Qwen3-Next and Qwen3.5 (gpu_worker.linear_attention) interleave Gated DeltaNet layers,
which read and update each sequence's recurrent state (a step's StateStep) instead of the
paged KV, with gated full-attention layers that rotate the first rotary_dim dims of each
head; such a model runs eagerly (never captured), and its linear-attention layers claim no
row invariance in bfloat16.

The layers are plain tensors rather than nn.Modules: a decode step is hundreds of small
kernels, and module call overhead would be a visible share of it on a CPU. What differs
between families is data on the layers (gpu_worker.layers): a part a family lacks is None
and skipped; the choices made once per model (Gemma's norms, GeGLU) are functions picked
at load. Layers that attend alike (the same window, scale and soft-capping) share one set
of attention records per step, one set per KV group (gpu_worker.kv_groups: the layers that
share block tables); a Llama model has one set for all its layers.
Which kernels run the attention, the small layer ops and the matmuls is the worker's
choice (gpu_worker.kernels), made once before the model loads.
Under tensor parallelism (gpu_worker.tensor_parallel) the model is one rank's: its
slices of the weights, its heads (its `config` counts only those, and so does the KV
cache allocated from it), and the collectives that join the ranks' results.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from gpu_worker.attention import AttentionMetadata, LayerAttention, paged_attention
from gpu_worker.kernels import Kernels
from gpu_worker.kv_cache import LayerKV
from gpu_worker.kv_groups import KVGroups
from gpu_worker.layer_ops import (
    add_gemma_rms_norm_,
    gelu_tanh_and_mul,
    gemma_rms_norm,
    rms_norm,
    rotate_,
    write_kv,
)
from gpu_worker.layers import load_layer
from gpu_worker.linear import LM_HEAD_ROW_SIZES, Linear
from gpu_worker.linear_attention import linear_attention
from gpu_worker.model_config import ModelConfig
from gpu_worker.per_layer_inputs import PerLayerInputs
from gpu_worker.quant import QUANTIZERS, QuantLinear, QuantWeight
from gpu_worker.recurrent_state import StateStep
from gpu_worker.rope import rope_tables
from gpu_worker.sampler import Logits
from gpu_worker.tensor_parallel import NO_SHARD, VOCAB, Shard, check_shardable
from gpu_worker.weights import MissingWeights, WeightTaker

REFINED_LOGITS = 8  # top logits per row recomputed in float32 when the model runs in bfloat16

__all__ = ["REFINED_LOGITS", "MissingWeights", "Model", "attention_kinds"]


class Model:
    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        *,
        max_positions: int,
        dtype: torch.dtype,
        device: torch.device,
        kernels: Kernels,
        quantization: str = "none",
        quantized: dict[str, QuantWeight] | None = None,
        shard: Shard = NO_SHARD,
    ) -> None:
        """`quantization` (gpu_worker.protocol.QUANTIZATIONS): int8 and int4 quantize the
        matmuls' weights here; gguf serves the `quantized` ones (a GGUF conversion's).
        `shard`: the rank this model is of a tensor-parallel group; ValueError where the
        group cannot split it (check_shardable)."""
        check_shardable(config, shard.world_size, quantization)
        self.config = shard.local_config(config)
        self.shard = shard
        self.dtype = dtype
        self.device = device
        self.kernels = kernels
        self.ops = kernels.layer_ops
        gemma, gemma4 = config.family.gemma, config.family.gemma4
        linear = config.family.linear_attention is not None
        self._pick_functions(gemma or linear)
        prefixes = config.family.text_prefixes
        take = WeightTaker(
            weights,
            dtype,
            device,
            kernels.matmul,
            # Gemma's and Qwen3-Next's norms: 1 + w; Gemma 4's: w
            (0.0 if gemma4 else 1.0) if gemma or linear else None,
            prefixes,
            quantizer=QUANTIZERS.get(quantization),
            quantized=quantized,
            quant_kernels=kernels.quant_matmul,
            shard=shard,
        )
        self.vocab_start, self.vocab_rows = shard.vocab_slice(config.vocab_size)
        head_shape = (config.vocab_size, config.hidden_size)
        self.embed = take("model.embed_tokens.weight", head_shape, VOCAB)
        # Gemma scales its embeddings by sqrt(hidden), rounded to the model's dtype.
        self.embed_scale = (
            torch.tensor(config.hidden_size**0.5).to(device, dtype) if gemma else None
        )
        groups = KVGroups.of(config)
        # how each KV group's layers attend: a step's attention records are per group
        self.group_attention = [_layer_attention(config, layers[0]) for layers in groups.layers]
        ropes = {}
        self.layers = []
        for i in range(config.num_hidden_layers):
            key = (config.rope_of(i), config.rotary_dim or config.head_dim_of(i))
            if key not in ropes:
                ropes[key] = rope_tables(key[1], key[0], max_positions, dtype, device)
            self.layers.append(load_layer(take, config, i, ropes[key], groups.group_of(i)))
        self.norm = take.norm("model.norm.weight", config.hidden_size)
        self.per_layer_inputs = (
            PerLayerInputs.load(take, config) if config.per_layer_input_size else None
        )
        # the layers whose K/V later layers read (Gemma 4): their k/v rows are kept per step
        self.kv_sources = {config.kv_source(i) for i in range(config.num_hidden_layers)}
        tied = config.tie_word_embeddings or "lm_head.weight" not in weights
        # Tied, the embedding stays dense for its lookups and a quantized head is a copy.
        name = "model.embed_tokens.weight" if tied else "lm_head.weight"
        dense: torch.Tensor | None = self.embed
        if not tied:
            dense = None if take.quantizes(name) else take(name, head_shape, VOCAB)
        self.lm_head = take.matmul(
            [name], [head_shape], sizes=LM_HEAD_ROW_SIZES, dense=dense, split=VOCAB
        )
        # for recomputing single logits: the served rows (a quantized head dequantizes its own)
        self.lm_head_rows = dense if isinstance(self.lm_head, Linear) else None
        # see gpu_worker.moe; the graphs' attention pieces pass no sinks (attend), nor
        # Gemma 4's per-layer inputs and shared K/V (forward)
        # and a recurrent state's step is not a graph's input
        self.capturable = config.moe is None and not (
            config.family.attention_sinks or gemma4 or linear
        )

    def _pick_functions(self, zero_centred: bool) -> None:
        """`zero_centred`: the norms scale by 1 + w (Gemma's, Qwen3-Next's)."""
        ops = self.ops
        self.rms_norm = gemma_rms_norm if zero_centred else ops.rms_norm
        self.add_rms_norm_ = add_gemma_rms_norm_ if zero_centred else ops.add_rms_norm_
        self.qk_norm = gemma_rms_norm if zero_centred else rms_norm
        gelu = self.config.hidden_act == "gelu_pytorch_tanh"
        self.act_and_mul = gelu_tanh_and_mul if gelu else ops.silu_and_mul
        self.act = functools.partial(F.gelu, approximate="tanh") if gelu else F.silu

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[LayerKV],
        metas: Sequence[AttentionMetadata],
        state: StateStep | None = None,
    ) -> torch.Tensor:
        """[T] token ids at [T] positions -> final-normed hidden states [T, hidden].

        `metas` holds a step's attention records for each KV group (`group_attention`);
        `state` the step's rows' recurrent states, for a model with linear-attention layers.
        Writes the tokens' K/V into their cache slots on the way. A mixed step's graph
        captures this whole, or the pieces between the attentions (`embedded`,
        `before_attention`, `after_attention`) where the attention runs eagerly
        (gpu_worker.mixed_graphs).
        """
        x, h = self.embedded(input_ids)
        per_layer = None
        if self.per_layer_inputs is not None:
            per_layer = self.per_layer_inputs(input_ids, x, self.rms_norm)
        kv_rows: dict[int, torch.Tensor] = {}  # the k/v rows of the layers others read
        for index, (layer, kv) in enumerate(zip(self.layers, kv_caches, strict=True)):
            if layer.linear is not None:
                assert state is not None, "a linear-attention layer needs the step's state"
                attn = linear_attention(layer.linear, layer.qkv(h), index, state)
                h = self.after_attention(index, x, attn, per_layer)
                continue
            meta = metas[layer.attention]
            qkv = self.before_attention(index, h, positions, kv, meta.slots)
            source = self.config.kv_source(index)
            if source != index:  # its q beside the k/v its source wrote
                qkv = torch.cat([qkv, kv_rows[source]], dim=1)
            elif index in self.kv_sources:
                kv_rows[index] = qkv[:, self.config.num_attention_heads * self.config.head_dim :]
            attn = self._own_width(index, self.attend(qkv, kv, meta, layer.sinks))
            if layer.attn_gate is not None:  # Qwen3-Next's gated attention
                attn = attn * torch.sigmoid(layer.attn_gate(h))
            h = self.after_attention(index, x, attn, per_layer)
        return h

    def embedded(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream x [T, hidden] and its first norm. x is updated in place from
        then on; each norm comes fused with the add before it."""
        x = self._embedding(input_ids)
        if self.embed_scale is not None:
            x = x * self.embed_scale
        return x, self.rms_norm(x, self.layers[0].input_norm, self.config.rms_norm_eps)

    def before_attention(
        self,
        index: int,
        h: torch.Tensor,
        positions: torch.Tensor,
        kv: LayerKV,
        slots: torch.Tensor,
    ) -> torch.Tensor:
        """Layer `index`'s qkv [T, (heads + 2 kv_heads) * d], rotated, its k/v in the cache;
        a layer that reads another's K/V (Gemma 4) gives its rotated q [T, heads * d] alone.
        A layer narrower than the cache (Gemma 4's sliding layers) pads its heads with zeros
        to the cache's d: the scores and the first d of each output row are unchanged."""
        cfg, layer = self.config, self.layers[index]
        heads, kv_heads, head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        own_dim, own_kv_heads = cfg.head_dim_of(index), cfg.kv_heads_of(index)
        owns_kv = cfg.kv_source(index) == index
        qkv = layer.qkv(h)
        if cfg.values_from_keys(index):  # v: the keys' projection, normed as v
            qkv = torch.cat([qkv, qkv[:, heads * own_dim :]], dim=1)
        if layer.qk_norm is not None:  # q and k heads (and Gemma 4's v heads) normed
            normed = layer.qk_norm.shape[0]
            heads_normed = qkv[:, : normed * own_dim].view(-1, normed, own_dim)
            heads_normed.copy_(self.qk_norm(heads_normed, layer.qk_norm, cfg.rms_norm_eps))
        if owns_kv and (own_dim, own_kv_heads) == (head_dim, kv_heads) and not cfg.rotary_dim:
            self.ops.rope_and_cache_(
                qkv, positions, layer.cos, layer.signed_sin, kv, slots, heads, kv_heads
            )
            return qkv
        return self._fitted_to_cache(index, qkv, positions, kv, slots)

    def _fitted_to_cache(
        self,
        index: int,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        kv: LayerKV,
        slots: torch.Tensor,
    ) -> torch.Tensor:
        """before_attention's end through the reference ops, for a layer whose heads are
        not the cache's: a q alone (Gemma 4's layers that read another's K/V), heads
        narrower than the cache's zero-padded to its d, and fewer k/v heads than it has each
        repeated (a query head's k/v head is then a copy of its own: the same scores); and
        heads rotated in their first rotary_dim dims alone (partial rotary: the layer's
        tables are that wide)."""
        cfg, layer = self.config, self.layers[index]
        heads, kv_heads, head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        own_dim, own_kv_heads = cfg.head_dim_of(index), cfg.kv_heads_of(index)
        owns_kv = cfg.kv_source(index) == index
        by_head = qkv.view(qkv.shape[0], -1, own_dim)
        rotated = heads + own_kv_heads if owns_kv else heads
        rotary = cfg.rotary_dim or own_dim
        rotate_(by_head[:, :rotated, :rotary], positions, layer.cos, layer.signed_sin)
        if own_dim != head_dim:
            by_head = F.pad(by_head, (0, head_dim - own_dim))
        if owns_kv:
            k, v = by_head[:, heads:rotated], by_head[:, rotated:]
            if own_kv_heads != kv_heads:
                repeats = kv_heads // own_kv_heads
                k, v = k.repeat_interleave(repeats, 1), v.repeat_interleave(repeats, 1)
                by_head = torch.cat([by_head[:, :heads], k, v], dim=1)
            write_kv(kv, k, v, slots)
        return by_head.reshape(qkv.shape[0], -1)

    def attend(
        self,
        qkv: torch.Tensor,
        kv: LayerKV,
        meta: AttentionMetadata,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The attention output [T, heads * d] of a layer's qkv (with its `sinks`, gpt-oss's:
        a model with sinks is never captured, so the graphs' pieces need not pass them)."""
        cfg = self.config
        heads, kv_heads, head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q_width, kv_width = heads * head_dim, kv_heads * head_dim
        q = qkv[:, :q_width].view(-1, heads, head_dim)
        k = qkv[:, q_width : q_width + kv_width].view(-1, kv_heads, head_dim)
        v = qkv[:, q_width + kv_width :].view(-1, kv_heads, head_dim)
        return paged_attention(q, k, v, kv, meta, sinks)

    def after_attention(
        self,
        index: int,
        x: torch.Tensor,
        attn: torch.Tensor,
        per_layer: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Layer `index` from its attention output on (x updated in place) -> the next
        layer's normed input, or the final norm's after the last layer. `per_layer`:
        Gemma 4's per-layer inputs [T, layers, width]."""
        layer, eps, norm, add_norm_ = (
            self.layers[index],
            self.config.rms_norm_eps,
            self.rms_norm,
            self.add_rms_norm_,
        )
        last = index == len(self.layers) - 1
        next_norm = self.norm if last else self.layers[index + 1].input_norm
        attn = layer.o_proj(attn)
        self.shard.all_reduce(attn)  # the ranks' partial sums, as down's below
        if layer.attn_out_norm is not None:
            attn = norm(attn, layer.attn_out_norm, eps)
        h = add_norm_(x, attn, layer.mlp_norm, eps)
        if layer.moe is not None and not layer.moe.config.beside_dense:
            mlp = layer.moe(h, self.act_and_mul)
        else:
            mlp = layer.down(self.act_and_mul(layer.gate_up(h)))  # type: ignore[misc]
            self.shard.all_reduce(mlp)
        if layer.moe is not None and layer.moe.config.beside_dense:  # from x, before its norm
            mlp = layer.moe.beside_dense(x, mlp, self.act_and_mul, norm, eps)
        if layer.mlp_out_norm is not None:
            mlp = norm(mlp, layer.mlp_out_norm, eps)
        if layer.scalar is None:
            return add_norm_(x, mlp, next_norm, eps)
        x.add_(mlp)
        if layer.per_layer_gate is not None and layer.per_layer_projection is not None:
            assert per_layer is not None and layer.per_layer_norm is not None
            gated = self._row_invariant_act(layer.per_layer_gate(x)) * per_layer[:, index]
            x.add_(norm(layer.per_layer_projection(gated), layer.per_layer_norm, eps))
        return norm(x.mul_(layer.scalar), next_norm, eps)

    def _own_width(self, index: int, attn: torch.Tensor) -> torch.Tensor:
        """The attention output [T, heads * d] of layer `index` at its own head_dim: the
        first of each head's zero-padded columns (before_attention)."""
        own_dim, head_dim = self.config.head_dim_of(index), self.config.head_dim
        if own_dim == head_dim:
            return attn
        return attn.view(attn.shape[0], -1, head_dim)[..., :own_dim].reshape(attn.shape[0], -1)

    def _row_invariant_act(self, x: torch.Tensor) -> torch.Tensor:
        """The activation of a narrow contiguous x [T, n], in float64 and rounded back: a
        CPU computes such a tensor as one flat run, its vectorized part and scalar tail
        (which elements get which depends on T) disagreeing in the last bit of float32,
        where they agree once rounded back from float64."""
        return self.act(x.double()).to(x.dtype)

    def _embedding(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The ids' embedding rows; under tensor parallelism each rank looks up the ids of
        its vocabulary slice, zeros for the others', and the all-reduce joins them."""
        if self.shard.world_size == 1:
            return F.embedding(input_ids, self.embed)
        ids = input_ids - self.vocab_start
        elsewhere = (ids < 0) | (ids >= self.vocab_rows)
        rows = F.embedding(ids.masked_fill(elsewhere, 0), self.embed)
        return self.shard.all_reduce(rows.masked_fill_(elsewhere.unsqueeze(1), 0))

    def logits(self, h: torch.Tensor) -> Logits:
        """The LM head for the final-normed rows that sample: [S, hidden] -> [S, vocab].

        A bfloat16 logit keeps 8 bits of mantissa: around 25, values 0.125 apart collapse,
        so the best tokens often tie and greedy decoding would choose among them by token
        id (SmolLM2 then answers "L'Étoile" instead of "Paris"). The few highest logits of
        each row are therefore recomputed in float32 from the same hidden state.

        Under tensor parallelism rank 0 returns these logits, by the same rule
        (_sharded_logits); every rank must call it, and the others get their own slice's.
        """
        if self.shard.world_size > 1:
            return self._sharded_logits(h)
        logits = self._capped(self.lm_head(h))
        if logits.dtype == torch.float32:
            return Logits(logits)
        top = self.ops.top_k_ids(logits, min(REFINED_LOGITS, logits.shape[1]))
        return Logits(logits, top, self._capped(self._exact_logits(h, top)))

    def _sharded_logits(self, h: torch.Tensor) -> Logits:
        """logits' rule over the ranks' vocabulary slices: rank 0 gathers the whole rows,
        picks each row's top ids from them with the op TP=1 uses, and broadcasts them;
        each id's float32 logit is computed, as _exact_logits computes it at TP=1, by the
        rank holding its row, and gathered. The other ranks get [S, their rows] logits,
        which they compute only for rank 0."""
        local = self.lm_head(h)
        gathered = self.shard.gather_vocab(local, self.config.vocab_size)
        logits = None if gathered is None else self._capped(gathered)
        if local.dtype == torch.float32:
            return Logits(local if logits is None else logits)
        top = self._broadcast_top_ids(logits, h.shape[0])
        exact = self.shard.gather_held(self._held_exact_logits(h, top), top, self.config.vocab_size)
        if logits is None or exact is None:  # not rank 0: its part is done
            return Logits(local)
        return Logits(logits, top, self._capped(exact))

    def _broadcast_top_ids(self, logits: torch.Tensor | None, rows: int) -> torch.Tensor:
        """Rank 0's top ids of each of `rows` rows (its `logits`; None elsewhere), on every
        rank."""
        k = min(REFINED_LOGITS, self.config.vocab_size)
        if logits is None:
            top = torch.empty((rows, k), dtype=torch.long, device=self.device)
        else:
            top = self.ops.top_k_ids(logits, k)
        return self.shard.broadcast(top)

    def _held_exact_logits(self, h: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
        """_exact_logits of the `top` ids this rank's vocabulary slice holds; those of the
        others' ids are of its first row, and gather_held drops them."""
        ids = top - self.vocab_start
        elsewhere = (ids < 0) | (ids >= self.vocab_rows)
        return self._exact_logits(h, ids.masked_fill(elsewhere, 0))

    def _capped(self, logits: torch.Tensor) -> torch.Tensor:
        """Gemma's final soft-capping, cap * tanh(logit / cap), where the config sets it."""
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def _exact_logits(self, h: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
        """The logits of the `top` ids [S, k] of each row, in float32.

        The rows are the served weight's: a quantized head's dequantized. Summed in
        float64, where the order of summation is lost in the rounding to float32:
        a library's matmul may sum a row otherwise by how many rows share the call, and a
        row's logits must not depend on its company.
        """
        if isinstance(self.lm_head, QuantLinear):
            rows = self.lm_head.dequantized_rows(top).double()  # [S, k, hidden]
        else:
            assert self.lm_head_rows is not None
            rows = self.lm_head_rows[top].double()
        return (rows * h.double().unsqueeze(1)).sum(-1).float()


def _layer_attention(config: ModelConfig, index: int) -> LayerAttention:
    scale = None if config.query_pre_attn_scalar is None else config.attention_scale
    return LayerAttention(
        scale,
        config.window_of(index),
        config.attn_logit_softcapping,
        config.family.attention_sinks,
    )


def attention_kinds(config: ModelConfig) -> list[LayerAttention]:
    """The distinct ways the model's layers attend, in the order layers first use them."""
    kinds: list[LayerAttention] = []
    for i in range(config.num_hidden_layers):
        kind = _layer_attention(config, i)
        if kind not in kinds:
            kinds.append(kind)
    return kinds
