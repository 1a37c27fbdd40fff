// The 8-bit KV cache (int8 or fp8 e4m3) shared by the cache write (layer_ops.cpp) and the
// attention kernels: half the bytes of a bfloat16 cache, so twice the tokens in the same
// memory and half the bytes a decode step streams.
//
// A cache [kv_heads, blocks, block_size, d] of codes comes with its scales [kv_heads,
// blocks, block_size] float32, one per row (token, kv head): a row's outliers then cost only
// that row its precision. A row x of the model dtype is stored as
//   scale = amax|x| / 127 (int8) or / 448 (fp8), all zeros where scale is 0;
//   code = clamp(nearbyint(x / scale), -127, 127) (int8) or Float8_e4m3fn(x / scale) (fp8);
// and attention sees T(float(code) * scale) for the model dtype T. The rounding to T is what
// makes an 8-bit cache exactly a cache of T holding those values: attention on it gives the
// bits it gives on that cache, so every kernel's bit-identity guarantees (a token decoded or
// recomputed in a prefill chunk) carry over. gpu_worker/kv_quant.py is the reference.

#pragma once

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

#include "cpu_vec.h"

namespace cadence_cpu {

enum class Codes { kNone, kInt8, kFp8 };  // kNone: the cache holds the model dtype

// The largest code magnitude: a row's amax maps to it.
inline float code_limit(Codes kind) { return kind == Codes::kInt8 ? 127.f : 448.f; }

// How far ahead of the rows being read to prefetch: the rows of a sequence are scattered
// over blocks, so the hardware prefetcher loses the stream at every block boundary, and
// the cache is far larger than the CPU's caches (decode steps 25% slower without it).
constexpr int64_t kPrefetchTokens = 32;

// One row of the model dtype -> d codes; returns its scale.
template <typename T>
float quantize_row(Codes kind, const T* x, int64_t d, uint8_t* codes) {
  float amax = 0.f;
  for (int64_t i = 0; i < d; ++i) amax = std::max(amax, std::abs(to_float(x[i])));
  const float scale = amax / code_limit(kind);
  if (scale == 0.f) {  // x / 0 would be NaN: all zeros (or so small that amax / limit is 0)
    std::fill(codes, codes + d, uint8_t{0});
    return 0.f;
  }
  for (int64_t i = 0; i < d; ++i) {
    const float r = to_float(x[i]) / scale;
    if (kind == Codes::kInt8) {
      // nearbyint rounds half to even in the default rounding mode, as torch.round does.
      const float code = std::clamp(std::nearbyint(r), -127.f, 127.f);
      codes[i] = static_cast<uint8_t>(static_cast<int8_t>(code));
    } else {
      codes[i] = c10::Float8_e4m3fn(r).x;
    }
  }
  return scale;
}

inline float code_value(Codes kind, uint8_t code) {
  if (kind == Codes::kInt8) return static_cast<int8_t>(code);
  return c10::Float8_e4m3fn(code, c10::Float8_e4m3fn::from_bits());
}

#if defined(__AVX512F__)
// 16 int8 codes -> their values, exactly.
inline __m512 int8_values16(const uint8_t* p) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
}

// 16 fp8 e4m3 codes -> 2^-8 times their values, exactly, as c10::Float8_e4m3fn converts
// them, but for NaN codes (s 1111 111, read as +-1.875). Code s eeee mmm read as the float16
// s 0eeee mmm0000000 has the exponent bias 15 instead of 7, and vcvtph2ps converts float16
// subnormals exactly: 4 instructions, where assembling float32 bits needs a separate path
// for subnormal codes. `nan` gathers the maximum of the codes with their sign bit set: 0xff
// once one is NaN.
inline __m512 fp8_values16_over_256(const uint8_t* p, __m128i& nan) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  nan = _mm_max_epu8(nan, _mm_or_si128(bytes, _mm_set1_epi8(-128)));
  // Sign-extended and shifted: s s eeee mmm 0000000; then the second s cleared.
  const __m256i half = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(bytes), 7),
                                        _mm256_set1_epi16(static_cast<short>(0xbfff)));
  return _mm512_cvtph_ps(half);
}

