// Rotary position embeddings as Hugging Face transformers computes them (modeling_rope_utils.py
// and LlamaRotaryEmbedding), for the rope types ModelConfig accepts.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <utility>

#include "roundpipe/models/model_config.h"

namespace roundpipe::models::detail {

/// Inverse frequencies [head_dim / 2] in fp32 on `device`: HF's default, linear or llama3 rule,
/// written with the same fp32 operations in the same order.
at::Tensor rotary_inv_freq(const RopeParameters& rope, int64_t head_dim, c10::Device device);

/// (cos, sin), each [seq_len, head_dim] in `dtype` on `device`, for positions 0..seq_len-1:
/// computed in fp32 and cast, as LlamaRotaryEmbedding.forward does.
std::pair<at::Tensor, at::Tensor> rotary_cos_sin(const RopeParameters& rope, int64_t head_dim, int64_t seq_len,
                                                 c10::Device device, c10::ScalarType dtype);

/// q * cos + rotate_half(q) * sin for x [B, heads, T, head_dim] and cos/sin [T, head_dim].
at::Tensor apply_rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

}  // namespace roundpipe::models::detail
