// Note [Lion element order]: per element, the operations of the Lion paper's PyTorch reference,
// each rounded to float as ATen's kernels round them (no fma: -ffp-contract=off):
//   p = p * decay;  c = m * beta1 + (1 - beta1) * g;  p = p + (-lr) * sign(c);
//   m = m * beta2 + (1 - beta2) * g
// sign(0) = sign(NaN) = 0 (torch.sign). ATen's vectorized add with alpha fuses its multiply-add
// (fma), so results agree with PyTorch to float rounding, not bitwise; every clone below performs
// the same IEEE operations, so they agree with each other bitwise. The loops are written
// branch-free so GCC vectorizes them; target_clones adds AVX2 and AVX-512 versions picked at load
// time (an ifunc), next to the baseline one.
#define ROUNDPIPE_ADAM_ISA lion_helpers  // for the exact bf16/fp16 widening helpers only
#include "optim/detail/adam_kernel_impl.h"
#undef ROUNDPIPE_ADAM_ISA

#include "optim/detail/lion_kernel.h"

namespace roundpipe::optim::detail {
namespace {

template <typename Load>
__attribute__((always_inline)) inline void lion_body(const LionTensor& t, int64_t begin, int64_t end, Load load) {
  const LionScalars s = t.scalars;
  float* __restrict p = t.param;
  float* __restrict m = t.exp_avg;
  for (int64_t i = begin; i < end; ++i) {
    const float g = load(i);
    const float mi = m[i];
    const float c = mi * s.beta1 + s.one_minus_beta1 * g;
    const float sign = c > 0.0f ? 1.0f : (c < 0.0f ? -1.0f : 0.0f);
    p[i] = p[i] * s.decay + s.neg_lr * sign;
    m[i] = mi * s.beta2 + s.one_minus_beta2 * g;
  }
}

__attribute__((target_clones("avx512f", "avx2", "default"))) void lion_float(const LionTensor& t, int64_t begin,
                                                                              int64_t end) {
  const float* __restrict g = static_cast<const float*>(t.grad);
  lion_body(t, begin, end, [g](int64_t i) { return g[i]; });
}

__attribute__((target_clones("avx512f", "avx2", "default"))) void lion_bf16(const LionTensor& t, int64_t begin,
                                                                             int64_t end) {
  const uint16_t* __restrict g = static_cast<const uint16_t*>(t.grad);
  lion_body(t, begin, end, [g](int64_t i) { return lion_helpers::float_from_bf16(g[i]); });
}

__attribute__((target_clones("avx512f", "avx2", "default"))) void lion_half(const LionTensor& t, int64_t begin,
                                                                             int64_t end) {
  const uint16_t* __restrict g = static_cast<const uint16_t*>(t.grad);
  lion_body(t, begin, end, [g](int64_t i) { return lion_helpers::float_from_half_soft(g[i]); });
}

}  // namespace

void lion_update(const LionTensor& t, int64_t begin, int64_t end) {
  switch (t.grad_dtype) {
    case GradDtype::kFloat:
      return lion_float(t, begin, end);
    case GradDtype::kBFloat16:
      return lion_bf16(t, begin, end);
    case GradDtype::kHalf:
      return lion_half(t, begin, end);
  }
}

}  // namespace roundpipe::optim::detail
