// y = x @ W.T with W kept quantized (gpu_worker.quant), on CPUs with AVX512-VNNI or AVX2.
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
//
// mxfp4 (mxfp4_matmul) is q4's layout of E2M1 codes, decoded as llama.cpp does: a byte
// shuffle through its kvalues_mxfp4 (E2M1's sixteen values doubled: integers -12..12), here
// biased by 12 so that vpdpbusd takes them on its unsigned side (the tile takes 12 x the
// activations' sum back); its scales are the E8M0 exponent bytes e [blocks, K / 32, 16],
// the group's scale 2^(e - 127) / 2, made exactly in float32 as each group needs it.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define CADENCE_QUANT_AVX512 1
#elif defined(__AVX2__)
#define CADENCE_QUANT_AVX2 1
#endif

#if defined(CADENCE_QUANT_AVX512) || defined(CADENCE_QUANT_AVX2)
#include <immintrin.h>

namespace {

constexpr int64_t kGroup = 32;  // activation values per scale
constexpr int64_t kSumGroup = 16;  // activation values per sum (the finest weight group)
constexpr int64_t kCols = 16;  // columns per packed block
constexpr int kMaxTile = 8;  // rows per register tile
constexpr int32_t kMxBias = 12;  // added to mxfp4's table: its values as unsigned codes
constexpr uint32_t kTinyScale = 0x00200000;  // 2^-128 (subnormal): E8M0 0's scale, halved

// The instruction set's part: 16 float32 or int32 lanes (one per column of a block), a
// 64-byte line of weight codes, and a line's integer dot with 4 broadcast activations. On
// AVX2 each is two 256-bit halves (columns 0-7, 8-15), lane for lane the same arithmetic:
// the integer dots are exact either way and the float steps are the same operations, so
// both give gpu_worker.quant.reference_matmul's bits.
#if defined(CADENCE_QUANT_AVX512)
struct F16 {
  __m512 v;
};
struct I16 {
  __m512i v;
};
struct Line {
  __m512i v;
};
inline F16 fzero() { return {_mm512_setzero_ps()}; }
inline F16 fload(const float* p) { return {_mm512_loadu_ps(p)}; }
inline F16 fset(float x) { return {_mm512_set1_ps(x)}; }
inline F16 fmul(F16 a, F16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline F16 fadd(F16 a, F16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline F16 to_float(I16 a) { return {_mm512_cvtepi32_ps(a.v)}; }
inline void fstore(float* p, F16 a) { _mm512_storeu_ps(p, a.v); }
inline I16 izero() { return {_mm512_setzero_si512()}; }
inline I16 isub(I16 a, int32_t b) { return {_mm512_sub_epi32(a.v, _mm512_set1_epi32(b))}; }
inline Line load_line(const uint8_t* p) { return {_mm512_loadu_si512(p)}; }
inline Line low_nibbles(Line l) { return {_mm512_and_si512(l.v, _mm512_set1_epi8(0x0F))}; }
inline Line high_nibbles(Line l) {
  return {_mm512_and_si512(_mm512_srli_epi16(l.v, 4), _mm512_set1_epi8(0x0F))};
}
// 16 added to the bytes whose bit is set in `mask` (bit j: byte j)
inline Line add_fifth_bits(Line l, uint64_t mask) {
  return {_mm512_mask_add_epi8(l.v, _cvtu64_mask64(mask), l.v, _mm512_set1_epi8(16))};
}
// acc + each column's 4 codes (unsigned, at most 31) . the 4 activations packed in `a`
inline I16 dot_small(I16 acc, Line codes, int32_t a) {
  return {_mm512_dpbusd_epi32(acc.v, codes.v, _mm512_set1_epi32(a))};
}
// q8 codes are the signed values + 128: vpdpbusd takes them as they are, and the tile
// takes 128 x the activations' sum back (kQ8Biased)
constexpr bool kQ8Biased = true;
inline I16 dot_q8(I16 acc, Line codes, int32_t a) { return dot_small(acc, codes, a); }
// each byte (0..15) replaced by the 16-byte table's entry
inline Line lookup(Line table, Line l) { return {_mm512_shuffle_epi8(table.v, l.v)}; }
inline Line broadcast_table(const int8_t* t) {
  return {_mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t)))};
}
// 16 E8M0 bytes -> 2^(e - 128) as float32 bits: e - 1 in the exponent field, or for e < 2
// the subnormals 2^-128 and 2^-127, so that every scale is exact
inline F16 e8m0_scales(const uint8_t* p) {
  const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
  const __m512i tiny = _mm512_sllv_epi32(_mm512_set1_epi32(kTinyScale), e);
  const __mmask16 small = _mm512_cmplt_epu32_mask(e, _mm512_set1_epi32(2));
  return {_mm512_castsi512_ps(_mm512_mask_blend_epi32(small, normal, tiny))};
}
#else
struct F16 {
  __m256 lo, hi;
};
struct I16 {
  __m256i lo, hi;
};
struct Line {
  __m256i lo, hi;
};
inline F16 fzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline F16 fload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline F16 fset(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline F16 fmul(F16 a, F16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline F16 fadd(F16 a, F16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline F16 to_float(I16 a) { return {_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
inline void fstore(float* p, F16 a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
inline I16 izero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline I16 isub(I16 a, int32_t b) {
  const __m256i v = _mm256_set1_epi32(b);
  return {_mm256_sub_epi32(a.lo, v), _mm256_sub_epi32(a.hi, v)};
}
inline Line load_line(const uint8_t* p) {
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))};
}
inline Line low_nibbles(Line l) {
  const __m256i m = _mm256_set1_epi8(0x0F);
  return {_mm256_and_si256(l.lo, m), _mm256_and_si256(l.hi, m)};
}
inline Line high_nibbles(Line l) {
  const __m256i m = _mm256_set1_epi8(0x0F);
  return {_mm256_and_si256(_mm256_srli_epi16(l.lo, 4), m),
          _mm256_and_si256(_mm256_srli_epi16(l.hi, 4), m)};
}
// 0xFF in the bytes whose bit is set in `mask` (bit j: byte j), 0 elsewhere
inline __m256i bytes_of_bits(uint32_t mask) {
  const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2,
                                          2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int32_t>(mask)), spread);
  return _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
}
inline Line add_fifth_bits(Line l, uint64_t mask) {
  const __m256i sixteen = _mm256_set1_epi8(16);
  __m256i lo = _mm256_and_si256(bytes_of_bits(static_cast<uint32_t>(mask)), sixteen);
  __m256i hi = _mm256_and_si256(bytes_of_bits(static_cast<uint32_t>(mask >> 32)), sixteen);
  return {_mm256_add_epi8(l.lo, lo), _mm256_add_epi8(l.hi, hi)};
}
// vpmaddubsw's pairs of u8 x s8 saturate at 16 bits: exact for codes up to 31 (31 x 127 x 2)
inline __m256i dot_half(__m256i acc, __m256i u, __m256i s) {
  const __m256i pairs = _mm256_maddubs_epi16(u, s);
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
inline I16 dot_small(I16 acc, Line codes, int32_t a) {
  const __m256i as = _mm256_set1_epi32(a);
  return {dot_half(acc.lo, codes.lo, as), dot_half(acc.hi, codes.hi, as)};
}
// q8's signed values (codes - 128) against the activations as |w| x (a with w's sign):
// |w| <= 128 and |a| <= 127 keep the pairs within 16 bits, and the dot needs no correction
constexpr bool kQ8Biased = false;
inline __m256i dot_signed_half(__m256i acc, __m256i codes, __m256i as) {
  const __m256i w = _mm256_xor_si256(codes, _mm256_set1_epi8(static_cast<char>(0x80)));
  return dot_half(acc, _mm256_abs_epi8(w), _mm256_sign_epi8(as, w));
}
inline I16 dot_q8(I16 acc, Line codes, int32_t a) {
  const __m256i as = _mm256_set1_epi32(a);
  return {dot_signed_half(acc.lo, codes.lo, as), dot_signed_half(acc.hi, codes.hi, as)};
}
inline Line lookup(Line table, Line l) {
  return {_mm256_shuffle_epi8(table.lo, l.lo), _mm256_shuffle_epi8(table.hi, l.hi)};
}
inline Line broadcast_table(const int8_t* t) {
  const __m256i v =
      _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t)));
  return {v, v};
}
inline __m256 e8m0_half(__m128i bytes) {
  const __m256i e = _mm256_cvtepu8_epi32(bytes);
  const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
  const __m256i tiny = _mm256_sllv_epi32(_mm256_set1_epi32(kTinyScale), e);
  const __m256i small = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e);
  return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, tiny, small));
}
inline F16 e8m0_scales(const uint8_t* p) {
  return {e8m0_half(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))),
          e8m0_half(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)))};
}
#endif

