#include "roundpipe/models/detail/rotary.h"

#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/pow.h>
#include <ATen/ops/reciprocal.h>
#include <ATen/ops/rsub.h>
#include <ATen/ops/where.h>
#include <c10/util/Exception.h>

#include <cmath>

namespace roundpipe::models::detail {

// Note [Matching HF's rotary arithmetic]: each expression below mirrors the Python one in
// transformers 5 (modeling_rope_utils._compute_*_parameters, LlamaRotaryEmbedding.forward).
// Python's `scalar / tensor` is `tensor.reciprocal() * scalar` and `scalar - tensor` is
// rsub, so those spellings are kept to get the same fp32 roundings, and cos/sin are computed in
// fp32 before the cast to the activation dtype. The inverse frequencies are recomputed on the
// activation's device on every call (a handful of tiny kernels) instead of cached: a per-device
// cache shared across worker threads and CUDA streams would need cross-stream synchronisation.

at::Tensor rotary_inv_freq(const RopeParameters& rope, int64_t head_dim, c10::Device device) {
  const auto fp32 = at::TensorOptions().dtype(at::kFloat).device(device);
  const int64_t dim = head_dim;
  // 1.0 / (base ** (arange(0, dim, 2).float() / dim))
  at::Tensor inv_freq = at::pow(rope.rope_theta, at::arange(0, dim, 2, fp32) / dim).reciprocal();
  if (rope.rope_type == "default") return inv_freq;
  if (rope.rope_type == "linear") return inv_freq / rope.factor;
  TORCH_CHECK(rope.rope_type == "llama3", "rope type \"", rope.rope_type,
              "\" is not supported (supported: default, linear, llama3)");
  const double factor = rope.factor;
  const double low = rope.low_freq_factor;
  const double high = rope.high_freq_factor;
  const double old_context_len = static_cast<double>(rope.original_max_position_embeddings);
  const double low_freq_wavelen = old_context_len / low;
  const double high_freq_wavelen = old_context_len / high;
  const at::Tensor wavelen = inv_freq.reciprocal() * (2 * M_PI);
  at::Tensor inv_freq_llama = at::where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq);
  const at::Tensor smooth_factor = (wavelen.reciprocal() * old_context_len - low) / (high - low);
  const at::Tensor smoothed =
      at::rsub(smooth_factor, 1) * inv_freq_llama / factor + smooth_factor * inv_freq_llama;
  const at::Tensor is_medium = (wavelen < high_freq_wavelen).logical_not() * (wavelen > low_freq_wavelen).logical_not();
  return at::where(is_medium, smoothed, inv_freq_llama);
}

std::pair<at::Tensor, at::Tensor> rotary_cos_sin(const RopeParameters& rope, int64_t head_dim, int64_t seq_len,
                                                 c10::Device device, c10::ScalarType dtype) {
  const auto fp32 = at::TensorOptions().dtype(at::kFloat).device(device);
  const at::Tensor inv_freq = rotary_inv_freq(rope, head_dim, device);
  const at::Tensor freqs = at::arange(seq_len, fp32).unsqueeze(-1) * inv_freq;  // [T, head_dim / 2]
  const at::Tensor emb = at::cat({freqs, freqs}, -1);
  return {emb.cos().to(dtype), emb.sin().to(dtype)};
}

at::Tensor apply_rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t half = x.size(-1) / 2;
  const at::Tensor x1 = x.narrow(-1, 0, half);
  const at::Tensor x2 = x.narrow(-1, half, x.size(-1) - half);
  return x * cos + at::cat({-x2, x1}, -1) * sin;
}

}  // namespace roundpipe::models::detail
