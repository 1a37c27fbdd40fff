// The arithmetic of one bfloat16 query row's attention over its keys [0, len), shared by
// the prefill and the decode kernels, for CPUs with AVX512-BF16.
//
// A row must get the same bits whichever kernel runs it: a token decoded alone, decoded
// beside other sequences, or recomputed as a row of a prefill chunk after a preemption.
// So both kernels lay the keys and values out the same way and reduce in the same order:
// - a score is one lane's sum over the head_dim pairs, in order (16 keys per vector);
// - the softmax sums exp(score - max) 16 keys per vector, then across lanes, then the tail;
// - an output sums the probability-weighted values over token pairs (0, 1), (2, 3), ... in
//   order, in one accumulator per 32 dims.
// None of these depends on how many queries share a pass or on the chunk's start.
//
// Scores and probabilities are rounded to bfloat16 where the PyTorch path holds them in
// bfloat16 tensors (scaled scores, probabilities after the float32 softmax), so the two
// agree to bfloat16 precision; the PyTorch path sums in other orders, so not bit for bit.

#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "attention_sinks.h"
#include "cpu_vec.h"
#include "kv_quant.h"

#if defined(__AVX512BF16__)

namespace cadence_cpu {

using bf16 = c10::BFloat16;

constexpr int64_t kKeys = 16;  // keys per score vector
constexpr int64_t kChunk = 32;  // bfloat16 values per vector

// One sequence's keys and values in the paged caches [kv_heads, cache_blocks, block_size, d]
// (bfloat16, or 8-bit codes and scales: kv_quant.h).
struct PagedKV {
  CacheRows<bf16> k, v;
  const int64_t* table;  // the sequence's block ids
  int64_t cache_blocks, block_size, d;
  int64_t from = 0;  // the first token seen (a sliding window's): "token t" is from + t

  // Indices of the rows of tokens [0, len) of `head`, then kPrefetchTokens copies of the
  // last (past the end, prefetch it again rather than test every time), walking the block
  // table once rather than dividing per token.
  void row_ids(int64_t head, int64_t len, std::vector<int64_t>& out) const {
    out.resize(len + kPrefetchTokens);
    int64_t slot = from % block_size;
    for (int64_t t = 0, i = from / block_size; t < len; ++i, slot = 0) {
      const int64_t first = (head * cache_blocks + table[i]) * block_size;
      for (; slot < block_size && t < len; ++slot, ++t) out[t] = first + slot;
    }
    std::fill(out.begin() + len, out.end(), out[len - 1]);
  }
};

// One kv head's keys and values [0, len) of a task, and the scores of a pass.
struct Workspace {
  std::vector<const bf16*> key_rows, value_rows;  // of tokens [0, len)
  std::vector<int64_t> row_ids;  // of tokens [0, len) in the caches
  // An 8-bit cache's rows [0, len), dequantized: from here on a task cannot tell them from
  // a bfloat16 cache's, so it gives them the same bits.
  std::vector<bf16> dequantized_keys, dequantized_values;
  // [key blocks][d / 2][16]: pairs of dims of 16 keys (Direct: room for two blocks)
  std::vector<uint32_t> keys;
  std::vector<uint32_t> values;  // [key pairs][d / 32][2][16]: LaidOut's value pairs
  std::vector<float> scores;  // [queries per pass][stride]
  std::vector<bf16> probs;  // [queries per pass][stride]
  int64_t stride = 0;  // the visible keys rounded up to whole key blocks, plus one

  // Rows of keys and values [0, len) of `head`, and room for `queries` per pass.
  void start(const PagedKV& kv, int64_t head, int64_t len, int64_t queries) {
    kv.row_ids(head, len, row_ids);
    rows(kv.k, len, kv.d, dequantized_keys, key_rows);
    rows(kv.v, len, kv.d, dequantized_values, value_rows);
    stride = (len + kKeys) / kKeys * kKeys;
    scores.resize(stride * queries);
    probs.resize(scores.size());
  }

