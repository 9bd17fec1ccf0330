#include "roundpipe/models/detail/moe_experts.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/sigmoid.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>

#include <numeric>

namespace roundpipe::models::detail {
namespace {

// y rows of every expert with rows; `gate_up_rows` [M, 2I] receives x G^T | x U^T when defined.
void experts_forward(const at::Tensor& x, const at::Tensor& gate_up, const at::Tensor& down,
                     const std::vector<int64_t>& counts, at::Tensor& y, const at::Tensor& gate_up_rows) {
  const int64_t inter = down.size(2);
  int64_t offset = 0;
  for (size_t e = 0; e < counts.size(); ++e) {
    const int64_t n = counts[e];
    if (n == 0) continue;
    const at::Tensor xe = x.narrow(0, offset, n);
    at::Tensor gu = gate_up_rows.defined() ? gate_up_rows.narrow(0, offset, n)
                                           : at::empty({n, 2 * inter}, x.options());
    at::mm_out(gu, xe, gate_up[static_cast<int64_t>(e)].t());
    const at::Tensor act = at::silu(gu.narrow(1, 0, inter)) * gu.narrow(1, inter, inter);
    at::Tensor ye = y.narrow(0, offset, n);
    at::mm_out(ye, act, down[static_cast<int64_t>(e)].t());
    offset += n;
  }
}

class SortedSwigluExperts : public torch::autograd::Function<SortedSwigluExperts> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& gate_up,
                            const at::Tensor& down, const std::vector<int64_t>& counts) {
    at::Tensor y = at::empty({x.size(0), x.size(1)}, x.options());
    at::Tensor gate_up_rows = at::empty({x.size(0), 2 * down.size(2)}, x.options());
    experts_forward(x, gate_up, down, counts, y, gate_up_rows);
    ctx->save_for_backward({x, gate_up, down, gate_up_rows});
    ctx->saved_data["counts"] = counts;
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const at::Tensor& gate_up = saved[1];
    const at::Tensor& down = saved[2];
    const at::Tensor& gate_up_rows = saved[3];
    const std::vector<int64_t> counts = ctx->saved_data["counts"].toIntVector();
    const at::Tensor grad_y = grad_outputs.at(0).contiguous();
    const int64_t inter = down.size(2);
    const bool want_x = ctx->needs_input_grad(0);
    at::Tensor grad_x = want_x ? at::empty_like(x, at::MemoryFormat::Contiguous) : at::Tensor();
    at::Tensor grad_gate_up = ctx->needs_input_grad(1) ? at::zeros_like(gate_up, at::MemoryFormat::Contiguous)
                                                       : at::Tensor();
    at::Tensor grad_down = ctx->needs_input_grad(2) ? at::zeros_like(down, at::MemoryFormat::Contiguous)
                                                    : at::Tensor();
    // The elementwise SwiGLU derivative in fp32 (autograd's silu_backward computes in fp32 too),
    // the products in the model's dtype.
    const bool low_precision = x.scalar_type() != at::kFloat && x.scalar_type() != at::kDouble;
    int64_t offset = 0;
    for (size_t k = 0; k < counts.size(); ++k) {
      const int64_t n = counts[k];
      if (n == 0) continue;
      const auto e = static_cast<int64_t>(k);
      const at::Tensor gy = grad_y.narrow(0, offset, n);
      const at::Tensor gu = gate_up_rows.narrow(0, offset, n);
      at::Tensor gate = gu.narrow(1, 0, inter);
      at::Tensor up = gu.narrow(1, inter, inter);
      if (low_precision) {
        gate = gate.to(at::kFloat);
        up = up.to(at::kFloat);
      }
      const at::Tensor sig = at::sigmoid(gate);
      const at::Tensor silu = gate * sig;
      if (grad_down.defined()) {
        // transformers computes act(gate) * up in the model's dtype: the same rounding here.
        const at::Tensor act = low_precision ? (at::silu(gu.narrow(1, 0, inter)) * gu.narrow(1, inter, inter)) : silu * up;
        at::Tensor gd = grad_down[e];
        at::mm_out(gd, gy.t(), act);
      }
      at::Tensor d_act = at::mm(gy, down[e]);  // [n, I]
      if (low_precision) d_act = d_act.to(at::kFloat);
      at::Tensor d_gu = at::empty({n, 2 * inter}, gate.options());
      d_gu.narrow(1, 0, inter).copy_(d_act * up * (sig * (1 + gate * (1 - sig))));
      d_gu.narrow(1, inter, inter).copy_(d_act * silu);
      if (low_precision) d_gu = d_gu.to(x.scalar_type());
      if (grad_gate_up.defined()) {
        at::Tensor gg = grad_gate_up[e];
        at::mm_out(gg, d_gu.t(), x.narrow(0, offset, n));
      }
      if (want_x) {
        at::Tensor gx = grad_x.narrow(0, offset, n);
        at::mm_out(gx, d_gu, gate_up[e]);
      }
      offset += n;
    }
    return {grad_x, grad_gate_up, grad_down, at::Tensor()};
  }
};

