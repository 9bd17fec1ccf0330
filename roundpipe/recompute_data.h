// Data a layer keeps from its forward pass for the recompute of that pass: what lets a layer whose
// forward makes a discrete decision (a mixture-of-experts router's top-k choice) replay exactly
// that decision when RoundPipe recomputes it in backward, instead of deciding again. The Python
// original's save_for_recompute / get_recompute_data.
//
//   at::Tensor MyLayerImpl::forward(const at::Tensor& x) {
//     at::Tensor choice;
//     if (auto saved = roundpipe::recompute_data("choice")) {
//       choice = saved->at(0);                   // the recompute: the forward's choice
//     } else {
//       choice = decide(x);
//       roundpipe::save_for_recompute("choice", {choice});  // kept only if a recompute follows
//     }
//     ...
//   }
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace roundpipe {

// Note [Recompute data]: RoundPipe runs every layer's forward on a microbatch once in a forward
// stage (no autograd) and again, recomputed, in the backward stage that differentiates it;
// layers of the fused tail run once, except with the layer grain, where the tail runs its layers
// but the last without autograd and recomputes them (docs/user-guide.md, "Recompute grains").
// Inside a layer's forward called by RoundPipe:
// - in a forward stage of a training call (or such a first pass of the fused tail),
//   save_for_recompute(key, tensors) keeps `tensors` for the recompute of this layer on this
//   microbatch (this call only; freed when it is read, or with the call);
// - in that recompute, recompute_data(key) returns them, device tensors moved to the
//   recompute's device (the forward and the recompute may run on different devices), CPU
//   tensors as they are (host-side data such as counts stays host-side);
// - everywhere else (the fused tail's last layer, or all of it with the stage grain, inference,
//   code outside RoundPipe) save_for_recompute does
//   nothing and recompute_data returns nullopt, so a layer written this way also runs plainly.
// The first pass happens-before its recompute through the stage hand-overs (the recompute needs
// gradients that depend on the first pass's output), so no further synchronization is needed.
// Keep the tensors small (indices, counts): they stay on the forward's device until the recompute.
// Thread-safety: the functions act on the calling thread's current layer pass only.

/// Keeps `tensors` under `key` for the recompute of the current layer pass (see the Note). A
/// second save under the same key in one pass replaces the first.
void save_for_recompute(const std::string& key, std::vector<at::Tensor> tensors);

/// In a recompute: the tensors the recomputed pass saved under `key` (nullopt if it saved none
/// under that key). Elsewhere: nullopt.
std::optional<std::vector<at::Tensor>> recompute_data(const std::string& key);

/// True when the current layer pass is a recompute.
bool in_recompute();

namespace detail {

/// The per-(layer, microbatch) store behind the functions above; owned by a run (RunContext).
struct RecomputeSlot {
  std::vector<std::pair<std::string, std::vector<at::Tensor>>> entries;
};

/// What a layer pass may do with its slot.
enum class PassKind { kPlain, kSaves, kReplays };

/// Installs `slot` (may be null for kPlain) as the calling thread's current layer pass for the
/// scope's lifetime, and restores the previous one after (passes do not nest in practice).
class RecomputePassScope {
 public:
  RecomputePassScope(RecomputeSlot* slot, PassKind kind, c10::Device device);
  ~RecomputePassScope();
  RecomputePassScope(const RecomputePassScope&) = delete;
  RecomputePassScope& operator=(const RecomputePassScope&) = delete;

 private:
  RecomputeSlot* previous_slot_;
  PassKind previous_kind_;
  c10::Device previous_device_;
};

}  // namespace detail
}  // namespace roundpipe
