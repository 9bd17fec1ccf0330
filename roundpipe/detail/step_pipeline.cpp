#include "roundpipe/detail/step_pipeline.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>

#include "amp/detail/scaler_core.h"
#include "amp/grad_scaler.h"
#include "base/thread_budget.h"

namespace roundpipe::detail {

// Note [Async step protocol]:
// step(fn, kAsync) number k queues one job on the optimizer thread (FIFO) and returns. The job
// (1) publishes the master values (after step k-1) into the compute copies, layer by layer,
// raising published[l] to k; (2) moves iteration k's gradients from the compute copies' .grad
// into the master .grad (cast to optim_dtype), raising consumed[l] to k; (3) runs fn.
// The next forward_backward (iteration k+1) runs concurrently with that job: a stage job waits,
// per layer, for published[l] >= k before it copies the layer (so iteration k+1 computes with
// the parameters after step k-1: staleness one, as in the Python original), and the caller waits
// for consumed[l] >= k before it adds iteration k+1's gradients to the layer's .grad. Stage jobs
// of iteration k+1 only read compute copies after their publish; the optimizer thread writes
// them only in (1), so no tensor is read and written concurrently. A failed job records its
// error, raises every counter (nobody waits forever) and the error is rethrown at the next
// forward_backward, step or synchronize. synchronize() drains the queue and publishes the
// masters, so afterwards compute copies hold the values after the last step. kSync drains, then
// does (2), fn and a publish inline: exactly a plain loop.
//
// Note [Gradient hand-over]:
// A stage job's parameter gradients reach the model without copies. On a CPU device the job hands
// over its shell's .grad tensors: the shell drops its reference at its next lease (before any
// backward), so nothing else ever writes them; on CUDA they are fresh host tensors from the
// download. forward_backward makes them the compute copies' .grad (or adds them into an existing
// .grad), and the step job makes them the master .grad when the dtypes match. Otherwise the step
// job casts into one persistent buffer per master (allocated at the first step), so no step
// allocates, page-faults or clones gradient-sized memory. "Match" means the master gradient dtype:
// the master's own, or RoundPipeOptions::master_grad_dtype, which lets bf16/fp16 compute
// gradients through uncast to an optimizer that widens them itself (roundpipe::optim::Adam).
// As with PyTorch's zero_grad(false), a master .grad tensor kept by the caller across steps may
// be overwritten by a later step.

// Note [In-place masters]:
// With RoundPipeOptions::in_place_masters the master of a trainable parameter is its compute copy
// itself (the same tensor): the step function's optimizer updates the parameters the next
// iteration computes with, and the gradients the tails add to the compute copies' .grad are
// already the master gradients. So publish and consume do nothing, and the model holds one copy
// of each parameter instead of two. This is safe only when no run reads the compute copies while
// a step function runs: sync steps (which wait for every tail first) and the caller's own calls
// between runs. Async steps are refused at step(): the next iteration reads the compute copies
// while an async step would write them (the staleness-one protocol needs two copies). For the
// same reason CPU devices compute on the parameters themselves instead of per-job copies (Note
// [Shared host parameters] in device_io.cpp).

// Note [Run tails]:
// A forward_backward returns once its forward and fused jobs have finished (the losses are
// known); its backward jobs may still run. What is left of the run, its tail, runs on the tail
// thread, FIFO across runs: it waits for the run's remaining jobs, then adds the run's gradients
// to the compute copies' .grad (accept_grads, still waiting per layer for the previous step to
// have taken the previous gradients). Two per-layer facts order the tail against the steps:
//  - released[l] counts the runs whose last reader of layer l (its backward job, or the fused
//    job) has its own copy of the layer: a step queued after run R overwrites compute copy l
//    only once released[l] >= R. The count is exact: a run started after that step waits for
//    its publish before it copies the layer, and a run's tail releases the layers its jobs did
//    not (a failed job) only after the tails before it, when those runs have released them.
//  - tails_done counts the finished tails (FIFO): a step queued after run R moves gradients
//    only once tails_done >= R.
// So the next iteration's forward jobs, which wait for the step's publish per layer, start as
// soon as the previous run's last backward job has copied its layers (checked once its first
// microbatch's compute is enqueued; CUDA: and its uploads are complete; Note [Lazy leases] in
// stage_jobs.cpp), filling the previous run's drain. Whoever reads the gradients outside a step (synchronize, a
// sync step, the scaler's marshalled unscale_, RoundPipe::parameters / module) waits for every
// posted tail first. A detached tail's error is kept like a queued step's: the step queued after
// it skips its step function, and the error is rethrown at the next entry point.

StepPipeline::StepPipeline(const std::vector<std::vector<at::Tensor>>* params,
                           std::optional<c10::ScalarType> optim_dtype, std::optional<c10::ScalarType> master_grad_dtype,
                           int64_t optimizer_threads, bool in_place_masters, bool sync_steps)
    : params_(params),
      optim_dtype_(optim_dtype),
      master_grad_dtype_(master_grad_dtype),
      in_place_(in_place_masters),
      sync_only_(in_place_masters || sync_steps),
      optimizer_threads_(optimizer_threads),
      published_(params->size(), 0),
      consumed_(params->size(), 0),
      released_(params->size(), 0) {}

StepPipeline::~StepPipeline() {
  // Queued tails and steps reference this object: finish them (errors are dropped: a destructor
  // cannot throw). Tails first: a queued step may wait for them.
  for (auto& f : pending_tails_) f.wait();
  drain();
}

int64_t StepPipeline::begin_run() { return ++runs_; }

void StepPipeline::release_layer(int64_t l) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ++released_[l];
  }
  cv_.notify_all();
}

