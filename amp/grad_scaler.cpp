// GradScaler: the port of torch.amp.GradScaler. Its state lives in detail::ScalerCore; the
// cross-thread machinery the runtime drives is in amp/detail/ (Note [Cross-thread GradScaler]).
#include "amp/grad_scaler.h"

#include <ATen/ATen.h>
#include <torch/optim/optimizer.h>

#include <algorithm>
#include <string>

#include "amp/detail/scaler_core.h"
#include "amp/detail/unscale.h"
#include "base/logging.h"

namespace roundpipe::amp {
namespace {

using detail::OptimizerStates;
using detail::OptState;

const Logger& logger() {
  static const Logger& instance = Logger::get("amp");
  return instance;
}

const char* kNoInfChecksForOptimizer = "No inf checks were recorded for this optimizer.";

std::string scale_is_none_message(const char* funcname) {
  return std::string("Attempted ") + funcname +
         " but _scale is None.  This may indicate your script did not use scaler.scale(loss or outputs) "
         "earlier in the iteration.";
}

// Note [Scaler calls on RoundPipe's threads]:
// Inside RoundPipe, loss_fn runs on a device worker (a ScaleObserver is installed there) and may
// only call scale(); unscale_/step belong in the step function and update() on the caller's
// thread. Called from loss_fn, unscale_/step would move gradients of an iteration still being
// computed and update() would change the scale in the middle of a run; called from a step
// function (inside an IterationScope, on the optimizer thread), update() would race the
// caller's next iteration (async) for the scale. Both used to go through silently; they now
// throw here, and RoundPipe reports the error at the call that ran the callback.
void check_not_in_loss_fn(const char* funcname) {
  TORCH_CHECK(detail::current_scale_observer() == nullptr, "GradScaler::", funcname,
              "() called inside a RoundPipe loss_fn (on a device worker thread); loss_fn may only call scale(): "
              "call unscale_/step in the step function passed to RoundPipe::step and update() on your own thread "
              "after step() returns (docs/amp.md, \"With RoundPipe\")");
}

const at::Tensor& checked_scale(const at::Tensor& scale, const char* funcname) {
  TORCH_CHECK(scale.defined(), scale_is_none_message(funcname));
  return scale;
}

void unscale_in(OptimizerStates& states, const at::Tensor& scale, torch::optim::Optimizer& optimizer) {
  auto& state = states[&optimizer];
  TORCH_CHECK(state.stage != OptState::kUnscaled,
              "unscale_() has already been called on this optimizer since the last update().");
  TORCH_CHECK(state.stage != OptState::kStepped, "unscale_() is being called after step().");

  // FP32 division can be imprecise for certain compile options, so the reciprocal is taken in FP64
  // (as torch does).
  auto inv_scale = scale.to(at::kDouble).reciprocal().to(at::kFloat);
  std::vector<at::Tensor> grads;
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& param : group.params()) grads.push_back(param.grad());
  }
  state.found_inf_per_device = detail::non_finite_check_and_unscale(grads, inv_scale, /*allow_fp16=*/false);
  state.stage = OptState::kUnscaled;
}

bool step_in(OptimizerStates& states, const at::Tensor& scale, torch::optim::Optimizer& optimizer) {
  auto& state = states[&optimizer];
  TORCH_CHECK(state.stage != OptState::kStepped, "step() has already been called since the last update().");
  if (state.stage == OptState::kReady) unscale_in(states, scale, optimizer);
  TORCH_CHECK(!state.found_inf_per_device.empty(), kNoInfChecksForOptimizer);

  double found_inf = 0.0;
  for (const auto& entry : state.found_inf_per_device) found_inf += entry.second.item<double>();
  const bool run = found_inf == 0.0;
  if (run) {
    optimizer.step();
  } else {
    ROUNDPIPE_LOG(logger(), kDebug, "GradScaler: inf/NaN gradients, optimizer step skipped (scale ",
                  scale.item<double>(), ")");
  }
  state.stage = OptState::kStepped;
  return run;
}

}  // namespace

