// roundpipe::amp autocast helpers: an RAII guard that turns LibTorch autocast on for one device type
// on the calling thread (the C++ counterpart of `with torch.autocast(device_type, dtype):`), and a
// value type that captures a thread's autocast settings so the runtime can re-apply them on its
// worker threads (autocast state is thread-local in LibTorch).
#pragma once

#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>

namespace roundpipe::amp {

/// Enables autocast for `device_type` with `dtype` on the calling thread for the guard's
/// lifetime, exactly like entering/exiting `torch.autocast(device_type, dtype)`: saves the
/// previous enabled flag, dtype and cache flag, increments the autocast nesting (the cast cache
/// is cleared when the outermost autocast region exits) and restores everything on destruction.
/// Supported: kCUDA with kHalf/kBFloat16, kCPU with kBFloat16/kHalf. `enabled = false` makes a
/// region with autocast off (like `torch.autocast(..., enabled=False)`).
///
///   {
///     roundpipe::amp::AutocastGuard autocast(c10::kCUDA, c10::kHalf);
///     auto loss = criterion(model->forward(x), y);   // matmuls run in fp16
///   }
///
/// Thread-safety: affects only the calling thread; must be destroyed on the thread that created
/// it, in LIFO order with other guards. Not copyable or movable.
class AutocastGuard {
 public:
  /// Throws c10::Error for a device type autocast does not support or a dtype it does not
  /// support on that device.
  AutocastGuard(c10::DeviceType device_type, c10::ScalarType dtype, bool enabled = true);
  ~AutocastGuard() noexcept;

  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;
  AutocastGuard(AutocastGuard&&) = delete;
  AutocastGuard& operator=(AutocastGuard&&) = delete;

 private:
  c10::DeviceType device_type_;
  bool prev_enabled_;
  c10::ScalarType prev_dtype_;
  bool prev_cache_enabled_;
};

/// A snapshot of one thread's CPU and CUDA autocast settings. Plain value type.
///
///   auto state = AutocastState::capture();      // on the caller's thread
///   pool.post([state] {
///     AutocastState::Guard autocast(state);      // on the worker thread
///     run_stage();
///   });
struct AutocastState {
  bool cpu_enabled = false;
  c10::ScalarType cpu_dtype = c10::kBFloat16;
  bool cuda_enabled = false;
  c10::ScalarType cuda_dtype = c10::kHalf;
  bool cache_enabled = true;

  /// Reads the calling thread's settings.
  static AutocastState capture();
  /// Sets the calling thread's settings to these (no nesting change, no cache clearing; prefer
  /// Guard, which restores the previous settings).
  void apply() const;
  /// True when autocast is on for either device type.
  bool any_enabled() const { return cpu_enabled || cuda_enabled; }

  class Guard;
};

/// RAII: applies a captured state on the calling thread like nested `torch.autocast` regions
/// (nesting incremented, cache cleared when the outermost region exits) and restores the thread's
/// previous settings on destruction. Same thread-safety as AutocastGuard.
class AutocastState::Guard {
 public:
  explicit Guard(const AutocastState& state);
  ~Guard() noexcept;
  Guard(const Guard&) = delete;
  Guard& operator=(const Guard&) = delete;
  Guard(Guard&&) = delete;
  Guard& operator=(Guard&&) = delete;

 private:
  AutocastState previous_;
};

}  // namespace roundpipe::amp