 private:
  void rows(const CacheRows<bf16>& cache, int64_t len, int64_t d, std::vector<bf16>& buffer,
            std::vector<const bf16*>& out) const {
    if (cache.quantized()) return dequantize_rows(cache, row_ids, len, d, buffer, out);
    out.resize(len);
    for (int64_t t = 0; t < len; ++t) out[t] = cache.values + row_ids[t] * d;
  }
};

// Word e of 16 rows -> one vector per e: the 16 x 16 transpose of 32-bit words, in
// registers (unpack within 128-bit lanes, then move whole lanes).
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  // Lane k of r[4g + e]: word 4k + e of rows 4g .. 4g + 3.
  for (int g = 0; g < 16; g += 4) {
    r[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
    r[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
    r[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
    r[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
  }
  for (int e = 0; e < 4; ++e) {
    const __m512i even01 = _mm512_shuffle_i32x4(r[e], r[4 + e], 0x88);  // lanes 0, 2
    const __m512i odd01 = _mm512_shuffle_i32x4(r[e], r[4 + e], 0xdd);  // lanes 1, 3
    const __m512i even23 = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], 0x88);
    const __m512i odd23 = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], 0xdd);
    t[e] = _mm512_shuffle_i32x4(even01, even23, 0x88);
    t[e + 4] = _mm512_shuffle_i32x4(odd01, odd23, 0x88);
    t[e + 8] = _mm512_shuffle_i32x4(even01, even23, 0xdd);
    t[e + 12] = _mm512_shuffle_i32x4(odd01, odd23, 0xdd);
  }
  for (int e = 0; e < 16; ++e) r[e] = t[e];
}

// Key block b of [0, len), transposed into dst: word p of its key j (dims 2p, 2p + 1) at
// dst[p * 16 + j]; keys past len are zero. Whole blocks are transposed in registers:
// storing word by word made decode attention ~1.2x slower.
inline void transpose_key_block(const Workspace& w, int64_t b, int64_t len, int64_t d,
                                uint32_t* dst) {
  const bf16* const* rows = w.key_rows.data() + b * kKeys;
  const int64_t n = std::min(kKeys, len - b * kKeys), words = d / 2;
  if (n < kKeys) {
    std::fill(dst, dst + words * kKeys, 0u);
    for (int64_t j = 0; j < n; ++j) {
      const auto* row = reinterpret_cast<const uint32_t*>(rows[j]);
      for (int64_t p = 0; p < words; ++p) dst[p * kKeys + j] = row[p];
    }
    return;
  }
  for (int64_t c = 0; c < d / kChunk; ++c) {  // words 16c .. 16c + 15
    __m512i r[kKeys];
    for (int64_t j = 0; j < kKeys; ++j) r[j] = _mm512_loadu_si512(rows[j] + c * kChunk);
    transpose16(r);
    for (int64_t e = 0; e < kKeys; ++e) _mm512_storeu_si512(dst + (c * kKeys + e) * kKeys, r[e]);
  }
}

// Values of tokens 2m and 2m + 1 (the second zero past len), interleaved for 32-dim chunk
// c by unpacklo/hi_epi16, so that vdpbf16ps meets them with the pair of their
// probabilities.
inline void value_pair(const Workspace& w, int64_t m, int64_t c, int64_t len, __m512i& low,
                       __m512i& high) {
  const __m512i r0 = _mm512_loadu_si512(w.value_rows[2 * m] + c * kChunk);
  const __m512i r1 = 2 * m + 1 < len ? _mm512_loadu_si512(w.value_rows[2 * m + 1] + c * kChunk)
                                     : _mm512_setzero_si512();
  low = _mm512_unpacklo_epi16(r0, r1);
  high = _mm512_unpackhi_epi16(r0, r1);
}

// Where the scoring and weighing passes find key blocks and value pairs. Two sources
// give them the same vectors, so a row gets the same bits from either:
// - LaidOut (prefill): all of a task's keys and values laid out once in the workspace,
//   then read by every query of the task;
// - Direct (decode, one query token, nothing to reuse a layout for): each key block
//   transposed into a small buffer just before it is scored, and value pairs interleaved
//   straight from the cache rows; each also asks for as many of the next task's cache
//   lines as it reads of this one's (Ahead).
struct LaidOut {
  const Workspace& w;
  int64_t d;

  // Lays out keys and values [0, len) of the workspace's rows.
  static void lay_out(Workspace& w, int64_t len, int64_t d) {
    const int64_t words = d / 2, blocks = (len + kKeys - 1) / kKeys;
    w.keys.resize(blocks * words * kKeys);
    for (int64_t b = 0; b < blocks; ++b) {
      transpose_key_block(w, b, len, d, w.keys.data() + b * words * kKeys);
    }
    const int64_t chunks = d / kChunk, pairs = (len + 1) / 2;
    w.values.resize(pairs * chunks * 2 * kKeys);
    for (int64_t m = 0; m < pairs; ++m) {
      for (int64_t c = 0; c < chunks; ++c) {
        __m512i low, high;
        value_pair(w, m, c, len, low, high);
        uint32_t* dst = w.values.data() + ((m * chunks + c) * 2) * kKeys;
        _mm512_storeu_si512(dst, low);
        _mm512_storeu_si512(dst + kKeys, high);
      }
    }
  }

