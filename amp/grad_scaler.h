// roundpipe::amp — dynamic loss scaling: GradScaler, a C++ port of `torch.amp.GradScaler` with
// the same scale trajectory, state and error messages. Sits above base, below the runtime; the
// hooks the runtime uses to drive it across threads are internal (amp/detail/, see
// docs/amp.md "With RoundPipe").
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

namespace torch::optim {
class Optimizer;
}  // namespace torch::optim
namespace torch::serialize {
class OutputArchive;
class InputArchive;
}  // namespace torch::serialize

namespace roundpipe::amp {
namespace detail {
struct ScalerCore;
class GradScalerAccess;
}  // namespace detail

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
/// (docs/amp.md, "With RoundPipe"): `scale()` in loss_fn on device workers, `unscale_`/`step`
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
  /// the first `scale()` (torch's `_get_scale_async()`, without the sync of get_scale()).
  at::Tensor scale_tensor() const;

 private:
  friend class detail::GradScalerAccess;  // the runtime's cross-thread hooks (amp/detail/)

  bool enabled_;
  double init_scale_;
  double growth_factor_;
  double backoff_factor_;
  int64_t growth_interval_;
  int64_t init_growth_tracker_ = 0;
  // The scale, growth tracker, per-optimizer states and cross-thread state, behind a pointer so
  // the scaler stays movable and this header free of internals.
  std::unique_ptr<detail::ScalerCore> core_;
};

}  // namespace roundpipe::amp
