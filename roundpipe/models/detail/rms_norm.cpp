#include "roundpipe/models/detail/rms_norm.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/result_type.h>
#include <ATen/ops/rsqrt.h>
#include <torch/csrc/autograd/custom_function.h>

#include <utility>

namespace roundpipe::models::detail {
namespace {

// h r and r of the forward, the same ops as autograd's expression.
std::pair<at::Tensor, at::Tensor> normalize(const at::Tensor& h, double eps) {
  const at::Tensor variance = h.pow(2).mean(-1, /*keepdim=*/true);
  at::Tensor r = at::rsqrt(variance + eps);
  return {h * r, r};
}

at::Tensor scale(const at::Tensor& normalized, const at::Tensor& weight, at::ScalarType dtype, bool weight_in_fp32) {
  if (weight_in_fp32) return (weight * normalized).to(dtype);
  return weight * normalized.to(dtype);
}

// The gradient autograd's engine hands an input: summed to its shape, then cast to its dtype.
at::Tensor as_input_grad(const at::Tensor& grad, const at::Tensor& input) {
  at::Tensor g = grad.sizes() == input.sizes() ? grad : grad.sum_to_size(input.sizes());
  return g.scalar_type() == input.scalar_type() ? g : g.to(input.scalar_type());
}

class RmsNormFunction : public torch::autograd::Function<RmsNormFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            double eps, bool weight_in_fp32) {
    const auto [normalized, r] = normalize(x.to(at::kFloat), eps);
    ctx->save_for_backward({x, weight, r});
    ctx->saved_data["weight_in_fp32"] = weight_in_fp32;
    return scale(normalized, weight, x.scalar_type(), weight_in_fp32);
  }

  // Autograd's backward of the forward expression, node by node (ToCopy, Mul, Mul, Rsqrt, Add,
  // Mean, Pow, ToCopy), each gradient summed and cast as the engine does between nodes.
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const at::Tensor& weight = saved[1];
    const at::Tensor& r = saved[2];
    const bool weight_in_fp32 = ctx->saved_data["weight_in_fp32"].toBool();
    const at::Tensor& grad = grad_outputs.at(0);
    const at::Tensor h = x.to(at::kFloat);
    const at::Tensor normalized = h * r;
    at::Tensor grad_weight;
    at::Tensor grad_normalized;  // of h r, float32
    if (weight_in_fp32) {
      // The forward's (weight * h r).to(dtype): its gradient cast back to the product's dtype.
      const at::Tensor g = grad.to(at::result_type(weight, normalized));
      if (ctx->needs_input_grad(1)) grad_weight = as_input_grad(g * normalized, weight);
      grad_normalized = as_input_grad(g * weight, normalized);
    } else {
      const at::Tensor cast = normalized.to(x.scalar_type());
      if (ctx->needs_input_grad(1)) grad_weight = as_input_grad(grad * cast, weight);
      grad_normalized = as_input_grad(as_input_grad(grad * weight, cast), normalized);
    }
    at::Tensor grad_x;
    if (ctx->needs_input_grad(0)) {
      // h r: h's first part; r's gradient, summed to [..., 1].
      const at::Tensor grad_h_direct = grad_normalized * r;
      const at::Tensor grad_r = as_input_grad(grad_normalized * h, r);
      // rsqrt: -0.5 grad result^3; the add passes it on; mean: expanded, divided by the width;
      // pow(2): grad (2 h^1).
      const at::Tensor grad_variance = -0.5 * grad_r * r.pow(3);
      const at::Tensor grad_squares = grad_variance.expand(h.sizes()) / h.size(-1);
      const at::Tensor grad_h = grad_h_direct + grad_squares * (2.0 * h.pow(1.0));
      grad_x = grad_h.to(x.scalar_type());
    }
    return {grad_x, grad_weight, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool weight_in_fp32) {
  if (at::GradMode::is_enabled() && (x.requires_grad() || weight.requires_grad())) {
    return RmsNormFunction::apply(x, weight, eps, weight_in_fp32);
  }
  const auto [normalized, r] = normalize(x.to(at::kFloat), eps);
  return scale(normalized, weight, x.scalar_type(), weight_in_fp32);
}

}  // namespace roundpipe::models::detail
