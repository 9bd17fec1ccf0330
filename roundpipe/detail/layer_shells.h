// Reusable per-layer module copies for stage jobs (internal).
#pragma once

#include <torch/nn/modules/container/any.h>

#include <cstdint>
#include <mutex>
#include <vector>

namespace roundpipe::detail {

// Note [Layer shells]:
// A stage job needs its own module object per layer (several jobs may run the same layer at
// once, e.g. a forward stage and the backward stage of the same layers on two devices). Making
// it with Cloneable::clone(device) on every job calls the layer's reset() each time, which
// re-initializes every parameter from the CPU generator before overwriting it: for a large layer
// that random fill costs more than the copy itself. Instead, the first job that needs layer l
// clones it once (RNG-isolated) into a "shell"; a job leases a shell, points its parameters and
// buffers at its own device copies of the layer's current values (set_data keeps the Variable
// objects, so modules that hold references to their parameters still see them), and on release
// the shell's tensors are swapped for empty placeholders (freeing the device memory) and its
// gradients reset. There are at most as many shells of a layer as jobs that ran it at once.

/// Pool of shells per layer. Thread-safety: `acquire`/`release` from any thread (one mutex); a
/// leased shell belongs to the leasing job until `release`.
class LayerShells {
 public:
  explicit LayerShells(const std::vector<torch::nn::AnyModule>* layers) : layers_(layers) {}

  /// A shell of layer `l` whose training mode matches the layer's; its tensors are empty
  /// placeholders until filled.
  torch::nn::AnyModule acquire(int64_t l);
  /// Empties the shell's tensors and gradients and returns it to the pool. noexcept.
  void release(int64_t l, torch::nn::AnyModule shell) noexcept;

 private:
  const std::vector<torch::nn::AnyModule>* layers_;
  std::mutex mutex_;
  std::vector<std::vector<torch::nn::AnyModule>> free_;  // [layer]; guarded by mutex_
};

/// A leased shell, released on destruction (also when the job fails).
class ShellLease {
 public:
  ShellLease(LayerShells& pool, int64_t l) : pool_(&pool), layer_(l), shell_(pool.acquire(l)) {}
  ~ShellLease() {
    if (pool_ != nullptr) pool_->release(layer_, std::move(shell_));
  }
  ShellLease(ShellLease&& other) noexcept
      : pool_(std::exchange(other.pool_, nullptr)), layer_(other.layer_), shell_(std::move(other.shell_)) {}
  ShellLease& operator=(ShellLease&&) = delete;
  ShellLease(const ShellLease&) = delete;
  ShellLease& operator=(const ShellLease&) = delete;

  torch::nn::AnyModule& module() { return shell_; }

 private:
  LayerShells* pool_;
  int64_t layer_;
  torch::nn::AnyModule shell_;
};

}  // namespace roundpipe::detail
