// roundpipe::amp — mixed-precision training support: dynamic loss scaling (GradScaler, a C++ port
// of `torch.amp.GradScaler` with identical scale trajectory and error messages) and autocast
// guards. Depends only on LibTorch and roundpipe::logging; the hooks of the cross-thread protocol
// that RoundPipe drives (DESIGN §3, Note [Cross-thread GradScaler]) are declared here too.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <torch/arg.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <unordered_map>
#include <utility>
#include <vector>

namespace torch::serialize {
class OutputArchive;
class InputArchive;
}  // namespace torch::serialize

namespace roundpipe::amp {

/// Options of a GradScaler. Defaults are torch's: `torch.amp.GradScaler(init_scale=2**16,
/// growth_factor=2.0, backoff_factor=0.5, growth_interval=2000, enabled=True)`.
/// Validated by GradScaler's constructor (when enabled, like torch).
struct GradScalerOptions {
  /// Scale used by the first iteration.
  TORCH_ARG(double, init_scale) = 65536.0;
  /// Factor the scale is multiplied by after `growth_interval` consecutive finite iterations.
  /// Must be > 1.
  TORCH_ARG(double, growth_factor) = 2.0;
  /// Factor the scale is multiplied by after an iteration with inf/NaN gradients. In (0, 1).
  TORCH_ARG(double, backoff_factor) = 0.5;
  /// Number of consecutive finite iterations before the scale grows. Must be > 0.
  TORCH_ARG(int64_t, growth_interval) = 2000;
  /// false: every method is a pass-through (scale returns its input, step just steps).
  TORCH_ARG(bool, enabled) = true;
};

/// A GradScaler's persistent state, the C++ counterpart of torch's `scaler.state_dict()`.
/// Plain value type.
struct GradScalerState {
  double scale = 65536.0;
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;
  int64_t growth_tracker = 0;
  /// true for the state of a disabled scaler (torch returns `{}`); loading it into an enabled
  /// scaler fails like torch does.
  bool empty = false;

  /// Writes the fields under the keys "scale", "growth_factor", "backoff_factor",
  /// "growth_interval", "growth_tracker" and "empty".
  void save(torch::serialize::OutputArchive& archive) const;
  /// Reads what `save` wrote; throws c10::Error naming a missing or mistyped key.
  void load(torch::serialize::InputArchive& archive);
};

/// `archive << state` / `archive >> state` (so `torch::save(state, path)` and
/// `torch::load(state, path)` work).
torch::serialize::OutputArchive& operator<<(torch::serialize::OutputArchive& archive,
                                            const GradScalerState& state);
torch::serialize::InputArchive& operator>>(torch::serialize::InputArchive& archive,
                                           GradScalerState& state);

/// Unscales `grads` in place by `inv_scale` and checks them for inf/NaN, one
/// `at::_amp_foreach_non_finite_check_and_unscale_` per (device, dtype) bucket, in order of first
/// appearance. Returns one 0-dim float32 found_inf per device (0: all finite, non-zero: some
/// inf/NaN), on that device. `inv_scale` is a 1-element float32 tensor (copied to each device);
/// pass 1.0 to check without unscaling. Undefined tensors are skipped; sparse gradients unscale
/// their values (fp16 sparse ones must be coalesced by the caller). With `allow_fp16 = false` an
/// fp16 gradient fails with "Attempting to unscale FP16 gradients.". No host sync.
std::vector<std::pair<c10::Device, at::Tensor>> non_finite_check_and_unscale(
    const std::vector<at::Tensor>& grads, const at::Tensor& inv_scale, bool allow_fp16);

/// Dynamic loss scaling for mixed-precision training; behaves exactly like
/// `torch.amp.GradScaler` (same ATen ops, same scale trajectory, same error messages) for CPU
/// and CUDA tensors and plain `torch::optim` optimizers.
///
///   GradScaler scaler;
///   for (auto& batch : loader) {
///     optimizer.zero_grad();
///     auto loss = criterion(model->forward(batch.data), batch.target);
///     scaler.scale(loss).backward();
///     scaler.unscale_(optimizer);               // optional: to clip or inspect grads
///     scaler.step(optimizer);                   // skipped when a gradient has inf/NaN
///     scaler.update();
///   }
///
/// The scale (0-dim float32) and growth tracker (0-dim int32) are created lazily by the first
/// `scale()` call, on that tensor's device; all later work on them is enqueued on that device's
/// current stream. `step()` reads found_inf on the host (a sync on CUDA, as in torch);
/// `get_scale()` and `state_dict()` sync too.
///
/// Per-optimizer state (READY -> UNSCALED -> STEPPED, reset by `update()`) is keyed by the
/// optimizer's address, so an optimizer must stay alive (and at one address) between its
/// `unscale_`/`step` and the next `update()`.
///
/// Thread-safety: the scale and growth tracker are guarded by an internal mutex, so `scale()` may
/// run on worker threads while another thread calls `update()`, `get_scale()` or `state_dict()`.
/// Per-optimizer state has one owner: the thread running an IterationScope for its iteration
/// (the runtime's optimizer thread), or else the caller, who must not race `unscale_`/`step`
/// with `update()`. Setters are for the thread that calls `update()`. Inside RoundPipe
/// (Note [Cross-thread GradScaler]): `scale()` in loss_fn on device workers, `unscale_`/`step`
/// in step functions on the optimizer thread (calls from the caller's thread are marshalled
/// there), `update()` on the caller's thread, which never waits for the optimizer thread.
class GradScaler {
 public:
  /// Throws c10::Error when enabled and growth_factor <= 1, backoff_factor not in (0, 1) or
  /// growth_interval <= 0.
  explicit GradScaler(GradScalerOptions options = {});

