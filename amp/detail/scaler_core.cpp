#include "amp/detail/scaler_core.h"

#include <ATen/ATen.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <algorithm>
#include <chrono>

namespace roundpipe::amp::detail {

// Note [Cross-thread GradScaler]:
// Inside RoundPipe, scale() runs in loss_fn on a device worker, unscale_/step in the step
// function on the optimizer thread, update() on the caller's thread. Three mechanisms make that
// exact (the next iteration's scale is torch.amp.GradScaler's, no lag) without making update()
// wait for the optimizer thread:
//  1. Flags from the workers. A ScaleObserver installed around loss_fn tells the runtime which
//     scaler the run used and its update generation g (number of update() calls so far). Right
//     after each backward stage, the worker checks that stage's parameter gradients for inf/NaN
//     on its device and posts the flag, tagged (g, run), into the lock-free FoundInfInbox (with
//     a CUDA event, no host sync). Once the run's losses are known, the runtime announces how
//     many flags it will post (expect_found_inf; its backward stages may still run, Note
//     [Overlapping iterations]); flags of a run that failed are dropped, like its gradients:
//     never announced, or cancelled by a marker in the inbox (drop_run) when the run failed in
//     its background tail.
//  2. update() combines the announced flags of generation g and applies _amp_update_scale_. If
//     some are still in flight it records a deferred update and returns at once; the update
//     completes, in order, in the first later call that reads or writes the scale (scale() on a
//     worker, get_scale, state_dict, update, ...), which waits for those flags only. Settings
//     (factors, interval) are those in force at the update() call.
//  3. The optimizer job of iteration k runs the step function inside an IterationScope holding
//     a copy of the scale iteration k was scaled with and per-optimizer states private to the
//     iteration: unscale_/step there never touch the live scale or states. unscale_/step called
//     outside a scope (e.g. on the caller's thread, to clip gradients) are marshalled through the
//     runtime's Executor onto the optimizer thread, into the pending iteration's scope.
// The optimizer thread decides to skip from the master gradients it unscales (as torch does),
// the scale update from the workers' flags: both see the same gradients, so they agree.
//
// Note [Scale across streams]: on a GPU the scale and growth tracker are written on the stream
// current on the writing thread (a worker's compute stream for the lazy init inside loss_fn, the
// caller's stream for update()) and read on other threads' streams. Every write records
// `scale_written` on the writer's stream; every read first makes the reader's current stream wait
// for it (no host sync). Scales on the CPU need neither.

namespace {

constexpr auto kFlagTimeout = std::chrono::minutes(10);
const char* kNoInfChecksPriorToUpdate = "No inf checks were recorded prior to update.";

}  // namespace

void ScalerCore::lazy_init_locked(const c10::Device& device, double init_scale, int64_t init_growth_tracker) {
  TORCH_INTERNAL_ASSERT(!growth_tracker.defined(), "_growth_tracker initialized before _scale");
  scale = at::full({}, init_scale, at::TensorOptions().dtype(at::kFloat).device(device));
  growth_tracker = at::full({}, init_growth_tracker, at::TensorOptions().dtype(at::kInt).device(device));
  scale_written_locked();
}

void ScalerCore::scale_written_locked() {
  if (!scale.defined() || scale.is_cpu()) return;
  c10::impl::VirtualGuardImpl guard(scale.device().type());
  if (!scale_written) scale_written.emplace(scale.device().type());
  scale_written->record(guard.getStream(scale.device()));
}

void ScalerCore::scale_ready_locked() {
  if (!scale_written || !scale.defined() || scale.is_cpu()) return;
  c10::impl::VirtualGuardImpl guard(scale.device().type());
  scale_written->block(guard.getStream(scale.device()));
}

void ScalerCore::collect_posted_flags_locked() {
  for (auto& flag : inbox.drain()) {
    const bool open = flag.generation >= generation || (deferred && deferred->generation == flag.generation);
    if (!open) continue;
    if (flag.cancel) {
      // The run failed after it was announced: none of its flags count (posted ones that arrive
      // in the same drain land in `received` without an announcement, and are dropped with it).
      if (auto e = expected.find(flag.generation); e != expected.end()) e->second.erase(flag.batch);
      if (auto r = received.find(flag.generation); r != received.end()) r->second.erase(flag.batch);
      continue;
    }
    received[flag.generation][flag.batch].push_back(std::move(flag.found_inf));
  }
}

bool ScalerCore::flags_complete_locked(int64_t gen) const {
  auto expected_it = expected.find(gen);
  if (expected_it == expected.end()) return true;
  auto received_it = received.find(gen);
  for (const auto& [run, count] : expected_it->second) {
    if (count == 0) continue;
    if (received_it == received.end()) return false;
    auto flags = received_it->second.find(run);
    if (flags == received_it->second.end() || static_cast<int64_t>(flags->second.size()) < count) return false;
  }
  return true;
}

std::vector<at::Tensor> ScalerCore::take_flags_locked(int64_t gen) {
  std::vector<at::Tensor> out;
  auto expected_it = expected.find(gen);
  auto received_it = received.find(gen);
  if (expected_it != expected.end() && received_it != received.end()) {
    for (const auto& entry : expected_it->second) {
      auto flags = received_it->second.find(entry.first);
      if (flags != received_it->second.end()) out.insert(out.end(), flags->second.begin(), flags->second.end());
    }
  }
  // Everything of this generation and older is settled; flags of unannounced runs are dropped.
  expected.erase(expected.begin(), expected.upper_bound(gen));
  received.erase(received.begin(), received.upper_bound(gen));
  return out;
}

void ScalerCore::complete_deferred_update_locked() {
  if (!deferred) return;
  const auto deadline = std::chrono::steady_clock::now() + kFlagTimeout;
  for (;;) {
    collect_posted_flags_locked();
    if (flags_complete_locked(deferred->generation)) break;
    const auto now = std::chrono::steady_clock::now();
    TORCH_CHECK(now < deadline, "GradScaler: waited ",
                std::chrono::duration_cast<std::chrono::seconds>(kFlagTimeout).count(),
                " s for the found_inf flags of update ", deferred->generation,
                " that the runtime announced; a device worker stopped without posting them. The scale was not "
                "updated; call update(new_scale) to set it explicitly.");
    // Slices bound the cost of any missed wakeup; a post normally wakes the wait at once.
    inbox.wait_for_post(std::min(deadline, now + std::chrono::milliseconds(50)));
  }
  Deferred done = std::move(*deferred);
  deferred.reset();
  auto flags = take_flags_locked(done.generation);
  done.found_infs.insert(done.found_infs.end(), flags.begin(), flags.end());
  apply_update_locked(std::move(done.found_infs), done.growth_factor, done.backoff_factor, done.growth_interval);
}

void ScalerCore::apply_update_locked(std::vector<at::Tensor> found_infs, double growth_factor, double backoff_factor,
                                     int64_t growth_interval) {
  TORCH_CHECK(!found_infs.empty(), kNoInfChecksPriorToUpdate);
  const auto options = at::TensorOptions().dtype(at::kFloat).device(scale.device());
  // A fresh tensor: summing in place must not alter the caller's (or an optimizer's) found_inf.
  auto combined = found_infs[0].reshape({}).to(options, /*non_blocking=*/true, /*copy=*/true);
  for (size_t i = 1; i < found_infs.size(); ++i) {
    combined.add_(found_infs[i].reshape({}).to(options, /*non_blocking=*/true));
  }
  scale_ready_locked();
  at::_amp_update_scale_(scale, growth_tracker, combined, growth_factor, backoff_factor, growth_interval);
  scale_written_locked();
}

}  // namespace roundpipe::amp::detail
