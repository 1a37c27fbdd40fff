// Causal attention of one prefill chunk straight from the paged KV cache, on the CPU, for
// bfloat16 queries on CPUs with AVX512-BF16, over bfloat16 caches or 8-bit ones (kv_quant.h:
// each task dequantizes the rows it sees to bfloat16 first).
//
// The PyTorch path (gpu_worker/attention.py) runs a handful of kernels per block of 128
// queries (matmul, mask, softmax, cast, matmul, copies): ~60 ms of a ~200 ms step for
// SmolLM2-135M with a 448-token chunk on two cores; here ~18 ms. One task takes 32 query
// tokens of one kv head: it lays the keys it can see out transposed, 16 keys per vector
// (so a score vector needs no horizontal sum), and the values interleaved in pairs, once,
// and then runs its queries through them with vdpbf16ps in units of up to 6 (neighbouring
// tokens times the heads of the group), so that each vector loaded serves all of them.
//
// The arithmetic of a query row (bf16_attention.h) is the decode kernel's too, so a token
// recomputed in a chunk after a preemption gets the bits it got when it was decoded;
// attention sinks (gpt-oss, attention_sinks.h) join its softmax alike.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "bf16_attention.h"

#if defined(__AVX512BF16__)

namespace {

using namespace cadence_cpu;

constexpr int64_t kQueryBlock = 32;  // query tokens per task

struct Chunk {
  const bf16* q;  // [n, heads, d], rows strided
  int64_t q_token_stride, q_head_stride;
  PagedKV kv;
  bf16* out;  // [n, heads, d], contiguous
  int64_t n, start, heads, kv_heads, group, d;
  float scale;
  const float* sinks;  // [heads] each query head's sink logit, or null: none
};

// Query tokens [first, end) under kv head `head`, in units of neighbouring tokens times
// the heads of the group.
void run_task(const Chunk& c, int64_t head, int64_t first, int64_t end, Workspace& w) {
  const int64_t visible = c.start + end;  // what the block's last query sees
  w.start(c.kv, head, visible, kUnit);
  LaidOut::lay_out(w, visible, c.d);
  const LaidOut keys_and_values{w, c.d};
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
          u.sinks[n] = sink_of(c.sinks, h);
          u.lens[n++] = c.start + t + 1;
        }
      }
      u.max_len = u.lens[n - 1];
      attend_unit(u, n, c.d, c.scale, w, keys_and_values);
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
// d] (bfloat16, or int8 / float8_e4m3fn with their scales [kv_heads, blocks, block_size]);
// block_table [W] int64 covers them -> [n, heads, d]; `sinks` [heads] float32 are
// attention sinks (gpt-oss).
at::Tensor paged_prefill_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                   const at::Tensor& v_cache, const at::Tensor& block_table,
                                   int64_t start, double scale,
                                   const std::optional<at::Tensor>& k_scales,
                                   const std::optional<at::Tensor>& v_scales,
                                   const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(),
              "CPU tensors only");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "caches must share a dtype");
  const Codes kind = checked_codes(k_cache, k_scales, "k_cache", "k_scales");
  checked_codes(v_cache, v_scales, "v_cache", "v_scales");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 &&
                  (kind != Codes::kNone || k_cache.scalar_type() == at::kBFloat16),
              "bfloat16 q and caches only (or int8 or float8_e4m3fn caches)");
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
  const float* sink_logits = checked_sinks(sinks, heads);
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
  const PagedKV kv{cache_rows<bf16>(k_cache, k_scales, kind),
                   cache_rows<bf16>(v_cache, v_scales, kind), ids, cache_blocks, block_size, d};
  run(Chunk{q.const_data_ptr<bf16>(), q.stride(0), q.stride(1), kv, out.mutable_data_ptr<bf16>(),
            n, start, heads, kv_heads, heads / kv_heads, d, static_cast<float>(scale),
            sink_logits});
  return out;
}

}  // namespace

// Registered only where the CPU can run it; gpu_worker.attention checks for the op.
TORCH_LIBRARY_FRAGMENT(cadence, m) {
  m.def("paged_prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, "
        "int start, float scale, Tensor? k_scales=None, Tensor? v_scales=None, Tensor? sinks=None) "
        "-> Tensor");
  m.impl("paged_prefill_attention", c10::DispatchKey::CPU, &paged_prefill_attention);
}

#endif
