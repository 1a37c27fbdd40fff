"""The C++ CPU kernels (csrc/), built on first use.

- paged_decode_attention.cpp: decode attention read straight from the paged KV cache;
- paged_prefill_attention.cpp: a prefill chunk's causal attention, likewise (bfloat16, on
  CPUs with AVX512-BF16; elsewhere the op is not registered); bf16_attention.h holds the
  arithmetic both attention kernels run for a bfloat16 query row, so that a row gets the
  same bits from either;
- layer_ops.cpp: the small operations between a layer's matmuls, fused (RMSNorm with the
  residual add, rotary embedding with the KV-cache write, SwiGLU);
- kv_quant.h: the 8-bit KV cache (int8 or fp8 codes, one scale per row) that the cache
  write quantizes and both attention kernels dequantize (reference: gpu_worker.kv_quant);
- top_logits.cpp: the ids of each row's k largest logits;
- quant_matmul.cpp: matmuls against weights kept quantized (gpu_worker.quant), on CPUs
  with AVX512-VNNI or AVX2 (elsewhere the ops are not registered);
- bf16_matmul.cpp: the bfloat16 matmul (gpu_worker.linear's "native" kernel), on CPUs with
  AVX512-BF16.

torch.utils.cpp_extension compiles them once into a directory of their own under the torch
extensions directory (~/.cache/torch_extensions unless TORCH_EXTENSIONS_DIR says
otherwise), one per checkout, source text, flags, CPU instruction set and torch version,
and later processes load the cached library. The instruction set is this CPU's list of
extensions: `-march=native` reads the same everywhere, but a library built for one CPU may
use instructions another lacks (a home directory shared by two hosts, a cache copied with
an image). One shared directory would make two checkouts rebuild each
other's library at every start, each waiting on the other's lock; and a build killed
midway leaves its lock behind, on which every later start would wait for ever, so a lock
older than any build is removed. The kernels are candidates only (gpu_worker.kernels):
when they cannot be built (no compiler, no ninja) the reason is logged once and the
PyTorch ones serve.

Setting CADENCE_NATIVE_KERNELS=0 turns them off without trying to build them.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import time
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

SOURCES = [
    Path(__file__).parent / "csrc" / name
    for name in (
        "paged_decode_attention.cpp",
        "paged_prefill_attention.cpp",
        "layer_ops.cpp",
        "top_logits.cpp",
        "quant_matmul.cpp",
        "bf16_matmul.cpp",
    )
]
LIBRARY = "cadence_native"  # the extension's name: its .so in the build directory
ENABLED = os.environ.get("CADENCE_NATIVE_KERNELS", "1") != "0"
# The instruction set to build for: this CPU's, or another level to see how the kernels do
# on CPUs without this one's extensions (x86-64-v3: AVX2, no AVX-512).
MARCH = os.environ.get("CADENCE_NATIVE_MARCH", "native")
# -march: the build is cached per machine, and AVX-512 where the CPU has it;
# -fopenmp: at::parallel_for is inline and runs serially without it;
# -ffp-contract=off: a*b + c stays two roundings, as in PyTorch's kernels.
CFLAGS = ["-O3", f"-march={MARCH}", "-fopenmp", "-ffp-contract=off"]
STALE_LOCK_SECONDS = 15 * 60  # a build takes about a minute


def sources_digest() -> str:
    """The text of every source and header, for whatever depends on the kernels' code."""
    text = b"".join(path.read_bytes() for path in sorted(SOURCES[0].parent.iterdir()))
    return hashlib.sha256(text).hexdigest()[:16]


