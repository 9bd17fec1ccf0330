// The expert MLPs of a mixture-of-experts layer over token rows sorted by expert (internal to
// roundpipe/models/moe.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace roundpipe::models::detail {

/// SwiGLU experts (Qwen3-MoE, Mixtral): rows [o_e, o_e + counts[e]) of `x` [M, H], where o_e is
/// the sum of the counts before e, go through expert e:
///   y = (silu(x G_e^T) * (x U_e^T)) D_e^T,
/// with gate_up [E, 2I, H] (G_e its first I rows, U_e the next I) and down [E, H, I], as
/// transformers' Qwen3MoeExperts / MixtralExperts. Returns y [M, H] in x's dtype.
///
/// Note [Sorted experts]: one GEMM per expert that has rows, on contiguous slices; an expert with
/// none costs nothing. Under autograd a custom function writes each expert's weight gradient
/// straight into its slice of one [E, ...] gradient (zero for experts without rows), where
/// autograd over `weight[e]` would make a full-size zero tensor per expert and sum them. The
/// forward keeps x G^T and x U^T ([M, 2I]) for the backward. `counts` are host integers summing
/// to M: on a GPU the caller syncs once to get them (moe.cpp replays them in recompute).
/// `row_weights` [M] (optional): each row of y is multiplied by its routing weight, in the
/// weights' dtype, then cast to x's (Note [Routing weights in the experts]); differentiable.
at::Tensor sorted_swiglu_experts(const at::Tensor& x, const at::Tensor& gate_up, const at::Tensor& down,
                                 const std::vector<int64_t>& counts, const at::Tensor& row_weights = {});

/// gpt-oss experts on the same sorted rows: gate_up [E, H, 2I], gate_up_bias [E, 2I], down
/// [E, I, H], down_bias [E, H]:
///   h = x W_e + b_e; g = h[:, 0::2].clamp(max = limit); u = h[:, 1::2].clamp(-limit, limit);
///   y = ((u + 1) * g * sigmoid(alpha * g)) D_e + d_e,
/// as transformers' GptOssExperts (no gradient where a clamp is active). Same scheme as above.
at::Tensor sorted_clamped_glu_experts(const at::Tensor& x, const at::Tensor& gate_up, const at::Tensor& gate_up_bias,
                                      const at::Tensor& down, const at::Tensor& down_bias,
                                      const std::vector<int64_t>& counts, double alpha, double limit);

}  // namespace roundpipe::models::detail
