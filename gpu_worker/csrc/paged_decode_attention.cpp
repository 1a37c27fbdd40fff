// Decode attention straight from the paged KV cache, on the CPU.
//
// One query token per sequence attends over its context. The PyTorch path gathers the
// keys into a buffer, multiplies, and lets embedding_bag sum the values: each key byte
// moves three times. Here every (sequence, kv head) task walks the block table once for
// the scores of the query heads sharing that kv head and once for their weighted sums of
// values, reading each K/V byte once and writing only the output.
//
// Scores, softmax and value sums accumulate in float32 whatever the cache dtype (float32
// or bfloat16); scores and probabilities are rounded to that dtype as the PyTorch path's
// tensors are, and the output is written in it. AVX-512 paths where the compiler targets
// it (-march=native), with plain loops for other CPUs and head_dims. An 8-bit cache
// (kv_quant.h) is read as the cache of the model dtype holding its dequantized values, bit
// for bit: rows are dequantized as they are staged, or, in the bfloat16 kernel, when a task
// starts.
//
// A sliding window (`window` > 0) is a first token: a row sees the last `window` tokens of
// its context, walked as a context of its own (the bfloat16 path's PagedKV::from). A
// `softcap` > 0 is Gemma 2's soft-capping of the scaled scores, cap * tanh(score / cap).
// Attention sinks (gpt-oss: a float32 logit per query head) join each row's softmax as one
// more logit, in its maximum and, last, its denominator, and weigh no value.
//
// A query row's result depends only on its own query and keys, never on the other rows of
// the call, so a float32 prefill chunk can run its rows here as well (gpu_worker.attention).
// In bfloat16 on CPUs with AVX512-BF16 a task runs the prefill kernel's arithmetic instead
// (bf16_attention.h): a token gets the same bits decoded or recomputed in a chunk.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "attention_sinks.h"
#include "bf16_attention.h"
#include "cpu_vec.h"
#include "kv_quant.h"

namespace {

using namespace cadence_cpu;

// row[t] = row[t] * factor, rounded to T (float32: no rounding). The PyTorch path holds
// scores and probabilities as tensors of the model dtype; rounding them alike keeps the
// two paths' greedy tokens the same (without it, one of 64 greedy outputs of
// ops.engine_bench differed between fcfs and stall_free schedules).
template <typename T>
void scale_and_round(float* row, int64_t n, float factor) {
  int64_t t = 0;
#if defined(__AVX512F__)
  const __m512 f = _mm512_set1_ps(factor);
  for (; t + kLanes <= n; t += kLanes) {
    _mm512_storeu_ps(row + t, round16<T>(_mm512_mul_ps(_mm512_loadu_ps(row + t), f)));
  }
#endif
  for (; t < n; ++t) row[t] = rounded<T>(row[t] * factor);
}

// Shapes and pointers of one call, shared by every task.
template <typename T>
struct Problem {
  const T* q;  // [batch, heads, head_dim], rows strided
  int64_t q_batch_stride, q_head_stride;
  CacheRows<T> k, v;  // [kv_heads, cache_blocks, block_size, head_dim], contiguous
  const int64_t* block_tables;  // [batch, width]
  const int64_t* context_lens;  // [batch]
  T* out;  // [batch, heads, head_dim], contiguous
  int64_t heads, kv_heads, group, head_dim, cache_blocks, block_size, width;
  float scale;
  int64_t window;  // > 0: a query at position p sees keys p - window < k <= p only
  float softcap;  // > 0: scores become softcap * tanh(score / softcap) before the softmax
  const float* sinks;  // [heads] each query head's sink logit, or null: none

  // The first token of a context of `len` tokens that its last token sees.
  int64_t first_seen(int64_t len) const {
    return window > 0 ? std::max<int64_t>(0, len - window) : 0;
  }

  // The memory of the keys, then the values, of tokens [from, len) of sequence `seq`
  // under kv head `head`.
  void task_spans(int64_t seq, int64_t head, int64_t from, int64_t len,
                  std::vector<Span>& out) const {
    for (const CacheRows<T>* cache : {&k, &v}) {
      for (int64_t i = from / block_size; i * block_size < len; ++i) {
        const int64_t t = std::max(i * block_size, from);
        const int64_t first = (head * cache_blocks + block_tables[seq * width + i]) * block_size;
        cache->spans(first + t - i * block_size, std::min((i + 1) * block_size, len) - t,
                     head_dim, out);
      }
    }
  }

