"""The model's matmuls, y = x @ weight.T + bias, with each row's bits independent of its call.

A library GEMM picks its kernel, and with it the order in which each output sums its
products, from the shape, the ISA and the cache sizes. oneDNN on a Zen 4 sums a lone
float32 row otherwise than two; on a Xeon with AMX, float32 calls of 2 to 45 rows otherwise
than wider ones. A token's logits would then depend on how many rows shared its step (its
batch, its prefill chunk), and recompute after a preemption would not reproduce the tokens
decoded before it. No probe of one shape can tell what the library does with the others.

So a Linear never hands its kernel an arbitrary number of rows. Rows go in calls of a few
fixed sizes (ROW_SIZES): the rows beyond the largest in calls of the largest, the rest in
one call of the smallest size that holds them, padded with zero rows. Which sizes a weight
may use is settled when it loads, on that weight and kernel: each size's calls give probe
rows at different positions beside different rows, and the sizes whose probe rows come out
bit for bit alike (and alike at every position) form the set used. Every shape a served
step can give the kernel is thus a shape that was checked.
"""

from __future__ import annotations

import bisect
import copy
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# The row counts a kernel is called with: fine steps where a decode batch's padding costs
# most (its weights stream from memory either way), coarser ones for prefill chunks.
ROW_SIZES = (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 96, 128, 160, 192, 224, 256)
# The LM head's weight is the vocabulary: checking its widest sizes would cost a second of
# start-up, and its rows (the sampled ones) are few.
LM_HEAD_ROW_SIZES = tuple(size for size in ROW_SIZES if size <= 64)
# The rows every size is checked on: enough that they hold PROBE_OUTPUTS outputs (in
# bfloat16 an order of summation changed shows in about one output in a few thousand).
PROBE_OUTPUTS = 65536
MAX_PROBE_ROWS = 64


@dataclass(frozen=True, slots=True)
class RowSizes:
    """The call sizes whose rows agree bit for bit, ascending."""

    sizes: tuple[int, ...]

    def calls(self, rows: int) -> list[tuple[int, int, int]]:
        """How `rows` rows go to the kernel: (first row, rows, call size) per call."""
        largest = self.sizes[-1]
        full, rest = divmod(rows, largest)
        calls = [(i * largest, largest, largest) for i in range(full)]
        if rest:
            calls.append((full * largest, rest, self.sizes[bisect.bisect_left(self.sizes, rest)]))
        return calls


class SizedCalls:
    """A matmul that hands its kernel only the row counts it checked (`row_sizes`)."""

    __slots__ = ()
    row_sizes: RowSizes

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if rows in self.row_sizes.sizes:  # one call of a checked size: most decode steps
            return self.kernel(x)
        calls = self.row_sizes.calls(rows)
        if not calls:
            return self.kernel(x)
        return torch.cat([self._padded_call(x, *call) for call in calls])

    def _padded_call(self, x: torch.Tensor, first: int, rows: int, size: int) -> torch.Tensor:
        part = x[first : first + rows]
        if rows < size:
            part = F.pad(part, (0, 0, 0, size - rows))
        return self.kernel(part)[:rows]


class Linear(SizedCalls):
    """y = x @ weight.T + bias, in calls of the checked sizes, on one of three kernels
    (gpu_worker.kernels' matmul seam):
    - "native": cadence's bfloat16 kernel (csrc/bf16_matmul.cpp, on CPUs with AVX512-BF16),
      the weight repacked once into its layout; it sums every row the same way at any call
      size, and streams a decode step's weights about twice as fast as oneDNN;
    - "onednn": the weight reordered once into oneDNN's blocked layout: the same results,
      bit for bit, as F.linear, and faster, since F.linear reorders the weight on every call
      (most of all for the skinny matmuls of decode steps);
    - "aten": plain F.linear.
    A kernel that cannot take the weight (another dtype or device, an odd K, a CPU oneDNN
    cannot serve) gives way to the next.
    """

    __slots__ = ("bias", "kind", "n", "row_sizes", "weight")

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        kernel: str = "onednn",
        sizes: tuple[int, ...] = ROW_SIZES,
    ) -> None:
        self.bias = bias
        self.n = weight.shape[0]
        self.kind, self.weight = _in_layout(weight, bias, kernel)  # the kernel's layout
        self.row_sizes = _checked_sizes(self, weight, sizes)

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        """The kernel's matmul on exactly these rows."""
        if self.kind == "native":
            return torch.ops.cadence.bf16_matmul(x, self.weight, self.bias, self.n)
        if self.kind == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


