// Scalar and AVX-512 helpers shared by the CPU kernels: loading float32 or bfloat16 as 16
// floats, rounding to bfloat16 exactly as c10::BFloat16 does, and exp.
#pragma once

#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace cadence_cpu {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }

// x as T would hold it (float32: unchanged).
template <typename T>
inline float rounded(float x) {
  return to_float(static_cast<T>(x));
}

// Gemma 2's soft-capping of scores [0, n): cap * tanh(score / cap), each step rounded to T
// as the PyTorch path's tensors of the model dtype are (float32: not rounded).
template <typename T>
inline void softcap_row(float* row, int64_t n, float cap) {
  for (int64_t t = 0; t < n; ++t) {
    row[t] = rounded<T>(rounded<T>(std::tanh(rounded<T>(row[t] / cap))) * cap);
  }
}

#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;  // floats per vector

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

// A bfloat16 is the upper half of a float32: widen and shift.
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

// Float bits rounded so that their upper half is the nearest bfloat16, ties to even, as
// c10::BFloat16 rounds finite values.
inline __m512i bf16_rounded_bits(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  return _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
}

// x rounded to T, kept as floats (float32: unchanged).
template <typename T>
inline __m512 round16(__m512 x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    const __m512i up = bf16_rounded_bits(x);
    return _mm512_castsi512_ps(_mm512_and_si512(up, _mm512_set1_epi32(~0xffff)));
  }
}

inline void store16(float* p, __m512 x) { _mm512_storeu_ps(p, x); }

inline void store16(c10::BFloat16* p, __m512 x) {
  const __m256i half = _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_rounded_bits(x), 16));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), half);
}

// exp(x): 2^(x log2 e) split into an integer power, applied exactly by scalef, and 2^f for
// |f| <= 0.5 by a degree-6 Taylor polynomial (relative error ~1e-7, as good as float32
// needs). Large negative x underflows to 0, large positive x overflows to inf.
inline __m512 exp16(__m512 x) {
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.69314718055994531f));
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// vdpbf16ps over two tokens' rows interleaved by unpacklo/hi_epi16 leaves element e of a
// 32-dim chunk in 128-bit lane e / 8, of `lo` for e % 8 < 4 and of `hi` otherwise: the
// chunk's elements 0-15 and 16-31 in order.
inline void deinterleave(__m512 lo, __m512 hi, __m512& first, __m512& second) {
  const __m512i low = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  first = _mm512_permutex2var_ps(lo, low, hi);
  second = _mm512_permutex2var_ps(lo, _mm512_add_epi32(low, _mm512_set1_epi32(8)), hi);
}
#endif

}  // namespace cadence_cpu
