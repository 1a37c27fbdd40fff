"""Gated DeltaNet: the linear-attention layers of Qwen3-Next and Qwen3.5, as transformers'
torch fallbacks compute them (torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule,
the causal conv1d and Qwen3NextRMSNormGated).

A layer's in-projection gives q, k, v (convolved together), z (the output gate) and per
value head b (beta = sigmoid(b), the write strength) and a (the decay: g = -exp(A_log) *
softplus(a + dt_bias)). Qwen3-Next's checkpoint fuses q, k, v and z per key head
(in_proj_qkvz) and b, a likewise (in_proj_ba); they are reordered at load into Qwen3.5's
layout (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a), and all four are one matmul here.

The state (gpu_worker.recurrent_state) is read and written in place, per row: a prompt
chunk runs the chunked form (chunks of 64 positions, as transformers) from its sequence's
state, which is zeros at position 0; the step's single-token rows run the recurrent form,
batched. The output is normed with the gate (silu(z)) per value head, before out_proj
(the layer's o_proj).

Row invariance in bfloat16 is not claimed: the chunked form's float32 matmuls and
triangular solves are sized by the chunk, so a prompt's bits depend on how it was chunked
(float32 results agree with transformers within the tests' tolerance).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gpu_worker.model_config import LinearAttention, ModelConfig
from gpu_worker.quant import Matmul
from gpu_worker.recurrent_state import StateStep
from gpu_worker.tensor_parallel import WHOLE
from gpu_worker.weights import WeightTaker

CHUNK = 64  # the chunked form's chunk, transformers' default
L2_EPS = 1e-6

__all__ = ["GatedDeltaNet", "linear_attention", "load_gated_delta_net"]


@dataclass(slots=True)
class GatedDeltaNet:
    """A linear-attention layer's parts beyond its in_proj (Layer.qkv) and out_proj
    (Layer.o_proj)."""

    shape: LinearAttention
    conv: torch.Tensor  # [conv_dim, kernel] the depthwise convolution's weight
    neg_rate: torch.Tensor  # [value_heads] -exp(A_log), float32
    dt_bias: torch.Tensor  # [value_heads]
    norm: torch.Tensor  # [value_dim] the gated RMSNorm's weight (w, not 1 + w)
    eps: float


def load_gated_delta_net(
    take: WeightTaker, cfg: ModelConfig, prefix: str
) -> tuple[Matmul, GatedDeltaNet]:
    """(in_proj [q k v | z | b | a], its other parts) of the layer at `prefix`."""
    shape, hidden = cfg.linear_attention, cfg.hidden_size
    assert shape is not None
    attn = prefix + "linear_attn."
    if cfg.family.linear_attention == "qwen3_next":
        _unfuse_qwen3_next(take.weights, attn, shape)
    value_width = shape.value_heads * shape.value_dim
    names = [f"{attn}in_proj_{p}.weight" for p in ("qkv", "z", "b", "a")]
    rows = [shape.conv_dim, value_width, shape.value_heads, shape.value_heads]
    in_proj = take.matmul(names, [(r, hidden) for r in rows], split=WHOLE)
    conv = take(attn + "conv1d.weight", (shape.conv_dim, 1, shape.conv_kernel))
    a_log = take(attn + "A_log", (shape.value_heads,))
    parts = GatedDeltaNet(
        shape=shape,
        conv=conv.squeeze(1).contiguous(),
        neg_rate=-a_log.float().exp(),  # transformers' A_log.float().exp()
        dt_bias=take(attn + "dt_bias", (shape.value_heads,)),
        norm=take(attn + "norm.weight", (shape.value_dim,)),
        eps=cfg.rms_norm_eps,
    )
    return in_proj, parts


def _unfuse_qwen3_next(weights: dict[str, torch.Tensor], attn: str, shape: LinearAttention) -> None:
    """Qwen3-Next's in_proj_qkvz and in_proj_ba (grouped per key head) in the checkpoint's
    dict as Qwen3.5's four projections, rows in transformers' fix_query_key_value_ordering's
    order."""
    qkvz, ba = weights.pop(attn + "in_proj_qkvz.weight"), weights.pop(attn + "in_proj_ba.weight")
    heads, per = shape.key_heads, shape.value_heads // shape.key_heads
    hidden = qkvz.shape[-1]
    widths = [shape.key_dim, shape.key_dim, per * shape.value_dim, per * shape.value_dim]
    q, k, v, z = qkvz.view(heads, -1, hidden).split(widths, dim=1)
    b, a = ba.view(heads, 2 * per, hidden).split([per, per], dim=1)
    flat = [t.reshape(-1, hidden) for t in (q, k, v, z, b, a)]
    weights[attn + "in_proj_qkv.weight"] = torch.cat(flat[:3])
    for name, tensor in zip(("z", "b", "a"), flat[3:], strict=True):
        weights[f"{attn}in_proj_{name}.weight"] = tensor


def linear_attention(
    layer: GatedDeltaNet, projected: torch.Tensor, index: int, step: StateStep
) -> torch.Tensor:
    """Layer `index`'s output before out_proj [T, value_heads * value_dim], from its
    in_proj's `projected` [T, conv_dim + value_width + 2 value_heads]; the step's rows'
    states updated in place."""
    shape = layer.shape
    value_width = shape.value_heads * shape.value_dim
    mixed, z, b, a = projected.split(
        [shape.conv_dim, value_width, shape.value_heads, shape.value_heads], dim=1
    )
    beta = b.sigmoid()
    decay = layer.neg_rate * F.softplus(a.float() + layer.dt_bias.float())
    conv_state, recurrent = step.state.conv[index], step.state.recurrent[index]
    out = torch.empty(
        (projected.shape[0], shape.value_heads, shape.value_dim),
        dtype=projected.dtype,
        device=projected.device,
    )
    for first, count, slot in step.chunks:
        rows = slice(first, first + count)
        qkv = _conv_chunk(layer, mixed[rows], conv_state, slot)
        q, k, v = _heads(shape, qkv)
        out[rows], recurrent[slot] = _chunked_rule(
            q, k, v, decay[rows], beta[rows], recurrent[slot]
        )
    if step.decode_tokens.numel():
        tokens, slots = step.decode_tokens, step.decode_slots
        qkv = _conv_decode(layer, mixed.index_select(0, tokens), conv_state, slots)
        q, k, v = _heads(shape, qkv)
        found, new_state = _recurrent_rule(
            q, k, v, decay.index_select(0, tokens), beta.index_select(0, tokens), recurrent[slots]
        )
        out.index_copy_(0, tokens, found.to(out.dtype))
        recurrent.index_copy_(0, slots, new_state)
    return _gated_norm(layer, out, z.view_as(out)).view(projected.shape[0], -1)


def _conv_chunk(
    layer: GatedDeltaNet, x: torch.Tensor, conv_state: torch.Tensor, slot: int
) -> torch.Tensor:
    """silu of the causal convolution of one row's x [n, C] after its state's last inputs;
    the state keeps the row's last kernel - 1 inputs."""
    padded = torch.cat([conv_state[slot], x.T.to(conv_state.dtype)], dim=1)  # [C, k - 1 + n]
    conv_state[slot] = padded[:, padded.shape[1] - conv_state.shape[2] :]
    out = F.conv1d(padded.unsqueeze(0), layer.conv.unsqueeze(1), groups=padded.shape[0])
    return F.silu(out[0]).T.to(x.dtype)


