// The hooks through which the runtime drives a GradScaler across threads (internal to RoundPipe):
// scale observers, per-iteration scopes, the executor that marshals unscale_/step onto the
// optimizer thread, and found_inf flags posted by device workers. See Note [Cross-thread
// GradScaler] in amp/detail/scaler_core.cpp.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>

namespace roundpipe::amp {
class GradScaler;
}  // namespace roundpipe::amp

namespace roundpipe::amp::detail {

struct Iteration;

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
  friend Iteration* scope_iteration(const GradScaler& scaler);
  const GradScaler* scaler_;
  std::shared_ptr<Iteration> iteration_;
  IterationScope* previous_;
};

/// Runs a call on the optimizer thread, inside the right IterationScope, and returns when it has
/// run (rethrowing its error).
using Executor = std::function<void(const std::function<void()>& call)>;

/// The runtime's access to a GradScaler's cross-thread entry points. Thread-safety as stated per
/// method; the scaler must outlive the calls.
class GradScalerAccess {
 public:
  /// Any thread, lock-free: posts the found_inf (1 element, any device; non-zero = inf/NaN) of
  /// one backward stage of run `batch`, scaled in update generation `generation`. Flags count
  /// only once their run is announced with `expect_found_inf`; flags of runs never announced
  /// (a failed run) are dropped.
  static void post_found_inf(GradScaler& scaler, int64_t generation, uint64_t batch, const at::Tensor& found_inf);
  /// Any thread: run `batch` of generation `generation` posts `count` flags. The update() of that
  /// generation combines them; if some are still in flight it returns at once and the update
  /// completes when the last arrives, at the latest in the next `scale()`, `get_scale()`,
  /// `state_dict()`, `load_state_dict()` or `update()` (which wait for it, up to 10 minutes).
  static void expect_found_inf(GradScaler& scaler, int64_t generation, uint64_t batch, int64_t count);
  /// Any thread, lock-free: announced run `batch` failed after all its jobs ended: its flags no
  /// longer count and an update waiting for them completes without them (like a run never
  /// announced).
  static void drop_run(GradScaler& scaler, int64_t generation, uint64_t batch);
  /// A new Iteration holding a copy of the current scale (completes a pending update first).
  static std::shared_ptr<Iteration> capture_iteration(GradScaler& scaler);
  /// `unscale_`/`step` called outside any IterationScope of `scaler` are marshalled through
  /// `executor` while it is alive (the runtime owns it; a weak reference is kept).
  static void set_executor(GradScaler& scaler, std::weak_ptr<const Executor> executor);
};

/// The observer installed on this thread, or null.
ScaleObserver* current_scale_observer();
/// The iteration of the innermost IterationScope of `scaler` on this thread, or null.
Iteration* scope_iteration(const GradScaler& scaler);

}  // namespace roundpipe::amp::detail
