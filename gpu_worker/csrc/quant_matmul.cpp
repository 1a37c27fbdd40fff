// y = x @ W.T with W kept quantized (gpu_worker.quant), on CPUs with AVX512-VNNI.
//
// llama.cpp's scheme: each row of x is quantized per group of 32 to int8 with a float
// scale (quantize_activations), each weight group of G (32, or 16 for Q6_K) holds unsigned
// codes with a float scale and, optionally, a float min (w = scale * code + min); a group's
// dot product is integer (vpdpbusd: the weight codes on its unsigned side), and the groups
// are summed in float, in K order. Every output is computed by the same operations whatever
// M is and whichever rows share the call: rows go through in register tiles that share the
// weight loads but give each row its own accumulators, and threads split the columns, never
// a row's sum. gpu_worker.quant.reference_matmul is the same arithmetic in PyTorch.
//
// The packed layout (gpu_worker.quant.pack): columns in blocks of 16; within a block, for
// each 32 values of K, 4 values of each of the 16 columns side by side (one 64-byte line
// per 4 values of K: one vpdpbusd against a broadcast of 4 activations). q8 codes are the
// signed values + 128, 8 lines per 32 K; q4 puts lines c and c + 4 into the low and high
// nibbles of one line, 4 lines per 32 K; q5 (codes 0..31) is q4's 4 lines of their low four
// bits and one line of their fifth: 8 little-endian 64-bit masks, mask c holding line c's
// 64 fifth bits (bit j: the line's byte j). Scales and mins are [blocks, K / G, 16] float32.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>

namespace {

constexpr int64_t kGroup = 32;  // activation values per scale
constexpr int64_t kSumGroup = 16;  // activation values per sum (the finest weight group)
constexpr int64_t kCols = 16;  // columns per packed block
constexpr int kMaxTile = 8;  // rows per register tile

// 16 values as float32: a bfloat16 is the upper half of a float32's bits.
inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 load16(const c10::BFloat16* x) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// One row's 32 values -> int8 codes, scale = max|x| / 127, the codes' sums per 16.
template <typename In>
void quantize_group(const In* x, int8_t* q, float* scale, int32_t* sums) {
  __m512 lo = load16(x), hi = load16(x + 16);
  float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
  float d = amax / 127.0f;
  float inverse = d != 0.0f ? 1.0f / d : 0.0f;
  __m512 scaled[2] = {_mm512_mul_ps(lo, _mm512_set1_ps(inverse)),
                      _mm512_mul_ps(hi, _mm512_set1_ps(inverse))};
  for (int half = 0; half < 2; ++half) {
    // round half to even (the default MXCSR mode), as torch.round
    __m512i codes = _mm512_cvtps_epi32(scaled[half]);
    codes = _mm512_max_epi32(_mm512_min_epi32(codes, _mm512_set1_epi32(127)),
                             _mm512_set1_epi32(-127));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16 * half), _mm512_cvtepi32_epi8(codes));
    sums[half] = _mm512_reduce_add_epi32(codes);
  }
  *scale = d;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_activations(const at::Tensor& input) {
  TORCH_CHECK(input.device().is_cpu() && input.dim() == 2, "x must be a CPU [rows, K] tensor");
  TORCH_CHECK(input.size(1) % kGroup == 0, "K must be a multiple of 32");
  TORCH_CHECK(input.scalar_type() == at::kFloat || input.scalar_type() == at::kBFloat16,
              "x must be float32 or bfloat16");
  at::Tensor x = input.contiguous();
  const int64_t rows = x.size(0), k = x.size(1), groups = k / kGroup;
  at::Tensor q = at::empty({rows, k}, x.options().dtype(at::kChar));
  at::Tensor scales = at::empty({rows, groups}, x.options().dtype(at::kFloat));
  at::Tensor sums = at::empty({rows, k / kSumGroup}, x.options().dtype(at::kInt));
  int8_t* qs = q.mutable_data_ptr<int8_t>();
  float* ss = scales.mutable_data_ptr<float>();
  int32_t* us = sums.mutable_data_ptr<int32_t>();
  auto each_group = [&](const auto* xs) {
    at::parallel_for(0, rows * groups, 64, [&](int64_t begin, int64_t end) {
      for (int64_t g = begin; g < end; ++g) {
        quantize_group(xs + g * kGroup, qs + g * kGroup, ss + g, us + 2 * g);
      }
    });
  };
  if (x.scalar_type() == at::kFloat) {
    each_group(x.const_data_ptr<float>());
  } else {
    each_group(x.const_data_ptr<c10::BFloat16>());
  }
  return {q, scales, sums};
}

// The activations of one row, as the tile loop reads them.
struct Row {
  const int8_t* q;
  const float* scales;  // per 32
  const int32_t* sums;  // per 16
};

template <typename Out>
void store(Out* out, const float* values, const float* bias, int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    float v = bias == nullptr ? values[j] : values[j] + bias[j];
    out[j] = static_cast<Out>(v);
  }
}