GradScaler::GradScaler(GradScalerOptions options)
    : enabled_(options.enabled()),
      init_scale_(options.init_scale()),
      growth_factor_(options.growth_factor()),
      backoff_factor_(options.backoff_factor()),
      growth_interval_(options.growth_interval()),
      core_(std::make_unique<detail::ScalerCore>()) {
  if (enabled_) {
    TORCH_CHECK(growth_factor_ > 1.0, "The growth factor must be > 1.0. (GradScalerOptions::growth_factor is ",
                growth_factor_, ")");
    TORCH_CHECK(backoff_factor_ < 1.0 && backoff_factor_ > 0.0,
                "The backoff factor must be < 1.0 and > 0.0. (GradScalerOptions::backoff_factor is ",
                backoff_factor_, ")");
    TORCH_CHECK(growth_interval_ > 0, "The growth interval must be > 0. (GradScalerOptions::growth_interval is ",
                growth_interval_, ")");
  }
}

GradScaler::GradScaler(GradScaler&&) noexcept = default;
GradScaler& GradScaler::operator=(GradScaler&&) noexcept = default;
GradScaler::~GradScaler() = default;

at::Tensor GradScaler::scale(const at::Tensor& outputs) {
  if (!enabled_) return outputs;
  return scale(std::vector<at::Tensor>{outputs}).front();
}

std::vector<at::Tensor> GradScaler::scale(const std::vector<at::Tensor>& outputs) {
  if (!enabled_) return outputs;
  detail::ScalerCore& core = *core_;
  std::vector<std::pair<c10::Device, at::Tensor>> per_device_scale;  // torch's _MultiDeviceReplicator
  int64_t generation = 0;
  {
    std::lock_guard<std::mutex> lock(core.mutex);
    core.complete_deferred_update_locked();
    if (!outputs.empty() && !core.scale.defined()) {
      core.lazy_init_locked(outputs.front().device(), init_scale_, init_growth_tracker_);
    }
    core.scale_ready_locked();
    for (const auto& output : outputs) {
      auto it = std::find_if(per_device_scale.begin(), per_device_scale.end(),
                             [&](const auto& entry) { return entry.first == output.device(); });
      if (it == per_device_scale.end()) {
        per_device_scale.emplace_back(output.device(), core.scale.to(at::TensorOptions().device(output.device()),
                                                                     /*non_blocking=*/true, /*copy=*/true));
      }
    }
    generation = core.generation;
  }
  if (auto* observer = detail::current_scale_observer(); observer != nullptr && !outputs.empty()) {
    observer->on_scale(*this, generation);
  }
  std::vector<at::Tensor> scaled;
  scaled.reserve(outputs.size());
  for (const auto& output : outputs) {
    auto it = std::find_if(per_device_scale.begin(), per_device_scale.end(),
                           [&](const auto& entry) { return entry.first == output.device(); });
    scaled.push_back(output * it->second);
  }
  return scaled;
}

void GradScaler::unscale_(torch::optim::Optimizer& optimizer) {
  if (!enabled_) return;
  check_not_in_loss_fn("unscale_");
  if (detail::Iteration* iteration = detail::scope_iteration(*this)) {
    TORCH_CHECK(iteration->scale.defined(), scale_is_none_message("unscale_"));
    unscale_in(iteration->states, iteration->scale, optimizer);
    return;
  }
  detail::ScalerCore& core = *core_;
  std::shared_ptr<const detail::Executor> run;
  {
    std::lock_guard<std::mutex> lock(core.mutex);
    run = core.executor.lock();
  }
  if (run) {
    (*run)([&] { unscale_(optimizer); });
    return;
  }
  std::lock_guard<std::mutex> lock(core.mutex);
  core.complete_deferred_update_locked();
  core.scale_ready_locked();
  unscale_in(core.per_optimizer_states, checked_scale(core.scale, "unscale_"), optimizer);
}

bool GradScaler::step(torch::optim::Optimizer& optimizer) {
  if (!enabled_) {
    optimizer.step();
    return true;
  }
  check_not_in_loss_fn("step");
  if (detail::Iteration* iteration = detail::scope_iteration(*this)) {
    TORCH_CHECK(iteration->scale.defined(), scale_is_none_message("step"));
    return step_in(iteration->states, iteration->scale, optimizer);
  }
  detail::ScalerCore& core = *core_;
  std::shared_ptr<const detail::Executor> run;
  {
    std::lock_guard<std::mutex> lock(core.mutex);
    run = core.executor.lock();
  }
  if (run) {
    bool stepped = false;
    (*run)([&] { stepped = step(optimizer); });
    return stepped;
  }
  std::lock_guard<std::mutex> lock(core.mutex);
  core.complete_deferred_update_locked();
  core.scale_ready_locked();
  return step_in(core.per_optimizer_states, checked_scale(core.scale, "step"), optimizer);
}

