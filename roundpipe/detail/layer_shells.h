// Reusable per-layer module copies for stage jobs (internal).
#pragma once

#include <torch/nn/modules/container/any.h>

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
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
//
// Note [Shell claims]:
// A clone is also a host-memory transient: reset() allocates the whole layer in the default dtype
// (float32) and the clone copies every tensor before they are emptied, e.g. 52 MB for a 12.9M-
// parameter decoder layer of a bf16 model. At the first iteration that costs nothing (no gradient
// or optimizer state exists yet); a clone in a later iteration lands on the run's peak. Detached
// training runs used to lease a shell per backward layer when they started (so that no backward
// job clones in the background, Note [Run tails]), while the previous run's backward jobs still
// held theirs and the new run's forward jobs leased more: a third shell of the first layers, cloned
// at the second asynchronous iteration, on top of the gradients and the optimizer state (+0.27
// B/param of the 2.5 measured for LoRA on 194M parameters, docs/benchmarks.md). A claim instead
// reserves the next shell of layer l released by a job that holds one now (such a job belongs to
// an earlier run or to this run's forward, so it ends without waiting for the claimant), and
// clones on the claiming thread only when no shell is free and none is out that is not already
// claimed. So two shells per layer serve overlapping iterations, and every shell is cloned during
// the first iteration. Releases serve claims first, oldest first.

/// Pool of shells per layer. Thread-safety: `acquire`/`release`/`claim` and ShellClaim's
/// `take` from any thread (one mutex); a leased shell belongs to the leasing job until
/// `release`.
class LayerShells {
 public:
  explicit LayerShells(const std::vector<torch::nn::AnyModule>* layers) : layers_(layers) {}

  /// A shell of layer `l` whose training mode matches the layer's; its tensors are empty
  /// placeholders until filled. Clones the layer on the calling thread when none is free.
  torch::nn::AnyModule acquire(int64_t l);
  /// Empties the shell's tensors and gradients and returns it to the pool (or to the oldest
  /// claim waiting for one). noexcept.
  void release(int64_t l, torch::nn::AnyModule shell) noexcept;

  /// Shared by a claim and the pool (guarded by the pool's mutex).
  struct ClaimState {
    torch::nn::AnyModule shell;
    bool ready = false;  // `shell` is set (or empty: the claimant clones, after a failed release)
  };
  /// Note [Shell claims]: a reservation of the next release of layer `l` when more shells are
  /// out than claims wait, else a free shell, else a clone made now on the calling thread.
  std::shared_ptr<ClaimState> claim(int64_t l);
  /// The claimed shell (waits for its release); counted as leased from the claim on.
  torch::nn::AnyModule take(int64_t l, const std::shared_ptr<ClaimState>& claim);
  /// A claim never taken (a failed run): its shell goes back, or its reservation is withdrawn.
  void abandon(int64_t l, const std::shared_ptr<ClaimState>& claim) noexcept;

 private:
  void resize_locked();
  torch::nn::AnyModule clone(int64_t l);
  torch::nn::AnyModule ready(int64_t l, torch::nn::AnyModule shell);
  // One shell of layer l fewer is out, and it was not returned: claims that no remaining lease
  // can serve clone for themselves.
  void drop_lease_locked(int64_t l);

  const std::vector<torch::nn::AnyModule>* layers_;
  std::mutex mutex_;
  std::condition_variable released_;
  // Per layer, guarded by mutex_: the shells in the pool; how many are out (leased, held by a
  // served claim, or being cloned); the claims not served yet, oldest first.
  std::vector<std::vector<torch::nn::AnyModule>> free_;
  std::vector<int64_t> out_;
  std::vector<std::deque<std::shared_ptr<ClaimState>>> waiting_;
};

/// A leased shell, released on destruction (also when the job fails).
class ShellLease {
 public:
  ShellLease(LayerShells& pool, int64_t l) : pool_(&pool), layer_(l), shell_(pool.acquire(l)) {}
  /// Takes a claimed shell (waits for it: Note [Shell claims]).
  ShellLease(LayerShells& pool, int64_t l, const std::shared_ptr<LayerShells::ClaimState>& claim)
      : pool_(&pool), layer_(l), shell_(pool.take(l, claim)) {}
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

/// A claim of a shell of one layer (Note [Shell claims]), taken by the one job that needs it, or
/// withdrawn on destruction.
class ShellClaim {
 public:
  ShellClaim(LayerShells& pool, int64_t l) : pool_(&pool), layer_(l), state_(pool.claim(l)) {}
  ~ShellClaim() {
    if (pool_ != nullptr) pool_->abandon(layer_, state_);
  }
  ShellClaim(ShellClaim&& other) noexcept
      : pool_(std::exchange(other.pool_, nullptr)), layer_(other.layer_), state_(std::move(other.state_)) {}
  ShellClaim& operator=(ShellClaim&&) = delete;
  ShellClaim(const ShellClaim&) = delete;
  ShellClaim& operator=(const ShellClaim&) = delete;

  /// The lease of the claimed shell (waits for its release). Once.
  ShellLease take() && {
    LayerShells* pool = std::exchange(pool_, nullptr);
    return ShellLease(*pool, layer_, state_);
  }

 private:
  LayerShells* pool_;
  int64_t layer_;
  std::shared_ptr<LayerShells::ClaimState> state_;
};

}  // namespace roundpipe::detail
