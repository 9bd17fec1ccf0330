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

/// Inverse frequencies [head_dim / 2] in fp32 on `device`: HF's default, linear, llama3 or yarn
/// rule, written with the same fp32 operations in the same order.
at::Tensor rotary_inv_freq(const RopeParameters& rope, int64_t head_dim, c10::Device device);

/// The factor HF's rotary embedding multiplies cos and sin by (its `attention_scaling`): 1 except
/// for "yarn", where it is rope.attention_factor or, when unset, derived from factor, mscale and
/// mscale_all_dim as _compute_yarn_parameters does (gpt-oss: 0.1 ln 32 + 1 = 1.3466).
double rotary_attention_factor(const RopeParameters& rope);

/// (cos, sin), each [seq_len, head_dim] in `dtype` on `device`, for positions
/// start..start+seq_len-1 (each position's values do not depend on the others):
/// computed in fp32, multiplied by rotary_attention_factor(rope) in fp32 and cast, as
/// LlamaRotaryEmbedding.forward (and GptOssRotaryEmbedding, whose [seq_len, head_dim / 2] halves
/// these repeat) does.
std::pair<at::Tensor, at::Tensor> rotary_cos_sin(const RopeParameters& rope, int64_t head_dim, int64_t seq_len,
                                                 c10::Device device, c10::ScalarType dtype, int64_t start = 0);

/// As rotary_cos_sin, at explicit positions [B, T] (integer; a packed batch's restarting
/// positions): (cos, sin), each [B, 1, T, head_dim], broadcasting over the heads. A row whose
/// positions are 0..T-1 gets exactly rotary_cos_sin's values (the same fp32 products).
std::pair<at::Tensor, at::Tensor> rotary_cos_sin_at(const RopeParameters& rope, int64_t head_dim,
                                                    const at::Tensor& positions, c10::ScalarType dtype);

/// q * cos + rotate_half(q) * sin for x [B, heads, T, head_dim] and cos/sin [T, head_dim].
at::Tensor apply_rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

}  // namespace roundpipe::models::detail
