// The optimizer side of RoundPipe: master copies, the hand-over of gradients, queued steps and the
// per-layer publish/consume protocol between them and the stage jobs (internal).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "amp/detail/grad_scaler_access.h"
#include "roundpipe/detail/device_worker.h"
#include "roundpipe/detail/master_checks.h"
#include "roundpipe/detail/stage_jobs.h"
#include "roundpipe/run_config.h"

namespace roundpipe::amp {
class GradScaler;
}  // namespace roundpipe::amp

namespace roundpipe::detail {

/// Owns the master copies and runs step functions (Note [Async step protocol], Note [Gradient
/// hand-over]). Per layer l it keeps two counters: published[l] (the last step whose master
/// values are in the compute copies) and consumed[l] (the last step that took the layer's
/// gradients); stage jobs and the caller wait on them per layer.
///
/// Thread-safety: the caller thread calls everything except `wait_published` and
/// `release_layer`, which stage jobs call from worker threads, and `accept_grads`, which run
/// tails call on the tail thread. The counters and the async error are guarded by `mutex_`; the
/// masters, their gradient buffers and the compute copies' .grad are owned by whoever the
/// protocol orders (Note [Async step protocol], Note [Run tails]): the tail thread while it adds
/// a run's gradients, the optimizer thread while a step moves them, else the caller (after
/// wait_tails). Queued tails, then queued steps, are drained by the destructor (errors dropped).
class StepPipeline {
 public:
  /// `params[l]`: layer l's parameters (the compute copies), owned by the caller and alive as long
  /// as this object. `optimizer_threads`: the optimizer thread's base::thread_budget (0: none;
  /// Note [Optimizer thread budget]). `in_place_masters`: the compute copies are the masters
  /// (RoundPipeOptions::in_place_masters; Note [In-place masters]); needs both dtypes unset.
  /// `sync_steps`: RoundPipeOptions::sync_steps (implied by `in_place_masters`).
  StepPipeline(const std::vector<std::vector<at::Tensor>>* params, std::optional<c10::ScalarType> optim_dtype,
               std::optional<c10::ScalarType> master_grad_dtype, int64_t optimizer_threads = 0,
               bool in_place_masters = false, bool sync_steps = false);
  ~StepPipeline();
  StepPipeline(const StepPipeline&) = delete;
  StepPipeline& operator=(const StepPipeline&) = delete;

  /// RoundPipe::step: queues (kAsync) or runs (kSync) step number steps()+1.
  void step(std::function<void()> step_fn, StepMode mode);
  /// RoundPipe::synchronize: drains the queue, publishes the masters, rethrows a step's error.
  void synchronize();
  /// Rethrows (once) the error of a failed queued step or background run tail.
  void rethrow_async_error();

  // Note [Run tails] (step_pipeline.cpp): the backward stages of a forward_backward may finish
  // after it returns.
  /// Caller: a training run starts; returns its number (1, 2, ...). Every run started must post
  /// exactly one tail and release each layer exactly once.
  int64_t begin_run();
  /// Any thread: run `run`'s last reader of layer l (the backward or fused job that copies it to
  /// its device) has its copy, so the next step may overwrite the compute copy.
  void release_layer(int64_t l);
  /// Caller: queues the tail of the run begun last (after the tails of earlier runs, FIFO, on the
  /// tail thread). `detached`: the caller does not wait; an error is kept and rethrown at the next
  /// entry point, and the next step skips its step function. Otherwise the error reaches the
  /// returned future.
  std::future<void> post_tail(std::function<void()> tail, bool detached);
  /// Caller: blocks until every tail posted so far has finished (gradients handed over).
  void wait_tails();
  /// Number of step() calls so far.
  int64_t steps() const { return steps_; }
  /// The master copies, [layer][param]; created on first call. Undefined for parameters that do
  /// not require grad when the masters are created.
  //
  // Note [Frozen parameters]: a parameter with requires_grad false (LoRA's base weights, a frozen
  // embedding) has no master copy, no gradient buffer and so no optimizer state: its compute copy
  // is its only copy in host memory. Stage jobs keep it frozen in their shells (DeviceIo), so no
  // gradient is computed, downloaded or handed over for it. Freeze parameters before the first
  // step (or optim_parameters() call): the set of masters is fixed when they are created.
  const std::vector<std::vector<at::Tensor>>& masters();
  /// Caller: [layer][param] whether no step can write the compute copy while a run is in flight,
  /// so a CPU device's stage job may compute on it instead of a copy (Note [Shared host
  /// parameters] in device_io.cpp): every parameter with in-place masters or sync_steps (sync
  /// steps only), else the frozen parameters without a master. A frozen parameter shared before the masters exist
  /// that has become trainable when they are created makes masters() wait for the runs' tails.
  std::vector<std::vector<bool>> shareable_parameters();