  // The rows in a cache of tokens [0, len) of sequence `seq` under kv head `head` (the same
  // for K and V), walking the block table once rather than dividing per token.
  void row_ids(int64_t seq, int64_t head, int64_t len, int64_t* ids) const {
    for (int64_t t = 0, i = 0; t < len; ++i) {
      const int64_t first = (head * cache_blocks + block_tables[seq * width + i]) * block_size;
      for (int64_t slot = 0; slot < block_size && t < len; ++slot, ++t) ids[t] = first + slot;
    }
  }
};

// Checked before any row is read: a bad table entry must not read outside the cache.
template <typename T>
void check_sequence(const Problem<T>& p, int64_t seq, int64_t len) {
  TORCH_CHECK(len >= 1 && len <= p.width * p.block_size, "sequence ", seq,
              " has context length ", len, " but its table covers ", p.width * p.block_size);
  for (int64_t i = 0; i < (len + p.block_size - 1) / p.block_size; ++i) {
    const int64_t block = p.block_tables[seq * p.width + i];
    TORCH_CHECK(block >= 0 && block < p.cache_blocks, "block id ", block, " of sequence ", seq,
                " is outside the cache's ", p.cache_blocks, " blocks");
  }
}

// Key rows handled per step: their dot products with a query reduce together (one
// horizontal reduction instead of four), and staged rows are widened to float32 once
// for every query of the group.
constexpr int64_t kRows = 4;

// The n rows `ids` -> float32 [kRows, d], missing rows zero.
template <typename T>
void stage(const CacheRows<T>& cache, const int64_t* ids, int64_t n, int64_t d, float* rows) {
  for (int64_t r = 0; r < kRows; ++r) {
    float* dst = rows + r * d;
    if (r >= n) {
      std::fill(dst, dst + d, 0.f);
      continue;
    }
    if (cache.quantized()) {
      cache.dequantize(ids[r], d, dst);
      continue;
    }
    const T* src = cache.values + ids[r] * d;
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + kLanes <= d; i += kLanes) _mm512_storeu_ps(dst + i, load16(src + i));
#endif
    for (; i < d; ++i) dst[i] = to_float(src[i]);
  }
}

#if defined(__AVX512F__)
// The lane sums of kRows = 4 accumulators -> out[0..3], in one reduction instead of
// four: interleave and add within 128-bit lanes, then add the four 128-bit lanes.
inline void dot_rows_sums(const __m512* acc, float* out) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(acc[0], acc[1]),
                                  _mm512_unpackhi_ps(acc[0], acc[1]));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(acc[2], acc[3]),
                                  _mm512_unpackhi_ps(acc[2], acc[3]));
  const __m512d abd = _mm512_castps_pd(ab), cdd = _mm512_castps_pd(cd);
  const __m512 abcd = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(abd, cdd)),
                                    _mm512_castpd_ps(_mm512_unpackhi_pd(abd, cdd)));
  const __m256 upper = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(abcd), 1));
  const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(abcd), upper);
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1)));
}
#endif

// dot(q, row r) for the kRows staged rows -> out[r].
void dot_rows(const float* q, const float* rows, int64_t d, float* out) {
#if defined(__AVX512F__)
  if (d % kLanes == 0) {  // every common head_dim; other sizes take the scalar loop
    __m512 acc[kRows];
    for (int64_t r = 0; r < kRows; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t i = 0; i < d; i += kLanes) {
      const __m512 qi = _mm512_loadu_ps(q + i);
      for (int64_t r = 0; r < kRows; ++r) {
        acc[r] = _mm512_fmadd_ps(qi, _mm512_loadu_ps(rows + r * d + i), acc[r]);
      }
    }
    dot_rows_sums(acc, out);
    return;
  }
#endif
  for (int64_t r = 0; r < kRows; ++r) {
    float acc = 0.f;
    for (int64_t i = 0; i < d; ++i) acc += q[i] * rows[r * d + i];
    out[r] = acc;
  }
}


// acc += sum over r of weights[r] * row r, for the kRows staged rows.
void axpy_rows(const float* weights, const float* rows, int64_t d, float* acc) {
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 w[kRows];
  for (int64_t r = 0; r < kRows; ++r) w[r] = _mm512_set1_ps(weights[r]);
  for (; i + kLanes <= d; i += kLanes) {
    __m512 a = _mm512_loadu_ps(acc + i);
    for (int64_t r = 0; r < kRows; ++r) {
      a = _mm512_fmadd_ps(w[r], _mm512_loadu_ps(rows + r * d + i), a);
    }
    _mm512_storeu_ps(acc + i, a);
  }
#endif
  for (; i < d; ++i) {
    for (int64_t r = 0; r < kRows; ++r) acc[i] += weights[r] * rows[r * d + i];
  }
}

