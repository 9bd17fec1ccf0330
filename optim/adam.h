// roundpipe::optim: CPU optimizers for RoundPipe's fp32 master weights. Adam/AdamW here is a
// drop-in torch::optim::Optimizer whose step is one fused, vectorized (AVX2/AVX-512, chosen at
// run time), multi-threaded pass over parameters, gradients and moments; it runs on RoundPipe's
// optimizer thread and can write the fp16/bf16 compute copy of each parameter in the same pass.
#pragma once

#include <torch/arg.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "optim/cpu_isa.h"
#include "optim/quantized_state.h"

namespace torch::serialize {
class OutputArchive;
class InputArchive;
}  // namespace torch::serialize

namespace roundpipe::optim {

/// How `Adam` stores exp_avg and exp_avg_sq (docs/optimizer.md, "8-bit states").
enum class AdamStateDtype {
  /// float32 tensors of the parameter's shape: torch's layout, 8 B/param.
  kFloat32 = 0,
  /// Block-wise 8-bit (Dettmers et al. 2021, bitsandbytes' 8-bit Adam): per moment a uint8 code
  /// tensor of the parameter's shape plus one float32 absmax per kQuantBlockSize (256) elements,
  /// dynamic maps (signed for exp_avg, unsigned for exp_avg_sq; optim/quantized_state.h):
  /// 2 + 8/256 B/param. Parameters with fewer than kMin8bitNumel (4096) elements keep float32
  /// states. Not combinable with amsgrad.
  kInt8 = 1,
};

/// Hyper-parameters of `Adam` (per parameter group), the same names and defaults as
/// torch::optim::AdamOptions plus PyTorch-Python's `maximize` and `decoupled_weight_decay`.
/// Serialized like torch's AdamOptions (archives of torch::optim::Adam load too).
struct AdamOptions : public torch::optim::OptimizerCloneableOptions<AdamOptions> {
  AdamOptions(double lr = 1e-3);  // NOLINT(google-explicit-constructor): mirrors torch
  /// Learning rate, >= 0.
  TORCH_ARG(double, lr) = 1e-3;
  using betas_t = std::tuple<double, double>;
  /// (beta1, beta2), each in [0, 1).
  TORCH_ARG(betas_t, betas) = std::make_tuple(0.9, 0.999);
  /// Added to the denominator, >= 0.
  TORCH_ARG(double, eps) = 1e-8;
  /// >= 0. L2 penalty added to the gradient, or decoupled decay (AdamW) when
  /// `decoupled_weight_decay` is true.
  TORCH_ARG(double, weight_decay) = 0;
  /// Use the running maximum of exp_avg_sq in the denominator (AMSGrad).
  TORCH_ARG(bool, amsgrad) = false;
  /// Maximize the objective (the gradient is negated).
  TORCH_ARG(bool, maximize) = false;
  /// AdamW: p *= 1 - lr * weight_decay instead of adding weight_decay * p to the gradient.
  TORCH_ARG(bool, decoupled_weight_decay) = false;
  /// Storage of the moments. kInt8 is written to archives as "state_dtype" (kFloat32 is not,
  /// so float32 archives keep torch's layout); loading an archive of the other dtype throws.
  TORCH_ARG(AdamStateDtype, state_dtype) = AdamStateDtype::kFloat32;
  /// Update bfloat16 parameters (bf16 master weights) with Kahan-compensated summation: a bf16
  /// compensation buffer per such parameter (AdamParamState::kahan_compensation) carries the part
  /// of each update that rounding to bf16 drops (docs/optimizer.md, "bf16 masters with Kahan
  /// summation"). Without it a bf16 parameter gets the float32 step of its widened value rounded
  /// to nearest once, which loses every update below half an ulp of the weight. float32
  /// parameters of the group are updated as without it.
  /// Written to archives as "kahan_sum" when true; loading an archive with the other value throws.
  TORCH_ARG(bool, kahan_sum) = false;

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
  friend bool operator==(const AdamOptions& lhs, const AdamOptions& rhs);
  double get_lr() const override;
  void set_lr(const double lr) override;
};

/// Per-parameter state; same fields and archive layout as torch::optim::AdamParamState (plus the
/// two absmax tensors with 8-bit states). `step` counts this parameter's updates (parameters
/// without a gradient do not advance).
struct AdamParamState : public torch::optim::OptimizerCloneableParamState<AdamParamState> {
  TORCH_ARG(int64_t, step) = 0;
  /// float32 of the parameter's shape; with 8-bit states uint8 codes of the parameter's shape
  /// (dequantize_blockwise(exp_avg, exp_avg_absmax, QuantMap::kSignedDynamic) gives the values).
  TORCH_ARG(torch::Tensor, exp_avg);
  /// As exp_avg; 8-bit: with exp_avg_sq_absmax and QuantMap::kUnsignedDynamic.
  TORCH_ARG(torch::Tensor, exp_avg_sq);
  /// Defined only with amsgrad.
  TORCH_ARG(torch::Tensor, max_exp_avg_sq);
  /// Defined only with 8-bit states: float32 [ceil(numel / 256)], one scale per block.
  TORCH_ARG(torch::Tensor, exp_avg_absmax);
  TORCH_ARG(torch::Tensor, exp_avg_sq_absmax);
  /// Defined only for bfloat16 parameters (AdamOptions::kahan_sum): bfloat16 of the parameter's
  /// shape, the Kahan compensation (zero before the first step).
  TORCH_ARG(torch::Tensor, kahan_compensation);

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
  friend bool operator==(const AdamParamState& lhs, const AdamParamState& rhs);
};

/// Adam / AdamW for fp32 CPU parameters, numerically equal (to float rounding, <= 1e-6 in tests)
/// to PyTorch's `torch.optim.Adam` / `torch.optim.AdamW` (single-tensor path).
///
/// Parameters may also be bfloat16 (bf16 master weights): the float32 update is computed from the
/// widened parameter as for an fp32 master, then, with `AdamOptions::kahan_sum(true)`, added with
/// Kahan compensation (a bf16 buffer per parameter in its state; docs/optimizer.md, "bf16 masters
/// with Kahan summation"): 2 + 2 + 8 B/param with float32 moments instead of 4 + 8. Without
/// kahan_sum the new float32 weight is rounded to bf16 (2 + 8 B/param; updates below half an ulp
/// of the weight are lost, so small learning rates stall: prefer kahan_sum).
///
/// With `AdamOptions::state_dtype(AdamStateDtype::kInt8)` the moments of parameters of at least
/// kMin8bitNumel elements are stored block-wise in 8 bits (2 + 8/256 instead of 8 B/param;
/// dequantized, updated and re-quantized in the same fused pass; docs/optimizer.md, "8-bit
/// states"). Parameters and gradients are unchanged (fp32 masters).
///
/// Each step is one pass per element: read p, g, m, v (and max_v), write p, m, v (and max_v, and
/// optionally a compute copy). Gradients may be float32, float16 or bfloat16: fp16/bf16 ones are
/// widened (exactly) in the same pass, so the result equals a step on their fp32 values while
/// reading 2 instead of 4 bytes per element and skipping a separate cast pass (RoundPipe hands its
/// compute copies' gradients over this way with `RoundPipeOptions::master_grad_dtype`). The
/// kernel is the best of AVX-512 / AVX2+FMA / scalar supported by the running CPU, and the
/// element range of all parameters together is split across up to `num_threads()` threads of its
/// own (docs/optimizer.md, "Threading").
///
/// Thread-safety: an Adam is used from one thread at a time (RoundPipe's optimizer thread); the
/// parameters, gradients and compute copies must not be touched by other threads during `step`.
/// Ownership: state tensors are owned by the optimizer; parameters and compute copies are shared
/// handles owned by the caller.
///
/// Example:
///
///   auto model = torch::nn::Linear(1024, 1024);
///   roundpipe::optim::Adam opt(model->parameters(),
///       roundpipe::optim::AdamOptions(1e-3).weight_decay(0.01).decoupled_weight_decay(true));
///   for (...) {
///     opt.zero_grad();
///     loss_fn(model->forward(x), y).backward();
///     opt.step();
///   }
class Adam : public torch::optim::Optimizer {
 public:
  /// Throws c10::Error for invalid options or parameters that are not contiguous fp32 or bf16 CPU
  /// tensors.
  explicit Adam(const std::vector<torch::optim::OptimizerParamGroup>& param_groups, AdamOptions defaults = {});
  explicit Adam(std::vector<torch::Tensor> params, AdamOptions defaults = {});

