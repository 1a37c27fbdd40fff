// The small operations between a layer's matmuls, fused, on the CPU.
//
// In PyTorch an RMSNorm is eight kernels, the rotary embedding four plus two index_copy_
// calls into the cache, SwiGLU three: at decode batch sizes each kernel moves a few KB,
// and dispatching ~40 of them per layer cost SmolLM2-135M ~13 ms of a ~57 ms decode
// step on two cores. Each operation here is one pass over its rows.
//
// Every rounding of the PyTorch path (gpu_worker/layer_ops.py) is kept: each elementwise
// result is rounded to the model's dtype where PyTorch stores a tensor of it, so greedy
// tokens do not depend on which path ran. Two results may differ in the last bit: the
// mean of squares sums in another order, and SiLU's exp is a polynomial here.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_vec.h"
#include "kv_quant.h"

namespace {

using namespace cadence_cpu;

// Work per thread worth the fork: rows are split so that each thread gets at least this
// many elements (a decode step's 64 rows of 576 stay on one or two threads).
constexpr int64_t kGrainElements = 16384;

int64_t grain_rows(int64_t row_elements) {
  return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, row_elements));
}

// ---- RMSNorm, optionally after the residual add ---------------------------------------

// One row: x += delta (when given, rounded to T), then out = weight * T(x * rsqrt(mean(x^2)
// + eps)), as layer_ops.rms_norm computes it.
template <typename T>
void norm_row(T* x, const T* delta, const T* weight, T* out, int64_t n, float eps) {
  int64_t i = 0;
  float sum = 0.f;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; i + kLanes <= n; i += kLanes) {
    __m512 v = load16(x + i);
    if (delta != nullptr) {
      v = round16<T>(_mm512_add_ps(v, load16(delta + i)));
      store16(x + i, v);
    }
    acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));
  }
  sum = _mm512_reduce_add_ps(acc);
#else
  // 16 partial sums, as the AVX-512 loop's lanes (and PyTorch's vectorized sum) keep them:
  // one running sum would round differently, a few ulps of the norm away
  constexpr int64_t kLanes = 16;
  float lanes[kLanes] = {};
  for (; i + kLanes <= n; i += kLanes) {
    for (int64_t j = 0; j < kLanes; ++j) {
      float v = static_cast<float>(x[i + j]);
      if (delta != nullptr) {
        v = rounded<T>(v + static_cast<float>(delta[i + j]));
        x[i + j] = static_cast<T>(v);
      }
      lanes[j] += v * v;
    }
  }
  for (int64_t width = kLanes / 2; width > 0; width /= 2) {
    for (int64_t j = 0; j < width; ++j) lanes[j] += lanes[j + width];
  }
  sum = lanes[0];
#endif
  for (; i < n; ++i) {
    float v = static_cast<float>(x[i]);
    if (delta != nullptr) {
      v = rounded<T>(v + static_cast<float>(delta[i]));
      x[i] = static_cast<T>(v);
    }
    sum += v * v;
  }
  const float inv = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
  i = 0;
#if defined(__AVX512F__)
  const __m512 vinv = _mm512_set1_ps(inv);
  for (; i + kLanes <= n; i += kLanes) {
    const __m512 normed = round16<T>(_mm512_mul_ps(load16(x + i), vinv));
    store16(out + i, _mm512_mul_ps(load16(weight + i), normed));
  }
#endif
  for (; i < n; ++i) {
    out[i] = static_cast<T>(static_cast<float>(weight[i]) *
                            rounded<T>(static_cast<float>(x[i]) * inv));
  }
}

// x is written only when delta is given.
template <typename T>
void norm_rows(T* x, const T* delta, const T* weight, T* out, int64_t rows, int64_t n,
               double eps) {
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      norm_row(x + r * n, delta != nullptr ? delta + r * n : nullptr, weight, out + r * n, n,
               static_cast<float>(eps));
    }
  });
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.dim() == 2 && t.is_contiguous(), name, " must be a contiguous [rows, n] tensor");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name,
              " must be float32 or bfloat16");
}

void check_weight(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(1),
              "weight must be a contiguous vector of the rows' width");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "weight and rows must share a dtype");
}

template <typename F>
void dispatch(const at::Tensor& t, const char* name, F&& body) {
  if (t.scalar_type() == at::kFloat) {
    body(float{});
  } else if (t.scalar_type() == at::kBFloat16) {
    body(c10::BFloat16{});
  } else {
    TORCH_CHECK(false, name, ": float32 or bfloat16 only");
  }
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  check_weight(x, weight);
  at::Tensor out = at::empty_like(x);
  dispatch(x, "rms_norm", [&](auto zero) {
    using T = decltype(zero);
    // Not written: there is no delta to add.
    T* rows = const_cast<T*>(x.const_data_ptr<T>());
    norm_rows<T>(rows, nullptr, weight.const_data_ptr<T>(), out.mutable_data_ptr<T>(),
                 x.size(0), x.size(1), eps);
  });
  return out;
}