// exp(x - max) of one row in place; returns their sum, and exp(sink - max) added last,
// the maximum taken over the sink too (a sink of -inf adds exact zeros: none).
float exp_row(float* s, int64_t n, float sink) {
  float max = s[0];
  int64_t m = 0;
#if defined(__AVX512F__)
  if (n >= kLanes) {
    __m512 vmax = _mm512_loadu_ps(s);
    for (m = kLanes; m + kLanes <= n; m += kLanes) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(s + m));
    max = _mm512_reduce_max_ps(vmax);
  }
#endif
  for (; m < n; ++m) max = std::max(max, s[m]);
  max = std::max(max, sink);
  float sum = 0.f;
  int64_t t = 0;
#if defined(__AVX512F__)
  __m512 vsum = _mm512_setzero_ps();
  for (; t + kLanes <= n; t += kLanes) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + t), _mm512_set1_ps(max)));
    _mm512_storeu_ps(s + t, e);
    vsum = _mm512_add_ps(vsum, e);
  }
  sum = _mm512_reduce_add_ps(vsum);
#endif
  for (; t < n; ++t) {
    s[t] = std::exp(s[t] - max);
    sum += s[t];
  }
  return sum + std::exp(sink - max);
}

// Query head `head` of sequence `seq`: a row of d values.
template <typename T>
const T* query(const Problem<T>& p, int64_t seq, int64_t head) {
  return p.q + seq * p.q_batch_stride + head * p.q_head_stride;
}

// Buffers of one task, in one allocation reused by a thread's tasks.
struct Buffers {
  float* q;  // [group, d]: the queries in float32
  float* acc;  // [group, d]: the weighted sums of values
  float* rows;  // [kRows, d]: staged K or V rows
  float* four;  // [kRows]: one query's scores, or weights, of those rows
  float* scores;  // [group, len]: row g's scores, then probabilities
};

Buffers carve(std::vector<float>& scratch, int64_t group, int64_t d, int64_t len) {
  scratch.resize(group * (2 * d + len) + kRows * (d + 1));
  Buffers b;
  b.q = scratch.data();
  b.acc = b.q + group * d;
  b.rows = b.acc + group * d;
  b.four = b.rows + kRows * d;
  b.scores = b.four + kRows;
  return b;
}

// Scores of the group's queries, scaled -> b.scores, for the tokens of rows `ids`.
template <typename T>
void key_scores(const Problem<T>& p, int64_t seq, int64_t first_head, const int64_t* ids,
                int64_t len, const Buffers& b, Ahead& ahead) {
  const int64_t d = p.head_dim, lines = kRows * lines_of_row(p.k.row_bytes(d));
  for (int64_t g = 0; g < p.group; ++g) {
    const T* src = query(p, seq, first_head + g);
    for (int64_t i = 0; i < d; ++i) b.q[g * d + i] = to_float(src[i]);
  }
  for (int64_t t = 0; t < len; t += kRows) {
    const int64_t n = std::min(kRows, len - t);
    ahead.ask(lines);
    stage(p.k, ids + t, n, d, b.rows);
    for (int64_t g = 0; g < p.group; ++g) {
      dot_rows(b.q + g * d, b.rows, d, b.four);
      std::copy(b.four, b.four + n, b.scores + g * len + t);
    }
  }
}

// Scores of query heads first_head.. -> probabilities, row by row; scaled scores and
// probabilities rounded to T.
template <typename T>
void softmax_rows(const Problem<T>& p, int64_t first_head, int64_t len, const Buffers& b) {
  for (int64_t g = 0; g < p.group; ++g) {
    float* row = b.scores + g * len;
    scale_and_round<T>(row, len, p.scale);  // as the PyTorch path scales after the dot
    if (p.softcap > 0.f) softcap_row<T>(row, len, p.softcap);
    scale_and_round<T>(row, len, 1.f / exp_row(row, len, sink_of(p.sinks, first_head + g)));
  }
}

// b.acc[g] = sum over tokens of probability g * value row.
template <typename T>
void weighted_values(const Problem<T>& p, const int64_t* ids, int64_t len, const Buffers& b,
                     Ahead& ahead) {
  const int64_t d = p.head_dim, lines = kRows * lines_of_row(p.v.row_bytes(d));
  std::fill(b.acc, b.acc + p.group * d, 0.f);
  for (int64_t t = 0; t < len; t += kRows) {
    const int64_t n = std::min(kRows, len - t);
    ahead.ask(lines);
    stage(p.v, ids + t, n, d, b.rows);
    for (int64_t g = 0; g < p.group; ++g) {
      std::fill(b.four, b.four + kRows, 0.f);  // the zero rows past the end get no weight
      std::copy(b.scores + g * len + t, b.scores + g * len + t + n, b.four);
      axpy_rows(b.four, b.rows, d, b.acc + g * d);
    }
  }
}