std::future<void> StepPipeline::post_tail(std::function<void()> tail, bool detached) {
  const int64_t run = runs_;
  if (!tail_thread_) tail_thread_ = std::make_unique<DeviceWorker>(c10::Device(c10::kCPU));
  pending_tails_.erase(std::remove_if(pending_tails_.begin(), pending_tails_.end(),
                                      [](const std::future<void>& f) {
                                        return f.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
                                      }),
                       pending_tails_.end());
  auto done = tail_thread_->post([this, run, detached, fn = std::move(tail)]() mutable {
    std::exception_ptr error;
    try {
      fn();
    } catch (...) {
      error = std::current_exception();
    }
    fn = nullptr;  // the run's context goes before anyone learns that the tail is done
    {
      std::lock_guard<std::mutex> lock(mutex_);
      tails_done_ = std::max(tails_done_, run);
      if (error && detached) {
        failed_tails_.insert(run);
        if (!async_error_) async_error_ = error;
      }
    }
    cv_.notify_all();
    if (error && !detached) std::rethrow_exception(error);
  });
  if (!detached) return done;
  pending_tails_.push_back(std::move(done));
  return {};
}

void StepPipeline::wait_tails_until(int64_t run) {
  std::unique_lock<std::mutex> lock(mutex_);
  cv_.wait(lock, [&] { return tails_done_ >= run; });
}

void StepPipeline::wait_tails() { wait_tails_until(runs_); }

void StepPipeline::wait_counter(const std::vector<int64_t>& counter, int64_t l, int64_t target) {
  std::unique_lock<std::mutex> lock(mutex_);
  cv_.wait(lock, [&] { return counter[l] >= target; });
}

void StepPipeline::raise_counter(std::vector<int64_t>& counter, int64_t l, int64_t value) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    counter[l] = std::max(counter[l], value);
  }
  cv_.notify_all();
}

void StepPipeline::raise_all(int64_t value) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& c : published_) c = std::max(c, value);
    for (auto& c : consumed_) c = std::max(c, value);
  }
  cv_.notify_all();
}

void StepPipeline::rethrow_async_error() {
  std::exception_ptr error;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    std::swap(error, async_error_);
  }
  if (error) std::rethrow_exception(error);
}

void StepPipeline::drain() {
  for (auto& f : pending_steps_) f.wait();
  pending_steps_.clear();
}

void StepPipeline::wait_published(int64_t l, int64_t step) { wait_counter(published_, l, step); }

// Writes master values into the compute copies of layer l (caller holds no lock).
void StepPipeline::publish_layer(size_t l) {
  if (in_place_) return;  // the masters are the compute copies (Note [In-place masters])
  at::NoGradGuard no_grad;
  const auto& params = (*params_)[l];
  for (size_t k = 0; k < params.size(); ++k) {
    if (masters_[l][k].defined()) params[k].copy_(masters_[l][k]);
  }
}