// gpt-oss: one expert's rows. `h` = x W + b [n, 2I] (kept for the backward); returns the GLU output.
at::Tensor clamped_glu(const at::Tensor& h, double alpha, double limit) {
  const at::Tensor gate = h.slice(1, 0, h.size(1), 2).clamp_max(limit);
  const at::Tensor up = h.slice(1, 1, h.size(1), 2).clamp(-limit, limit);
  const at::Tensor glu = gate * at::sigmoid(gate * alpha);
  return (up + 1) * glu;
}

void clamped_forward(const at::Tensor& x, const at::Tensor& gate_up, const at::Tensor& gate_up_bias,
                     const at::Tensor& down, const at::Tensor& down_bias, const std::vector<int64_t>& counts,
                     double alpha, double limit, at::Tensor& y, const at::Tensor& gate_up_rows) {
  const int64_t width = gate_up.size(2);
  int64_t offset = 0;
  for (size_t k = 0; k < counts.size(); ++k) {
    const int64_t n = counts[k];
    if (n == 0) continue;
    const auto e = static_cast<int64_t>(k);
    at::Tensor h = gate_up_rows.defined() ? gate_up_rows.narrow(0, offset, n) : at::empty({n, width}, x.options());
    // transformers: x @ W + b (a product, then the bias added).
    at::mm_out(h, x.narrow(0, offset, n), gate_up[e]);
    h.add_(gate_up_bias[e]);
    at::Tensor ye = y.narrow(0, offset, n);
    at::mm_out(ye, clamped_glu(h, alpha, limit), down[e]);
    ye.add_(down_bias[e]);
    offset += n;
  }
}

class SortedClampedGluExperts : public torch::autograd::Function<SortedClampedGluExperts> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& gate_up,
                            const at::Tensor& gate_up_bias, const at::Tensor& down, const at::Tensor& down_bias,
                            const std::vector<int64_t>& counts, double alpha, double limit) {
    at::Tensor y = at::empty({x.size(0), down.size(2)}, x.options());
    at::Tensor rows = at::empty({x.size(0), gate_up.size(2)}, x.options());
    clamped_forward(x, gate_up, gate_up_bias, down, down_bias, counts, alpha, limit, y, rows);
    ctx->save_for_backward({x, gate_up, down, rows});
    ctx->saved_data["counts"] = counts;
    ctx->saved_data["alpha"] = alpha;
    ctx->saved_data["limit"] = limit;
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const at::Tensor& gate_up = saved[1];
    const at::Tensor& down = saved[2];
    const at::Tensor& rows = saved[3];
    const std::vector<int64_t> counts = ctx->saved_data["counts"].toIntVector();
    const double alpha = ctx->saved_data["alpha"].toDouble();
    const double limit = ctx->saved_data["limit"].toDouble();
    const at::Tensor grad_y = grad_outputs.at(0).contiguous();
    const bool low_precision = x.scalar_type() != at::kFloat && x.scalar_type() != at::kDouble;
    const int64_t width = gate_up.size(2);
    at::Tensor grad_x = ctx->needs_input_grad(0) ? at::empty_like(x, at::MemoryFormat::Contiguous) : at::Tensor();
    at::Tensor grad_gate_up = ctx->needs_input_grad(1) ? at::zeros_like(gate_up) : at::Tensor();
    at::Tensor grad_gate_up_bias =
        ctx->needs_input_grad(2) ? at::zeros({gate_up.size(0), width}, gate_up.options()) : at::Tensor();
    at::Tensor grad_down = ctx->needs_input_grad(3) ? at::zeros_like(down) : at::Tensor();
    at::Tensor grad_down_bias =
        ctx->needs_input_grad(4) ? at::zeros({down.size(0), down.size(2)}, down.options()) : at::Tensor();
    int64_t offset = 0;
    for (size_t k = 0; k < counts.size(); ++k) {
      const int64_t n = counts[k];
      if (n == 0) continue;
      const auto e = static_cast<int64_t>(k);
      const at::Tensor gy = grad_y.narrow(0, offset, n);
      const at::Tensor h = rows.narrow(0, offset, n);
      if (grad_down.defined()) {
        at::Tensor gd = grad_down[e];
        at::mm_out(gd, clamped_glu(h, alpha, limit).t(), gy);  // transformers' rounding of the GLU
      }
      if (grad_down_bias.defined()) grad_down_bias[e].copy_(gy.sum(0));
      at::Tensor d_out = at::mm(gy, down[e].t());  // [n, I]
      at::Tensor hf = low_precision ? h.to(at::kFloat) : h;
      if (low_precision) d_out = d_out.to(at::kFloat);
      const at::Tensor g_raw = hf.slice(1, 0, width, 2);
      const at::Tensor u_raw = hf.slice(1, 1, width, 2);
      const at::Tensor g = g_raw.clamp_max(limit);
      const at::Tensor u = u_raw.clamp(-limit, limit);
      const at::Tensor sig = at::sigmoid(g * alpha);
      const at::Tensor glu = g * sig;
      // As torch's clamp backward: the gradient passes where min <= x <= max.
      const at::Tensor d_g = d_out * (u + 1) * (sig + g * alpha * sig * (1 - sig)) * g_raw.le(limit);
      const at::Tensor d_u = d_out * glu * u_raw.ge(-limit).logical_and(u_raw.le(limit));
      at::Tensor d_h = at::empty({n, width}, hf.options());
      d_h.slice(1, 0, width, 2).copy_(d_g);
      d_h.slice(1, 1, width, 2).copy_(d_u);
      if (low_precision) d_h = d_h.to(x.scalar_type());
      if (grad_gate_up.defined()) {
        at::Tensor gg = grad_gate_up[e];
        at::mm_out(gg, x.narrow(0, offset, n).t(), d_h);
      }
      if (grad_gate_up_bias.defined()) grad_gate_up_bias[e].copy_(d_h.sum(0));
      if (grad_x.defined()) {
        at::Tensor gx = grad_x.narrow(0, offset, n);
        at::mm_out(gx, d_h, gate_up[e].t());
      }
      offset += n;
    }
    return {grad_x, grad_gate_up, grad_gate_up_bias, grad_down, grad_down_bias, at::Tensor(), at::Tensor(),
            at::Tensor()};
  }
};

}  // namespace