// One sequence and kv head: the `group` query heads that share it, start to finish.
// `scratch` and `ids` (the tokens' rows in the caches) are reused across tasks; `ahead`
// holds the next task's cache lines, asked for while this one computes.
template <typename T>
void attend(const Problem<T>& p, int64_t seq, int64_t head, std::vector<float>& scratch,
            std::vector<int64_t>& ids, Ahead& ahead) {
  const int64_t context = p.context_lens[seq], from = p.first_seen(context);
  const int64_t len = context - from;  // the keys seen: tokens [from, context)
  const Buffers b = carve(scratch, p.group, p.head_dim, len);
  ids.resize(context);
  p.row_ids(seq, head, context, ids.data());
  const int64_t* seen = ids.data() + from;

  const int64_t first_head = head * p.group;
  key_scores(p, seq, first_head, seen, len, b, ahead);
  softmax_rows(p, first_head, len, b);
  weighted_values(p, seen, len, b, ahead);
  T* out = p.out + (seq * p.heads + first_head) * p.head_dim;
  for (int64_t i = 0; i < p.group * p.head_dim; ++i) out[i] = static_cast<T>(b.acc[i]);
}

#if defined(__AVX512BF16__)
// As attend, for bfloat16 on CPUs with AVX512-BF16: the prefill kernel's arithmetic
// (bf16_attention.h), so that a token decoded here and the same token recomputed in a
// prefill chunk after a preemption get the same bits. With one query token per task there
// is nothing to reuse a layout for: keys are transposed block by block as they are used.
// `ahead` holds the next task's cache lines, asked for while this one computes.
void attend_bf16(const Problem<bf16>& p, int64_t seq, int64_t head, Workspace& w,
                 Ahead& ahead) {
  const int64_t context = p.context_lens[seq], from = p.first_seen(context);
  const int64_t len = context - from;  // the keys seen: tokens [from, context)
  const PagedKV kv{p.k, p.v, p.block_tables + seq * p.width, p.cache_blocks, p.block_size,
                   p.head_dim, from};
  w.start(kv, head, len, std::min(p.group, kUnit));
  w.keys.resize(2 * p.head_dim / 2 * kKeys);
  const Direct keys_and_values{w, p.head_dim, len, w.keys.data(), ahead};
  for (int64_t first = 0; first < p.group; first += kUnit) {
    const int64_t n = std::min(kUnit, p.group - first);
    Unit u;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t h = head * p.group + first + i;
      u.queries[i] = reinterpret_cast<const uint32_t*>(query(p, seq, h));
      u.out[i] = p.out + (seq * p.heads + h) * p.head_dim;
      u.lens[i] = len;
      u.sinks[i] = sink_of(p.sinks, h);
    }
    u.max_len = len;
    attend_unit(u, n, p.head_dim, p.scale, w, keys_and_values, p.softcap);
  }
}

// Whether attend_bf16 serves these shapes: head_dim a multiple of 32 up to 256.
bool bf16_kernel_serves(int64_t head_dim) {
  return head_dim % kChunk == 0 && head_dim <= 8 * kChunk;
}
#endif

// Tasks [begin, end) in order: attend(seq, head, ahead) each, with `ahead` holding the
// next task's cache lines. Every sequence is checked before its table is read.
template <typename T, typename Attend>
void attend_in_order(const Problem<T>& p, int64_t begin, int64_t end, const Attend& attend) {
  Ahead ahead;
  check_sequence(p, begin / p.kv_heads, p.context_lens[begin / p.kv_heads]);
  for (int64_t task = begin; task < end; ++task) {
    ahead.reset();
    if (task + 1 < end) {
      const int64_t next = (task + 1) / p.kv_heads;
      check_sequence(p, next, p.context_lens[next]);
      const int64_t len = p.context_lens[next];
      p.task_spans(next, (task + 1) % p.kv_heads, p.first_seen(len), len, ahead.spans);
    }
    attend(task / p.kv_heads, task % p.kv_heads, ahead);
  }
}

