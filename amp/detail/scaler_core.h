// GradScaler's state behind its public header: the scale, the per-optimizer states and the
// cross-thread machinery of Note [Cross-thread GradScaler] (internal to roundpipe::amp).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/Event.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <utility>
#include <vector>

#include "amp/detail/found_inf_inbox.h"
#include "amp/detail/grad_scaler_access.h"

namespace roundpipe::amp::detail {

/// torch's per-optimizer state machine: READY -> UNSCALED -> STEPPED, reset by update().
enum class OptState { kReady, kUnscaled, kStepped };
struct PerOptimizerState {
  OptState stage = OptState::kReady;
  std::vector<std::pair<c10::Device, at::Tensor>> found_inf_per_device;
};
/// Keyed by the optimizer's address.
using OptimizerStates = std::unordered_map<const void*, PerOptimizerState>;

/// The scale snapshot and per-optimizer states of one iteration, for its optimizer step job.
struct Iteration {
  at::Tensor scale;  // copy of the scale the iteration was scaled with (undefined: never scaled)
  OptimizerStates states;
};

/// Everything of a GradScaler but its settings. `mutex` guards every member except `inbox`
/// (lock-free for posters, drained under `mutex`). Methods named *_locked expect `mutex` held.
/// Mutable state behind a const GradScaler: a const reader completes a deferred update first.
struct ScalerCore {
  mutable std::mutex mutex;
  at::Tensor scale;           // 0-dim float32, undefined until the first scale()
  at::Tensor growth_tracker;  // 0-dim int32, created with scale
  OptimizerStates per_optimizer_states;  // used outside IterationScopes

  FoundInfInbox inbox;
  int64_t generation = 0;  // update() calls so far
  std::map<int64_t, std::map<uint64_t, int64_t>> expected;                  // [generation][run] -> flags
  std::map<int64_t, std::map<uint64_t, std::vector<at::Tensor>>> received;  // [generation][run]
  struct Deferred {
    int64_t generation;
    std::vector<at::Tensor> found_infs;  // the per-optimizer ones, taken at update()
    double growth_factor, backoff_factor;
    int64_t growth_interval;
  };
  std::optional<Deferred> deferred;
  std::weak_ptr<const Executor> executor;
  std::optional<c10::Event> scale_written;  // Note [Scale across streams]

  /// Creates the scale and growth tracker on `device`.
  void lazy_init_locked(const c10::Device& device, double init_scale, int64_t init_growth_tracker);
  /// Note [Scale across streams]: after every write of the scale / before every read of it.
  void scale_written_locked();
  void scale_ready_locked();
  /// Moves posted flags of open generations from the inbox into `received`.
  void collect_posted_flags_locked();
  /// Whether every announced flag of `generation` has arrived.
  bool flags_complete_locked(int64_t generation) const;
  /// The announced flags of `generation`; settles it and every older one.
  std::vector<at::Tensor> take_flags_locked(int64_t generation);
  /// Applies a deferred update once its flags are in (bounded wait, clear error).
  void complete_deferred_update_locked();
  /// Combines `found_infs` and applies at::_amp_update_scale_.
  void apply_update_locked(std::vector<at::Tensor> found_infs, double growth_factor, double backoff_factor,
                           int64_t growth_interval);
};

}  // namespace roundpipe::amp::detail
