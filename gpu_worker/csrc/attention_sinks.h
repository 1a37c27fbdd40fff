// Attention sinks (gpt-oss): a learned logit per query head that joins each softmax of
// the layer as one more column, in its maximum and its denominator, and weighs no value.
// Both attention kernels take them as an optional float32 tensor [heads]; a row without a
// sink takes -inf, whose exp adds an exact zero, so a layer without sinks keeps its bits.

#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <optional>

namespace cadence_cpu {

// The sink of query head `head` from a layer's sinks [heads], or -inf without them.
inline float sink_of(const float* sinks, int64_t head) {
  return sinks == nullptr ? -INFINITY : sinks[head];
}

// The sinks' float32 values, one per query head, or null where there are none.
inline const float* checked_sinks(const std::optional<at::Tensor>& sinks, int64_t heads) {
  if (!sinks.has_value()) return nullptr;
  const at::Tensor& s = *sinks;
  TORCH_CHECK(s.device().is_cpu() && s.scalar_type() == at::kFloat && s.dim() == 1 &&
                  s.numel() == heads && s.is_contiguous(),
              "sinks must be a contiguous float32 CPU tensor [heads]");
  return s.const_data_ptr<float>();
}

}  // namespace cadence_cpu