  const uint32_t* key_block(int64_t b) const { return w.keys.data() + b * d / 2 * kKeys; }

  void pair(int64_t m, int64_t c, __m512bh& low, __m512bh& high) const {
    const uint32_t* v = w.values.data() + ((m * (d / kChunk) + c) * 2) * kKeys;
    low = (__m512bh)_mm512_loadu_si512(v);
    high = (__m512bh)_mm512_loadu_si512(v + kKeys);
  }
};

struct Direct {
  const Workspace& w;
  int64_t d, len;
  uint32_t* blocks;  // two blocks' room: key blocks b and b + 1 are used together
  Ahead& ahead;

  const uint32_t* key_block(int64_t b) const {
    ahead.ask(kKeys * lines_of_row(d * static_cast<int64_t>(sizeof(bf16))));
    uint32_t* dst = blocks + (b % 2) * d / 2 * kKeys;
    transpose_key_block(w, b, len, d, dst);
    return dst;
  }

  void pair(int64_t m, int64_t c, __m512bh& low, __m512bh& high) const {
    ahead.ask(2);  // 32 dims of two rows: two lines
    __m512i lo, hi;
    value_pair(w, m, c, len, lo, hi);
    low = (__m512bh)lo;
    high = (__m512bh)hi;
  }
};

// A unit: up to kUnit queries that share the task's keys and values, so that each key
// and value vector loaded serves all of them.
constexpr int64_t kUnit = 6;

struct Unit {
  const uint32_t* queries[kUnit];  // d / 2 words each
  bf16* out[kUnit];
  int64_t lens[kUnit];  // keys each query sees
  // Each query's attention sink (gpt-oss: its head's logit, which joins the softmax's
  // denominator and weighs no value); -inf where the layer has none, which adds exact zeros.
  float sinks[kUnit];
  int64_t max_len;
};


// Scaled scores, rounded to bfloat16, of the Q queries over keys [0, max_len) -> scores
// [q][...]; a query's scores past its own length are computed and never read. Two key
// blocks per pass: 2 * Q independent accumulation chains.
template <int64_t Q, typename Source>
void score_keys(const Unit& u, int64_t words, float scale, const Source& src, float* scores,
                int64_t stride) {
  const int64_t blocks = (u.max_len + kKeys - 1) / kKeys;
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t b = 0; b < blocks; b += 2) {
    const bool two = b + 1 < blocks;
    __m512 acc[2][Q];
    for (int64_t q = 0; q < Q; ++q) acc[0][q] = acc[1][q] = _mm512_setzero_ps();
    const uint32_t* k0 = src.key_block(b);
    const uint32_t* k1 = two ? src.key_block(b + 1) : k0;  // past the last block: not stored
    for (int64_t p = 0; p < words; ++p) {
      const __m512bh first = (__m512bh)_mm512_loadu_si512(k0 + p * kKeys);
      const __m512bh second = (__m512bh)_mm512_loadu_si512(k1 + p * kKeys);
      for (int64_t q = 0; q < Q; ++q) {
        const __m512bh qp = (__m512bh)_mm512_set1_epi32(static_cast<int>(u.queries[q][p]));
        acc[0][q] = _mm512_dpbf16_ps(acc[0][q], first, qp);
        acc[1][q] = _mm512_dpbf16_ps(acc[1][q], second, qp);
      }
    }
    for (int64_t q = 0; q < Q; ++q) {
      float* row = scores + q * stride + b * kKeys;
      _mm512_storeu_ps(row, round16<bf16>(_mm512_mul_ps(acc[0][q], vscale)));
      if (two) _mm512_storeu_ps(row + kKeys, round16<bf16>(_mm512_mul_ps(acc[1][q], vscale)));
    }
  }
}

