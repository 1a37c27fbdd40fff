// Causal attention of one prefill chunk straight from the paged KV cache, on the CPU, for
// bfloat16 caches on CPUs with AVX512-BF16.
//
// The PyTorch path (gpu_worker/attention.py) runs a handful of kernels per block of 128
// queries (matmul, mask, softmax, cast, matmul, copies): ~60 ms of a ~200 ms step for
// SmolLM2-135M with a 448-token chunk on two cores; here ~18 ms. One task takes 32 query
// tokens of one kv head: it lays the keys it can see out transposed, 16 keys per vector
// (so a score vector needs no horizontal sum), and the values interleaved in pairs, once,
// and then runs its queries through them with vdpbf16ps in units of up to 6 (neighbouring
// tokens times the heads of the group), so that each vector loaded serves all of them.
//
// Scores and probabilities are rounded to bfloat16 where the PyTorch path holds them in
// bfloat16 tensors (scaled scores, probabilities after the float32 softmax), so the two
// paths agree to bfloat16 precision; sums run in another order, so not bit for bit.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_vec.h"

#if defined(__AVX512BF16__)

namespace {

using namespace cadence_cpu;
using bf16 = c10::BFloat16;

constexpr int64_t kKeys = 16;  // keys per score vector
constexpr int64_t kQueryBlock = 32;  // query tokens per task
constexpr int64_t kChunk = 32;  // bfloat16 values per vector

struct Chunk {
  const bf16* q;  // [n, heads, d], rows strided
  int64_t q_token_stride, q_head_stride;
  const bf16* k_cache;  // [kv_heads, cache_blocks, block_size, d], contiguous
  const bf16* v_cache;
  const int64_t* table;  // the sequence's block ids
  bf16* out;  // [n, heads, d], contiguous
  int64_t n, start, heads, kv_heads, group, d, cache_blocks, block_size;
  float scale;

  const bf16* key_row(const bf16* cache, int64_t head, int64_t token) const {
    const int64_t block = table[token / block_size];
    return cache + ((head * cache_blocks + block) * block_size + token % block_size) * d;
  }
};

// One task's keys and values, laid out for vdpbf16ps, and its scores.
struct Workspace {
  std::vector<uint32_t> keys;  // [key blocks][d / 2][16]: pairs of dims of 16 keys
  std::vector<uint32_t> values;  // [key pairs][d / 32][2][16]: two tokens' rows interleaved
  std::vector<float> scores;  // [heads per pass][stride]
  std::vector<bf16> probs;  // [heads per pass][stride]
  int64_t stride = 0;  // the task's visible keys rounded up to whole key blocks, plus one
};

// Keys [0, len) of `head`, transposed: word p of key j of block b (dims 2p, 2p + 1) at
// keys[(b * d / 2 + p) * 16 + j]; keys past len are zero.
void lay_out_keys(const Chunk& c, int64_t head, int64_t len, Workspace& w) {
  const int64_t words = c.d / 2, blocks = (len + kKeys - 1) / kKeys;
  w.keys.assign(blocks * words * kKeys, 0u);
  for (int64_t t = 0; t < len; ++t) {
    const auto* row = reinterpret_cast<const uint32_t*>(c.key_row(c.k_cache, head, t));
    uint32_t* dst = w.keys.data() + (t / kKeys) * words * kKeys + t % kKeys;
    for (int64_t p = 0; p < words; ++p) dst[p * kKeys] = row[p];
  }
}

// Values of tokens 2m and 2m + 1 interleaved per 32-dim chunk c (unpacklo/hi_epi16), so that
// vdpbf16ps meets them with the pair of their probabilities; a missing odd token is zero.
void lay_out_values(const Chunk& c, int64_t head, int64_t len, Workspace& w) {
  const int64_t chunks = c.d / kChunk, pairs = (len + 1) / 2;
  w.values.resize(pairs * chunks * 2 * kKeys);
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t m = 0; m < pairs; ++m) {
    const bf16* row0 = c.key_row(c.v_cache, head, 2 * m);
    const bf16* row1 = 2 * m + 1 < len ? c.key_row(c.v_cache, head, 2 * m + 1) : nullptr;
    for (int64_t ch = 0; ch < chunks; ++ch) {
      const __m512i r0 = _mm512_loadu_si512(row0 + ch * kChunk);
      const __m512i r1 = row1 != nullptr ? _mm512_loadu_si512(row1 + ch * kChunk) : zero;
      uint32_t* dst = w.values.data() + ((m * chunks + ch) * 2) * kKeys;
      _mm512_storeu_si512(dst, _mm512_unpacklo_epi16(r0, r1));
      _mm512_storeu_si512(dst + kKeys, _mm512_unpackhi_epi16(r0, r1));
    }
  }
}