  /// Runs `closure` (if given) with grad mode on, then updates every parameter that has a
  /// gradient. Returns the closure's loss (undefined without a closure).
  torch::Tensor step(LossClosure closure = nullptr) override;
  void save(torch::serialize::OutputArchive& archive) const override;
  /// Throws c10::Error (and leaves this optimizer unchanged) when a param group of the archive
  /// has another state_dtype or kahan_sum than this optimizer's group: resume with the options it
  /// was saved with.
  void load(torch::serialize::InputArchive& archive) override;

  /// Also writes `copy` = param (rounded to copy's dtype, nearest even) in the same pass on every
  /// later step. `copy` must be a contiguous CPU tensor of param's shape, dtype float32, float16
  /// or bfloat16 (e.g. the pinned compute copy uploaded to the GPU). An undefined `copy` removes
  /// the registration. `param` must belong to this optimizer and be float32 (a bf16 master is its
  /// own compute copy).
  void set_compute_copy(const torch::Tensor& param, torch::Tensor copy);

  /// Multiplies every gradient by `factor` in the next step(), inside its fused pass (in float32,
  /// after widening bf16/fp16 gradients, before weight decay): bitwise what `grad.mul_(factor)` on
  /// float32 gradients followed by step() gives, without a pass over the gradients and, for
  /// bf16/fp16 gradients (RoundPipeOptions::master_grad_dtype), without rounding the products back
  /// to 16 bits. clip_grad_norm(Adam&, ...) below uses it. The factor belongs to the gradients
  /// present now: the next step() consumes it, and throws (updating nothing) if a parameter's
  /// gradient was replaced, added or removed in between (e.g. GradScaler skipped the step this
  /// factor was for and a new iteration's gradients arrived), or modified in place by an operation
  /// that bumps its version counter (writes through `.data()` do not). Any float is accepted, as
  /// by mul_ (a non-finite factor poisons the update, as torch's clipping of a non-finite norm does).
  void scale_next_gradients(float factor);
  /// The factor scale_next_gradients() set for the next step(), if any.
  std::optional<float> next_gradient_factor() const;

