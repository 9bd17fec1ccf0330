#include "roundpipe/models/detail/rotary.h"

#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/pow.h>
#include <ATen/ops/reciprocal.h>
#include <ATen/ops/rsub.h>
#include <ATen/ops/where.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>

namespace roundpipe::models::detail {

// Note [Matching HF's rotary arithmetic]: each expression below mirrors the Python one in
// transformers 5 (modeling_rope_utils._compute_*_parameters, LlamaRotaryEmbedding.forward).
// Python's `scalar / tensor` is `tensor.reciprocal() * scalar` and `scalar - tensor` is
// rsub, so those spellings are kept to get the same fp32 roundings, and cos/sin are computed in
// fp32 before the cast to the activation dtype. The inverse frequencies are recomputed on the
// activation's device on every call (a handful of tiny kernels) instead of cached: a per-device
// cache shared across worker threads and CUDA streams would need cross-stream synchronisation.

namespace {

// HF's get_mscale: 0.1 * mscale * ln(scale) + 1 above scale 1, in double as Python computes it.
double yarn_mscale(double scale, double mscale) {
  if (scale <= 1) return 1.0;
  return 0.1 * mscale * std::log(scale) + 1.0;
}

// HF's find_correction_dim: the dimension whose wavelength makes `num_rotations` turns over
// `max_position_embeddings` positions.
double yarn_correction_dim(double num_rotations, int64_t dim, double base, double max_position_embeddings) {
  return (static_cast<double>(dim) * std::log(max_position_embeddings / (num_rotations * 2 * M_PI))) /
         (2 * std::log(base));
}

// Note [YaRN inverse frequencies]: _compute_yarn_parameters. The correction range (low, high) is
// double arithmetic, floored/ceiled only with `truncate` (gpt-oss turns it off), then clamped to
// [0, dim - 1]. The ramp over the dim / 2 frequencies is fp32 `(arange - low) / (high - low)`
// clamped to [0, 1]; each frequency blends the interpolated (1 / (factor * pos_freqs)) and the
// extrapolated (1 / pos_freqs) one with weight 1 - ramp on the extrapolated. Python's `1.0 / t` is
// `t.reciprocal() * 1.0`, an exact no-op multiplication left out here.
at::Tensor yarn_inv_freq(const RopeParameters& rope, int64_t head_dim, c10::Device device) {
  const auto fp32 = at::TensorOptions().dtype(at::kFloat).device(device);
  const int64_t dim = head_dim;
  const double base = rope.rope_theta;
  const double original = static_cast<double>(rope.original_max_position_embeddings);
  const at::Tensor pos_freqs = at::pow(base, at::arange(0, dim, 2, fp32) / dim);
  const at::Tensor inv_freq_extrapolation = pos_freqs.reciprocal();
  const at::Tensor inv_freq_interpolation = (pos_freqs * rope.factor).reciprocal();

  double low = yarn_correction_dim(rope.beta_fast, dim, base, original);
  double high = yarn_correction_dim(rope.beta_slow, dim, base, original);
  if (rope.truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, static_cast<double>(dim - 1));
  if (low == high) high += 0.001;  // HF: prevents a division by zero

  const at::Tensor ramp = ((at::arange(dim / 2, fp32) - low) / (high - low)).clamp(0, 1);
  const at::Tensor extrapolation_factor = at::rsub(ramp, 1);
  return inv_freq_interpolation * at::rsub(extrapolation_factor, 1) + inv_freq_extrapolation * extrapolation_factor;
}

}  // namespace

double rotary_attention_factor(const RopeParameters& rope) {
  if (rope.rope_type != "yarn") return 1.0;
  if (rope.attention_factor) return *rope.attention_factor;
  // HF: `if mscale and mscale_all_dim`, so an unset or zero value falls back to the factor alone.
  if (rope.mscale.value_or(0.0) != 0.0 && rope.mscale_all_dim.value_or(0.0) != 0.0) {
    return yarn_mscale(rope.factor, *rope.mscale) / yarn_mscale(rope.factor, *rope.mscale_all_dim);
  }
  return yarn_mscale(rope.factor, 1.0);
}

at::Tensor rotary_inv_freq(const RopeParameters& rope, int64_t head_dim, c10::Device device) {
  const auto fp32 = at::TensorOptions().dtype(at::kFloat).device(device);
  const int64_t dim = head_dim;
  // 1.0 / (base ** (arange(0, dim, 2).float() / dim))
  at::Tensor inv_freq = at::pow(rope.rope_theta, at::arange(0, dim, 2, fp32) / dim).reciprocal();
  if (rope.rope_type == "default") return inv_freq;
  if (rope.rope_type == "linear") return inv_freq / rope.factor;
  if (rope.rope_type == "yarn") return yarn_inv_freq(rope, head_dim, device);
  TORCH_CHECK(rope.rope_type == "llama3", "rope type \"", rope.rope_type,
              "\" is not supported (supported: default, linear, llama3, yarn)");
  const double factor = rope.factor;
  const double low = rope.low_freq_factor;
  const double high = rope.high_freq_factor;
  const double old_context_len = static_cast<double>(rope.original_max_position_embeddings);
  const double low_freq_wavelen = old_context_len / low;
  const double high_freq_wavelen = old_context_len / high;
  const at::Tensor wavelen = inv_freq.reciprocal() * (2 * M_PI);
  at::Tensor inv_freq_llama = at::where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq);
  const at::Tensor smooth_factor = (wavelen.reciprocal() * old_context_len - low) / (high - low);
  const at::Tensor smoothed = at::rsub(smooth_factor, 1) * inv_freq_llama / factor + smooth_factor * inv_freq_llama;
  const at::Tensor is_medium = (wavelen < high_freq_wavelen).logical_not() * (wavelen > low_freq_wavelen).logical_not();
  return at::where(is_medium, smoothed, inv_freq_llama);
}