// Scores [0, len) -> probabilities as bfloat16 in `probs`, zero from len to `zero_to`.
// `sink` is one more logit of the row, as a column the PyTorch path appends: it counts in
// the maximum and the denominator, last, and takes no value (-inf: none, the same bits).
inline void softmax_row(float* s, int64_t len, bf16* probs, int64_t zero_to, float sink) {
  __m512 vmax = _mm512_set1_ps(-INFINITY);
  int64_t t = 0;
  for (; t + kKeys <= len; t += kKeys) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(s + t));
  float max = _mm512_reduce_max_ps(vmax);
  for (; t < len; ++t) max = std::max(max, s[t]);
  max = std::max(max, sink);
  __m512 vsum = _mm512_setzero_ps();
  const __m512 vmaxs = _mm512_set1_ps(max);
  t = 0;
  for (; t + kKeys <= len; t += kKeys) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + t), vmaxs));
    _mm512_storeu_ps(s + t, e);
    vsum = _mm512_add_ps(vsum, e);
  }
  float sum = _mm512_reduce_add_ps(vsum);
  for (; t < len; ++t) {
    s[t] = std::exp(s[t] - max);
    sum += s[t];
  }
  sum += std::exp(sink - max);
  // vcvtneps2bf16 rounds to nearest even, as c10::BFloat16 does for finite values.
  const __m512 inv = _mm512_set1_ps(1.f / sum);
  t = 0;
  for (; t + kKeys <= len; t += kKeys) {
    const __m256bh rounded = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(s + t), inv));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(probs + t), (__m256i)rounded);
  }
  for (; t < len; ++t) probs[t] = static_cast<bf16>(s[t] * (1.f / sum));
  std::fill(probs + len, probs + zero_to, static_cast<bf16>(0.f));
}

// The 32 sums of a chunk from its interleaved accumulators -> bfloat16 out[0..31];
// vcvtneps2bf16 rounds to nearest even, as c10::BFloat16 does for finite values.
inline void store_interleaved(__m512 lo, __m512 hi, bf16* out) {
  __m512 first, second;
  deinterleave(lo, hi, first, second);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), (__m256i)_mm512_cvtneps_pbh(first));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + kLanes),
                      (__m256i)_mm512_cvtneps_pbh(second));
}

// out[q] = sum over t < max_len of probs[q][t] * value t, for Q queries and d = chunks * 32,
// one 32-dim chunk at a time (2 * Q accumulators per pass over the pairs of tokens). A
// query's zero probabilities past its own length add exact zeros.
template <int64_t Q, typename Source>
void weigh_values(const Unit& u, const bf16* probs, int64_t stride, int64_t chunks,
                  const Source& src) {
  const int64_t pairs = (u.max_len + 1) / 2;
  for (int64_t c = 0; c < chunks; ++c) {
    __m512 lo[Q], hi[Q];
    for (int64_t q = 0; q < Q; ++q) lo[q] = hi[q] = _mm512_setzero_ps();
    for (int64_t m = 0; m < pairs; ++m) {
      __m512bh low, high;
      src.pair(m, c, low, high);
      for (int64_t q = 0; q < Q; ++q) {
        uint32_t pair;  // the probabilities of tokens 2m and 2m + 1, as one word
        std::memcpy(&pair, probs + q * stride + 2 * m, sizeof pair);
        const __m512bh weights = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
        lo[q] = _mm512_dpbf16_ps(lo[q], low, weights);
        hi[q] = _mm512_dpbf16_ps(hi[q], high, weights);
      }
    }
    for (int64_t q = 0; q < Q; ++q) store_interleaved(lo[q], hi[q], u.out[q] + c * kChunk);
  }
}

// `softcap` > 0: Gemma 2's soft-capping of the scaled scores, before the softmax; each
// query's sink (Unit::sinks) joins its softmax.
template <int64_t Q, typename Source>
void attend_unit_of(const Unit& u, int64_t d, float scale, Workspace& w, const Source& src,
                    float softcap) {
  const int64_t stride = w.stride, even = (u.max_len + 1) / 2 * 2;
  score_keys<Q>(u, d / 2, scale, src, w.scores.data(), stride);
  for (int64_t q = 0; q < Q; ++q) {
    float* scores = w.scores.data() + q * stride;
    if (softcap > 0.f) softcap_row<bf16>(scores, u.lens[q], softcap);
    softmax_row(scores, u.lens[q], w.probs.data() + q * stride, even, u.sinks[q]);
  }
  weigh_values<Q>(u, w.probs.data(), stride, d / kChunk, src);
}

// The unit's n queries (1 <= n <= kUnit) over the keys and values of `src`.
template <typename Source>
void attend_unit(const Unit& u, int64_t n, int64_t d, float scale, Workspace& w,
                 const Source& src, float softcap = 0.f) {
  switch (n) {
    case 1: return attend_unit_of<1>(u, d, scale, w, src, softcap);
    case 2: return attend_unit_of<2>(u, d, scale, w, src, softcap);
    case 3: return attend_unit_of<3>(u, d, scale, w, src, softcap);
    case 4: return attend_unit_of<4>(u, d, scale, w, src, softcap);
    case 5: return attend_unit_of<5>(u, d, scale, w, src, softcap);
    default: return attend_unit_of<6>(u, d, scale, w, src, softcap);
  }
}

}  // namespace cadence_cpu

#endif