// x rounded to T -> out: floats holding T's values.
template <typename T>
inline void store_rounded(float* out, __m512 x) {
  _mm512_storeu_ps(out, round16<T>(x));
}

// x rounded to bfloat16 -> out (vcvtneps2bf16 rounds to nearest even, as c10::BFloat16 does
// for finite values).
template <typename T>
inline void store_rounded(c10::BFloat16* out, __m512 x) {
#if defined(__AVX512BF16__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), (__m256i)_mm512_cvtneps_pbh(x));
#else
  store16(out, x);
#endif
}
#endif

// d codes -> T(float(code) * scale) in out: T, or floats holding T's values.
template <typename T, typename Out>
void dequantize_row(Codes kind, const uint8_t* codes, float scale, int64_t d, Out* out) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 s = _mm512_set1_ps(scale);
  if (kind == Codes::kInt8) {
    for (; i + kLanes <= d; i += kLanes) {
      store_rounded<T>(out + i, _mm512_mul_ps(int8_values16(codes + i), s));
    }
  } else if (std::abs(scale) * 256.f <= std::numeric_limits<float>::max()) {
    // 2^8 times the scale is exact where finite, as every scale the quantizer writes (at most
    // float's max / 448) keeps it; any other scale takes the plain loop.
    const __m512 s256 = _mm512_set1_ps(scale * 256.f);
    __m128i nan = _mm_setzero_si128();
    for (; i + kLanes <= d; i += kLanes) {
      store_rounded<T>(out + i, _mm512_mul_ps(fp8_values16_over_256(codes + i, nan), s256));
    }
    // A NaN code (only a NaN in the row quantized writes one): the plain loop redoes the row.
    if (_mm_movemask_epi8(_mm_cmpeq_epi8(nan, _mm_set1_epi8(-1))) != 0) i = 0;
  }
#endif
  for (; i < d; ++i) {
    const T value = static_cast<T>(code_value(kind, codes[i]) * scale);
    out[i] = static_cast<Out>(value);
  }
}

// Bytes one after another in memory.
struct Span {
  const char* start;
  int64_t size;
};

// One paged cache [kv_heads, blocks, block_size, d] as the attention kernels read it: rows
// of the model dtype T, or 8-bit codes with one scale per row. A row is addressed by its
// index in [kv_heads * blocks * block_size].
template <typename T>
struct CacheRows {
  const T* values = nullptr;  // a cache of T
  const uint8_t* codes = nullptr;  // an 8-bit cache
  const float* scales = nullptr;
  Codes kind = Codes::kNone;

  bool quantized() const { return kind != Codes::kNone; }

  // The bytes of a row of d values, and how many.
  const char* bytes(int64_t row, int64_t d) const {
    return quantized() ? reinterpret_cast<const char*>(codes + row * d)
                       : reinterpret_cast<const char*>(values + row * d);
  }
  int64_t row_bytes(int64_t d) const {
    return d * (quantized() ? 1 : static_cast<int64_t>(sizeof(T)));
  }

  // Asks for the cache lines of a row (and of its scale).
  void prefetch(int64_t row, int64_t d) const {
    const char* first = bytes(row, d);
    for (int64_t byte = 0; byte < row_bytes(d); byte += 64) __builtin_prefetch(first + byte);
    if (quantized()) __builtin_prefetch(scales + row);
  }

  // Appends the memory of rows [first, first + n), which lie one after another (and of
  // their scales).
  void spans(int64_t first, int64_t n, int64_t d, std::vector<Span>& out) const {
    out.push_back({bytes(first, d), n * row_bytes(d)});
    if (quantized()) {
      out.push_back({reinterpret_cast<const char*>(scales + first),
                     n * static_cast<int64_t>(sizeof(float))});
    }
  }

  // An 8-bit cache's row -> out: T, or floats holding T's values.
  template <typename Out>
  void dequantize(int64_t row, int64_t d, Out* out) const {
    dequantize_row<T>(kind, codes + row * d, scales[row], d, out);
  }
};

// Cache lines, 64 bytes, that a row of `bytes` spans.
constexpr int64_t lines_of_row(int64_t bytes) { return (bytes + 63) / 64; }