at::Tensor add_rms_norm_(at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight,
                         double eps) {
  check_rows(x, "x");
  check_rows(delta, "delta");
  check_weight(x, weight);
  TORCH_CHECK(delta.sizes() == x.sizes() && delta.scalar_type() == x.scalar_type(),
              "delta must match x");
  at::Tensor out = at::empty_like(x);
  dispatch(x, "add_rms_norm_", [&](auto zero) {
    using T = decltype(zero);
    norm_rows<T>(x.mutable_data_ptr<T>(), delta.const_data_ptr<T>(), weight.const_data_ptr<T>(),
                 out.mutable_data_ptr<T>(), x.size(0), x.size(1), eps);
  });
  return out;
}

// ---- SwiGLU ---------------------------------------------------------------------------

// out = T(silu(gate)) * up, rounded to T after each step as F.silu(gate) * up is.
template <typename T>
void silu_mul_row(const T* gate, const T* up, T* out, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 one = _mm512_set1_ps(1.f);
  for (; i + kLanes <= n; i += kLanes) {
    const __m512 g = load16(gate + i);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
    const __m512 silu = round16<T>(_mm512_div_ps(g, _mm512_add_ps(one, e)));
    store16(out + i, _mm512_mul_ps(silu, load16(up + i)));
  }
#endif
  for (; i < n; ++i) {
    const float g = static_cast<float>(gate[i]);
    const float silu = rounded<T>(g / (1.f + std::exp(-g)));
    out[i] = static_cast<T>(silu * static_cast<float>(up[i]));
  }
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up must have an even width");
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, n}, gate_up.options());
  dispatch(gate_up, "silu_and_mul", [&](auto zero) {
    using T = decltype(zero);
    const T* in = gate_up.const_data_ptr<T>();
    T* op = out.mutable_data_ptr<T>();
    at::parallel_for(0, rows, grain_rows(2 * n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        silu_mul_row(in + r * 2 * n, in + r * 2 * n + n, op + r * n, n);
      }
    });
  });
  return out;
}

// ---- Rotary embedding and the KV-cache write ------------------------------------------

// One head in place: x = T(x * cos) + T(roll(x) * signed_sin), each product and the sum
// rounded to T, as layer_ops.apply_rope computes it. `rolled` holds d floats.
template <typename T>
void rotate_head(T* x, const T* cos, const T* sin, int64_t d, float* rolled) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; ++i) {
    rolled[i] = static_cast<float>(x[i + half]);
    rolled[i + half] = static_cast<float>(x[i]);
  }
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + kLanes <= d; i += kLanes) {
    const __m512 a = round16<T>(_mm512_mul_ps(load16(x + i), load16(cos + i)));
    const __m512 b = round16<T>(_mm512_mul_ps(_mm512_loadu_ps(rolled + i), load16(sin + i)));
    store16(x + i, _mm512_add_ps(a, b));
  }
#endif
  for (; i < d; ++i) {
    const float a = rounded<T>(static_cast<float>(x[i]) * static_cast<float>(cos[i]));
    const float b = rounded<T>(rolled[i] * static_cast<float>(sin[i]));
    x[i] = static_cast<T>(a + b);
  }
}

// Where the new k or v rows go: a cache of T, or 8-bit codes and their scales (kv_quant.h).
template <typename T>
struct CacheOut {
  T* values;
  uint8_t* codes;
  float* scales;
  Codes kind;

  void write(int64_t row, const T* x, int64_t d) const {
    if (kind == Codes::kNone) {
      std::copy(x, x + d, values + row * d);
    } else {
      scales[row] = quantize_row(kind, x, d, codes + row * d);
    }
  }
};

template <typename T>
CacheOut<T> cache_out(at::Tensor& cache, const std::optional<at::Tensor>& scales, Codes kind) {
  if (kind == Codes::kNone) return {cache.mutable_data_ptr<T>(), nullptr, nullptr, kind};
  return {nullptr, static_cast<uint8_t*>(cache.mutable_data_ptr()),
          scales->mutable_data_ptr<float>(), kind};
}

struct RopeShape {
  int64_t heads, kv_heads, head_dim, row_stride, slots_per_head, max_positions;
};