at::Tensor sorted_clamped_glu_experts(const at::Tensor& x, const at::Tensor& gate_up, const at::Tensor& gate_up_bias,
                                      const at::Tensor& down, const at::Tensor& down_bias,
                                      const std::vector<int64_t>& counts, double alpha, double limit) {
  TORCH_CHECK(x.dim() == 2 && gate_up.dim() == 3 && down.dim() == 3 && gate_up_bias.dim() == 2 && down_bias.dim() == 2,
              "experts: expected x [M, H], gate_up [E, H, 2I], gate_up_bias [E, 2I], down [E, I, H], down_bias [E, H]");
  const int64_t experts = gate_up.size(0);
  TORCH_CHECK(static_cast<int64_t>(counts.size()) == experts && gate_up.size(1) == x.size(1) &&
                  gate_up.size(2) == 2 * down.size(1) && down.size(2) == x.size(1) &&
                  gate_up_bias.size(1) == gate_up.size(2) && down_bias.size(1) == down.size(2),
              "experts: inconsistent shapes x ", x.sizes(), ", gate_up ", gate_up.sizes(), ", down ", down.sizes());
  TORCH_CHECK(std::accumulate(counts.begin(), counts.end(), int64_t{0}) == x.size(0), "experts: the counts sum to ",
              std::accumulate(counts.begin(), counts.end(), int64_t{0}), " but x has ", x.size(0), " rows");
  const at::Tensor xc = x.contiguous();
  const bool records = at::GradMode::is_enabled() &&
                       (x.requires_grad() || gate_up.requires_grad() || gate_up_bias.requires_grad() ||
                        down.requires_grad() || down_bias.requires_grad());
  if (records) {
    return SortedClampedGluExperts::apply(xc, gate_up, gate_up_bias, down, down_bias, counts, alpha, limit);
  }
  at::Tensor y = at::empty({x.size(0), down.size(2)}, x.options());
  clamped_forward(xc, gate_up, gate_up_bias, down, down_bias, counts, alpha, limit, y, at::Tensor());
  return y;
}

at::Tensor sorted_swiglu_experts(const at::Tensor& x, const at::Tensor& gate_up, const at::Tensor& down,
                                 const std::vector<int64_t>& counts) {
  TORCH_CHECK(x.dim() == 2 && gate_up.dim() == 3 && down.dim() == 3, "experts: expected x [M, H], gate_up [E, 2I, H], ",
              "down [E, H, I], got ", x.sizes(), ", ", gate_up.sizes(), ", ", down.sizes());
  const int64_t experts = gate_up.size(0);
  TORCH_CHECK(down.size(0) == experts && static_cast<int64_t>(counts.size()) == experts &&
                  gate_up.size(1) == 2 * down.size(2) && gate_up.size(2) == x.size(1) && down.size(1) == x.size(1),
              "experts: inconsistent shapes x ", x.sizes(), ", gate_up ", gate_up.sizes(), ", down ", down.sizes(),
              ", ", counts.size(), " counts");
  TORCH_CHECK(std::accumulate(counts.begin(), counts.end(), int64_t{0}) == x.size(0), "experts: the counts sum to ",
              std::accumulate(counts.begin(), counts.end(), int64_t{0}), " but x has ", x.size(0), " rows");
  const at::Tensor xc = x.contiguous();
  const bool records =
      at::GradMode::is_enabled() && (x.requires_grad() || gate_up.requires_grad() || down.requires_grad());
  if (records) return SortedSwigluExperts::apply(xc, gate_up, down, counts);
  at::Tensor y = at::empty({x.size(0), x.size(1)}, x.options());
  experts_forward(xc, gate_up, down, counts, y, at::Tensor());
  return y;
}

}  // namespace roundpipe::models::detail
