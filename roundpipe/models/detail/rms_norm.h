// RMSNorm's forward and backward with the fewest saved tensors (internal to roundpipe/models/layers.cpp).
#pragma once

#include <ATen/core/Tensor.h>

namespace roundpipe::models::detail {

/// HF LlamaRMSNorm over the last dimension of x: with h = x.float(), r = rsqrt(mean(h^2) + eps),
///   weight * (h r).to(x.dtype)            (weight_in_fp32 false)
///   (weight * (h r)).to(x.dtype)          (weight_in_fp32 true: GptOssRMSNorm),
/// computed with the same ops as that expression, so the output is bitwise autograd's.
///
/// Note [RMSNorm saved tensors]: under autograd the expression keeps, besides x, the normalized
/// product h r (for the weight's gradient), and in bf16/fp16 the float32 copy h as well: 1-3x
/// the input's bytes more per norm, which the memory model (scheduler/memory_model.cpp) does not
/// count and bench/moe_bench measured (docs/benchmarks.md, "Saved activations"). This keeps x,
/// the weight and r (one float per row) and recomputes h and h r in the backward, whose
/// gradients are autograd's, op for op (the same kernels in the same order), so bitwise equal.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool weight_in_fp32);

}  // namespace roundpipe::models::detail