template <typename T>
void rope_and_cache_rows(T* qkv, const int64_t* positions, const T* cos, const T* sin,
                         const CacheOut<T>& k_cache, const CacheOut<T>& v_cache,
                         const int64_t* slots, int64_t rows, const RopeShape& s) {
  const int64_t d = s.head_dim;
  // Checked before anything is written: a bad index must not write outside the cache.
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(positions[r] >= 0 && positions[r] < s.max_positions, "position ", positions[r],
                " is outside the ", s.max_positions, " rows of the rope tables");
    TORCH_CHECK(slots[r] >= 0 && slots[r] < s.slots_per_head, "slot ", slots[r],
                " is outside the cache");
  }
  at::parallel_for(0, rows, grain_rows(s.row_stride), [&](int64_t begin, int64_t end) {
    std::vector<float> rolled(d);
    for (int64_t r = begin; r < end; ++r) {
      const int64_t pos = positions[r];
      T* row = qkv + r * s.row_stride;
      for (int64_t h = 0; h < s.heads + s.kv_heads; ++h) {
        rotate_head(row + h * d, cos + pos * d, sin + pos * d, d, rolled.data());
      }
      const T* k = row + s.heads * d;
      const T* v = k + s.kv_heads * d;
      for (int64_t h = 0; h < s.kv_heads; ++h) {
        const int64_t cache_row = h * s.slots_per_head + slots[r];
        k_cache.write(cache_row, k + h * d, d);
        v_cache.write(cache_row, v + h * d, d);
      }
    }
  });
}

// qkv [T, (heads + 2 kv_heads) * d]: q and k rotated in place at their positions, then the
// new k and v rows written to the caches [kv_heads, blocks, block_size, d] at flat `slots`:
// caches of qkv's dtype, or int8 / float8_e4m3fn ones that get each row quantized, its scale
// going to k_scales / v_scales [kv_heads, blocks, block_size].
void rope_and_cache_(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos,
                     const at::Tensor& signed_sin, at::Tensor& k_cache, at::Tensor& v_cache,
                     const at::Tensor& slots, int64_t heads, int64_t kv_heads,
                     const std::optional<at::Tensor>& k_scales,
                     const std::optional<at::Tensor>& v_scales) {
  check_rows(qkv, "qkv");
  const int64_t rows = qkv.size(0);
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(), "caches must match");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  const int64_t d = k_cache.size(3);
  TORCH_CHECK(heads > 0 && kv_heads == k_cache.size(0) && d % 2 == 0 &&
                  qkv.size(1) == (heads + 2 * kv_heads) * d,
              "qkv must hold heads + 2 kv_heads rows of the caches' head_dim");
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == signed_sin.sizes() && cos.size(1) == d &&
                  cos.is_contiguous() && signed_sin.is_contiguous(),
              "rope tables must be contiguous [positions, head_dim]");
  for (const at::Tensor* t : {&cos, &signed_sin}) {
    TORCH_CHECK(t->scalar_type() == qkv.scalar_type() && t->device().is_cpu(),
                "rope tables must be CPU tensors of qkv's dtype");
  }
  TORCH_CHECK(k_cache.device().is_cpu() && v_cache.device().is_cpu() &&
                  k_cache.scalar_type() == v_cache.scalar_type(),
              "caches must be CPU tensors of one dtype");
  const Codes kind = checked_codes(k_cache, k_scales, "k_cache", "k_scales");
  checked_codes(v_cache, v_scales, "v_cache", "v_scales");
  TORCH_CHECK(kind != Codes::kNone || k_cache.scalar_type() == qkv.scalar_type(),
              "caches must be of qkv's dtype, or int8 or float8_e4m3fn");
  TORCH_CHECK(positions.scalar_type() == at::kLong && slots.scalar_type() == at::kLong &&
                  positions.numel() == rows && slots.numel() == rows,
              "positions and slots must be int64, one per row");
  const at::Tensor pos = positions.contiguous(), flat_slots = slots.contiguous();
  const RopeShape shape{heads, kv_heads, d, qkv.size(1), k_cache.size(1) * k_cache.size(2),
                        cos.size(0)};
  dispatch(qkv, "rope_and_cache_", [&](auto zero) {
    using T = decltype(zero);
    rope_and_cache_rows<T>(qkv.mutable_data_ptr<T>(), pos.const_data_ptr<int64_t>(),
                           cos.const_data_ptr<T>(), signed_sin.const_data_ptr<T>(),
                           cache_out<T>(k_cache, k_scales, kind),
                           cache_out<T>(v_cache, v_scales, kind),
                           flat_slots.const_data_ptr<int64_t>(), rows, shape);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cadence, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm_(Tensor(a!) x, Tensor delta, Tensor weight, float eps) -> Tensor");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def("rope_and_cache_(Tensor(a!) qkv, Tensor positions, Tensor cos, Tensor signed_sin, "
        "Tensor(b!) k_cache, Tensor(c!) v_cache, Tensor slots, int heads, int kv_heads, "
        "Tensor(d!)? k_scales=None, Tensor(e!)? v_scales=None) -> ()");
  m.impl("rms_norm", c10::DispatchKey::CPU, &rms_norm);
  m.impl("add_rms_norm_", c10::DispatchKey::CPU, &add_rms_norm_);
  m.impl("silu_and_mul", c10::DispatchKey::CPU, &silu_and_mul);
  m.impl("rope_and_cache_", c10::DispatchKey::CPU, &rope_and_cache_);
}
