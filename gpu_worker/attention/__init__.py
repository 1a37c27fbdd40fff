"""Paged attention: the index records of one step (base), and the backends that compute it,
one module each.

Each layer's cache (kv_cache.LayerKV) is a pair of tensors [kv_heads, num_blocks,
block_size, head_dim]; a sequence's token at absolute position p lives in slot
p % block_size of block block_table[p // block_size]. Heads come first so that gathering a
sequence's blocks yields, per head, one contiguous [tokens, head_dim] matrix: what the
matmuls want. The model has written the new tokens' K/V into their slots (with the rotary
embedding, layer_ops.rope_and_cache_) before a layer attends.

The backends (gpu_worker.kernels offers them, gpu_worker.kernel_choice picks one per worker
by measuring):
- TorchAttention (torch_backend): PyTorch ops on any device, the reference;
- NativeAttention and NativeRowsAttention (native_backend): the C++ kernels, row invariant;
- HybridAttention (hybrid_backend): the C++ decode kernel beside PyTorch's prefill;
- FlexAttention (flex_backend): CUDA's, FlexAttention compiled through Triton;
- TritonAttention (triton_backend, triton_varlen): cadence's paged decode kernel and its
  prompt chunks' kernel (a step's chunks in one launch), in Triton, on CUDA
  (gpu_worker.kernels imports it there alone: the CPU worker runs without triton).
Each keeps what it prepares for a step in the records' `prepared` field, its own type.
"""

from gpu_worker.attention.base import (
    FULL,
    QUERY_BLOCK,
    AttentionBackend,
    AttentionMetadata,
    CapturedStep,
    DecodeGroup,
    LayerAttention,
    PrefillChunk,
    build_metadata,
    decode_records,
    metadata_for,
    paged_attention,
)
from gpu_worker.attention.flex_backend import FlexAttention
from gpu_worker.attention.hybrid_backend import HybridAttention
from gpu_worker.attention.native_backend import NativeAttention, NativeRowsAttention
from gpu_worker.attention.torch_backend import TorchAttention

__all__ = [
    "FULL",
    "QUERY_BLOCK",
    "AttentionBackend",
    "AttentionMetadata",
    "CapturedStep",
    "DecodeGroup",
    "FlexAttention",
    "HybridAttention",
    "LayerAttention",
    "NativeAttention",
    "NativeRowsAttention",
    "PrefillChunk",
    "TorchAttention",
    "build_metadata",
    "decode_records",
    "metadata_for",
    "paged_attention",
]
