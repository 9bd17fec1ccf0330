#include "amp/grad_scaler.h"

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/serialize/archive.h>

#include <algorithm>
#include <chrono>
#include <iterator>
#include <map>
#include <mutex>
#include <string>

#include "amp/detail/found_inf_inbox.h"
#include "roundpipe/logging.h"

namespace roundpipe::amp {
namespace {

const Logger& logger() {
  static const Logger& instance = Logger::get("amp");
  return instance;
}

const char* kNoInfChecksForOptimizer = "No inf checks were recorded for this optimizer.";
const char* kNoInfChecksPriorToUpdate = "No inf checks were recorded prior to update.";

std::string scale_is_none_message(const char* funcname) {
  return std::string("Attempted ") + funcname +
         " but _scale is None.  This may indicate your script did not use scaler.scale(loss or outputs) "
         "earlier in the iteration.";
}

}  // namespace

// ---- GradScalerState --------------------------------------------------------------------------

void GradScalerState::save(torch::serialize::OutputArchive& archive) const {
  archive.write("scale", c10::IValue(scale));
  archive.write("growth_factor", c10::IValue(growth_factor));
  archive.write("backoff_factor", c10::IValue(backoff_factor));
  archive.write("growth_interval", c10::IValue(growth_interval));
  archive.write("growth_tracker", c10::IValue(growth_tracker));
  archive.write("empty", c10::IValue(empty));
}

void GradScalerState::load(torch::serialize::InputArchive& archive) {
  auto read = [&archive](const char* key) {
    c10::IValue value;
    TORCH_CHECK(archive.try_read(key, value), "GradScalerState::load: the archive has no key '", key,
                "' (was it written by GradScalerState::save?)");
    return value;
  };
  auto read_double = [&read](const char* key) {
    auto value = read(key);
    TORCH_CHECK(value.isDouble(), "GradScalerState::load: key '", key, "' holds a ", value.tagKind(),
                ", expected a double");
    return value.toDouble();
  };
  auto read_int = [&read](const char* key) {
    auto value = read(key);
    TORCH_CHECK(value.isInt(), "GradScalerState::load: key '", key, "' holds a ", value.tagKind(),
                ", expected an int");
    return value.toInt();
  };
  GradScalerState loaded;
  loaded.scale = read_double("scale");
  loaded.growth_factor = read_double("growth_factor");
  loaded.backoff_factor = read_double("backoff_factor");
  loaded.growth_interval = read_int("growth_interval");
  loaded.growth_tracker = read_int("growth_tracker");
  auto empty_value = read("empty");
  TORCH_CHECK(empty_value.isBool(), "GradScalerState::load: key 'empty' holds a ", empty_value.tagKind(),
              ", expected a bool");
  loaded.empty = empty_value.toBool();
  *this = loaded;
}

torch::serialize::OutputArchive& operator<<(torch::serialize::OutputArchive& archive,
                                            const GradScalerState& state) {
  state.save(archive);
  return archive;
}

torch::serialize::InputArchive& operator>>(torch::serialize::InputArchive& archive,
                                           GradScalerState& state) {
  state.load(archive);
  return archive;
}

// ---- Unscale kernel driver ----------------------------------------------------------------------

std::vector<std::pair<c10::Device, at::Tensor>> non_finite_check_and_unscale(
    const std::vector<at::Tensor>& grads, const at::Tensor& inv_scale, bool allow_fp16) {
  // Buckets by (device, dtype) in order of first appearance, like torch's nested defaultdicts.
  // Every gradient is validated before any is touched, so a rejected list is left unmodified.
  struct DtypeBucket {
    c10::ScalarType dtype;
    std::vector<at::Tensor> tensors;
  };
  struct DeviceBucket {
    c10::Device device;
    std::vector<DtypeBucket> by_dtype;
  };
  std::vector<DeviceBucket> buckets;
  for (const auto& grad : grads) {
    if (!grad.defined()) continue;
    TORCH_CHECK_VALUE(allow_fp16 || grad.scalar_type() != at::kHalf, "Attempting to unscale FP16 gradients.");
    at::Tensor to_unscale = grad.is_sparse() ? grad._values() : grad;
    auto device_it = std::find_if(buckets.begin(), buckets.end(),
                                  [&](const DeviceBucket& b) { return b.device == to_unscale.device(); });
    if (device_it == buckets.end()) {
      buckets.push_back(DeviceBucket{to_unscale.device(), {}});
      device_it = std::prev(buckets.end());
    }
    auto& by_dtype = device_it->by_dtype;
    auto dtype_it = std::find_if(by_dtype.begin(), by_dtype.end(),
                                 [&](const DtypeBucket& b) { return b.dtype == to_unscale.scalar_type(); });
    if (dtype_it == by_dtype.end()) {
      by_dtype.push_back(DtypeBucket{to_unscale.scalar_type(), {}});
      dtype_it = std::prev(by_dtype.end());
    }
    dtype_it->tensors.push_back(std::move(to_unscale));
  }

  std::vector<std::pair<c10::Device, at::Tensor>> found_inf_per_device;
  at::NoGradGuard no_grad;
  for (auto& bucket : buckets) {
    auto found_inf = at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(bucket.device));
    auto device_inv_scale = inv_scale.to(at::TensorOptions().device(bucket.device), /*non_blocking=*/true);
    for (auto& dtype_bucket : bucket.by_dtype) {
      at::_amp_foreach_non_finite_check_and_unscale_(dtype_bucket.tensors, found_inf, device_inv_scale);
    }
    found_inf_per_device.emplace_back(bucket.device, std::move(found_inf));
  }
  return found_inf_per_device;
}

