// roundpipe::optim::Lion: the Lion optimizer (Chen et al. 2023, "Symbolic Discovery of
// Optimization Algorithms") for RoundPipe's fp32 CPU master weights, one fused multi-threaded pass
// per step. One state tensor per parameter (Adam keeps two): 4 bytes per parameter less host
// memory for the optimizer state.
#pragma once

#include <torch/arg.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <tuple>
#include <vector>

namespace torch::serialize {
class OutputArchive;
class InputArchive;
}  // namespace torch::serialize

namespace roundpipe::optim {

/// Hyper-parameters of `Lion` (per parameter group); defaults are the paper's (lr 1e-4, betas
/// (0.9, 0.99), no weight decay). Lion's update has unit size per element, so its lr is usually
/// 3-10x smaller than AdamW's and its weight decay 3-10x larger (the paper, section 5).
struct LionOptions : public torch::optim::OptimizerCloneableOptions<LionOptions> {
  LionOptions(double lr = 1e-4);  // NOLINT(google-explicit-constructor): mirrors torch's options
  /// Learning rate, >= 0.
  TORCH_ARG(double, lr) = 1e-4;
  using betas_t = std::tuple<double, double>;
  /// (beta1: interpolation of the update direction, beta2: the momentum's decay), each in [0, 1].
  TORCH_ARG(betas_t, betas) = std::make_tuple(0.9, 0.99);
  /// Decoupled weight decay, >= 0: p *= 1 - lr * weight_decay before the update.
  TORCH_ARG(double, weight_decay) = 0;

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
  friend bool operator==(const LionOptions& lhs, const LionOptions& rhs);
  double get_lr() const override;
  void set_lr(const double lr) override;
};

/// Per-parameter state: the momentum `exp_avg` and the number of updates.
struct LionParamState : public torch::optim::OptimizerCloneableParamState<LionParamState> {
  TORCH_ARG(int64_t, step) = 0;
  TORCH_ARG(torch::Tensor, exp_avg);

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
  friend bool operator==(const LionParamState& lhs, const LionParamState& rhs);
};

/// Lion for fp32 CPU parameters. Per element and step, with g the gradient and m the momentum:
///   p = p * (1 - lr * weight_decay);  c = beta1 * m + (1 - beta1) * g;
///   p = p - lr * sign(c);  m = beta2 * m + (1 - beta2) * g
/// (sign(0) = sign(NaN) = 0, as torch.sign), the paper's reference implementation; equal to it
/// in PyTorch to float rounding (tested to 1e-6). One pass reads p, g, m and writes p, m.
/// Gradients may be float32, float16 or bfloat16 (widened exactly in the same pass).
/// Thread-safety and threads: as `Adam` (one thread at a time; the element range split across
/// up to num_threads() helper threads; results do not depend on the count).
///
///   roundpipe::optim::Lion opt(model.parameters(), roundpipe::optim::LionOptions(3e-5).weight_decay(0.1));
class Lion : public torch::optim::Optimizer {
 public:
  /// Throws c10::Error for invalid options or parameters that are not contiguous fp32 CPU tensors.
  explicit Lion(const std::vector<torch::optim::OptimizerParamGroup>& param_groups, LionOptions defaults = {});
  explicit Lion(std::vector<torch::Tensor> params, LionOptions defaults = {});

  torch::Tensor step(LossClosure closure = nullptr) override;
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

  /// Caps the threads one step uses, as Adam::set_num_threads.
  void set_num_threads(int64_t num_threads);
  int64_t num_threads() const { return num_threads_; }
  /// Threads the last step used (0 before the first step that updated a parameter).
  int64_t last_step_threads() const { return last_step_threads_; }

 private:
  int64_t num_threads_ = 0;
  int64_t last_step_threads_ = 0;
};

}  // namespace roundpipe::optim