// A unit: up to kUnit queries that share the task's keys and values, (token, head) pairs
// of neighbouring tokens and the heads of the group, so that each key and value vector
// loaded from the workspace (in L2 for long contexts) serves all of them.
constexpr int64_t kUnit = 6;

struct Unit {
  const uint32_t* queries[kUnit];  // d / 2 words each
  bf16* out[kUnit];
  int64_t lens[kUnit];  // keys each query sees
  int64_t max_len;
};

// Scaled scores, rounded to bfloat16, of the Q queries over keys [0, max_len) -> scores
// [q][...]; a query's scores past its own length are computed and never read. Two key
// blocks per pass: 2 * Q independent accumulation chains.
template <int64_t Q>
void score_keys(const Unit& u, int64_t words, float scale, const Workspace& w, float* scores,
                int64_t stride) {
  const int64_t blocks = (u.max_len + kKeys - 1) / kKeys;
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t b = 0; b < blocks; b += 2) {
    const bool two = b + 1 < blocks;
    __m512 acc[2][Q];
    for (int64_t q = 0; q < Q; ++q) acc[0][q] = acc[1][q] = _mm512_setzero_ps();
    const uint32_t* k0 = w.keys.data() + b * words * kKeys;
    const uint32_t* k1 = two ? k0 + words * kKeys : k0;  // past the last block: not stored
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
void softmax_row(float* s, int64_t len, bf16* probs, int64_t zero_to) {
  __m512 vmax = _mm512_set1_ps(-INFINITY);
  int64_t t = 0;
  for (; t + kKeys <= len; t += kKeys) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(s + t));
  float max = _mm512_reduce_max_ps(vmax);
  for (; t < len; ++t) max = std::max(max, s[t]);
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
// one 32-dim chunk at a time (2 * Q accumulators per pass over the pairs of tokens).
template <int64_t Q>
void weigh_values(const Unit& u, const bf16* probs, int64_t stride, int64_t chunks,
                  const Workspace& w) {
  const int64_t pairs = (u.max_len + 1) / 2;
  for (int64_t c = 0; c < chunks; ++c) {
    __m512 lo[Q], hi[Q];
    for (int64_t q = 0; q < Q; ++q) lo[q] = hi[q] = _mm512_setzero_ps();
    const uint32_t* v = w.values.data() + c * 2 * kKeys;
    for (int64_t m = 0; m < pairs; ++m, v += chunks * 2 * kKeys) {
      const __m512bh low = (__m512bh)_mm512_loadu_si512(v);
      const __m512bh high = (__m512bh)_mm512_loadu_si512(v + kKeys);
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

template <int64_t Q>
void attend_unit(const Chunk& c, const Unit& u, Workspace& w) {
  const int64_t stride = w.stride, even = (u.max_len + 1) / 2 * 2;
  score_keys<Q>(u, c.d / 2, c.scale, w, w.scores.data(), stride);
  for (int64_t q = 0; q < Q; ++q) {
    softmax_row(w.scores.data() + q * stride, u.lens[q], w.probs.data() + q * stride, even);
  }
  weigh_values<Q>(u, w.probs.data(), stride, c.d / kChunk, w);
}

// Query tokens [first, end) under kv head `head`, in units of neighbouring tokens times
// the heads of the group.
void run_task(const Chunk& c, int64_t head, int64_t first, int64_t end, Workspace& w) {
  const int64_t visible = c.start + end;  // what the block's last query sees
  lay_out_keys(c, head, visible, w);
  lay_out_values(c, head, visible, w);
  w.stride = (visible + kKeys) / kKeys * kKeys;  // whole key blocks, and one more token
  w.scores.resize(w.stride * kUnit);
  w.probs.resize(w.scores.size());
  const int64_t heads = std::min(c.group, kUnit), tokens = kUnit / heads;
  for (int64_t i = first; i < end; i += tokens) {
    for (int64_t g = 0; g < c.group; g += heads) {
      Unit u;
      int64_t n = 0;
      for (int64_t t = i; t < std::min(end, i + tokens); ++t) {
        for (int64_t h = head * c.group + g; h < head * c.group + std::min(c.group, g + heads);
             ++h) {
          u.queries[n] = reinterpret_cast<const uint32_t*>(c.q + t * c.q_token_stride +
                                                           h * c.q_head_stride);
          u.out[n] = c.out + (t * c.heads + h) * c.d;
          u.lens[n++] = c.start + t + 1;
        }
      }
      u.max_len = u.lens[n - 1];
      switch (n) {
        case 1: attend_unit<1>(c, u, w); break;
        case 2: attend_unit<2>(c, u, w); break;
        case 3: attend_unit<3>(c, u, w); break;
        case 4: attend_unit<4>(c, u, w); break;
        case 5: attend_unit<5>(c, u, w); break;
        default: attend_unit<6>(c, u, w); break;
      }
    }
  }
}

void run(const Chunk& c) {
  // Tasks (query block, kv head), the costliest (latest) blocks first, handed out one at a
  // time: causal blocks differ in cost, and a static split would leave a thread idle.
  const int64_t blocks = (c.n + kQueryBlock - 1) / kQueryBlock;
  const int64_t tasks = blocks * c.kv_heads;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    Workspace w;
    for (int64_t task = next++; task < tasks; task = next++) {
      const int64_t block = blocks - 1 - task / c.kv_heads;
      const int64_t first = block * kQueryBlock;
      run_task(c, task % c.kv_heads, first, std::min(c.n, first + kQueryBlock), w);
    }
  });
}

// q [n, heads, d] (rows strided, last dim contiguous) of one sequence's chunk at positions
// start .. start + n - 1, whose K/V are already in the caches [kv_heads, blocks, block_size,
// d]; block_table [W] int64 covers them -> [n, heads, d].
at::Tensor paged_prefill_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                   const at::Tensor& v_cache, const at::Tensor& block_table,
                                   int64_t start, double scale) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16 &&
                  v_cache.scalar_type() == at::kBFloat16,
              "bfloat16 q and caches only");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [n, heads, d], rows contiguous");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(), "caches must match");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  const int64_t n = q.size(0), heads = q.size(1), d = q.size(2), kv_heads = k_cache.size(0);
  TORCH_CHECK(k_cache.size(3) == d && d % kChunk == 0 && d <= 8 * kChunk,
              "head_dim must match the caches and be a multiple of 32 up to 256");
  TORCH_CHECK(heads % kv_heads == 0, "heads must be a multiple of kv_heads");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && block_table.dim() == 1,
              "block_table must be an int64 vector");
  TORCH_CHECK(start >= 0, "start must be >= 0");
  const at::Tensor table = block_table.contiguous();
  const int64_t cache_blocks = k_cache.size(1), block_size = k_cache.size(2);
  const int64_t needed = (start + n + block_size - 1) / block_size;
  TORCH_CHECK(table.numel() >= needed, "the block table covers ", table.numel() * block_size,
              " tokens, the chunk reaches ", start + n);
  const int64_t* ids = table.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < needed; ++i) {
    TORCH_CHECK(ids[i] >= 0 && ids[i] < cache_blocks, "block id ", ids[i],
                " is outside the cache's ", cache_blocks, " blocks");
  }
  at::Tensor out = at::empty({n, heads, d}, q.options());
  if (n == 0) return out;
  run(Chunk{q.const_data_ptr<bf16>(), q.stride(0), q.stride(1), k_cache.const_data_ptr<bf16>(),
            v_cache.const_data_ptr<bf16>(), ids, out.mutable_data_ptr<bf16>(), n, start, heads,
            kv_heads, heads / kv_heads, d, cache_blocks, block_size, static_cast<float>(scale)});
  return out;
}

}  // namespace

// Registered only where the CPU can run it; gpu_worker.attention checks for the op.
TORCH_LIBRARY_FRAGMENT(cadence, m) {
  m.def("paged_prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, "
        "int start, float scale) -> Tensor");
  m.impl("paged_prefill_attention", c10::DispatchKey::CPU, &paged_prefill_attention);
}

#endif