  /// Any thread: blocks until layer l's compute copy holds the values after step `step` - 1
  /// (for a run that started after `step` steps were queued: staleness one).
  void wait_published(int64_t l, int64_t step);
  /// Adds a successful run's gradients (RunContext::grads, per LayerSet::uses) to the compute
  /// copies' .grad, each layer once step `steps_before` has taken the previous ones.
  void accept_grads(const LayerSet& layers, std::vector<std::vector<at::Tensor>>& grads, int64_t steps_before);

  /// After a successful run whose loss_fn used `scaler` (link.scaler()): announces the `flags`
  /// its jobs post (Note [Run scaler link]), snapshots the iteration's scale for its step, and
  /// (re)installs the executor.
  void attach_scaler(amp::GradScaler& scaler, const ScalerLink& link, int64_t flags);

 private:
  void wait_counter(const std::vector<int64_t>& counter, int64_t l, int64_t target);
  void raise_counter(std::vector<int64_t>& counter, int64_t l, int64_t value);
  void raise_all(int64_t value);
  void drain();
  void wait_tails_until(int64_t run);
  void publish_layer(size_t l);
  void consume_grads_layer(size_t l);
  c10::ScalarType master_grad_dtype(const at::Tensor& compute, const at::Tensor& master) const;
  DeviceWorker& optimizer_thread();
  void run_marshalled(amp::GradScaler& scaler, const std::function<void()>& call);
  bool runs_may_share_new_masters() const;

  const std::vector<std::vector<at::Tensor>>* params_;
  const std::optional<c10::ScalarType> optim_dtype_;
  const std::optional<c10::ScalarType> master_grad_dtype_;
  const bool in_place_;  // masters_ hold the compute copies themselves (Note [In-place masters])
  // RoundPipeOptions::sync_steps (or in_place_): async steps are refused, so no step writes a
  // compute copy while a run is in flight (Note [Shared host parameters]).
  const bool sync_only_;
  std::vector<std::vector<at::Tensor>> masters_;  // lazy
  // Per master: the gradient buffer (in master_grad_dtype()) reused by every step whose compute
  // copy grads have another dtype (Note [Gradient hand-over]); lazy.
  std::vector<std::vector<at::Tensor>> master_grad_buffers_;
  MasterWatch watch_{&masters_};  // wraps every step function (Note [Untouched masters])
  // [layer][param]: frozen parameters shareable_parameters() let runs share before the masters
  // existed (caller thread; cleared when the masters are created).
  std::vector<std::vector<bool>> shared_before_masters_;

  const int64_t optimizer_threads_;
  std::unique_ptr<DeviceWorker> optimizer_thread_;
  std::vector<std::future<void>> pending_steps_;  // caller thread only
  int64_t steps_ = 0;                             // caller thread only
  std::unique_ptr<DeviceWorker> tail_thread_;     // lazy; created and posted to by the caller only
  std::vector<std::future<void>> pending_tails_;  // caller thread only (pruned as they finish)
  int64_t runs_ = 0;                              // caller thread only
  int64_t runs_at_last_step_ = 0;                 // caller thread only
  std::mutex mutex_;
  std::condition_variable cv_;
  std::vector<int64_t> published_;  // guarded by mutex_
  std::vector<int64_t> consumed_;   // guarded by mutex_
  std::vector<int64_t> released_;   // guarded by mutex_: [l] runs whose last reader of l has its copy
  int64_t tails_done_ = 0;          // guarded by mutex_: runs whose tail has finished (FIFO)
  std::set<int64_t> failed_tails_;  // guarded by mutex_: runs whose detached tail failed (pruned by step)
  std::exception_ptr async_error_;  // guarded by mutex_

  // Cross-thread GradScaler (Note [Cross-thread GradScaler]). Caller thread only. `scaler_`: the
  // one the last run's loss_fn used; `pending_iteration_`: the scale and per-optimizer states of
  // the gradients awaiting step(); `scaler_executor_`: marshals the scaler's unscale_/step calls
  // made outside step functions onto the optimizer thread (the scaler holds a weak reference,
  // which expires with this object).
  amp::GradScaler* scaler_ = nullptr;
  std::shared_ptr<amp::detail::Iteration> pending_iteration_;
  std::shared_ptr<const amp::detail::Executor> scaler_executor_;
};

}  // namespace roundpipe::detail
