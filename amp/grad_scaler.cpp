#include "amp/grad_scaler.h"

#include <ATen/ATen.h>
#include <torch/serialize/archive.h>

#include <algorithm>
#include <iterator>
#include <string>

#include "roundpipe/logging.h"

namespace roundpipe::amp {
namespace {

const Logger& logger() {
  static const Logger& instance = Logger::get("amp");
  return instance;
}

const char* kNoInfChecksForOptimizer = "No inf checks were recorded for this optimizer.";
const char* kNoInfChecksPriorToUpdate = "No inf checks were recorded prior to update.";

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

GradScaler::GradScaler(GradScalerOptions options)
    : enabled_(options.enabled()),
      init_scale_(options.init_scale()),
      growth_factor_(options.growth_factor()),
      backoff_factor_(options.backoff_factor()),
      growth_interval_(options.growth_interval()) {
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

void GradScaler::lazy_init(const c10::Device& device) {
  TORCH_INTERNAL_ASSERT(!growth_tracker_.defined(), "_growth_tracker initialized before _scale");
  scale_ = at::full({}, init_scale_, at::TensorOptions().dtype(at::kFloat).device(device));
  growth_tracker_ = at::full({}, init_growth_tracker_, at::TensorOptions().dtype(at::kInt).device(device));
}

const at::Tensor& GradScaler::checked_scale(const char* funcname) const {
  TORCH_CHECK(scale_.defined(), "Attempted ", funcname,
              " but _scale is None.  This may indicate your script did not use scaler.scale(loss or outputs) "
              "earlier in the iteration.");
  return scale_;
}

at::Tensor GradScaler::scale(const at::Tensor& outputs) {
  if (!enabled_) return outputs;
  if (!scale_.defined()) lazy_init(outputs.device());
  return outputs * scale_.to(at::TensorOptions().device(outputs.device()), /*non_blocking=*/true);
}

std::vector<at::Tensor> GradScaler::scale(const std::vector<at::Tensor>& outputs) {
  if (!enabled_) return outputs;
  std::vector<at::Tensor> scaled;
  scaled.reserve(outputs.size());
  std::vector<std::pair<c10::Device, at::Tensor>> per_device_scale;  // torch's _MultiDeviceReplicator
  for (const auto& output : outputs) {
    if (!scale_.defined()) lazy_init(output.device());
    auto it = std::find_if(per_device_scale.begin(), per_device_scale.end(),
                           [&](const auto& entry) { return entry.first == output.device(); });
    if (it == per_device_scale.end()) {
      per_device_scale.emplace_back(output.device(),
                                    scale_.to(at::TensorOptions().device(output.device()), /*non_blocking=*/true));
      it = std::prev(per_device_scale.end());
    }
    scaled.push_back(output * it->second);
  }
  return scaled;
}

void GradScaler::unscale_(torch::optim::Optimizer& optimizer) {
  if (!enabled_) return;
  unscale_with(optimizer, checked_scale("unscale_"));
}

void GradScaler::unscale_(torch::optim::Optimizer& optimizer, const at::Tensor& scale) {
  if (!enabled_) return;
  checked_scale("unscale_");
  unscale_with(optimizer, scale);
}

void GradScaler::unscale_with(torch::optim::Optimizer& optimizer, const at::Tensor& scale) {
  TORCH_CHECK(scale.defined() && scale.numel() == 1 && scale.scalar_type() == at::kFloat,
              "GradScaler::unscale_: the scale must be a 1-element float32 tensor, got ",
              scale.defined() ? scale.toString() : std::string("an undefined tensor"));
  auto& state = per_optimizer_states_[&optimizer];
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

bool GradScaler::step(torch::optim::Optimizer& optimizer) { return step_with(optimizer, nullptr); }

bool GradScaler::step(torch::optim::Optimizer& optimizer, const at::Tensor& scale) {
  return step_with(optimizer, &scale);
}

bool GradScaler::step_with(torch::optim::Optimizer& optimizer, const at::Tensor* scale) {
  if (!enabled_) {
    optimizer.step();
    return true;
  }
  checked_scale("step");
  auto& state = per_optimizer_states_[&optimizer];
  TORCH_CHECK(state.stage != OptState::kStepped, "step() has already been called since the last update().");
  if (state.stage == OptState::kReady) unscale_with(optimizer, scale != nullptr ? *scale : scale_);
  TORCH_CHECK(!state.found_inf_per_device.empty(), kNoInfChecksForOptimizer);

  double found_inf = 0.0;
  for (const auto& entry : state.found_inf_per_device) found_inf += entry.second.item<double>();
  const bool run = found_inf == 0.0;
  if (run) {
    optimizer.step();
  } else {
    ROUNDPIPE_LOG(logger(), kDebug, "GradScaler: inf/NaN gradients, optimizer step skipped (scale ",
                  (scale != nullptr ? *scale : scale_).item<double>(), ")");
  }
  state.stage = OptState::kStepped;
  return run;
}

void GradScaler::update(std::optional<double> new_scale) {
  if (!enabled_) return;
  checked_scale("update");
  if (new_scale.has_value()) {
    scale_.fill_(*new_scale);
  } else {
    std::vector<at::Tensor> found_infs;
    for (const auto& entry : per_optimizer_states_) {
      for (const auto& device_found_inf : entry.second.found_inf_per_device) {
        found_infs.push_back(device_found_inf.second);
      }
    }
    apply_update(std::move(found_infs));
  }
  per_optimizer_states_.clear();
}

void GradScaler::update_from_found_inf(const std::vector<at::Tensor>& found_infs) {
  if (!enabled_) return;
  checked_scale("update");
  for (const auto& found_inf : found_infs) {
    TORCH_CHECK(found_inf.defined() && found_inf.numel() == 1,
                "GradScaler::update_from_found_inf: every found_inf must be a 1-element tensor");
  }
  apply_update(found_infs);
  per_optimizer_states_.clear();
}

void GradScaler::apply_update(std::vector<at::Tensor> found_infs) {
  TORCH_CHECK(!found_infs.empty(), kNoInfChecksPriorToUpdate);
  const auto options = at::TensorOptions().dtype(at::kFloat).device(scale_.device());
  // A fresh tensor: summing in place must not alter the caller's (or an optimizer's) found_inf.
  auto combined = found_infs[0].reshape({}).to(options, /*non_blocking=*/true, /*copy=*/true);
  for (size_t i = 1; i < found_infs.size(); ++i) {
    combined.add_(found_infs[i].reshape({}).to(options, /*non_blocking=*/true));
  }
  at::_amp_update_scale_(scale_, growth_tracker_, combined, growth_factor_, backoff_factor_, growth_interval_);
}

double GradScaler::get_scale() const {
  if (!enabled_) return 1.0;
  return scale_.defined() ? static_cast<double>(scale_.item<float>()) : init_scale_;
}

at::Tensor GradScaler::scale_tensor() const { return scale_.defined() ? scale_.clone() : at::Tensor(); }

GradScalerState GradScaler::state_dict() const {
  GradScalerState state;
  if (!enabled_) {
    state.empty = true;
    return state;
  }
  state.scale = get_scale();
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
  init_scale_ = state.scale;
  if (scale_.defined()) scale_.fill_(state.scale);
  growth_factor_ = state.growth_factor;
  backoff_factor_ = state.backoff_factor;
  growth_interval_ = state.growth_interval;
  init_growth_tracker_ = state.growth_tracker;
  if (growth_tracker_.defined()) growth_tracker_.fill_(state.growth_tracker);
}

}  // namespace roundpipe::amp