# By kernel, weight shape, dtype, device, bias, threads and the sizes offered: a library
# chooses its kernel by these, never by the weight's values. Those of the library's kernels
# (Linear's own) are recorded per machine by their text (gpu_worker.runtime), so that the
# next start skips the probes; the text names the probe too (a better one checks again).
_CHECKED: dict[tuple[type, str], RowSizes] = {}
_PROBE = "stand-in weight, cancelling rows, every position"
# The stand-in weight's big columns and the probe rows' values there (_with_cancelling_pairs)
_BIG = 2.0**10


def _checked_sizes(linear: Linear, weight: torch.Tensor, sizes: tuple[int, ...]) -> RowSizes:
    described = repr(
        (
            tuple(weight.shape),
            str(weight.dtype),
            str(weight.device),
            None if linear.bias is None else tuple(linear.bias.shape),
            linear.kind,
            torch.get_num_threads(),
            sizes,
            _PROBE,
        )
    )
    key = (type(linear), described)
    if key not in _CHECKED:
        kernel = _stand_in(linear, weight)
        _CHECKED[key] = agreeing_sizes(kernel, weight.shape[1], sizes, weight, cancelling=True)
    return _CHECKED[key]


def _stand_in(linear: Linear, weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """`linear`'s kernel on a stand-in of its weight: random values of its shape (and
    bias), a few columns BIG (agreeing_sizes' cancelling probe rows). The library picks
    its kernel by the shape, so the sizes found hold for every weight of it, whichever
    loads first; and a model's weights can hide an order of summation changed, which at
    bfloat16's precision shows in about one output in 50,000 (an Intel AMX machine's
    256-row calls passed a probe of the model's down projection, and not a test's)."""
    generator = torch.Generator().manual_seed(1)
    values = torch.randn(weight.shape, generator=generator)
    values[:, _big_columns(weight.shape[1])] = _BIG
    values = values.to(weight.device, weight.dtype)
    bias = linear.bias
    if bias is not None:
        bias = torch.randn(bias.shape, generator=generator).to(bias.device, bias.dtype)
    stand_in = copy.copy(linear)
    stand_in.bias = bias
    stand_in.kind, stand_in.weight = _in_layout(values, bias, linear.kind)
    return stand_in.kernel


def _big_columns(in_features: int) -> list[int]:
    return sorted({0, in_features // 3, 2 * in_features // 3, in_features - 1})


def _with_cancelling_pairs(rows: torch.Tensor) -> torch.Tensor:
    """`rows` with +BIG and -BIG at two of the big columns of each (another pair in each
    row) and 0 at the others. Against a stand-in weight the two products cancel exactly,
    but between them a row's running sum is about BIG^2, where each product added rounds
    at float32's step there (1/8): the result, of the size of the small products' sum,
    then carries rounding errors that any other order of summation changes, and bfloat16
    shows them too."""
    columns = _big_columns(rows.shape[1])
    pairs = list(itertools.permutations(columns, 2))
    if not pairs:  # one column: nothing to cancel
        return rows
    rows = rows.clone()
    rows[:, columns] = 0
    for i, (plus, minus) in enumerate(pairs):
        rows[i :: len(pairs), plus] = _BIG
        rows[i :: len(pairs), minus] = -_BIG
    return rows


def checked_sizes() -> dict[str, list[int]]:
    """The checks of the library's kernels made (or recalled) in this process, by what
    their result depends on."""
    return {text: list(found.sizes) for (kind, text), found in _CHECKED.items() if kind is Linear}


def recall_checked_sizes(recorded: dict[str, list[int]]) -> None:
    """Checks made before on this machine (the caller keys them by it): weights of these
    shapes use the recorded sizes without probing."""
    for text, sizes in recorded.items():
        _CHECKED.setdefault((Linear, text), RowSizes(tuple(sizes)))


def agreeing_sizes(
    kernel: Callable[[torch.Tensor], torch.Tensor],
    in_features: int,
    sizes: tuple[int, ...],
    like: torch.Tensor,
    *,
    cancelling: bool = False,
) -> RowSizes:
    """The largest set of `sizes` whose calls give every probe row the same bits;
    `cancelling`: the probe rows are _with_cancelling_pairs' (for _stand_in's kernel).

    Each size computes the probe rows at every position of its calls: from their first
    position on, at each later offset behind other rows, and at their ends (where a
    kernel's row tail is). A size whose passes differ depends on its company and is out.
    On a CPU, so is a size whose bits change on one thread (a kernel that splits a row's
    sum between threads), unless every size does.
    The rest fall into classes by their bits; the class with the most sizes is used (ties:
    the one reaching the largest size). One row alone has no company, so the set is never
    empty.
    """
    out_features = kernel(torch.zeros(1, in_features, dtype=like.dtype, device=like.device))
    probes = min(MAX_PROBE_ROWS, max(4, -(-PROBE_OUTPUTS // out_features.shape[1])))
    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(probes + max(sizes), in_features, generator=generator)
    if cancelling:
        rows = _with_cancelling_pairs(rows)
    rows = rows.to(like.device, like.dtype)
    alike: dict[int, torch.Tensor] = {}
    for size in sizes:
        first, *others = (
            _probe_pass(kernel, rows, probes, size, lead) for lead in _leads(size, probes)
        )
        if all(torch.equal(first, other) for other in others):
            alike[size] = first
    if like.device.type == "cpu" and torch.get_num_threads() > 1:
        alike = _on_one_thread_too(kernel, rows, probes, alike) or alike
    classes: list[tuple[torch.Tensor, list[int]]] = []
    for size, bits in alike.items():
        members = next((m for b, m in classes if torch.equal(b, bits)), None)
        if members is None:
            classes.append((bits, [size]))
        else:
            members.append(size)
    chosen = max(classes, key=lambda c: (len(c[1]), c[1][-1]))[1]
    return RowSizes(tuple(chosen))


def _on_one_thread_too(
    kernel: Callable[[torch.Tensor], torch.Tensor],
    rows: torch.Tensor,
    probes: int,
    alike: dict[int, torch.Tensor],
) -> dict[int, torch.Tensor]:
    """The sizes of `alike` whose bits are the same on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {
            size: bits
            for size, bits in alike.items()
            if torch.equal(_probe_pass(kernel, rows, probes, size, 0), bits)
        }
    finally:
        torch.set_num_threads(threads)


def _leads(size: int, probes: int) -> list[int]:
    """Where a size's probe passes put the probe rows: behind this many other rows, so
    that every position of a call holds a probe row in some pass, the last one included."""
    if size == 1:
        return [0]
    return sorted({*range(0, size, probes), size - min(size - 1, probes)})


def _probe_pass(
    kernel: Callable[[torch.Tensor], torch.Tensor],
    rows: torch.Tensor,
    probes: int,
    size: int,
    lead: int,
) -> torch.Tensor:
    """The first `probes` rows' outputs from calls of `size` rows, each call's probe rows
    behind `lead` other rows."""
    probe_rows, filler = rows[:probes], rows[probes:]
    per_call = min(size - lead, probes)
    outputs = []
    for start in range(0, probes, per_call):
        part = probe_rows[start : start + per_call]
        after = size - lead - part.shape[0]
        call = torch.cat((filler[:lead], part, filler[lead : lead + after]))
        outputs.append(kernel(call)[lead : lead + part.shape[0]])
    return torch.cat(outputs)


def _in_layout(
    weight: torch.Tensor, bias: torch.Tensor | None, kernel: str
) -> tuple[str, torch.Tensor]:
    """The kernel that takes the weight, the first of `kernel` and those after it, and the
    weight in its layout."""
    if kernel == "native" and _native_serves(weight):
        return "native", pack_bf16(weight)
    if kernel in ("native", "onednn"):
        packed = _onednn_packed(weight, bias)
        if packed is not None:
            return "onednn", packed
    return "aten", weight


def _native_serves(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and weight.shape[1] % 2 == 0
        and hasattr(torch.ops.cadence, "bf16_matmul")
    )


def pack_bf16(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] as csrc/bf16_matmul.cpp reads it: columns in groups of 64 (the last padded
    with zeros), each group's values in K order, per pair of K the 64 columns' pairs side by
    side: [groups, K / 2, 64, 2]."""
    n, k = weight.shape
    groups = -(-n // 64)
    padded = F.pad(weight, (0, 0, 0, groups * 64 - n))
    return padded.view(groups, 64, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def _onednn_packed(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        probe = torch.ones(1, weight.shape[1], dtype=weight.dtype)
        torch.ops.mkldnn._linear_pointwise(probe, packed, bias, "none", [], "")
    except (RuntimeError, AttributeError):  # an old torch or a CPU oneDNN cannot serve
        return None
    return packed