std::pair<at::Tensor, at::Tensor> rotary_cos_sin(const RopeParameters& rope, int64_t head_dim, int64_t seq_len,
                                                 c10::Device device, c10::ScalarType dtype, int64_t start) {
  const auto fp32 = at::TensorOptions().dtype(at::kFloat).device(device);
  const at::Tensor inv_freq = rotary_inv_freq(rope, head_dim, device);
  const at::Tensor freqs = at::arange(start, start + seq_len, fp32).unsqueeze(-1) * inv_freq;  // [T, head_dim / 2]
  const at::Tensor emb = at::cat({freqs, freqs}, -1);
  const double attention_factor = rotary_attention_factor(rope);
  if (attention_factor == 1.0) return {emb.cos().to(dtype), emb.sin().to(dtype)};  // HF's `* 1.0` is exact
  // fp32 multiplication by the factor rounded to fp32, as `emb.cos() * self.attention_scaling`.
  return {(emb.cos() * attention_factor).to(dtype), (emb.sin() * attention_factor).to(dtype)};
}

std::pair<at::Tensor, at::Tensor> rotary_cos_sin_at(const RopeParameters& rope, int64_t head_dim,
                                                    const at::Tensor& positions, c10::ScalarType dtype) {
  TORCH_CHECK(positions.dim() == 2 && !at::isFloatingType(positions.scalar_type()),
              "rotary embedding: positions must be an integer tensor [batch, seq], got ", positions.scalar_type(), " ",
              positions.sizes());
  const at::Tensor inv_freq = rotary_inv_freq(rope, head_dim, positions.device());
  const at::Tensor freqs = positions.to(at::kFloat).unsqueeze(-1) * inv_freq;  // [B, T, head_dim / 2]
  const at::Tensor emb = at::cat({freqs, freqs}, -1).unsqueeze(1);             // [B, 1, T, head_dim]
  const double attention_factor = rotary_attention_factor(rope);
  if (attention_factor == 1.0) return {emb.cos().to(dtype), emb.sin().to(dtype)};
  return {(emb.cos() * attention_factor).to(dtype), (emb.sin() * attention_factor).to(dtype)};
}

at::Tensor apply_rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t half = x.size(-1) / 2;
  const at::Tensor x1 = x.narrow(-1, 0, half);
  const at::Tensor x2 = x.narrow(-1, half, x.size(-1) - half);
  return x * cos + at::cat({-x2, x1}, -1) * sin;
}

}  // namespace roundpipe::models::detail