// R rows against one block of 16 columns, all of K. kGroupSize: the weight group (16 or
// 32); kBits: 8, or nibble codes (4; 5 with a line of fifth bits; groups of 32 only); kMins:
// w = scale * code + min.
template <int R, int kGroupSize, int kBits, bool kMins, typename Out>
void tile(const Row* rows, int64_t k, const uint8_t* weights, const float* w_scales,
          const float* w_mins, const float* bias, Out* out, int64_t out_stride, int64_t cols) {
  constexpr int kLines = kGroupSize / 4;  // 4 values of K per line
  const int64_t groups = k / kGroupSize;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
  const __m512i sixteen = _mm512_set1_epi8(16);
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t k0 = g * kGroupSize;
    __m512i dot[R];
    for (int r = 0; r < R; ++r) dot[r] = _mm512_setzero_si512();
    if constexpr (kBits != 8) {
      const uint8_t* lines = weights + g * kGroupSize * kCols * kBits / 8;
      for (int c = 0; c < 4; ++c) {
        __m512i line = _mm512_loadu_si512(lines + 64 * c);
        __m512i lo = _mm512_and_si512(line, low_nibbles);
        __m512i hi = _mm512_and_si512(_mm512_srli_epi16(line, 4), low_nibbles);
        if constexpr (kBits == 5) {  // the fifth bits: 16 added where the mask has them
          uint64_t lo_fifth, hi_fifth;
          std::memcpy(&lo_fifth, lines + 256 + 8 * c, 8);
          std::memcpy(&hi_fifth, lines + 256 + 8 * (c + 4), 8);
          lo = _mm512_mask_add_epi8(lo, _cvtu64_mask64(lo_fifth), lo, sixteen);
          hi = _mm512_mask_add_epi8(hi, _cvtu64_mask64(hi_fifth), hi, sixteen);
        }
        for (int r = 0; r < R; ++r) {
          int32_t a_lo, a_hi;
          std::memcpy(&a_lo, rows[r].q + k0 + 4 * c, 4);
          std::memcpy(&a_hi, rows[r].q + k0 + 16 + 4 * c, 4);
          dot[r] = _mm512_dpbusd_epi32(dot[r], lo, _mm512_set1_epi32(a_lo));
          dot[r] = _mm512_dpbusd_epi32(dot[r], hi, _mm512_set1_epi32(a_hi));
        }
      }
    } else {
      const uint8_t* lines = weights + g * kGroupSize * kCols;
      for (int c = 0; c < kLines; ++c) {
        __m512i line = _mm512_loadu_si512(lines + 64 * c);
        for (int r = 0; r < R; ++r) {
          int32_t a;
          std::memcpy(&a, rows[r].q + k0 + 4 * c, 4);
          dot[r] = _mm512_dpbusd_epi32(dot[r], line, _mm512_set1_epi32(a));
        }
      }
    }
    const __m512 scale = _mm512_loadu_ps(w_scales + g * kCols);
    __m512 min;
    if constexpr (kMins) min = _mm512_loadu_ps(w_mins + g * kCols);
    for (int r = 0; r < R; ++r) {
      const int64_t first_sum = k0 / kSumGroup;
      int32_t sum = rows[r].sums[first_sum];
      if constexpr (kGroupSize == 32) sum += rows[r].sums[first_sum + 1];
      if constexpr (kBits == 8) {  // the codes are values + 128
        dot[r] = _mm512_sub_epi32(dot[r], _mm512_set1_epi32(128 * sum));
      }
      const float a_scale = rows[r].scales[k0 / kGroup];
      __m512 term = _mm512_mul_ps(_mm512_cvtepi32_ps(dot[r]), scale);
      term = _mm512_mul_ps(term, _mm512_set1_ps(a_scale));
      acc[r] = _mm512_add_ps(acc[r], term);
      if constexpr (kMins) {
        const float a_sum = a_scale * static_cast<float>(sum);
        acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(min, _mm512_set1_ps(a_sum)));
      }
    }
  }
  alignas(64) float values[kCols];
  for (int r = 0; r < R; ++r) {
    _mm512_store_ps(values, acc[r]);
    store(out + r * out_stride, values, bias, cols);
  }
}

template <int kGroupSize, int kBits, bool kMins, typename Out, int R = kMaxTile>
void rest_tile(int rest, const Row* rows, int64_t k, const uint8_t* w, const float* s,
               const float* m, const float* bias, Out* out, int64_t stride, int64_t cols) {
  if constexpr (R > 0) {
    if (rest == R) {
      tile<R, kGroupSize, kBits, kMins>(rows, k, w, s, m, bias, out, stride, cols);
    } else {
      rest_tile<kGroupSize, kBits, kMins, Out, R - 1>(rest, rows, k, w, s, m, bias, out, stride,
                                                     cols);
    }
  }
}