// The dtype of `master`'s .grad: RoundPipeOptions::master_grad_dtype for parameters whose
// compute copy has that dtype (their gradients go over uncast), else the master's own dtype (so
// e.g. fp32 norm weights in a bf16 model keep fp32 gradients).
c10::ScalarType StepPipeline::master_grad_dtype(const at::Tensor& compute, const at::Tensor& master) const {
  return master_grad_dtype_ && compute.scalar_type() == *master_grad_dtype_ ? *master_grad_dtype_
                                                                            : master.scalar_type();
}

// Moves layer l's gradients from the compute copies into the master .grad (Note [Gradient
// hand-over]): accumulated in place if the master has one, taken over if dtypes match, else cast
// into the master's persistent gradient buffer. Optimizer thread (or the caller after drain()).
void StepPipeline::consume_grads_layer(size_t l) {
  if (in_place_) return;  // the compute copies' .grad are the master gradients (Note [In-place masters])
  at::NoGradGuard no_grad;
  const auto& params = (*params_)[l];
  for (size_t k = 0; k < params.size(); ++k) {
    at::Tensor p = params[k];
    at::Tensor& master = masters_[l][k];
    if (!p.grad().defined() || !master.defined()) continue;
    const at::Tensor& g = p.grad();
    const auto grad_dtype = master_grad_dtype(p, master);
    if (master.grad().defined()) {
      master.mutable_grad().add_(g);  // add_ casts a bf16/fp16 g in the same pass
    } else if (g.scalar_type() == grad_dtype && g.device() == master.device()) {
      master.mutable_grad() = g;
    } else {
      at::Tensor& buffer = master_grad_buffers_[l][k];
      if (!buffer.defined()) buffer = at::empty(master.sizes(), master.options().dtype(grad_dtype));
      buffer.copy_(g);
      master.mutable_grad() = buffer;
    }
    p.mutable_grad().reset();
  }
}

const std::vector<std::vector<at::Tensor>>& StepPipeline::masters() {
  if (!masters_.empty() || params_->empty()) return masters_;
  if (!optim_dtype_) check_parameter_master_dtypes(*params_);  // before any master exists
  if (runs_may_share_new_masters()) wait_tails();              // steps will write them: Note [Shared host parameters]
  shared_before_masters_.clear();
  at::NoGradGuard no_grad;
  masters_.resize(params_->size());
  master_grad_buffers_.resize(params_->size());
  for (size_t l = 0; l < params_->size(); ++l) {
    for (const auto& p : (*params_)[l]) {
      if (!p.requires_grad()) {
        // Frozen (e.g. LoRA's base weights): no master, no gradient buffer, no optimizer state;
        // the compute copy is the only copy (Note [Frozen parameters] in step_pipeline.h).
        masters_[l].emplace_back();
        master_grad_buffers_[l].emplace_back();
        continue;
      }
      if (in_place_) {  // Note [In-place masters]
        masters_[l].push_back(p);
        master_grad_buffers_[l].emplace_back();
        continue;
      }
      auto dtype = optim_dtype_.value_or(p.scalar_type());
      auto master = p.detach().to(c10::kCPU, dtype, /*non_blocking=*/false, /*copy=*/true);
      master.requires_grad_(p.requires_grad());
      const auto grad_dtype = master_grad_dtype(p, master);
      if (grad_dtype != dtype && master.requires_grad()) master.set_grad_dtype(grad_dtype);
      masters_[l].push_back(master);
      master_grad_buffers_[l].emplace_back();
    }
  }
  return masters_;
}

bool StepPipeline::runs_may_share_new_masters() const {
  for (size_t l = 0; l < shared_before_masters_.size(); ++l) {
    for (size_t k = 0; k < shared_before_masters_[l].size(); ++k) {
      if (shared_before_masters_[l][k] && (*params_)[l][k].requires_grad()) return true;
    }
  }
  return false;
}