template <typename T>
void run(const Problem<T>& p, int64_t batch) {
  // One task per (sequence, kv head): equal work when contexts are similar, and enough
  // tasks (batch * kv_heads) to keep every thread busy.
  at::parallel_for(0, batch * p.kv_heads, 1, [&](int64_t begin, int64_t end) {
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<T, bf16>) {
      if (bf16_kernel_serves(p.head_dim)) {
        Workspace w;
        attend_in_order(p, begin, end, [&](int64_t seq, int64_t head, Ahead& ahead) {
          attend_bf16(p, seq, head, w, ahead);
        });
        return;
      }
    }
#endif
    std::vector<float> scratch;
    std::vector<int64_t> ids;
    attend_in_order(p, begin, end, [&](int64_t seq, int64_t head, Ahead& ahead) {
      attend(p, seq, head, scratch, ids, ahead);
    });
  });
}

template <typename T>
Problem<T> make_problem(const at::Tensor& q, const CacheRows<T>& k, const CacheRows<T>& v,
                        const at::Tensor& k_cache, const at::Tensor& tables,
                        const at::Tensor& lens, at::Tensor& out, double scale, int64_t window,
                        double softcap, const float* sinks) {
  const int64_t heads = q.size(1), kv_heads = k_cache.size(0);
  return Problem<T>{q.const_data_ptr<T>(), q.stride(0), q.stride(1), k, v,
                    tables.const_data_ptr<int64_t>(), lens.const_data_ptr<int64_t>(),
                    out.mutable_data_ptr<T>(), heads, kv_heads, heads / kv_heads, q.size(2),
                    k_cache.size(1), k_cache.size(2), tables.size(1), static_cast<float>(scale),
                    window, static_cast<float>(softcap), sinks};
}

// q [batch, heads, head_dim] (last dim contiguous), caches [kv_heads, blocks, block_size,
// head_dim] of q's dtype, or int8 / float8_e4m3fn with their scales [kv_heads, blocks,
// block_size], block_tables [batch, width] and context_lens [batch] int64 -> [batch, heads, d].
// A `window` > 0 is a sliding window: each row sees its last `window` tokens only; a
// `softcap` > 0 soft-caps the scores (Gemma 2); `sinks` [heads] float32 are attention
// sinks (gpt-oss).
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                                  const at::Tensor& context_lens, double scale,
                                  const std::optional<at::Tensor>& k_scales,
                                  const std::optional<at::Tensor>& v_scales, int64_t window,
                                  double softcap, const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(),
              "CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [batch, heads, d], rows contiguous");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(), "caches must match");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "caches must share a dtype");
  const Codes kind = checked_codes(k_cache, k_scales, "k_cache", "k_scales");
  checked_codes(v_cache, v_scales, "v_cache", "v_scales");
  TORCH_CHECK(kind != Codes::kNone || q.scalar_type() == k_cache.scalar_type(),
              "q and caches must share a dtype (or the caches be int8 or float8_e4m3fn)");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "block tables and context lengths must be int64");
  const int64_t batch = q.size(0), heads = q.size(1), head_dim = q.size(2);
  const int64_t kv_heads = k_cache.size(0);
  TORCH_CHECK(k_cache.size(3) == head_dim, "head_dim of q and caches differ");
  TORCH_CHECK(heads % kv_heads == 0, "heads must be a multiple of kv_heads");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == batch &&
                  context_lens.numel() == batch,
              "one block table and context length per sequence");
  const at::Tensor tables = block_tables.contiguous();
  const at::Tensor lens = context_lens.contiguous();
  const float* sink_logits = checked_sinks(sinks, heads);
  at::Tensor out = at::empty({batch, heads, head_dim}, q.options());
  if (batch == 0) return out;

  const auto attend_all = [&](auto zero) {
    using T = decltype(zero);
    run(make_problem<T>(q, cache_rows<T>(k_cache, k_scales, kind),
                        cache_rows<T>(v_cache, v_scales, kind), k_cache, tables, lens, out,
                        scale, window, softcap, sink_logits),
        batch);
  };
  AT_DISPATCH_SWITCH(q.scalar_type(), "paged_decode_attention",
      AT_DISPATCH_CASE(at::kFloat, [&] { attend_all(scalar_t{}); })
      AT_DISPATCH_CASE(at::kBFloat16, [&] { attend_all(scalar_t{}); }));
  return out;
}

}  // namespace

TORCH_LIBRARY(cadence, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor context_lens, float scale, Tensor? k_scales=None, Tensor? v_scales=None, "
        "int window=0, float softcap=0.0, Tensor? sinks=None) -> Tensor");
  m.impl("paged_decode_attention", c10::DispatchKey::CPU, &paged_decode_attention);
}