  // Not copyable: a copy would share (and update in place) the same scale tensor. Movable.
  GradScaler(const GradScaler&) = delete;
  GradScaler& operator=(const GradScaler&) = delete;
  GradScaler(GradScaler&&) noexcept;
  GradScaler& operator=(GradScaler&&) noexcept;
  ~GradScaler();

  /// `outputs * scale` (the scale copied to `outputs`' device). The first call creates the scale
  /// and growth tracker on `outputs`' device. Disabled: returns `outputs` itself.
  at::Tensor scale(const at::Tensor& outputs);
  /// Scales each tensor (order kept); the lazy init uses the first one's device.
  std::vector<at::Tensor> scale(const std::vector<at::Tensor>& outputs);

  /// Divides the optimizer's gradients by the scale in place (inverse computed in double) and
  /// records per device whether any was inf/NaN. At most once per optimizer between updates.
  /// Throws "unscale_() has already been called on this optimizer since the last update().",
  /// "unscale_() is being called after step().", "Attempting to unscale FP16 gradients.", or
  /// "Attempted unscale_ but _scale is None. ..." before any `scale()`. Disabled: no-op.
  void unscale_(torch::optim::Optimizer& optimizer);

  /// Unscales (unless `unscale_` already ran since the last update) and runs
  /// `optimizer.step()` unless an inf/NaN was found. Returns whether the step ran. Throws
  /// "step() has already been called since the last update()." or "No inf checks were recorded
  /// for this optimizer." (no parameter has a gradient). Disabled: `optimizer.step()`, true.
  bool step(torch::optim::Optimizer& optimizer);

  /// Without argument: combines every optimizer's found_inf and applies
  /// `at::_amp_update_scale_` (backoff on inf; growth after `growth_interval` finite iterations,
  /// only to a finite value). With `new_scale`: sets the scale (as float32), tracker untouched.
  /// Resets every optimizer to READY. Throws "No inf checks were recorded prior to update." when
  /// no optimizer was unscaled. Disabled: no-op.
  void update(std::optional<double> new_scale = std::nullopt);

  /// The current scale: init_scale before the first `scale()`, 1.0 when disabled.
  double get_scale() const;
  double get_growth_factor() const { return growth_factor_; }
  /// Takes effect at the next `update()`. Not validated, like torch.
  void set_growth_factor(double new_factor) { growth_factor_ = new_factor; }
  double get_backoff_factor() const { return backoff_factor_; }
  /// Takes effect at the next `update()`. Not validated, like torch.
  void set_backoff_factor(double new_factor) { backoff_factor_ = new_factor; }
  int64_t get_growth_interval() const { return growth_interval_; }
  /// Takes effect at the next `update()`. A value at or below the current growth tracker stops
  /// growth until the next inf resets the tracker (torch compares with ==).
  void set_growth_interval(int64_t new_interval) { growth_interval_ = new_interval; }
  bool is_enabled() const { return enabled_; }

  /// scale, factors, interval and growth tracker (init values before the first `scale()`).
  /// Disabled: a state with `empty = true`. Syncs on CUDA; call it after `update()`.
  GradScalerState state_dict() const;
  /// Restores `state`; fills the scale and tracker tensors if they exist. Disabled: no-op.
  /// Throws "The source state dict is empty, ..." for an empty state.
  void load_state_dict(const GradScalerState& state);

  /// A copy of the current scale tensor (0-dim float32 on the scale's device), undefined before
  /// the first `scale()`.
  at::Tensor scale_tensor() const;

  // ---- Cross-thread protocol (Note [Cross-thread GradScaler] in grad_scaler.cpp) -------------
  // Used by the runtime; a plain training loop never needs these.