std::vector<std::vector<bool>> StepPipeline::shareable_parameters() {
  std::vector<std::vector<bool>> out(params_->size());
  const bool before_masters = masters_.empty();
  if (before_masters && !sync_only_) shared_before_masters_.resize(params_->size());
  for (size_t l = 0; l < params_->size(); ++l) {
    const auto& layer = (*params_)[l];
    out[l].assign(layer.size(), sync_only_);  // sync steps only: nothing writes them during a run
    if (sync_only_) continue;
    for (size_t k = 0; k < layer.size(); ++k) {
      // Frozen without a master: no step publishes into it (publish_layer skips it).
      out[l][k] = !layer[k].requires_grad() && (before_masters || !masters_[l][k].defined());
    }
    if (before_masters) {
      auto& shared = shared_before_masters_[l];
      shared.resize(layer.size(), false);
      for (size_t k = 0; k < layer.size(); ++k) shared[k] = shared[k] || out[l][k];
    }
  }
  return out;
}

void StepPipeline::accept_grads(const LayerSet& layers, std::vector<std::vector<at::Tensor>>& grads,
                                int64_t steps_before) {
  at::NoGradGuard no_grad;
  for (size_t l = 0; l < grads.size(); ++l) {
    const auto& uses = layers.uses[l];
    TORCH_INTERNAL_ASSERT(grads[l].empty() || grads[l].size() == uses.size(), "layer ", layers.names[l], ": ",
                          grads[l].size(), " gradients for ", uses.size(), " parameters");
    for (size_t u = 0; u < grads[l].size(); ++u) {
      const auto& g = grads[l][u];
      at::Tensor p = (*params_)[uses[u].layer][uses[u].index];
      if (!g.defined() || !p.requires_grad()) continue;
      wait_counter(consumed_, uses[u].layer, steps_before);  // the previous step has taken its grads
      if (p.grad().defined()) {
        p.mutable_grad().add_(g);  // add_ casts in the same pass
      } else {
        p.mutable_grad() = g.to(p.device(), p.scalar_type());  // handed over, no copy (Note [Gradient hand-over])
      }
    }
  }
}

// Note [Optimizer thread budget]:
// An async step runs while the device workers launch the next iteration's kernels. A CPU
// optimizer that takes every core (roundpipe::optim::Adam defaults to at::get_num_threads())
// leaves the worker threads none: on an H200 host (16 cores, one GPU, 0.95B parameters) the
// iterations jittered 416-534 ms with 16 Adam threads and ran 391-401 ms with 8, at the same Adam
// time (215 ms: the step is memory-bound; docs/benchmarks.md). So when RoundPipe drives GPUs its
// optimizer thread carries base::thread_budget = half the cores (at least 1), which Adam obeys
// when it was given no explicit thread count (Adam::set_num_threads wins). CPU devices compute on
// the cores themselves; there the budget is left unset.
DeviceWorker& StepPipeline::optimizer_thread() {
  if (!optimizer_thread_) {
    optimizer_thread_ = std::make_unique<DeviceWorker>(c10::Device(c10::kCPU));
    // One thread, FIFO: this runs before any step job, and its thread-local budget stays.
    optimizer_thread_->post([threads = optimizer_threads_] { base::set_thread_budget(threads); });
  }
  return *optimizer_thread_;
}

void StepPipeline::attach_scaler(amp::GradScaler& scaler, const ScalerLink& link, int64_t flags) {
  using amp::detail::GradScalerAccess;
  link.announce_flags(scaler, flags);
  if (&scaler != scaler_) {
    scaler_ = &scaler;
    scaler_executor_ = std::make_shared<const amp::detail::Executor>(
        [this, &scaler](const std::function<void()>& call) { run_marshalled(scaler, call); });
  }
  GradScalerAccess::set_executor(scaler, scaler_executor_);
  if (!pending_iteration_) pending_iteration_ = GradScalerAccess::capture_iteration(scaler);
}

// The scaler's unscale_/step called outside a step function: run on the optimizer thread, after
// queued steps, on this iteration's gradients (moved into the master copies first) and inside
// its IterationScope; a later step function continues the same per-optimizer state.
void StepPipeline::run_marshalled(amp::GradScaler& scaler, const std::function<void()>& call) {
  using amp::detail::GradScalerAccess;
  if (optimizer_thread_ && optimizer_thread_->is_current()) {
    // A step function queued without a scaled iteration (no forward_backward since the last step).
    amp::detail::IterationScope scope(scaler, GradScalerAccess::capture_iteration(scaler));
    call();
    return;
  }
  wait_tails();
  rethrow_async_error();
  masters();
  if (!pending_iteration_) pending_iteration_ = GradScalerAccess::capture_iteration(scaler);
  optimizer_thread()
      .post([this, &scaler, &call, iteration = pending_iteration_] {
        for (size_t l = params_->size(); l-- > 0;) consume_grads_layer(l);
        amp::detail::IterationScope scope(scaler, iteration);
        call();
      })
      .get();
}

