// The fused CPU Lion element kernel (internal): a plain-pointer interface, free of LibTorch
// headers; compiled per ISA in the Adam kernel TUs (lion_kernel_impl.h), picked at run time.
#pragma once

#include <cstdint>

#include "optim/detail/adam_kernel.h"  // GradDtype

namespace roundpipe::optim::detail {

/// Per-tensor scalars, rounded to float where PyTorch rounds the Python floats of the reference
/// (p.mul_(1 - lr * wd), m.mul(beta1).add(g, alpha=1 - beta1), p.add_(sign, alpha=-lr), ...).
struct LionScalars {
  float decay = 1;  ///< 1 - lr * weight_decay (exactly 1 without weight decay: p * 1 == p)
  float beta1 = 0, one_minus_beta1 = 0, neg_lr = 0, beta2 = 0, one_minus_beta2 = 0;
};

/// One parameter's buffers, all contiguous, `numel` elements.
struct LionTensor {
  float* param = nullptr;
  const void* grad = nullptr;  ///< `numel` elements of `grad_dtype`
  GradDtype grad_dtype = GradDtype::kFloat;
  float* exp_avg = nullptr;
  int64_t numel = 0;
  LionScalars scalars;
};

/// Updates elements [begin, end) of `t` in one pass (Note [Lion element order],
/// lion_kernel_impl.h). All ISAs give bitwise-identical results.
void lion_update_scalar(const LionTensor& t, int64_t begin, int64_t end);
void lion_update_avx2(const LionTensor& t, int64_t begin, int64_t end);
void lion_update_avx512(const LionTensor& t, int64_t begin, int64_t end);

using LionUpdateFn = void (*)(const LionTensor&, int64_t, int64_t);
/// The kernel for `isa` (which must be supported; adam_dispatch.cpp).
LionUpdateFn lion_update_fn(CpuIsa isa);

}  // namespace roundpipe::optim::detail