// ---- GradScaler ---------------------------------------------------------------------------------

struct GradScaler::Iteration {
  at::Tensor scale;  // copy of the scale the iteration was scaled with (undefined: never scaled)
  OptimizerStates states;
};

struct GradScaler::CrossThread {
  // Guards scale_, growth_tracker_ and every member below except `inbox` (which is lock-free for
  // posters and drained under this mutex) .
  mutable std::mutex mutex;
  detail::FoundInfInbox inbox;
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
};

GradScaler::GradScaler(GradScalerOptions options)
    : enabled_(options.enabled()),
      init_scale_(options.init_scale()),
      growth_factor_(options.growth_factor()),
      backoff_factor_(options.backoff_factor()),
      growth_interval_(options.growth_interval()),
      xt_(std::make_unique<CrossThread>()) {
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

void GradScaler::lazy_init(const c10::Device& device) {
  TORCH_INTERNAL_ASSERT(!growth_tracker_.defined(), "_growth_tracker initialized before _scale");
  scale_ = at::full({}, init_scale_, at::TensorOptions().dtype(at::kFloat).device(device));
  growth_tracker_ = at::full({}, init_growth_tracker_, at::TensorOptions().dtype(at::kInt).device(device));
  scale_written_locked();
}

// Note [Scale across streams]: on a GPU the scale and growth tracker are written on the stream
// current on the writing thread (a worker's compute stream for the lazy init inside loss_fn, the
// caller's stream for update()) and read on other threads' streams. Every write records
// `scale_written` on the writer's stream; every read first makes the reader's current stream wait
// for it (no host sync). Scales on the CPU need neither.
void GradScaler::scale_written_locked() const {
  if (!scale_.defined() || scale_.is_cpu()) return;
  c10::impl::VirtualGuardImpl guard(scale_.device().type());
  if (!xt_->scale_written) xt_->scale_written.emplace(scale_.device().type());
  xt_->scale_written->record(guard.getStream(scale_.device()));
}

void GradScaler::scale_ready_locked() const {
  if (!xt_->scale_written || !scale_.defined() || scale_.is_cpu()) return;
  c10::impl::VirtualGuardImpl guard(scale_.device().type());
  xt_->scale_written->block(guard.getStream(scale_.device()));
}

const at::Tensor& GradScaler::checked_scale(const char* funcname) const {
  TORCH_CHECK(scale_.defined(), scale_is_none_message(funcname));
  return scale_;
}

// Note [Cross-thread GradScaler]:
// Inside RoundPipe, scale() runs in loss_fn on a device worker, unscale_/step in the step
// function on the optimizer thread, update() on the caller's thread. Three mechanisms make that
// exact (the next iteration's scale is torch.amp.GradScaler's, no lag) without making update()
// wait for the optimizer thread:
//  1. Flags from the workers. A ScaleObserver installed around loss_fn tells the runtime which
//     scaler the run used and its update generation g (number of update() calls so far). Right
//     after each backward stage, the worker checks that stage's parameter gradients for inf/NaN
//     on its device and posts the flag, tagged (g, run), into the lock-free FoundInfInbox (with
//     a CUDA event, no host sync). When the run succeeds, the runtime announces how many flags
//     it posted (expect_found_inf); flags of a run that failed are never announced and are
//     dropped, like its gradients.
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

namespace {

constexpr auto kFlagTimeout = std::chrono::minutes(10);
thread_local GradScaler::ScaleObserver* current_observer = nullptr;
thread_local GradScaler::IterationScope* current_scope = nullptr;

}  // namespace

GradScaler::ScopedScaleObserver::ScopedScaleObserver(ScaleObserver* observer) : previous_(current_observer) {
  current_observer = observer;
}
GradScaler::ScopedScaleObserver::~ScopedScaleObserver() { current_observer = previous_; }

GradScaler::IterationScope::IterationScope(const GradScaler& scaler, std::shared_ptr<Iteration> iteration)
    : scaler_(&scaler), iteration_(std::move(iteration)), previous_(current_scope) {
  TORCH_INTERNAL_ASSERT(iteration_ != nullptr, "IterationScope needs an Iteration");
  current_scope = this;
}
GradScaler::IterationScope::~IterationScope() { current_scope = previous_; }

GradScaler::Iteration* GradScaler::scope_iteration() const {
  for (IterationScope* s = current_scope; s != nullptr; s = s->previous_) {
    if (s->scaler_ == this) return s->iteration_.get();
  }
  return nullptr;
}

void GradScaler::collect_posted_flags_locked() const {
  for (auto& flag : xt_->inbox.drain()) {
    const bool open = flag.generation >= xt_->generation ||
                      (xt_->deferred && xt_->deferred->generation == flag.generation);
    if (open) xt_->received[flag.generation][flag.batch].push_back(std::move(flag.found_inf));
  }
}

bool GradScaler::flags_complete_locked(int64_t generation) const {
  auto expected = xt_->expected.find(generation);
  if (expected == xt_->expected.end()) return true;
  auto received = xt_->received.find(generation);
  for (const auto& [run, count] : expected->second) {
    if (count == 0) continue;
    if (received == xt_->received.end()) return false;
    auto flags = received->second.find(run);
    if (flags == received->second.end() || static_cast<int64_t>(flags->second.size()) < count) return false;
  }
  return true;
}

std::vector<at::Tensor> GradScaler::take_flags_locked(int64_t generation) const {
  std::vector<at::Tensor> out;
  auto expected = xt_->expected.find(generation);
  auto received = xt_->received.find(generation);
  if (expected != xt_->expected.end() && received != xt_->received.end()) {
    for (const auto& entry : expected->second) {
      auto flags = received->second.find(entry.first);
      if (flags != received->second.end()) out.insert(out.end(), flags->second.begin(), flags->second.end());
    }
  }
  // Everything of this generation and older is settled; flags of unannounced runs are dropped.
  xt_->expected.erase(xt_->expected.begin(), xt_->expected.upper_bound(generation));
  xt_->received.erase(xt_->received.begin(), xt_->received.upper_bound(generation));
  return out;
}

void GradScaler::complete_deferred_update_locked() const {
  if (!xt_->deferred) return;
  const auto deadline = std::chrono::steady_clock::now() + kFlagTimeout;
  for (;;) {
    collect_posted_flags_locked();
    if (flags_complete_locked(xt_->deferred->generation)) break;
    const auto now = std::chrono::steady_clock::now();
    TORCH_CHECK(now < deadline, "GradScaler: waited ",
                std::chrono::duration_cast<std::chrono::seconds>(kFlagTimeout).count(),
                " s for the found_inf flags of update ", xt_->deferred->generation,
                " that the runtime announced; a device worker stopped without posting them. The scale was not "
                "updated; call update(new_scale) to set it explicitly.");
    // Slices bound the cost of any missed wakeup; a post normally wakes the wait at once.
    xt_->inbox.wait_for_post(std::min(deadline, now + std::chrono::milliseconds(50)));
  }
  CrossThread::Deferred deferred = std::move(*xt_->deferred);
  xt_->deferred.reset();
  auto flags = take_flags_locked(deferred.generation);
  deferred.found_infs.insert(deferred.found_infs.end(), flags.begin(), flags.end());
  apply_update(std::move(deferred.found_infs), deferred.growth_factor, deferred.backoff_factor,
               deferred.growth_interval);
}

void GradScaler::post_found_inf(int64_t generation, uint64_t batch, const at::Tensor& found_inf) {
  if (!enabled_) return;
  TORCH_CHECK(found_inf.defined() && found_inf.numel() == 1,
              "GradScaler::post_found_inf: found_inf must be a 1-element tensor");
  xt_->inbox.post(detail::FoundInfFlag{generation, batch, found_inf});
}

void GradScaler::expect_found_inf(int64_t generation, uint64_t batch, int64_t count) {
  if (!enabled_) return;
  TORCH_CHECK(count >= 0, "GradScaler::expect_found_inf: count must be >= 0, got ", count);
  std::lock_guard<std::mutex> lock(xt_->mutex);
  TORCH_CHECK(generation >= xt_->generation, "GradScaler::expect_found_inf: update ", generation,
              " already ran; a run's flags must be announced before the update() that follows its scale()");
  xt_->expected[generation][batch] += count;
}

std::shared_ptr<GradScaler::Iteration> GradScaler::capture_iteration() {
  auto iteration = std::make_shared<Iteration>();
  std::lock_guard<std::mutex> lock(xt_->mutex);
  complete_deferred_update_locked();
  scale_ready_locked();
  if (scale_.defined()) iteration->scale = scale_.clone();
  return iteration;
}

void GradScaler::set_executor(std::weak_ptr<const Executor> executor) {
  std::lock_guard<std::mutex> lock(xt_->mutex);
  xt_->executor = std::move(executor);
}

std::shared_ptr<const GradScaler::Executor> GradScaler::executor() const {
  std::lock_guard<std::mutex> lock(xt_->mutex);
  return xt_->executor.lock();
}

at::Tensor GradScaler::scale(const at::Tensor& outputs) {
  if (!enabled_) return outputs;
  return scale(std::vector<at::Tensor>{outputs}).front();
}

std::vector<at::Tensor> GradScaler::scale(const std::vector<at::Tensor>& outputs) {
  if (!enabled_) return outputs;
  std::vector<std::pair<c10::Device, at::Tensor>> per_device_scale;  // torch's _MultiDeviceReplicator
  int64_t generation = 0;
  {
    std::lock_guard<std::mutex> lock(xt_->mutex);
    complete_deferred_update_locked();
    if (!outputs.empty() && !scale_.defined()) lazy_init(outputs.front().device());
    scale_ready_locked();
    for (const auto& output : outputs) {
      auto it = std::find_if(per_device_scale.begin(), per_device_scale.end(),
                             [&](const auto& entry) { return entry.first == output.device(); });
      if (it == per_device_scale.end()) {
        per_device_scale.emplace_back(output.device(), scale_.to(at::TensorOptions().device(output.device()),
                                                                 /*non_blocking=*/true, /*copy=*/true));
      }
    }
    generation = xt_->generation;
  }
  if (current_observer != nullptr && !outputs.empty()) current_observer->on_scale(*this, generation);
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
  if (Iteration* iteration = scope_iteration()) {
    TORCH_CHECK(iteration->scale.defined(), scale_is_none_message("unscale_"));
    unscale_in(iteration->states, iteration->scale, optimizer);
    return;
  }
  if (auto run = executor()) {
    (*run)([&] { unscale_(optimizer); });
    return;
  }
  std::lock_guard<std::mutex> lock(xt_->mutex);
  complete_deferred_update_locked();
  scale_ready_locked();
  unscale_in(per_optimizer_states_, checked_scale("unscale_"), optimizer);
}

void GradScaler::unscale_in(OptimizerStates& states, const at::Tensor& scale, torch::optim::Optimizer& optimizer) {
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
  state.found_inf_per_device = non_finite_check_and_unscale(grads, inv_scale, /*allow_fp16=*/false);
  state.stage = OptState::kUnscaled;
}

bool GradScaler::step(torch::optim::Optimizer& optimizer) {
  if (!enabled_) {
    optimizer.step();
    return true;
  }
  if (Iteration* iteration = scope_iteration()) {
    TORCH_CHECK(iteration->scale.defined(), scale_is_none_message("step"));
    return step_in(iteration->states, iteration->scale, optimizer);
  }
  if (auto run = executor()) {
    bool stepped = false;
    (*run)([&] { stepped = step(optimizer); });
    return stepped;
  }
  std::lock_guard<std::mutex> lock(xt_->mutex);
  complete_deferred_update_locked();
  scale_ready_locked();
  return step_in(per_optimizer_states_, checked_scale("step"), optimizer);
}

bool GradScaler::step_in(OptimizerStates& states, const at::Tensor& scale, torch::optim::Optimizer& optimizer) {
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

void GradScaler::update(std::optional<double> new_scale) {
  if (!enabled_) return;
  std::lock_guard<std::mutex> lock(xt_->mutex);
  complete_deferred_update_locked();
  checked_scale("update");
  const int64_t generation = xt_->generation;
  collect_posted_flags_locked();
  if (new_scale.has_value()) {
    scale_ready_locked();
    scale_.fill_(*new_scale);
    scale_written_locked();
    take_flags_locked(generation);  // an explicit scale ignores this iteration's flags, like torch
  } else {
    std::vector<at::Tensor> found_infs;
    for (const auto& entry : per_optimizer_states_) {
      for (const auto& device_found_inf : entry.second.found_inf_per_device) {
        found_infs.push_back(device_found_inf.second);
      }
    }
    if (flags_complete_locked(generation)) {
      auto flags = take_flags_locked(generation);
      found_infs.insert(found_infs.end(), flags.begin(), flags.end());
      apply_update(std::move(found_infs), growth_factor_, backoff_factor_, growth_interval_);
    } else {
      xt_->deferred = CrossThread::Deferred{generation, std::move(found_infs), growth_factor_, backoff_factor_,
                                            growth_interval_};
    }
  }
  ++xt_->generation;
  per_optimizer_states_.clear();
}

void GradScaler::apply_update(std::vector<at::Tensor> found_infs, double growth_factor, double backoff_factor,
                              int64_t growth_interval) const {
  TORCH_CHECK(!found_infs.empty(), kNoInfChecksPriorToUpdate);
  const auto options = at::TensorOptions().dtype(at::kFloat).device(scale_.device());
  // A fresh tensor: summing in place must not alter the caller's (or an optimizer's) found_inf.
  auto combined = found_infs[0].reshape({}).to(options, /*non_blocking=*/true, /*copy=*/true);
  for (size_t i = 1; i < found_infs.size(); ++i) {
    combined.add_(found_infs[i].reshape({}).to(options, /*non_blocking=*/true));
  }
  scale_ready_locked();
  at::_amp_update_scale_(scale_, growth_tracker_, combined, growth_factor, backoff_factor, growth_interval);
  scale_written_locked();
}

double GradScaler::get_scale() const {
  if (!enabled_) return 1.0;
  std::lock_guard<std::mutex> lock(xt_->mutex);
  complete_deferred_update_locked();
  scale_ready_locked();
  return scale_.defined() ? static_cast<double>(scale_.item<float>()) : init_scale_;
}

at::Tensor GradScaler::scale_tensor() const {
  std::lock_guard<std::mutex> lock(xt_->mutex);
  complete_deferred_update_locked();
  scale_ready_locked();
  return scale_.defined() ? scale_.clone() : at::Tensor();
}

GradScalerState GradScaler::state_dict() const {
  GradScalerState state;
  if (!enabled_) {
    state.empty = true;
    return state;
  }
  std::lock_guard<std::mutex> lock(xt_->mutex);
  complete_deferred_update_locked();
  scale_ready_locked();
  state.scale = scale_.defined() ? static_cast<double>(scale_.item<float>()) : init_scale_;
  state.growth_factor = growth_factor_;
  state.backoff_factor = backoff_factor_;
  state.growth_interval = growth_interval_;
  state.growth_tracker = growth_tracker_.defined() ? growth_tracker_.item<int64_t>() : init_growth_tracker_;
  return state;
}

void GradScaler::load_state_dict(const GradScalerState& state) {
  if (!enabled_) return;
  TORCH_CHECK(!state.empty,
              "The source state dict is empty, possibly because it was saved from a disabled instance of "
              "GradScaler.");
  std::lock_guard<std::mutex> lock(xt_->mutex);
  complete_deferred_update_locked();
  scale_ready_locked();
  init_scale_ = state.scale;
  if (scale_.defined()) scale_.fill_(state.scale);
  growth_factor_ = state.growth_factor;
  backoff_factor_ = state.backoff_factor;
  growth_interval_ = state.growth_interval;
  init_growth_tracker_ = state.growth_tracker;
  if (growth_tracker_.defined()) growth_tracker_.fill_(state.growth_tracker);
  scale_written_locked();
}

}  // namespace roundpipe::amp