def _conv_decode(
    layer: GatedDeltaNet, x: torch.Tensor, conv_state: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """_conv_chunk of one token per row, batched: x [D, C], the rows' states at `slots`."""
    padded = torch.cat([conv_state[slots], x.unsqueeze(2).to(conv_state.dtype)], dim=2)
    conv_state.index_copy_(0, slots, padded[:, :, 1:])
    out = F.conv1d(padded, layer.conv.unsqueeze(1), groups=padded.shape[1])  # [D, C, 1]
    return F.silu(out[:, :, 0]).to(x.dtype)


def _heads(
    shape: LinearAttention, qkv: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q and k [n, value_heads, key_dim] (each key head repeated for its value heads),
    l2-normed in float32, q scaled; v [n, value_heads, value_dim] in float32."""
    key_width = shape.key_heads * shape.key_dim
    q, k, v = qkv.split([key_width, key_width, shape.value_heads * shape.value_dim], dim=1)
    repeats = shape.value_heads // shape.key_heads
    q, k = (t.reshape(t.shape[0], shape.key_heads, shape.key_dim) for t in (q, k))
    if repeats > 1:
        q, k = q.repeat_interleave(repeats, dim=1), k.repeat_interleave(repeats, dim=1)
    q, k = _l2norm(q.float()), _l2norm(k.float())
    v = v.reshape(v.shape[0], shape.value_heads, shape.value_dim).float()
    return q * shape.key_dim**-0.5, k, v


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2_EPS)


def _chunked_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One row's gated delta rule by chunks, as torch_chunk_gated_delta_rule: q, k [n, H,
    dk], v [n, H, dv], decay and beta [n, H], from `state` [H, dk, dv] -> (out [n, H, dv],
    the new state)."""
    n = q.shape[0]
    pad = (CHUNK - n % CHUNK) % CHUNK
    # [H, chunks, CHUNK, d]
    q, k, v = (F.pad(t.transpose(0, 1), (0, 0, 0, pad)) for t in (q, k, v))
    beta, decay = (F.pad(t.float().T, (0, pad)) for t in (beta, decay))
    heads = q.shape[0]
    q, k, v = (t.reshape(heads, -1, CHUNK, t.shape[-1]) for t in (q, k, v))
    beta, decay = beta.reshape(heads, -1, CHUNK), decay.reshape(heads, -1, CHUNK)
    k_beta, v_beta = k * beta.unsqueeze(-1), v * beta.unsqueeze(-1)
    upper = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu(1)
    cum = decay.cumsum(dim=-1)
    pairwise = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * pairwise
    intra = (q @ k.transpose(-1, -2)) * pairwise
    decayed_k_beta = k_beta * cum.exp().unsqueeze(-1)
    values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cum = torch.linalg.solve_triangular(system, decayed_k_beta, upper=False, unitriangular=True)
    q = q * cum.exp().unsqueeze(-1)
    k = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]
    state = state.float()
    out = torch.empty_like(values)
    for i in range(q.shape[1]):
        v_new = values[:, i] - k_cum[:, i] @ state
        out[:, i] = q[:, i] @ state + intra[:, i] @ v_new
        state = state * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ v_new
    out = out.reshape(heads, -1, out.shape[-1])[:, :n].transpose(0, 1)
    return out, state


def _recurrent_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of D rows, as torch_recurrent_gated_delta_rule: q, k [D, H, dk], v [D, H,
    dv], decay and beta [D, H], states [D, H, dk, dv] -> (out [D, H, dv], new states)."""
    state = state * decay.exp()[..., None, None]
    remembered = (state * k.unsqueeze(-1)).sum(dim=-2)
    delta = (v - remembered) * beta.float().unsqueeze(-1)
    state = state + k.unsqueeze(-1) * delta.unsqueeze(-2)
    return (state * q.unsqueeze(-1)).sum(dim=-2), state


def _gated_norm(layer: GatedDeltaNet, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """Qwen3NextRMSNormGated over each value head: x [T, H, dv] normed, scaled by w, times
    silu(z), rounded to the model's dtype at transformers' points."""
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + layer.eps)).to(x.dtype)
    return (layer.norm * normed * F.silu(z.float())).to(x.dtype)