@functools.cache
def cpu_flags() -> str:
    """This CPU's instruction-set extensions as the kernel lists them ("flags" on x86,
    "Features" on Arm): what `-march=native` compiles for."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    for line in lines:
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return value.strip()
    return ""


def build_directory() -> Path:
    """The build of these sources with these flags, for this CPU and this torch: shared by
    every checkout of the same sources (a fresh clone builds nothing a former one built)."""
    described = (
        f"{sources_digest()}|{CFLAGS}|{torch.__version__}|{platform.machine()}|{cpu_flags()}"
    )
    digest = hashlib.sha256(described.encode()).hexdigest()[:16]
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions"
    return Path(root) / f"cadence_native_{digest}"


def staged_sources(directory: Path) -> list[Path]:
    """SOURCES as copies inside the build directory, headers beside them: ninja rebuilds
    whatever it compiled from another path, so a build shared by checkouts compiles the
    same paths whichever checkout asks."""
    staged = directory / "src"
    staged.mkdir(exist_ok=True)
    for source in sorted(SOURCES[0].parent.iterdir()):
        target, text = staged / source.name, source.read_bytes()
        if not target.exists() or target.read_bytes() != text:
            partial = staged / f".{source.name}.{os.getpid()}.tmp"
            partial.write_bytes(text)
            os.replace(partial, target)  # atomic: a concurrent build reads old or new, whole
    return [staged / source.name for source in SOURCES]


def _load_built(directory: Path) -> bool:
    """Loads the library a former process built here, if there is one. The directory's name
    already says which sources, flags, torch and CPU it was built for; through
    cpp_extension.load, a new virtual environment's torch include paths would change the
    compile commands, and ninja would build it all again (40 s in every fresh CI clone)."""
    library = directory / f"{LIBRARY}.so"
    if not library.is_file():
        return False
    try:
        torch.ops.load_library(str(library))
    except OSError:  # a build cut short: build it again
        return False
    return True


def clear_stale_lock(directory: Path, max_age: float = STALE_LOCK_SECONDS) -> bool:
    """Removes the build lock a killed build left; True when there was one."""
    lock = directory / "lock"
    try:
        stale = time.time() - lock.stat().st_mtime > max_age
    except FileNotFoundError:
        return False
    if stale:
        log.warning("removing the lock of a build that never finished: %s", lock)
        lock.unlink(missing_ok=True)
    return stale


@functools.cache
def kernels() -> Any | None:
    """The `torch.ops.cadence` namespace, or None when disabled or the build fails.

    Its ops take CPU tensors only:
    - paged_decode_attention(q [B, heads, d], k_cache, v_cache [kv_heads, blocks,
      block_size, d], block_tables [B, W], context_lens [B], scale, k_scales=None,
      v_scales=None, window=0, softcap=0.0, sinks=None) -> [B, heads, d] (window > 0:
      each row sees its last `window` tokens; sinks [heads] float32: attention sinks);
    - paged_prefill_attention(q [n, heads, d], k_cache, v_cache, block_table [W], start,
      scale, k_scales=None, v_scales=None, sinks=None) -> [n, heads, d], where the CPU has
      AVX512-BF16;
    - rms_norm, add_rms_norm_, silu_and_mul, rope_and_cache_: see gpu_worker.layer_ops;
      rope_and_cache_ takes k_scales=None, v_scales=None last.
    Caches hold q's dtype, or int8 / float8_e4m3fn codes with their scales [kv_heads, blocks,
    block_size] float32 (gpu_worker.kv_quant).
    - top_k_indices(logits [rows, vocab], k) -> [rows, k] int64, best first (ties: lower id);
    - quantize_activations, quant_matmul: see gpu_worker.quant;
    - bf16_matmul(x [M, K], packed, bias=None, n) -> [M, n]: see gpu_worker.linear.
    """
    if not ENABLED:
        return None
    try:
        from torch.utils import cpp_extension

        directory = build_directory()
        if _load_built(directory):
            return torch.ops.cadence
        directory.mkdir(parents=True, exist_ok=True)
        clear_stale_lock(directory)
        cpp_extension.load(
            name=LIBRARY,
            sources=[str(source) for source in staged_sources(directory)],
            extra_cflags=CFLAGS,
            build_directory=str(directory),
            is_python_module=False,
        )
    except Exception as exc:  # a missing compiler or ninja fails in many different ways
        log.warning("native CPU kernels unavailable, using PyTorch: %s", exc)
        return None
    return torch.ops.cadence