void StepPipeline::step(std::function<void()> step_fn, StepMode mode) {
  TORCH_CHECK(!in_place_ || mode == StepMode::kSync,
              "RoundPipe::step(..., StepMode::kAsync) with "
              "RoundPipeOptions::in_place_masters: the optimizer would update the parameters while the next "
              "iteration computes with them. Call step(fn, StepMode::kSync), or keep separate master copies "
              "(in_place_masters(false)) for async steps");
  TORCH_CHECK(!sync_only_ || mode == StepMode::kSync,
              "RoundPipe::step(..., StepMode::kAsync) with RoundPipeOptions::sync_steps: CPU devices compute on "
              "the compute copies the step would publish into while the next iteration runs. Call step(fn, "
              "StepMode::kSync), or construct the RoundPipe without sync_steps for async steps");
  rethrow_async_error();
  masters();
  const int64_t k = ++steps_;
  const int64_t runs = runs_;
  int64_t skip_after = runs_at_last_step_;  // a run in (skip_after, runs] failing later skips fn
  runs_at_last_step_ = runs;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    // Failures recorded so far were reported (rethrow_async_error above, or an earlier call):
    // the caller queued this step knowing them.
    if (!failed_tails_.empty()) skip_after = std::max(skip_after, *failed_tails_.rbegin());
    failed_tails_.erase(failed_tails_.begin(), failed_tails_.upper_bound(skip_after));
  }
  step_fn = watch_.wrap(std::move(step_fn));
  if (pending_iteration_) {
    // The step function runs inside the scope of the iteration its gradients come from.
    step_fn = [scaler = scaler_, iteration = std::move(pending_iteration_), fn = std::move(step_fn)] {
      amp::detail::IterationScope scope(*scaler, iteration);
      if (fn) fn();
    };
  }
  if (mode == StepMode::kSync) {
    // Note [Failed sync step]: the counters reach k even when this step fails (an earlier queued
    // step's error, or step_fn throwing): the next run waits for published[l] >= k and would
    // otherwise wait forever. The compute copies get whatever the masters hold, as a plain
    // loop's parameters would after a throwing optimizer step.
    std::exception_ptr error;
    try {
      wait_tails();
      drain();
      rethrow_async_error();
      for (size_t l = 0; l < params_->size(); ++l) consume_grads_layer(l);
      if (step_fn) step_fn();
    } catch (...) {
      error = std::current_exception();
    }
    for (size_t l = 0; l < params_->size(); ++l) publish_layer(l);
    raise_all(k);
    if (error) std::rethrow_exception(error);
    return;
  }
  pending_steps_.push_back(optimizer_thread().post([this, k, runs, skip_after, fn = std::move(step_fn)] {
    try {
      for (size_t l = 0; l < params_->size(); ++l) {
        wait_counter(released_, static_cast<int64_t>(l), runs);  // Note [Run tails]
        publish_layer(l);
        raise_counter(published_, static_cast<int64_t>(l), k);
      }
      wait_tails_until(runs);
      bool tail_failed = false;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        auto failed = failed_tails_.upper_bound(skip_after);
        tail_failed = failed != failed_tails_.end() && *failed <= runs;
      }
      for (size_t l = params_->size(); l-- > 0;) {
        consume_grads_layer(l);
        raise_counter(consumed_, static_cast<int64_t>(l), k);
      }
      if (fn && !tail_failed) fn();  // a run of this step failed in its tail: its error comes next
    } catch (...) {
      {
        std::lock_guard<std::mutex> lock(mutex_);
        if (!async_error_) async_error_ = std::current_exception();
      }
      raise_all(k);
    }
  }));
}

void StepPipeline::synchronize() {
  wait_tails();
  drain();
  if (!masters_.empty()) {
    for (size_t l = 0; l < params_->size(); ++l) publish_layer(l);
  }
  raise_all(steps_);
  rethrow_async_error();
}

}  // namespace roundpipe::detail
