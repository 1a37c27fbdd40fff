"""The C++ CPU decode-attention kernel (csrc/paged_decode_attention.cpp), built on first use.

torch.utils.cpp_extension compiles it once per machine into the torch extensions directory
(~/.cache/torch_extensions unless TORCH_EXTENSIONS_DIR says otherwise) and later processes
load the cached library. It is an optimisation only: when it cannot be built (no compiler,
no ninja) the reason is logged once and callers keep the pure-PyTorch path.

Setting CADENCE_NATIVE_ATTENTION=0 turns it off without trying to build it.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_decode_attention.cpp"
ENABLED = os.environ.get("CADENCE_NATIVE_ATTENTION", "1") != "0"


@functools.cache
def paged_decode_attention() -> Callable[..., torch.Tensor] | None:
    """The kernel, or None when it is disabled or cannot be built.

    (q [B, heads, d], k_cache, v_cache [kv_heads, blocks, block_size, d], block_tables
    [B, W] and context_lens [B] int64, scale) -> [B, heads, d]; CPU tensors only.
    """
    if not ENABLED:
        return None
    try:
        from torch.utils import cpp_extension

        cpp_extension.load(
            name="cadence_paged_decode_attention",
            sources=[str(SOURCE)],
            # -march=native: the build is cached per machine, and AVX-512 where the CPU has it;
            # -fopenmp: at::parallel_for is inline and runs serially without it.
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            is_python_module=False,
        )
    except Exception as exc:  # a missing compiler or ninja fails in many different ways
        log.warning("native decode attention unavailable, using PyTorch: %s", exc)
        return None
    return torch.ops.cadence.paged_decode_attention
