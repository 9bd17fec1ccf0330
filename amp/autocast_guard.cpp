#include "amp/autocast_guard.h"

#include <ATen/autocast_mode.h>
#include <c10/util/Exception.h>

namespace roundpipe::amp {
namespace {

void check_supported(c10::DeviceType device_type, c10::ScalarType dtype) {
  TORCH_CHECK(device_type == c10::kCPU || device_type == c10::kCUDA,
              "AutocastGuard: autocast is supported for CPU and CUDA here, got device type ", device_type);
  TORCH_CHECK(dtype == c10::kHalf || dtype == c10::kBFloat16, "AutocastGuard: the autocast dtype on ", device_type,
              " must be Half or BFloat16, got ", dtype);
}

}  // namespace

AutocastGuard::AutocastGuard(c10::DeviceType device_type, c10::ScalarType dtype, bool enabled)
    : device_type_(device_type) {
  check_supported(device_type, dtype);
  prev_enabled_ = at::autocast::is_autocast_enabled(device_type_);
  prev_dtype_ = at::autocast::get_autocast_dtype(device_type_);
  prev_cache_enabled_ = at::autocast::is_autocast_cache_enabled();
  at::autocast::set_autocast_enabled(device_type_, enabled);
  at::autocast::set_autocast_dtype(device_type_, dtype);
  at::autocast::increment_nesting();
}

AutocastGuard::~AutocastGuard() noexcept {
  // Drop the cast cache when leaving the outermost autocast region (torch.autocast.__exit__).
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  at::autocast::set_autocast_enabled(device_type_, prev_enabled_);
  at::autocast::set_autocast_dtype(device_type_, prev_dtype_);
  at::autocast::set_autocast_cache_enabled(prev_cache_enabled_);
}

AutocastState AutocastState::capture() {
  AutocastState state;
  state.cpu_enabled = at::autocast::is_autocast_enabled(c10::kCPU);
  state.cpu_dtype = at::autocast::get_autocast_dtype(c10::kCPU);
  state.cuda_enabled = at::autocast::is_autocast_enabled(c10::kCUDA);
  state.cuda_dtype = at::autocast::get_autocast_dtype(c10::kCUDA);
  state.cache_enabled = at::autocast::is_autocast_cache_enabled();
  return state;
}

void AutocastState::apply() const {
  at::autocast::set_autocast_enabled(c10::kCPU, cpu_enabled);
  at::autocast::set_autocast_dtype(c10::kCPU, cpu_dtype);
  at::autocast::set_autocast_enabled(c10::kCUDA, cuda_enabled);
  at::autocast::set_autocast_dtype(c10::kCUDA, cuda_dtype);
  at::autocast::set_autocast_cache_enabled(cache_enabled);
}

AutocastState::Guard::Guard(const AutocastState& state) : previous_(AutocastState::capture()) {
  state.apply();
  at::autocast::increment_nesting();
}

AutocastState::Guard::~Guard() noexcept {
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  previous_.apply();
}

}  // namespace roundpipe::amp