  /// Notified by every `scale()` call made on the thread where it is installed (see
  /// `ScopedScaleObserver`), with the scaler and its update generation (the number of `update()`
  /// calls so far): the runtime learns which scaler a loss_fn used and tags that run's flags.
  class ScaleObserver {
   public:
    virtual ~ScaleObserver() = default;
    virtual void on_scale(GradScaler& scaler, int64_t generation) = 0;
  };
  /// Installs `observer` on the calling thread for its lifetime (restores the previous one).
  class ScopedScaleObserver {
   public:
    explicit ScopedScaleObserver(ScaleObserver* observer);
    ~ScopedScaleObserver();
    ScopedScaleObserver(const ScopedScaleObserver&) = delete;
    ScopedScaleObserver& operator=(const ScopedScaleObserver&) = delete;

   private:
    ScaleObserver* previous_;
  };

  /// Any thread, lock-free: posts the found_inf (1 element, any device; non-zero = inf/NaN) of
  /// one backward stage of run `batch`, scaled in update generation `generation`. Flags count
  /// only once their run is announced with `expect_found_inf`; flags of runs never announced
  /// (a failed run) are dropped.
  void post_found_inf(int64_t generation, uint64_t batch, const at::Tensor& found_inf);
  /// Any thread: run `batch` of generation `generation` posts `count` flags. The update() of that
  /// generation combines them; if some are still in flight it returns at once and the update
  /// completes when the last arrives, at the latest in the next `scale()`, `get_scale()`,
  /// `state_dict()`, `load_state_dict()` or `update()` (which wait for it, up to 10 minutes).
  void expect_found_inf(int64_t generation, uint64_t batch, int64_t count);

  /// The scale snapshot and per-optimizer states of one iteration, for its optimizer step job.
  class Iteration;
  /// A new Iteration holding a copy of the current scale (completes a pending update first).
  std::shared_ptr<Iteration> capture_iteration();
  /// While alive on a thread, `unscale_`/`step` of `scaler` called on that thread use the
  /// iteration's scale and per-optimizer states instead of the live ones, so they may run on an
  /// optimizer thread while another thread runs `update()` and the next `scale()`. Nestable.
  class IterationScope {
   public:
    IterationScope(const GradScaler& scaler, std::shared_ptr<Iteration> iteration);
    ~IterationScope();
    IterationScope(const IterationScope&) = delete;
    IterationScope& operator=(const IterationScope&) = delete;

   private:
    friend class GradScaler;
    const GradScaler* scaler_;
    std::shared_ptr<Iteration> iteration_;
    IterationScope* previous_;
  };

  /// Runs a call on the optimizer thread, inside the right IterationScope, and returns when it
  /// has run (rethrowing its error).
  using Executor = std::function<void(const std::function<void()>& call)>;
  /// `unscale_`/`step` called outside any IterationScope of this scaler are marshalled through
  /// `executor` while it is alive (the runtime owns it; a weak reference is kept).
  void set_executor(std::weak_ptr<const Executor> executor);

 private:
  enum class OptState { kReady, kUnscaled, kStepped };
  struct PerOptimizerState {
    OptState stage = OptState::kReady;
    std::vector<std::pair<c10::Device, at::Tensor>> found_inf_per_device;
  };

  void lazy_init(const c10::Device& device);
  const at::Tensor& checked_scale(const char* funcname) const;
  using OptimizerStates = std::unordered_map<const void*, PerOptimizerState>;
  static void unscale_in(OptimizerStates& states, const at::Tensor& scale, torch::optim::Optimizer& optimizer);
  static bool step_in(OptimizerStates& states, const at::Tensor& scale, torch::optim::Optimizer& optimizer);
  void apply_update(std::vector<at::Tensor> found_infs, double growth_factor, double backoff_factor,
                    int64_t growth_interval) const;
  void update_locked(std::optional<double> new_scale);
  void complete_deferred_update_locked() const;
  void scale_written_locked() const;  // Note [Scale across streams]
  void scale_ready_locked() const;
  void collect_posted_flags_locked() const;
  bool flags_complete_locked(int64_t generation) const;
  std::vector<at::Tensor> take_flags_locked(int64_t generation) const;
  std::shared_ptr<const Executor> executor() const;
  Iteration* scope_iteration() const;  // the innermost IterationScope of this scaler on this thread

  bool enabled_;
  double init_scale_;
  double growth_factor_;
  double backoff_factor_;
  int64_t growth_interval_;
  int64_t init_growth_tracker_ = 0;
  // Guarded by xt_->mutex. Mutable: a const reader completes a deferred update first.
  mutable at::Tensor scale_;           // 0-dim float32, undefined until the first scale()
  mutable at::Tensor growth_tracker_;  // 0-dim int32, created with scale_
  OptimizerStates per_optimizer_states_;  // used outside IterationScopes
  // Cross-thread state, behind a pointer so the scaler stays movable.
  struct CrossThread;
  std::unique_ptr<CrossThread> xt_;
};

}  // namespace roundpipe::amp