template <int kGroupSize, int kBits, bool kMins, typename Out>
void matmul(const std::vector<Row>& rows, int64_t k, int64_t n, const uint8_t* weights,
            const float* scales, const float* mins, const float* bias, Out* out) {
  const int64_t blocks = (n + kCols - 1) / kCols, m = static_cast<int64_t>(rows.size());
  const int64_t block_bytes = k * kCols * kBits / 8;
  const int64_t block_params = k / kGroupSize * kCols;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const uint8_t* w = weights + b * block_bytes;
      const float* s = scales + b * block_params;
      const float* mn = kMins ? mins + b * block_params : nullptr;
      const float* bb = bias == nullptr ? nullptr : bias + b * kCols;
      const int64_t cols = std::min(kCols, n - b * kCols);
      for (int64_t r = 0; r < m; r += kMaxTile) {
        const int rest = static_cast<int>(std::min<int64_t>(kMaxTile, m - r));
        Out* o = out + r * n + b * kCols;
        rest_tile<kGroupSize, kBits, kMins>(rest, rows.data() + r, k, w, s, mn, bb, o, n, cols);
      }
    }
  });
}

template <typename Out>
void dispatch(const std::vector<Row>& rows, int64_t k, int64_t n, int64_t bits, int64_t group,
              const at::Tensor& weights, const at::Tensor& scales, const float* mins,
              const float* bias, Out* out) {
  const uint8_t* w = weights.const_data_ptr<uint8_t>();
  const float* s = scales.const_data_ptr<float>();
  if (bits != 8) {
    TORCH_CHECK(bits == 4 || bits == 5, "quantized weights have 8, 5 or 4 bits");
    TORCH_CHECK(group == 32, "q4 and q5 weights come in groups of 32");
    if (bits == 5) {
      if (mins != nullptr) return matmul<32, 5, true>(rows, k, n, w, s, mins, bias, out);
      return matmul<32, 5, false>(rows, k, n, w, s, mins, bias, out);
    }
    if (mins != nullptr) return matmul<32, 4, true>(rows, k, n, w, s, mins, bias, out);
    return matmul<32, 4, false>(rows, k, n, w, s, mins, bias, out);
  }
  TORCH_CHECK(group == 32 || group == 16, "q8 weights come in groups of 32 or 16");
  if (group == 16) {
    if (mins != nullptr) return matmul<16, 8, true>(rows, k, n, w, s, mins, bias, out);
    return matmul<16, 8, false>(rows, k, n, w, s, mins, bias, out);
  }
  if (mins != nullptr) return matmul<32, 8, true>(rows, k, n, w, s, mins, bias, out);
  return matmul<32, 8, false>(rows, k, n, w, s, mins, bias, out);
}

// x [M, K] (float32 or bfloat16) against packed weights of n columns -> [M, n] in x's dtype:
// x quantized by quantize_activations, then the tiles. One op per call, not two: a decode
// step makes some 120 of these calls, and each op's dispatch and outputs cost microseconds.
at::Tensor quant_matmul(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& scales,
                        const c10::optional<at::Tensor>& mins, const c10::optional<at::Tensor>& bias,
                        int64_t n, int64_t group, int64_t bits) {
  TORCH_CHECK(weights.is_contiguous() && scales.is_contiguous(),
              "quant_matmul takes contiguous weights");
  const auto [q, a_scales, a_sums] = quantize_activations(x);
  const int64_t m = q.size(0), k = q.size(1), blocks = (n + kCols - 1) / kCols;
  TORCH_CHECK(weights.numel() == blocks * k * kCols * bits / 8,
              "packed weights do not match n and K");
  TORCH_CHECK(scales.numel() == blocks * k / group * kCols, "scales do not match n, K, group");
  at::Tensor bias_f;
  if (bias.has_value()) bias_f = bias->to(at::kFloat).contiguous();
  const float* bias_p = bias.has_value() ? bias_f.const_data_ptr<float>() : nullptr;
  const float* mins_p = mins.has_value() ? mins->const_data_ptr<float>() : nullptr;
  std::vector<Row> rows(m);
  for (int64_t r = 0; r < m; ++r) {
    rows[r] = {q.const_data_ptr<int8_t>() + r * k, a_scales.const_data_ptr<float>() + r * (k / 32),
               a_sums.const_data_ptr<int32_t>() + r * (k / 16)};
  }
  at::Tensor out = at::empty({m, n}, x.options());
  if (x.scalar_type() == at::kFloat) {
    dispatch(rows, k, n, bits, group, weights, scales, mins_p, bias_p,
             out.mutable_data_ptr<float>());
  } else {
    dispatch(rows, k, n, bits, group, weights, scales, mins_p, bias_p,
             out.mutable_data_ptr<c10::BFloat16>());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cadence, m) {
  m.def("quantize_activations(Tensor x) -> (Tensor, Tensor, Tensor)");
  m.def("quant_matmul(Tensor x, Tensor weights, Tensor scales, Tensor? mins, Tensor? bias, "
        "int n, int group, int bits) -> Tensor");
  m.impl("quantize_activations", c10::DispatchKey::CPU, &quantize_activations);
  m.impl("quant_matmul", c10::DispatchKey::CPU, &quant_matmul);
}
#endif
