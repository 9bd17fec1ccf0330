// roundpipe::optim::Adafactor: the Adafactor optimizer (Shazeer & Stern 2018, "Adafactor: Adaptive
// Learning Rates with Sublinear Memory Cost") as torch.optim.Adafactor computes it, for RoundPipe's
// fp32 CPU master weights. A matrix keeps a factored second moment (one float per row and one per
// column, (rows + cols) * 4 bytes), a vector or scalar one float per element: far less host memory
// for the optimizer state than Adam's 8 bytes per parameter.
#pragma once

#include <torch/arg.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace torch::serialize {
class OutputArchive;
class InputArchive;
}  // namespace torch::serialize

namespace roundpipe::optim {

/// Hyper-parameters of `Adafactor` (per parameter group); names and defaults are
/// torch.optim.Adafactor's (lr 1e-2, beta2_decay -0.8, eps (None, 1e-3), d 1.0, no weight decay).
struct AdafactorOptions : public torch::optim::OptimizerCloneableOptions<AdafactorOptions> {
  AdafactorOptions(double lr = 1e-2);  // NOLINT(google-explicit-constructor): mirrors torch's options
  /// Learning rate, >= 0; the relative step size is min(lr, 1 / sqrt(step)).
  TORCH_ARG(double, lr) = 1e-2;
  /// Exponent of the second moment's decay, <= 0: beta2 at step t is 1 - t^beta2_decay.
  TORCH_ARG(double, beta2_decay) = -0.8;
  /// Floor of the second moment estimate (squared before use), >= 0; unset: float32's machine
  /// epsilon (torch.finfo(torch.float32).eps), as torch's eps1=None.
  TORCH_ARG(std::optional<double>, eps1) = std::nullopt;
  /// Floor of the parameter's root mean square in the step size, >= 0.
  TORCH_ARG(double, eps2) = 1e-3;
  /// Clipping threshold of the update's root mean square, >= 1.
  TORCH_ARG(double, d) = 1.0;
  /// Decoupled weight decay, >= 0: p *= 1 - lr * weight_decay before the update (as torch).
  TORCH_ARG(double, weight_decay) = 0;
  /// Maximize the objective (step along +gradient) instead of minimizing it.
  TORCH_ARG(bool, maximize) = false;

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
  friend bool operator==(const AdafactorOptions& lhs, const AdafactorOptions& rhs);
  double get_lr() const override;
  void set_lr(const double lr) override;
};

/// Per-parameter state, torch's names and shapes: for a parameter of 2 or more dimensions
/// [..., R, C], `row_var` [..., R, 1] and `col_var` [..., 1, C] (`variance` undefined); for one of
/// 0 or 1 dimension `variance` of its shape (`row_var`, `col_var` undefined).
struct AdafactorParamState : public torch::optim::OptimizerCloneableParamState<AdafactorParamState> {
  TORCH_ARG(int64_t, step) = 0;
  TORCH_ARG(torch::Tensor, row_var);
  TORCH_ARG(torch::Tensor, col_var);
  TORCH_ARG(torch::Tensor, variance);

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
  friend bool operator==(const AdafactorParamState& lhs, const AdafactorParamState& rhs);
};

/// Adafactor for fp32 CPU parameters, torch.optim.Adafactor's update (equal to it to float
/// rounding, tested to 1e-6). Per parameter p with gradient g at step t:
///   rho = min(lr, 1/sqrt(t));  alpha = max(eps2, rms(p)) * rho;  p *= 1 - lr * weight_decay;
///   matrix: row_var.lerp_(mean(g^2, over columns), t^beta2_decay), col_var likewise over rows,
///           v = row_var * col_var / max(mean(row_var), eps1);   vector: variance.lerp_(g^2, ...), v = variance;
///   u = g / sqrt(max(v, eps1^2));  p -= alpha / max(1, rms(u) / d) * u
/// A few passes over each tensor (norms first), sums in double over fixed blocks, so results do
/// not depend on the thread count. Gradients may be float32, float16 or bfloat16 (widened to a
/// float32 copy first).
/// Thread-safety and threads: as `Adam` (one thread at a time; each pass split across up to
/// num_threads() helper threads).
///
///   roundpipe::optim::Adafactor opt(model.parameters(), roundpipe::optim::AdafactorOptions(1e-2));
class Adafactor : public torch::optim::Optimizer {
 public:
  /// Throws c10::Error for invalid options or parameters that are not contiguous fp32 CPU tensors.
  explicit Adafactor(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                     AdafactorOptions defaults = {});
  explicit Adafactor(std::vector<torch::Tensor> params, AdafactorOptions defaults = {});

  torch::Tensor step(LossClosure closure = nullptr) override;
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

  /// Caps the threads one step uses, as Adam::set_num_threads (0: all intra-op threads).
  void set_num_threads(int64_t num_threads);
  int64_t num_threads() const { return num_threads_; }

 private:
  int64_t num_threads_ = 0;
};

}  // namespace roundpipe::optim
