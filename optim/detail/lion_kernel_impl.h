// The body of the fused Lion kernel, included by each per-ISA Adam kernel TU after
// adam_kernel_impl.h, inside the same per-ISA namespace (Note [Per-ISA namespaces]).
//
// Note [Lion element order]: per element, the operations of the Lion paper's PyTorch reference,
// each rounded to float as ATen's kernels round them (no fma: -ffp-contract=off):
//   p = p * decay;  c = m * beta1 + (1 - beta1) * g;  p = p + (-lr) * sign(c);
//   m = m * beta2 + (1 - beta2) * g
// sign(0) = sign(NaN) = 0 (torch.sign). ATen's vectorized add with alpha fuses its multiply-add,
// so results agree with PyTorch to float rounding, not bitwise; every ISA performs the same IEEE
// operations, so they agree with each other bitwise. The loop is branch-free plain C++, which GCC
// vectorizes with the TU's -m flags (-O3); decay is exactly 1 without weight decay (p * 1 == p).
#pragma once

#ifndef ROUNDPIPE_ADAM_ISA
#error "include adam_kernel_impl.h (which needs ROUNDPIPE_ADAM_ISA) before lion_kernel_impl.h"
#endif

#include "optim/detail/lion_kernel.h"

namespace roundpipe::optim::detail::ROUNDPIPE_ADAM_ISA {

template <typename Load>
inline void lion_loop(const LionTensor& t, int64_t begin, int64_t end, Load load) {
  const LionScalars s = t.scalars;
  float* __restrict p = t.param;
  float* __restrict m = t.exp_avg;
  for (int64_t i = begin; i < end; ++i) {
    const float g = load(i);
    const float mi = m[i];
    const float c = mi * s.beta1 + s.one_minus_beta1 * g;
    const float sign = static_cast<float>(c > 0.0f) - static_cast<float>(c < 0.0f);
    p[i] = p[i] * s.decay + s.neg_lr * sign;
    m[i] = mi * s.beta2 + s.one_minus_beta2 * g;
  }
}

inline void lion_update(const LionTensor& t, int64_t begin, int64_t end) {
  switch (t.grad_dtype) {
    case GradDtype::kFloat: {
      const float* __restrict g = static_cast<const float*>(t.grad);
      return lion_loop(t, begin, end, [g](int64_t i) { return g[i]; });
    }
    case GradDtype::kBFloat16: {
      const uint16_t* __restrict g = static_cast<const uint16_t*>(t.grad);
      return lion_loop(t, begin, end, [g](int64_t i) { return float_from_bf16(g[i]); });
    }
    case GradDtype::kHalf: {
      const uint16_t* __restrict g = static_cast<const uint16_t*>(t.grad);
      return lion_loop(t, begin, end, [g](int64_t i) { return float_from_half_soft(g[i]); });
    }
  }
}

}  // namespace roundpipe::optim::detail::ROUNDPIPE_ADAM_ISA