void GradScaler::update(std::optional<double> new_scale) {
  if (!enabled_) return;
  check_not_in_loss_fn("update");
  TORCH_CHECK(detail::scope_iteration(*this) == nullptr,
              "GradScaler::update() called inside a RoundPipe step function (on the optimizer thread); call "
              "update() on your own thread after RoundPipe::step returns (docs/amp.md, \"With RoundPipe\")");
  detail::ScalerCore& core = *core_;
  std::lock_guard<std::mutex> lock(core.mutex);
  core.complete_deferred_update_locked();
  checked_scale(core.scale, "update");
  const int64_t generation = core.generation;
  core.collect_posted_flags_locked();
  if (new_scale.has_value()) {
    core.scale_ready_locked();
    core.scale.fill_(*new_scale);
    core.scale_written_locked();
    core.take_flags_locked(generation);  // an explicit scale ignores this iteration's flags, like torch
  } else {
    std::vector<at::Tensor> found_infs;
    for (const auto& entry : core.per_optimizer_states) {
      for (const auto& device_found_inf : entry.second.found_inf_per_device) {
        found_infs.push_back(device_found_inf.second);
      }
    }
    if (core.flags_complete_locked(generation)) {
      auto flags = core.take_flags_locked(generation);
      found_infs.insert(found_infs.end(), flags.begin(), flags.end());
      core.apply_update_locked(std::move(found_infs), growth_factor_, backoff_factor_, growth_interval_);
    } else {
      core.deferred = detail::ScalerCore::Deferred{generation, std::move(found_infs), growth_factor_,
                                                   backoff_factor_, growth_interval_};
    }
  }
  ++core.generation;
  core.per_optimizer_states.clear();
}

double GradScaler::get_scale() const {
  if (!enabled_) return 1.0;
  std::lock_guard<std::mutex> lock(core_->mutex);
  core_->complete_deferred_update_locked();
  core_->scale_ready_locked();
  return core_->scale.defined() ? static_cast<double>(core_->scale.item<float>()) : init_scale_;
}

at::Tensor GradScaler::scale_tensor() const {
  std::lock_guard<std::mutex> lock(core_->mutex);
  core_->complete_deferred_update_locked();
  core_->scale_ready_locked();
  return core_->scale.defined() ? core_->scale.clone() : at::Tensor();
}

GradScalerState GradScaler::state_dict() const {
  GradScalerState state;
  if (!enabled_) {
    state.empty = true;
    return state;
  }
  std::lock_guard<std::mutex> lock(core_->mutex);
  core_->complete_deferred_update_locked();
  core_->scale_ready_locked();
  state.scale = core_->scale.defined() ? static_cast<double>(core_->scale.item<float>()) : init_scale_;
  state.growth_factor = growth_factor_;
  state.backoff_factor = backoff_factor_;
  state.growth_interval = growth_interval_;
  state.growth_tracker =
      core_->growth_tracker.defined() ? core_->growth_tracker.item<int64_t>() : init_growth_tracker_;
  return state;
}

void GradScaler::load_state_dict(const GradScalerState& state) {
  if (!enabled_) return;
  TORCH_CHECK(!state.empty,
              "The source state dict is empty, possibly because it was saved from a disabled instance of "
              "GradScaler.");
  std::lock_guard<std::mutex> lock(core_->mutex);
  core_->complete_deferred_update_locked();
  core_->scale_ready_locked();
  init_scale_ = state.scale;
  if (core_->scale.defined()) core_->scale.fill_(state.scale);
  growth_factor_ = state.growth_factor;
  backoff_factor_ = state.backoff_factor;
  growth_interval_ = state.growth_interval;
  init_growth_tracker_ = state.growth_tracker;
  if (core_->growth_tracker.defined()) core_->growth_tracker.fill_(state.growth_tracker);
  core_->scale_written_locked();
}

}  // namespace roundpipe::amp