// llama.cpp's kvalues_mxfp4 + kMxBias
alignas(16) constexpr int8_t kMxTable[16] = {12, 13, 14, 15, 16, 18, 20, 24,
                                             12, 11, 10, 9,  8,  6,  4,  0};
inline F16 load_scales(const float* p) { return fload(p); }
inline F16 load_scales(const uint8_t* p) { return e8m0_scales(p); }

#if defined(CADENCE_QUANT_AVX512)
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

#else
// 32 values as float32: a bfloat16 is the upper half of a float32's bits.
inline void to_float32(const float* x, float* out) { std::memcpy(out, x, 32 * sizeof(float)); }
inline void to_float32(const c10::BFloat16* x, float* out) {
  for (int i = 0; i < 32; ++i) {
    uint32_t bits = static_cast<uint32_t>(x[i].x) << 16;
    std::memcpy(out + i, &bits, 4);
  }
}

// quantize_group as AVX-512's, in scalar code: a row's quantization is K values against the
// K x N of its matmul. std::nearbyint rounds half to even (the default mode), as torch.round.
template <typename In>
void quantize_group(const In* x, int8_t* q, float* scale, int32_t* sums) {
  float values[32];
  to_float32(x, values);
  float amax = 0.0f;
  for (float v : values) amax = std::max(amax, std::fabs(v));
  const float d = amax / 127.0f;
  const float inverse = d != 0.0f ? 1.0f / d : 0.0f;
  sums[0] = sums[1] = 0;
  for (int i = 0; i < 32; ++i) {
    const float scaled = values[i] * inverse;
    const int32_t code = std::clamp(static_cast<int32_t>(std::nearbyint(scaled)), -127, 127);
    q[i] = static_cast<int8_t>(code);
    sums[i / 16] += code;
  }
  *scale = d;
}