  /// Caps the threads one step uses (0 = at::get_num_threads() of the calling thread, capped by
  /// the thread's base::thread_budget where one is set, as on RoundPipe's optimizer thread when it
  /// drives GPUs: half the cores; a larger request is also capped by at::get_num_threads()).
  /// Results do not depend on the thread count.
  void set_num_threads(int64_t num_threads);
  int64_t num_threads() const { return num_threads_; }
  /// Threads the last step used (0 before the first step that updated a parameter).
  int64_t last_step_threads() const { return last_step_threads_; }

  /// Non-temporal stores for parameters of 2^20 elements or more (skips the write-allocate read
  /// of p, m, v). Default off: on the AMD EPYC VM we measured it 25% slower; try it on Intel
  /// servers. Results are bitwise the same either way.
  void set_streaming_stores(bool enabled);
  bool streaming_stores() const { return streaming_stores_; }

  /// The kernel ISA steps use; by default best_cpu_isa() (optim/cpu_isa.h has its name).
  CpuIsa kernel_isa() const { return isa_; }
  /// Forces a kernel ISA, mainly for tests and benchmarks. Throws if the CPU (or the build) does
  /// not support it (cpu_supports).
  void set_kernel_isa(CpuIsa isa);

 private:
  template <typename Self, typename Archive>
  static void serialize(Self& self, Archive& archive);
  void check_param(const torch::Tensor& param, const AdamOptions& options) const;
  std::vector<std::pair<const void*, int64_t>> gradient_identities() const;

  int64_t num_threads_ = 0;
  int64_t last_step_threads_ = 0;
  bool streaming_stores_ = false;
  CpuIsa isa_;
  std::unordered_map<const void*, torch::Tensor> compute_copies_;  // TensorImpl* -> copy
  // scale_next_gradients(): the factor and, per parameter with a gradient then (in group order),
  // its gradient's TensorImpl and version, which the next step() checks before using the factor.
  struct GradientFactor {
    float factor = 1;
    std::vector<std::pair<const void*, int64_t>> gradients;
  };
  std::optional<GradientFactor> gradient_factor_;
};

/// Clips the gradients of `optimizer`'s parameters to a global L2 norm of at most `max_norm` as
/// torch::nn::utils::clip_grad_norm_ does (the same total norm, coefficient max_norm / (norm +
/// 1e-6) clamped to 1), but applies the coefficient inside the next step()
/// (Adam::scale_next_gradients) instead of writing it into the gradients: bf16/fp16 gradients are
/// reduced in float32 and never rounded back, and float32 ones are left as they are, saving a pass.
/// With float32 gradients the step's result is bitwise that of clip_grad_norm_ + step(). A
/// contiguous bf16/fp16 gradient of more than kClipNormPiece elements is normed in pieces of that
/// many (the pieces' norms then combined as the tensors' are): torch's norm of a 16-bit tensor
/// with a float32 result first copies the whole tensor to float32 (docs/optimizer.md, "Gradient
/// clipping inside the step"). Returns the total norm before clipping (0 without gradients). Call it where
/// clip_grad_norm_ would go: after GradScaler::unscale_, right before step().
double clip_grad_norm(Adam& optimizer, double max_norm);

/// The piece size of clip_grad_norm's 16-bit gradients, in elements (16 MiB of float32).
inline constexpr int64_t kClipNormPiece = int64_t{1} << 22;

}  // namespace roundpipe::optim