// The cache lines of the decode task after this one, asked for while this one computes,
// with each step as many as the step reads of this task. Decode attention streams the KV
// cache, and a task's few hundred rows are too short a stream for the CPU's own
// prefetcher: without this a task's reads and its arithmetic take turns (a decode step's
// attention at batch 64, context 320 from 28-36 ms to 21-23 ms on a Zen 4, whose caches the
// 30 layers' KV cache far exceeds). All at once, the requests fill the core's queue of
// misses and stall the task's own loads; into L1 (prefetcht0), the next task's rows evict
// the current one's.
struct Ahead {
  std::vector<Span> spans;  // of the next task, in the order it reads them
  size_t span = 0;  // the first span not asked for in full
  int64_t offset = 0;  // the bytes of it asked for

  void reset() {
    spans.clear();
    span = 0;
    offset = 0;
  }

  // Asks for the next n cache lines.
  void ask(int64_t n) {
    for (; n > 0 && span < spans.size(); ++span, offset = 0) {
      const Span& s = spans[span];
      for (; n > 0 && offset < s.size; offset += 64, --n) {
        __builtin_prefetch(s.start + offset, 0, 2);
      }
      if (offset < s.size) return;
    }
  }
};

// The rows `ids` [0, len) of an 8-bit cache, dequantized to T into `buffer` [len, d], in
// order and prefetching ahead (ids holds kPrefetchTokens more past len); out[t] -> row t.
template <typename T>
void dequantize_rows(const CacheRows<T>& cache, const std::vector<int64_t>& ids, int64_t len,
                     int64_t d, std::vector<T>& buffer, std::vector<const T*>& out) {
  buffer.resize(len * d);
  out.resize(len);
  for (int64_t t = 0; t < len; ++t) {
    cache.prefetch(ids[t + kPrefetchTokens], d);
    cache.dequantize(ids[t], d, buffer.data() + t * d);
    out[t] = buffer.data() + t * d;
  }
}

// The kind of `cache`, checking that `scales` come with it exactly when it is 8-bit, as
// [kv_heads, blocks, block_size] float32 contiguous.
inline Codes checked_codes(const at::Tensor& cache, const std::optional<at::Tensor>& scales,
                           const char* cache_name, const char* scales_name) {
  TORCH_CHECK(cache.dim() == 4, cache_name, " must be [kv_heads, blocks, block_size, d]");
  const at::ScalarType type = cache.scalar_type();
  const Codes kind = type == at::kChar            ? Codes::kInt8
                     : type == at::kFloat8_e4m3fn ? Codes::kFp8
                                                  : Codes::kNone;
  const bool given = scales.has_value() && scales->defined();
  if (kind == Codes::kNone) {
    TORCH_CHECK(!given, scales_name, " given, but ", cache_name, " is ", type,
                ", not int8 or float8_e4m3fn");
    return kind;
  }
  TORCH_CHECK(given, cache_name, " is ", type, ": its scales ", scales_name,
              " [kv_heads, blocks, block_size] float32 must be given");
  const at::Tensor& s = *scales;
  TORCH_CHECK(s.device().is_cpu() && s.scalar_type() == at::kFloat && s.is_contiguous() &&
                  s.dim() == 3 && s.sizes() == cache.sizes().slice(0, 3),
              scales_name, " must be a contiguous float32 CPU tensor [kv_heads, blocks, "
              "block_size] = ", cache.sizes().slice(0, 3), " of ", cache_name, ", got ",
              s.scalar_type(), " ", s.sizes());
  return kind;
}

// `cache` (of T, or 8-bit with `scales`, as checked_codes found) as rows.
template <typename T>
CacheRows<T> cache_rows(const at::Tensor& cache, const std::optional<at::Tensor>& scales,
                        Codes kind) {
  CacheRows<T> rows;
  rows.kind = kind;
  if (kind == Codes::kNone) {
    rows.values = cache.const_data_ptr<T>();
  } else {
    rows.codes = static_cast<const uint8_t*>(cache.const_data_ptr());
    rows.scales = scales->const_data_ptr<float>();
  }
  return rows;
}

}  // namespace cadence_cpu