#endif

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

// E8M0 exponent bytes for mxfp4, float32 scales for the others
template <bool kMx>
using Scale = std::conditional_t<kMx, uint8_t, float>;

// R rows against one block of 16 columns, all of K. kGroupSize: the weight group (16 or
// 32); kBits: 8, or nibble codes (4; 5 with a line of fifth bits; groups of 32 only); kMins:
// w = scale * code + min; kMx: mxfp4 (4-bit codes through kMxTable, E8M0 scales).
template <int R, int kGroupSize, int kBits, bool kMins, bool kMx, typename Out>
void tile(const Row* rows, int64_t k, const uint8_t* weights, const Scale<kMx>* w_scales,
          const float* w_mins, const float* bias, Out* out, int64_t out_stride, int64_t cols) {
  constexpr int kLines = kGroupSize / 4;  // 4 values of K per line
  const int64_t groups = k / kGroupSize;
  Line table;
  if constexpr (kMx) table = broadcast_table(kMxTable);
  F16 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = fzero();
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t k0 = g * kGroupSize;
    I16 dot[R];
    for (int r = 0; r < R; ++r) dot[r] = izero();
    if constexpr (kBits != 8) {
      const uint8_t* lines = weights + g * kGroupSize * kCols * kBits / 8;
      for (int c = 0; c < 4; ++c) {
        const Line line = load_line(lines + 64 * c);
        Line lo = low_nibbles(line), hi = high_nibbles(line);
        if constexpr (kBits == 5) {  // the fifth bits: 16 added where the mask has them
          uint64_t lo_fifth, hi_fifth;
          std::memcpy(&lo_fifth, lines + 256 + 8 * c, 8);
          std::memcpy(&hi_fifth, lines + 256 + 8 * (c + 4), 8);
          lo = add_fifth_bits(lo, lo_fifth);
          hi = add_fifth_bits(hi, hi_fifth);
        }
        if constexpr (kMx) {
          lo = lookup(table, lo);
          hi = lookup(table, hi);
        }
        for (int r = 0; r < R; ++r) {
          int32_t a_lo, a_hi;
          std::memcpy(&a_lo, rows[r].q + k0 + 4 * c, 4);
          std::memcpy(&a_hi, rows[r].q + k0 + 16 + 4 * c, 4);
          dot[r] = dot_small(dot_small(dot[r], lo, a_lo), hi, a_hi);
        }
      }
    } else {
      const uint8_t* lines = weights + g * kGroupSize * kCols;
      for (int c = 0; c < kLines; ++c) {
        const Line line = load_line(lines + 64 * c);
        for (int r = 0; r < R; ++r) {
          int32_t a;
          std::memcpy(&a, rows[r].q + k0 + 4 * c, 4);
          dot[r] = dot_q8(dot[r], line, a);
        }
      }
    }
    const F16 scale = load_scales(w_scales + g * kCols);
    F16 min;
    if constexpr (kMins) min = fload(w_mins + g * kCols);
    for (int r = 0; r < R; ++r) {
      const int64_t first_sum = k0 / kSumGroup;
      int32_t sum = rows[r].sums[first_sum];
      if constexpr (kGroupSize == 32) sum += rows[r].sums[first_sum + 1];
      if constexpr (kBits == 8 && kQ8Biased) dot[r] = isub(dot[r], 128 * sum);
      if constexpr (kMx) dot[r] = isub(dot[r], kMxBias * sum);
      const float a_scale = rows[r].scales[k0 / kGroup];
      const F16 term = fmul(fmul(to_float(dot[r]), scale), fset(a_scale));
      acc[r] = fadd(acc[r], term);
      if constexpr (kMins) {
        const float a_sum = a_scale * static_cast<float>(sum);
        acc[r] = fadd(acc[r], fmul(min, fset(a_sum)));
      }
    }
  }
  float values[kCols];
  for (int r = 0; r < R; ++r) {
    fstore(values, acc[r]);
    store(out + r * out_stride, values, bias, cols);
  }
}

