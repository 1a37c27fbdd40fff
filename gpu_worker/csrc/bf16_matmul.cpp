// y = x @ W.T + bias for bfloat16 x and W, on CPUs with AVX512-BF16.
//
// oneDNN serves a decode step's skinny matmuls at under half the memory bandwidth on a Zen 4
// (a lone row streams every weight once, and little else should matter), and chooses its
// kernel, and with it each output's order of summation, by the shape. This kernel gives
// every output the same operations whatever M is and whichever rows share the call: one
// float32 accumulator per output, fed pairs of K in order by vdpbf16ps (each pair's two
// products added in turn, as the instruction defines), then the bias, then one rounding to
// bfloat16. Rows go through in register tiles that share the weight loads but give each
// row its own accumulators, and threads split the columns, never a row's sum.
//
// The packed layout (gpu_worker.linear.pack_bf16): columns in groups of 64, each group one
// contiguous run that a register tile reads straight through (a single stream per thread,
// which the hardware prefetcher follows; four blocks apart, it read 15-20% slower): for
// each pair of K values, the group's 64 columns' pairs side by side, 16 to a 64-byte line
// (one vdpbf16ps against a broadcast of the row's pair). Columns past N are zero.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512BF16__)
#include <immintrin.h>

namespace {

constexpr int64_t kCols = 16;  // columns per 64-byte line
constexpr int kLines = 4;  // lines per pair of K in a group: 64 columns
constexpr int64_t kGroupCols = kCols * kLines;
constexpr int kTileRows = 6;  // rows per register tile: 6 x 4 accumulators

// R rows against one group of 64 columns, all of K; the first `cols` columns are real.
template <int R>
void tile(const c10::BFloat16* x, int64_t k, const c10::BFloat16* group, const float* bias,
          c10::BFloat16* out, int64_t n, int64_t cols) {
  __m512 acc[R][kLines];
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < kLines; ++c) acc[r][c] = _mm512_setzero_ps();
  }
  for (int64_t p = 0; p < k / 2; ++p) {
    const c10::BFloat16* lines = group + p * 2 * kGroupCols;
    __m512bh line[kLines];
    for (int c = 0; c < kLines; ++c) {
      line[c] = (__m512bh)_mm512_loadu_si512(lines + c * 2 * kCols);
    }
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * k + 2 * p, 4);
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
      for (int c = 0; c < kLines; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], line[c], a);
    }
  }
  for (int c = 0; c < kLines; ++c) {
    const int64_t real = std::clamp<int64_t>(cols - c * kCols, 0, kCols);
    if (real == 0) break;
    const __mmask16 mask = static_cast<__mmask16>((1u << real) - 1u);
    __m512 b = _mm512_setzero_ps();
    if (bias != nullptr) b = _mm512_maskz_loadu_ps(mask, bias + c * kCols);
    for (int r = 0; r < R; ++r) {
      const __m512 v = bias == nullptr ? acc[r][c] : _mm512_add_ps(acc[r][c], b);
      _mm256_mask_storeu_epi16(out + r * n + c * kCols, mask, (__m256i)_mm512_cvtneps_pbh(v));
    }
  }
}

template <int R = kTileRows>
void rows_tile(int rows, const c10::BFloat16* x, int64_t k, const c10::BFloat16* group,
               const float* bias, c10::BFloat16* out, int64_t n, int64_t cols) {
  if constexpr (R > 0) {
    if (rows == R) {
      tile<R>(x, k, group, bias, out, n, cols);
    } else {
      rows_tile<R - 1>(rows, x, k, group, bias, out, n, cols);
    }
  }
}

// x [M, K] bfloat16 against a packed weight of n columns (above); bias [n].
at::Tensor bf16_matmul(const at::Tensor& input, const at::Tensor& packed,
                       const c10::optional<at::Tensor>& bias, int64_t n) {
  TORCH_CHECK(input.device().is_cpu() && input.dim() == 2, "x must be a CPU [rows, K] tensor");
  TORCH_CHECK(input.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16,
              "bf16_matmul takes bfloat16 x and weights");
  TORCH_CHECK(packed.is_contiguous(), "the packed weight must be contiguous");
  at::Tensor x = input.contiguous();
  const int64_t m = x.size(0), k = x.size(1), groups = (n + kGroupCols - 1) / kGroupCols;
  TORCH_CHECK(k % 2 == 0, "K must be even");
  TORCH_CHECK(packed.numel() == groups * kGroupCols * k, "the packed weight does not match n, K");
  at::Tensor bias_f;
  if (bias.has_value()) {
    bias_f = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(bias_f.numel() == n, "the bias does not match n");
  }
  const float* b = bias.has_value() ? bias_f.const_data_ptr<float>() : nullptr;
  at::Tensor out = at::empty({m, n}, x.options());
  const c10::BFloat16* xs = x.const_data_ptr<c10::BFloat16>();
  const c10::BFloat16* ws = packed.const_data_ptr<c10::BFloat16>();
  c10::BFloat16* os = out.mutable_data_ptr<c10::BFloat16>();
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t first = g * kGroupCols;
      for (int64_t r = 0; r < m; r += kTileRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kTileRows, m - r));
        rows_tile(rows, xs + r * k, k, ws + first * k, b == nullptr ? nullptr : b + first,
                  os + r * n + first, n, std::min(n - first, kGroupCols));
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cadence, m) {
  m.def("bf16_matmul(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor");
  m.impl("bf16_matmul", c10::DispatchKey::CPU, &bf16_matmul);
}
#endif
