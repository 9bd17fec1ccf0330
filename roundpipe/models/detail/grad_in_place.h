// The existing .grad a custom backward may add its weight gradient into (the token embedding's
// Note [Embedding gradient in place], the experts' Note [Expert gradients in place]).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/grad_mode.h>

namespace roundpipe::models::detail {

/// The .grad of `weight` when a backward may add its gradient (of `dtype`, on `device`) into it in
/// place instead of returning it to autograd, whose AccumulateGrad would compute the same
/// `grad + new`: `weight` is a leaf (the .grad of a non-leaf is not ours to read) whose .grad is a
/// dense, contiguous tensor of that dtype, device and the weight's shape, and grad mode is off (no
/// create_graph). Otherwise an undefined tensor: return the gradient to autograd as usual.
inline at::Tensor grad_to_add_into(const at::Tensor& weight, at::ScalarType dtype, c10::Device device) {
  if (at::GradMode::is_enabled() || !weight.is_leaf()) return {};
  at::Tensor existing = weight.grad();
  if (!existing.defined() || existing.layout() != at::kStrided || existing.scalar_type() != dtype ||
      existing.device() != device || existing.sizes() != weight.sizes() || !existing.is_contiguous()) {
    return {};
  }
  return existing;
}

}  // namespace roundpipe::models::detail
