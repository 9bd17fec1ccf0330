#include "roundpipe/models/detail/moe_experts.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/sigmoid.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/silu_backward.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>

#include <numeric>

namespace roundpipe::models::detail {
namespace {

// A weight gradient [E, ...] like `weight`, whose slices the backward overwrites for every expert
// with rows: only the slices of experts without rows are zeroed (a full zero fill of the expert
// weights' size cost ~15 ms of a ~280 ms layer; docs/benchmarks.md, "Mixture of experts").
at::Tensor expert_grad(const at::Tensor& weight, const std::vector<int64_t>& counts) {
  at::Tensor grad = at::empty_like(weight, at::MemoryFormat::Contiguous);
  for (size_t e = 0; e < counts.size(); ++e) {
    if (counts[e] == 0) grad[static_cast<int64_t>(e)].zero_();
  }
  return grad;
}

// Note [Routing weights in the experts]: the sorted SwiGLU experts multiply each row of their
// output by its routing weight (`row_weights` [M], optional) inside the per-expert loop, as
// transformers multiplies an expert's output by top_k_weights: y = (y_u.to(w) * w).to(x), in
// w's dtype (fp32 for Mixtral's products, else the model's). On an expert's slice the product
// and, in the backward, the weight's gradient sum(g * y_u) and g * w are computed while the
// slice is in cache, instead of two passes over [M, H] by autograd's MulBackward (~20 ms of the
// layer). The unweighted rows y_u are kept for the weights' gradient.
void weigh_rows(at::Tensor& ye, const at::Tensor& unweighted, const at::Tensor& w) {
  if (w.scalar_type() == ye.scalar_type()) {
    at::mul_out(ye, unweighted, w.unsqueeze(1));
  } else {
    ye.copy_(unweighted.to(w.scalar_type()) * w.unsqueeze(1));
  }
}

// y rows of every expert with rows; `gate_up_rows` [M, 2I] receives x G^T | x U^T when defined.
// With `row_weights`, y's rows are weighted and `unweighted` [M, H] (defined) receives them
// before (Note [Routing weights in the experts]).
void experts_forward(const at::Tensor& x, const at::Tensor& gate_up, const at::Tensor& down,
                     const std::vector<int64_t>& counts, at::Tensor& y, const at::Tensor& gate_up_rows,
                     const at::Tensor& row_weights, const at::Tensor& unweighted) {
  const int64_t inter = down.size(2);
  int64_t offset = 0;
  for (size_t e = 0; e < counts.size(); ++e) {
    const int64_t n = counts[e];
    if (n == 0) continue;
    const at::Tensor xe = x.narrow(0, offset, n);
    at::Tensor gu = gate_up_rows.defined() ? gate_up_rows.narrow(0, offset, n) : at::empty({n, 2 * inter}, x.options());
    at::mm_out(gu, xe, gate_up[static_cast<int64_t>(e)].t());
    const at::Tensor act = at::silu(gu.narrow(1, 0, inter)) * gu.narrow(1, inter, inter);
    at::Tensor ye = y.narrow(0, offset, n);
    if (!row_weights.defined()) {
      at::mm_out(ye, act, down[static_cast<int64_t>(e)].t());
    } else {
      at::Tensor u = unweighted.defined() ? unweighted.narrow(0, offset, n) : at::empty({n, y.size(1)}, y.options());
      at::mm_out(u, act, down[static_cast<int64_t>(e)].t());
      weigh_rows(ye, u, row_weights.narrow(0, offset, n));
    }
    offset += n;
  }
}

class SortedSwigluExperts : public torch::autograd::Function<SortedSwigluExperts> {
 public:
  // `row_weights`: undefined, or [M] (Note [Routing weights in the experts]).
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& gate_up,
                            const at::Tensor& down, const at::Tensor& row_weights, const std::vector<int64_t>& counts) {
    at::Tensor y = at::empty({x.size(0), x.size(1)}, x.options());
    at::Tensor gate_up_rows = at::empty({x.size(0), 2 * down.size(2)}, x.options());
    const at::Tensor unweighted = row_weights.defined() ? at::empty_like(y) : at::Tensor();
    experts_forward(x, gate_up, down, counts, y, gate_up_rows, row_weights, unweighted);
    ctx->save_for_backward({x, gate_up, down, gate_up_rows, row_weights, unweighted});
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
    const at::Tensor& row_weights = saved[4];
    const at::Tensor& unweighted = saved[5];
    const std::vector<int64_t> counts = ctx->saved_data["counts"].toIntVector();
    const at::Tensor grad_y = grad_outputs.at(0).contiguous();
    const int64_t inter = down.size(2);
    const bool want_x = ctx->needs_input_grad(0);
    at::Tensor grad_x = want_x ? at::empty_like(x, at::MemoryFormat::Contiguous) : at::Tensor();
    at::Tensor grad_gate_up = ctx->needs_input_grad(1) ? expert_grad(gate_up, counts) : at::Tensor();
    at::Tensor grad_down = ctx->needs_input_grad(2) ? expert_grad(down, counts) : at::Tensor();
    at::Tensor grad_weights =
        row_weights.defined() && ctx->needs_input_grad(3) ? at::empty_like(row_weights) : at::Tensor();
    const bool low_precision = x.scalar_type() != at::kFloat && x.scalar_type() != at::kDouble;
    int64_t offset = 0;
    for (size_t k = 0; k < counts.size(); ++k) {
      const int64_t n = counts[k];
      if (n == 0) continue;
      const auto e = static_cast<int64_t>(k);
      at::Tensor gy = grad_y.narrow(0, offset, n);
      if (row_weights.defined()) {
        // y = (u.to(w) * w).to(x): the gradients of u and w from the slice's gradient.
        const at::Tensor w = row_weights.narrow(0, offset, n);
        const at::Tensor g = gy.to(w.scalar_type());
        if (grad_weights.defined()) {
          at::Tensor gw = grad_weights.narrow(0, offset, n);
          at::sum_out(gw, g * unweighted.narrow(0, offset, n).to(w.scalar_type()), {1});
        }
        gy = (g * w.unsqueeze(1)).to(x.scalar_type());
      }
      const at::Tensor gu = gate_up_rows.narrow(0, offset, n);
      at::Tensor d_gu;
      if (!low_precision) {
        // fp32/fp64: autograd's own kernels, fused (silu_backward: g sig (1 + x (1 - sig))), each
        // writing its half of d_gu: 5 elementwise passes instead of ~12 with temporaries.
        const at::Tensor gate = gu.narrow(1, 0, inter);
        const at::Tensor up = gu.narrow(1, inter, inter);
        const at::Tensor silu = at::silu(gate);
        if (grad_down.defined()) {
          at::Tensor gd = grad_down[e];
          at::mm_out(gd, gy.t(), silu * up);
        }
        const at::Tensor d_act = at::mm(gy, down[e]);  // [n, I]
        d_gu = at::empty({n, 2 * inter}, x.options());
        at::Tensor d_gate = d_gu.narrow(1, 0, inter);
        at::Tensor d_up = d_gu.narrow(1, inter, inter);
        at::silu_backward_out(d_gate, d_act * up, gate);
        at::mul_out(d_up, d_act, silu);
      } else {
        // bf16/fp16: the elementwise SwiGLU derivative in fp32 (autograd's silu_backward computes
        // in fp32 too), the products in the model's dtype.
        const at::Tensor gate = gu.narrow(1, 0, inter).to(at::kFloat);
        const at::Tensor up = gu.narrow(1, inter, inter).to(at::kFloat);
        const at::Tensor sig = at::sigmoid(gate);
        const at::Tensor silu = gate * sig;
        if (grad_down.defined()) {
          // transformers computes act(gate) * up in the model's dtype: the same rounding here.
          at::Tensor gd = grad_down[e];
          at::mm_out(gd, gy.t(), at::silu(gu.narrow(1, 0, inter)) * gu.narrow(1, inter, inter));
        }
        const at::Tensor d_act = at::mm(gy, down[e]).to(at::kFloat);  // [n, I]
        at::Tensor d_f = at::empty({n, 2 * inter}, gate.options());
        d_f.narrow(1, 0, inter).copy_(d_act * up * (sig * (1 + gate * (1 - sig))));
        d_f.narrow(1, inter, inter).copy_(d_act * silu);
        d_gu = d_f.to(x.scalar_type());
      }
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
    return {grad_x, grad_gate_up, grad_down, grad_weights, at::Tensor()};
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
    at::Tensor grad_gate_up = ctx->needs_input_grad(1) ? expert_grad(gate_up, counts) : at::Tensor();
    at::Tensor grad_gate_up_bias =
        ctx->needs_input_grad(2) ? at::zeros({gate_up.size(0), width}, gate_up.options()) : at::Tensor();
    at::Tensor grad_down = ctx->needs_input_grad(3) ? expert_grad(down, counts) : at::Tensor();
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
    return {grad_x,         grad_gate_up, grad_gate_up_bias, grad_down,
            grad_down_bias, at::Tensor(), at::Tensor(),      at::Tensor()};
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
  const bool records =
      at::GradMode::is_enabled() && (x.requires_grad() || gate_up.requires_grad() || gate_up_bias.requires_grad() ||
                                     down.requires_grad() || down_bias.requires_grad());
  if (records) {
    return SortedClampedGluExperts::apply(xc, gate_up, gate_up_bias, down, down_bias, counts, alpha, limit);
  }
  at::Tensor y = at::empty({x.size(0), down.size(2)}, x.options());
  clamped_forward(xc, gate_up, gate_up_bias, down, down_bias, counts, alpha, limit, y, at::Tensor());
  return y;
}

at::Tensor sorted_swiglu_experts(const at::Tensor& x, const at::Tensor& gate_up, const at::Tensor& down,
                                 const std::vector<int64_t>& counts, const at::Tensor& row_weights) {
  TORCH_CHECK(x.dim() == 2 && gate_up.dim() == 3 && down.dim() == 3, "experts: expected x [M, H], gate_up [E, 2I, H], ",
              "down [E, H, I], got ", x.sizes(), ", ", gate_up.sizes(), ", ", down.sizes());
  const int64_t experts = gate_up.size(0);
  TORCH_CHECK(down.size(0) == experts && static_cast<int64_t>(counts.size()) == experts &&
                  gate_up.size(1) == 2 * down.size(2) && gate_up.size(2) == x.size(1) && down.size(1) == x.size(1),
              "experts: inconsistent shapes x ", x.sizes(), ", gate_up ", gate_up.sizes(), ", down ", down.sizes(),
              ", ", counts.size(), " counts");
  TORCH_CHECK(std::accumulate(counts.begin(), counts.end(), int64_t{0}) == x.size(0), "experts: the counts sum to ",
              std::accumulate(counts.begin(), counts.end(), int64_t{0}), " but x has ", x.size(0), " rows");
  TORCH_CHECK(!row_weights.defined() || (row_weights.dim() == 1 && row_weights.size(0) == x.size(0) &&
                                         at::isFloatingType(row_weights.scalar_type())),
              "experts: row_weights must be floating [", x.size(0), "], got ",
              row_weights.defined() ? c10::str(row_weights.sizes()) : std::string("undefined"));
  const at::Tensor xc = x.contiguous();
  const at::Tensor wc = row_weights.defined() ? row_weights.contiguous() : row_weights;
  const bool records = at::GradMode::is_enabled() && (x.requires_grad() || gate_up.requires_grad() ||
                                                      down.requires_grad() || (wc.defined() && wc.requires_grad()));
  if (records) return SortedSwigluExperts::apply(xc, gate_up, down, wc, counts);
  at::Tensor y = at::empty({x.size(0), x.size(1)}, x.options());
  experts_forward(xc, gate_up, down, counts, y, at::Tensor(), wc, at::Tensor());
  return y;
}

}  // namespace roundpipe::models::detail