template <int kGroupSize, int kBits, bool kMins, bool kMx, typename Out, int R = kMaxTile>
void rest_tile(int rest, const Row* rows, int64_t k, const uint8_t* w, const Scale<kMx>* s,
               const float* m, const float* bias, Out* out, int64_t stride, int64_t cols) {
  if constexpr (R > 0) {
    if (rest == R) {
      tile<R, kGroupSize, kBits, kMins, kMx>(rows, k, w, s, m, bias, out, stride, cols);
    } else {
      rest_tile<kGroupSize, kBits, kMins, kMx, Out, R - 1>(rest, rows, k, w, s, m, bias, out,
                                                          stride, cols);
    }
  }
}

template <int kGroupSize, int kBits, bool kMins, bool kMx = false, typename Out>
void matmul(const std::vector<Row>& rows, int64_t k, int64_t n, const uint8_t* weights,
            const Scale<kMx>* scales, const float* mins, const float* bias, Out* out) {
  const int64_t blocks = (n + kCols - 1) / kCols, m = static_cast<int64_t>(rows.size());
  const int64_t block_bytes = k * kCols * kBits / 8;
  const int64_t block_params = k / kGroupSize * kCols;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const uint8_t* w = weights + b * block_bytes;
      const Scale<kMx>* s = scales + b * block_params;
      const float* mn = kMins ? mins + b * block_params : nullptr;
      const float* bb = bias == nullptr ? nullptr : bias + b * kCols;
      const int64_t cols = std::min(kCols, n - b * kCols);
      for (int64_t r = 0; r < m; r += kMaxTile) {
        const int rest = static_cast<int>(std::min<int64_t>(kMaxTile, m - r));
        Out* o = out + r * n + b * kCols;
        rest_tile<kGroupSize, kBits, kMins, kMx>(rest, rows.data() + r, k, w, s, mn, bb, o, n,
                                                 cols);
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

// x [M, K] (float32 or bfloat16) quantized by quantize_activations, then `tiles(rows,
// bias, out)` writes x @ W.T + bias [M, n] in x's dtype. One op per call, not two: a decode
// step makes some 120 of these calls, and each op's dispatch and outputs cost microseconds.
template <typename Tiles>
at::Tensor quantized_product(const at::Tensor& x, const c10::optional<at::Tensor>& bias,
                             int64_t n, const Tiles& tiles) {
  const auto [q, a_scales, a_sums] = quantize_activations(x);
  const int64_t m = q.size(0), k = q.size(1);
  at::Tensor bias_f;
  if (bias.has_value()) bias_f = bias->to(at::kFloat).contiguous();
  const float* bias_p = bias.has_value() ? bias_f.const_data_ptr<float>() : nullptr;
  std::vector<Row> rows(m);
  for (int64_t r = 0; r < m; ++r) {
    rows[r] = {q.const_data_ptr<int8_t>() + r * k, a_scales.const_data_ptr<float>() + r * (k / 32),
               a_sums.const_data_ptr<int32_t>() + r * (k / 16)};
  }
  at::Tensor out = at::empty({m, n}, x.options());
  if (x.scalar_type() == at::kFloat) {
    tiles(rows, bias_p, out.mutable_data_ptr<float>());
  } else {
    tiles(rows, bias_p, out.mutable_data_ptr<c10::BFloat16>());
  }
  return out;
}

int64_t blocks_of(int64_t n) { return (n + kCols - 1) / kCols; }

at::Tensor quant_matmul(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& scales,
                        const c10::optional<at::Tensor>& mins, const c10::optional<at::Tensor>& bias,
                        int64_t n, int64_t group, int64_t bits) {
  TORCH_CHECK(weights.is_contiguous() && scales.is_contiguous(),
              "quant_matmul takes contiguous weights");
  const int64_t k = x.size(1), blocks = blocks_of(n);
  TORCH_CHECK(weights.numel() == blocks * k * kCols * bits / 8,
              "packed weights do not match n and K");
  TORCH_CHECK(scales.numel() == blocks * k / group * kCols, "scales do not match n, K, group");
  const float* mins_p = mins.has_value() ? mins->const_data_ptr<float>() : nullptr;
  return quantized_product(x, bias, n, [&](const auto& rows, const float* b, auto* out) {
    dispatch(rows, k, n, bits, group, weights, scales, mins_p, b, out);
  });
}

// x [M, K] against mxfp4 weights of n columns: packed codes as q4's, E8M0 exponents
// [blocks, K / 32, 16] uint8.
at::Tensor mxfp4_matmul(const at::Tensor& x, const at::Tensor& weights,
                        const at::Tensor& exponents, const c10::optional<at::Tensor>& bias,
                        int64_t n) {
  TORCH_CHECK(weights.is_contiguous() && exponents.is_contiguous(),
              "mxfp4_matmul takes contiguous weights");
  TORCH_CHECK(exponents.scalar_type() == at::kByte, "mxfp4 scales are E8M0 exponent bytes");
  const int64_t k = x.size(1), blocks = blocks_of(n);
  TORCH_CHECK(weights.numel() == blocks * k * kCols / 2, "packed weights do not match n and K");
  TORCH_CHECK(exponents.numel() == blocks * k / kGroup * kCols, "scales do not match n and K");
  const uint8_t* w = weights.const_data_ptr<uint8_t>();
  const uint8_t* e = exponents.const_data_ptr<uint8_t>();
  return quantized_product(x, bias, n, [&](const auto& rows, const float* b, auto* out) {
    matmul<32, 4, false, true>(rows, k, n, w, e, nullptr, b, out);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cadence, m) {
  m.def("quantize_activations(Tensor x) -> (Tensor, Tensor, Tensor)");
  m.def("quant_matmul(Tensor x, Tensor weights, Tensor scales, Tensor? mins, Tensor? bias, "
        "int n, int group, int bits) -> Tensor");
  m.impl("quantize_activations", c10::DispatchKey::CPU, &quantize_activations);
  m.def("mxfp4_matmul(Tensor x, Tensor weights, Tensor exponents, Tensor? bias, int n) -> Tensor");
  m.impl("quant_matmul", c10::DispatchKey::CPU, &quant_matmul);
  m.impl("mxfp4_matmul", c10::DispatchKey::CPU, &mxfp4_matmul);
}
#endif
