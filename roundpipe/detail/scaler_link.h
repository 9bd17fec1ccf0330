// The hand-off between one run's stage jobs and the GradScaler its loss_fn scaled with (internal).
#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
#include <cstdint>
#include <mutex>

namespace roundpipe::amp {
class GradScaler;
}  // namespace roundpipe::amp

namespace roundpipe::detail {

/// Note [Run scaler link]: one run's side of Note [Cross-thread GradScaler], in one place.
///  1. Before the run's jobs are posted, the caller gives the run its flag batch (an id unique in
///     the process) and, with data parallelism, defers its flags (defer_flags: Note [found_inf
///     across ranks] in round_pipe.cpp).
///  2. The fused job, the only one that calls loss_fn, records the GradScaler and its update
///     generation at the first scale() (observe_scale); a second scaler, or an update() between
///     two scale() calls of the run, is an error.
///  3. Each backward or fused job, after its last microbatch, posts one found_inf flag
///     (post_found_inf): to the scaler, tagged (generation, flag batch), and counted; or, deferred,
///     added into the run's sum. A backward job reads scaler() only after it received gradients
///     that depend on the loss, so after step 2.
///  4. The caller, at dispatch (a detached run: it announces the flags the jobs will post) or
///     after the jobs (an attached run: flags_posted, or the deferred sum combined over the ranks
///     and posted as one flag by post_combined), tells the scaler what to expect; a failed
///     detached run drops what it announced (drop_announced_flags).
/// Synchronization: flag_batch_ and defer_ are written in step 1 only, before any job exists;
/// scaler_ and generation_ are atomics written once in step 2 (generation_ first); flags_posted_
/// is atomic; deferred_ is guarded by mutex_.
class ScalerLink {
 public:
  void set_flag_batch(uint64_t batch) { flag_batch_ = batch; }
  void defer_flags() { defer_ = true; }

  /// Step 2; throws c10::Error for a second scaler or a changed generation.
  void observe_scale(amp::GradScaler& scaler, int64_t generation);

  /// The scaler loss_fn used, or null (none, or not yet).
  amp::GradScaler* scaler() const { return scaler_.load(); }
  int64_t generation() const { return generation_.load(); }
  uint64_t flag_batch() const { return flag_batch_; }

  /// Step 3, for a job's found_inf (a 0-dim float tensor on its device). Call only with a scaler
  /// that is enabled.
  void post_found_inf(const at::Tensor& found_inf);
  /// Flags posted to the scaler so far (not counting deferred ones).
  int64_t flags_posted() const { return flags_posted_.load(); }
  /// The deferred flags' sum (float, CPU), or an undefined tensor when none was posted.
  at::Tensor deferred_found_inf() const;

  /// Step 4: tells `scaler` to expect `count` flags of this run (for its next update()).
  void announce_flags(amp::GradScaler& scaler, int64_t count) const;
  /// Step 4, data parallelism: posts the flag combined over the ranks (0-dim) as this run's one flag.
  void post_combined(const at::Tensor& found_inf) const;
  /// Step 4, a failed detached run: the scaler forgets the flags announced for it.
  void drop_announced_flags(amp::GradScaler& scaler) const;

 private:
  uint64_t flag_batch_ = 0;
  bool defer_ = false;
  std::atomic<amp::GradScaler*> scaler_{nullptr};
  std::atomic<int64_t> generation_{0};
  std::atomic<int64_t> flags_posted_{0};
  mutable std::mutex mutex_;
  at::Tensor deferred_;  // guarded by mutex_
};

}  // namespace roundpipe::detail
