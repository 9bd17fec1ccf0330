#include "roundpipe/detail/stage_jobs.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/autograd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <deque>
#include <exception>
#include <functional>
#include <limits>
#include <optional>
#include <sstream>

#include "amp/detail/grad_scaler_access.h"
#include "amp/detail/unscale.h"
#include "amp/grad_scaler.h"
#include "roundpipe/detail/device_io.h"
#include "roundpipe/detail/layer_rng.h"
#include "roundpipe/layer_seed.h"

namespace roundpipe::detail {
namespace {

// An error received from an upstream job through a channel: propagated unchanged.
struct UpstreamError {
  std::exception_ptr error;
};

const Activations& await(const ChannelPtr& channel) {
  try {
    return channel->get();
  } catch (...) {
    throw UpstreamError{std::current_exception()};
  }
}

// Note [Deferred hand-over]:
// A job's per-microbatch results (forward outputs, saved inputs, activation gradients, losses) go
// to other jobs through channels, and only complete host tensors may go. Waiting for each
// download right after its microbatch would leave a CUDA device idle until the worker has
// enqueued the next microbatch's kernels. So on CUDA a job enqueues the downloads of microbatch j
// (DeviceIo::download_async), goes on to enqueue microbatch j+1's compute, and only then waits
// for j's copies and hands them over: the copies and the hand-over overlap the next microbatch's
// compute. A job never blocks on an input while holding results back: before an await whose
// channel is not ready it hands over everything it holds (the producer upstream never depends on
// them, but a consumer downstream may be waiting). At the end of the job everything is handed
// over, before its parameter gradients. A failing job hands over nothing more; guarded() fails
// the channels it had not set. CPU jobs hand over at once (their downloads are complete on
// return), unless set_cuda_flow_on_cpu_for_testing.
std::atomic<bool> cuda_flow_on_cpu{false};

class Handovers {
 public:
  explicit Handovers(const DeviceIo& io) : defer_(io.device().is_cuda() || cuda_flow_on_cpu.load()) {}
  Handovers(const Handovers&) = delete;
  Handovers& operator=(const Handovers&) = delete;

  using Deliver = std::function<void(Activations)>;
  /// Hands `download`'s tensors to `deliver` now (CPU) or at a later flush.
  void post(int64_t microbatch, Deliver deliver, DeviceIo::Pending download) {
    if (!defer_) {
      deliver(download.wait());
      return;
    }
    held_.push_back({microbatch, std::move(deliver), std::move(download)});
  }
  void post(int64_t microbatch, const ChannelPtr& channel, DeviceIo::Pending download) {
    post(
        microbatch, [channel](Activations a) { channel->set(std::move(a)); }, std::move(download));
  }
  /// Hands over what was posted for microbatches before `microbatch`, in posting order.
  void flush_before(int64_t microbatch) {
    while (!held_.empty() && held_.front().microbatch < microbatch) {
      Held h = std::move(held_.front());
      held_.pop_front();
      h.deliver(h.download.wait());
    }
  }
  void flush_all() { flush_before(std::numeric_limits<int64_t>::max()); }
  /// await(channel), handing everything over first if it would block.
  const Activations& await_input(const ChannelPtr& channel) {
    if (!held_.empty() && !channel->ready()) flush_all();
    return await(channel);
  }

 private:
  struct Held {
    int64_t microbatch;
    Deliver deliver;
    DeviceIo::Pending download;
  };
  const bool defer_;
  std::deque<Held> held_;
};

// Where a job is, for error messages. Owned by the job's thread.
struct Position {
  const char* phase;
  scheduler::LayerRange stage;
  std::optional<int64_t> layer = std::nullopt;       // none: not inside one layer's pass
  std::optional<int64_t> microbatch = std::nullopt;  // none: before or after the microbatches
  const char* step = "";                             // set through StepLabel; "" names none
};

// Names what a job is doing (Position::step) for the label's scope, then restores the enclosing
// label. A scope left by an exception keeps its label: guarded() reads the position after the
// unwinding, to say where the job failed.
class StepLabel {
 public:
  StepLabel(Position& pos, const char* step)
      : pos_(pos), enclosing_(pos.step), exceptions_at_entry_(std::uncaught_exceptions()) {
    pos.step = step;
  }
  ~StepLabel() {
    if (std::uncaught_exceptions() == exceptions_at_entry_) pos_.step = enclosing_;
  }
  StepLabel(const StepLabel&) = delete;
  StepLabel& operator=(const StepLabel&) = delete;

 private:
  Position& pos_;
  const char* enclosing_;
  int exceptions_at_entry_;
};

std::string job_name(const Position& pos) { return std::string(pos.phase) + " stage " + pos.stage.to_string(); }

// Runs `body`; on failure fails every output channel and rethrows, wrapping a local error with
// the job's position (upstream errors pass through unchanged, so the root cause is reported).
template <typename Body>
void guarded(RunContext& ctx, const c10::Device& device, Position& pos, const std::vector<ChannelPtr>& outputs,
             Body&& body) {
  std::exception_ptr error;
  try {
    amp::AutocastState::Guard autocast(ctx.autocast);
    body();
    return;
  } catch (const UpstreamError& upstream) {
    error = upstream.error;
  } catch (const std::exception& e) {
    const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
    std::ostringstream msg;
    msg << "RoundPipe '" << ctx.model_name << "': " << pos.phase << " stage " << pos.stage.to_string() << " on "
        << device;
    if (pos.layer) msg << ", layer " << ctx.model->names[*pos.layer];
    if (pos.microbatch) msg << ", microbatch " << *pos.microbatch;
    if (*pos.step) msg << " (" << pos.step << ")";
    msg << ": " << (c10_error ? c10_error->what_without_backtrace() : e.what());
    error = std::make_exception_ptr(c10::Error(msg.str()));
  }
  for (const auto& channel : outputs) {
    if (channel) channel->fail(error);
  }
  std::rethrow_exception(error);
}

bool is_float(const at::Tensor& t) { return t.defined() && at::isFloatingType(t.scalar_type()); }

// Fresh leaves for recompute/backward on the device: floating tensors require grad when `need_grad`.
Activations make_leaves(DeviceIo& io, const Activations& host, bool need_grad) {
  Activations out = io.upload(host);
  for (size_t k = 0; k < out.size(); ++k) {
    auto& t = out[k];
    if (!t.defined()) continue;
    t = t.detach();
    if (t.data_ptr() == host[k].data_ptr()) t = t.clone();  // never share storage with a saved input
    if (need_grad && is_float(t)) t.requires_grad_(true);
  }
  return out;
}

Activations leaf_grads(const Activations& leaves) {
  Activations grads;
  grads.reserve(leaves.size());
  for (const auto& t : leaves) grads.push_back(t.defined() && t.requires_grad() ? t.grad() : at::Tensor());
  return grads;
}

// Backward through `outputs` with `grads` (on the outputs' device), pairing by position and skipping outputs that need
// no gradient or received none.
void backward_paired(const Activations& outputs, const Activations& grads) {
  TORCH_CHECK(outputs.size() == grads.size(), "recompute produced ", outputs.size(),
              " output tensors but the next stage sent gradients for ", grads.size(),
              ": a layer's output structure must not depend on whether it is recomputed");
  std::vector<at::Tensor> outs, gs;
  for (size_t k = 0; k < outputs.size(); ++k) {
    if (outputs[k].defined() && outputs[k].requires_grad() && grads[k].defined()) {
      outs.push_back(outputs[k]);
      gs.push_back(grads[k]);
    }
  }
  if (!outs.empty()) torch::autograd::backward(outs, gs);
}

// Note [Lazy leases]:
// A job leases a shell for each of its layers and fills it with the layer's values on the device,
// each after the optimizer has published the values this iteration must use (Note [Async step
// protocol]). It does so when its first microbatch first needs the layer, not all up front: in
// async mode the step queued just before this run publishes layer by layer while this job
// starts, so the host waits for layer l's publish only when layer l is next, with the compute of
// the layers before it already enqueued. Publish (a host pass over the masters), upload and the
// first microbatch's compute then overlap layer by layer instead of running one after the other
// (on a GPU the whole publish and upload were exposed before every iteration's first job).
// Layers are leased in order: using layer l leases every layer of the job before it first. A
// call that measures layer times leases up front, so that no timer sees a copy, and so do CPU jobs
// (their copies are host copies on the job's own thread: nothing to overlap; they release their
// layers before their first microbatch), unless set_cuda_flow_on_cpu_for_testing.
// release_after_copy (the run's last reader has its copies, Note [Run tails]) leases whatever is
// left first.
// Where a job's layer copies take their buffers from: the model (a forward or fused job), or the
// forward's snapshots (a backward job, which recomputes from the buffers the forward started
// from and must not read the model's: Note [Buffers in recompute], Note [Run tails]).
enum class LayerBuffers { kFromModel, kFromForwardSnapshot };

class LayerLeases {
 public:
  LayerLeases(RunContext& ctx, scheduler::LayerRange r, DeviceIo& io, Position& pos,
              LayerBuffers buffers = LayerBuffers::kFromModel)
      : ctx_(ctx),
        r_(r),
        io_(io),
        pos_(pos),
        buffers_(buffers),
        lazy_(ctx.forward_ms.empty() && (io.device().is_cuda() || cuda_flow_on_cpu.load())) {
    shells_.reserve(static_cast<size_t>(r.end - r.begin));
    if (!lazy_) all();
  }
  LayerLeases(const LayerLeases&) = delete;
  LayerLeases& operator=(const LayerLeases&) = delete;

  /// Layer l's shell (l in the job's range), leased and uploaded on first use.
  ShellLease& operator[](int64_t l) {
    TORCH_INTERNAL_ASSERT(l >= r_.begin && l < r_.end, "layer ", l, " is not in stage ", r_.to_string());
    if (l - r_.begin >= static_cast<int64_t>(shells_.size())) lease_through(l);
    return shells_[static_cast<size_t>(l - r_.begin)];
  }
  bool lazy() const { return lazy_; }
  /// Every layer's shell, in order (leases the rest).
  std::vector<ShellLease>& all() {
    if (r_.end > r_.begin) lease_through(r_.end - 1);
    return shells_;
  }

 private:
  void lease_through(int64_t last) {
    const std::optional<int64_t> layer = pos_.layer;
    StepLabel copying(pos_, "copying the layer to the device");
    for (int64_t l = r_.begin + static_cast<int64_t>(shells_.size()); l <= last; ++l) {
      pos_.layer = l;
      if (ctx_.wait_layer_ready) {
        StepLabel waiting(pos_, "waiting for the optimizer");
        ctx_.wait_layer_ready(l);
      }
      const bool from_snapshot = buffers_ == LayerBuffers::kFromForwardSnapshot;
      const Activations* buffers = nullptr;
      if (from_snapshot) {
        StepLabel waiting(pos_, "waiting for the forward's buffers");
        buffers = &await(ctx_.buffer_snapshot[l]);
      }
      if (from_snapshot && l < static_cast<int64_t>(ctx_.claimed.size()) && ctx_.claimed[l]) {
        // Claimed by the caller (Note [Run tails]); held until a job of an earlier run or this
        // run's forward releases a shell of the layer (Note [Shell claims]).
        StepLabel waiting(pos_, "waiting for a copy of the layer to be released");
        shells_.push_back(std::move(*ctx_.claimed[l]).take());
      } else {
        shells_.emplace_back(ctx_.model->shells, l);
      }
      const auto& shared = ctx_.cpu_shared_parameters;
      io_.upload_layer(*shells_.back().module().ptr(), *ctx_.model->layers[l].ptr(), buffers,
                       static_cast<size_t>(l) < shared.size() ? &shared[static_cast<size_t>(l)] : nullptr);
    }
    pos_.layer = layer;
  }

  RunContext& ctx_;
  scheduler::LayerRange r_;
  DeviceIo& io_;
  Position& pos_;
  LayerBuffers buffers_;
  bool lazy_;
  std::vector<ShellLease> shells_;  // layers r.begin, r.begin + 1, ... leased so far
};

// Note [Side inputs]: the caller's side inputs (roundpipe/side_inputs.h), split into microbatches
// with the inputs (ctx.side_inputs, read-only during the run), are installed by every stage job
// around the passes of its layers on a microbatch -- forward stages, the fused tail and the
// recompute of backward stages alike -- so a layer sees the same rows in its first pass and in
// its recompute. One scope per (job, microbatch): each tensor is moved to the job's device at most
// once for all of the stage's layers. The scope is the worker thread's own (thread-local); the
// host tensors it starts from are shared read-only. The backward pass itself calls no forward:
// what a layer derived from a side input (a mask) is in its autograd graph.
SideInputScope microbatch_side_inputs(const RunContext& ctx, int64_t j, DeviceIo& io) {
  SideInputs rows = ctx.side_inputs.empty() ? SideInputs{} : ctx.side_inputs[static_cast<size_t>(j)];
  return SideInputScope(std::move(rows), io.device());
}

// `kind`: whether the pass saves data for its recompute (a training forward stage), replays it (a
// recompute) or neither (Note [Recompute data] in roundpipe/recompute_data.h). Any pass but a
// recompute is the layer's first pass on the microbatch (its forward or fused pass): timed when
// measuring.
// Note [Draws in the tail]: a training run's first pass notes whether the layer drew random
// numbers on the microbatch (ctx.rng_used, written before the pass's output goes downstream, so
// the recompute of that microbatch sees it). A recompute of a pass that drew nothing runs
// unseeded: bitwise the same, and it leaves the device's default generator alone, which lets a
// run whose backward stages draw nothing finish them in the background while the caller's
// thread uses the generator (Note [Overlapping iterations]).
Activations run_layer(RunContext& ctx, ShellLease& shell, int64_t l, int64_t j, const Activations& acts, DeviceIo& io,
                      PassKind kind) {
  const bool first_pass = kind != PassKind::kReplays;
  RecomputeSlot* slot =
      ctx.recompute_slots.empty() ? nullptr : &ctx.recompute_slots[static_cast<size_t>(l * ctx.num_microbatch + j)];
  if (slot == nullptr) kind = PassKind::kPlain;
  RecomputePassScope pass(slot, kind, io.device());
  auto& layer = shell.module();
  io.before_compute(*layer.ptr());
  const bool timed = first_pass && !ctx.forward_ms.empty();
  std::chrono::steady_clock::time_point t0;
  if (timed) {
    io.synchronize();
    t0 = std::chrono::steady_clock::now();
  }
  std::atomic<bool>* drew = ctx.rng_used ? &ctx.rng_used[l * ctx.num_microbatch + j] : nullptr;
  Activations out;
  auto call = [&] { out = call_layer(layer, acts, ctx.model->call_modes[l]); };
  if (ctx.preserve_rng && (first_pass || drew == nullptr || drew->load())) {
    const bool used = run_seeded(io.device(), layer_seed(ctx.seed, ctx.iteration, j, l), call);
    if (first_pass && used && drew != nullptr) drew->store(true);
  } else if (first_pass && drew != nullptr) {
    if (run_noting_draws(io.device(), call)) drew->store(true);
  } else {
    call();
  }
  if (timed) {
    io.synchronize();
    ctx.forward_ms[l] += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  }
  return out;
}

// Times one microbatch of a backward or fused stage when the call measures layer times: from
// construction (the microbatch's inputs are on the device) to stop(), with the device synchronized
// at both ends, added into ctx.backward_stage_ms[stage].
class StageTimer {
 public:
  StageTimer(RunContext& ctx, DeviceIo& io, size_t stage)
      : ctx_(ctx), io_(io), stage_(stage), on_(stage < ctx.backward_stage_ms.size()) {
    if (!on_) return;
    io_.synchronize();
    start_ = std::chrono::steady_clock::now();
  }
  void stop() {
    pause();
    on_ = false;
  }
  /// Stops counting until resume() (the fused tail's recomputes, Note [Fused tail recompute]).
  void pause() {
    if (!on_ || paused_) return;
    io_.synchronize();
    ctx_.backward_stage_ms[stage_] +=
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start_).count();
    paused_ = true;
  }
  void resume() {
    if (!on_ || !paused_) return;
    io_.synchronize();
    start_ = std::chrono::steady_clock::now();
    paused_ = false;
  }

 private:
  RunContext& ctx_;
  DeviceIo& io_;
  size_t stage_;
  bool on_;
  bool paused_ = false;
  std::chrono::steady_clock::time_point start_;
};

std::vector<at::Tensor> buffer_copies(ShellLease& shell, DeviceIo& io) {
  return io.download_copy(shell.module().ptr()->buffers());
}

// The shell's gradients per parameter the layer uses (LayerSet::uses[l]), in host memory. A
// parameter at several positions of the layer (a module held twice) gets the sum of the
// gradients of its positions: the shell is a clone and may hold a separate copy for each (or one
// shared tensor, counted once). No copy on CPU when each parameter has one position: release
// only drops the shell's reference.
std::vector<at::Tensor> param_grads(const RunContext& ctx, int64_t l, ShellLease& shell, DeviceIo& io) {
  const auto& use_of = ctx.model->use_of_position[l];
  const auto params = shell.module().ptr()->parameters();
  TORCH_INTERNAL_ASSERT(params.size() == use_of.size(), "layer ", ctx.model->names[l], ": its shell has ",
                        params.size(), " parameters, the layer ", use_of.size());
  std::vector<at::Tensor> grads(ctx.model->uses[l].size());
  std::vector<std::vector<const c10::TensorImpl*>> counted(grads.size());
  for (size_t pos = 0; pos < params.size(); ++pos) {
    const int64_t u = use_of[pos];
    const c10::TensorImpl* impl = params[pos].unsafeGetTensorImpl();
    if (std::find(counted[u].begin(), counted[u].end(), impl) != counted[u].end()) continue;
    counted[u].push_back(impl);
    const at::Tensor& g = params[pos].grad();
    if (!g.defined()) continue;
    grads[u] = grads[u].defined() ? grads[u] + g : g;
  }
  return io.download(grads, ctx.model->grad_buffers.get());
}

// Records which GradScaler the loss_fn used (Note [Run scaler link] in scaler_link.h). Runs on the
// fused job's thread, the only one that calls loss_fn.
class RunScaleObserver final : public amp::detail::ScaleObserver {
 public:
  explicit RunScaleObserver(RunContext& ctx) : ctx_(ctx) {}
  void on_scale(amp::GradScaler& scaler, int64_t generation) override {
    ctx_.scaler_link.observe_scale(scaler, generation);
  }

 private:
  RunContext& ctx_;
};

// After a backward or fused job's last microbatch: checks its layers' parameter gradients for
// inf/NaN on the device (no host sync) and posts the flag to the run's GradScaler, if any.
void post_found_inf(RunContext& ctx, LayerLeases& leases, const c10::Device& device) {
  amp::GradScaler* scaler = ctx.scaler_link.scaler();
  if (scaler == nullptr || !scaler->is_enabled()) return;
  std::vector<at::Tensor> grads;
  for (auto& shell : leases.all()) {
    for (const auto& p : shell.module().ptr()->parameters()) {
      if (p.grad().defined()) grads.push_back(p.grad());
    }
  }
  const auto one = at::ones({}, at::TensorOptions().dtype(at::kFloat).device(device));
  auto per_device = amp::detail::non_finite_check_and_unscale(grads, one, /*allow_fp16=*/true);
  at::Tensor found_inf = at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(device));
  for (const auto& entry : per_device) found_inf.add_(entry.second.to(device));
  ctx.scaler_link.post_found_inf(found_inf);
}

// When a backward or fused job tells the step that the run's last reader of its layers has its
// copy of them (Note [Run tails]).
enum class ReleasePoint {
  kBeforeFirstMicrobatch,  // after the leases: an eager CPU job's copies are complete by then
  kAfterFirstMicrobatch,   // once the first microbatch's compute is enqueued
};

// Releases layers [r.begin, r.end) at `point` if that is this job's release point: an eager CPU
// job (Note [Lazy leases]) releases before its first microbatch; a lazy job after its first
// microbatch's compute is enqueued, every layer being leased by then (leased now if not), and on
// CUDA, whose copies are asynchronous, once they are complete (waiting for them earlier would
// hold that compute back; they complete before it, which waits for each layer's copy).
void release_after_copy(RunContext& ctx, scheduler::LayerRange r, LayerLeases& shells, DeviceIo& io,
                        ReleasePoint point) {
  if (!ctx.on_release) return;
  const bool eager_cpu = io.device().is_cpu() && !shells.lazy();
  if (point != (eager_cpu ? ReleasePoint::kBeforeFirstMicrobatch : ReleasePoint::kAfterFirstMicrobatch)) return;
  shells.all();
  io.wait_for_layer_uploads();
  release_layers(ctx, r.begin, r.end);
}

enum class LabelUse { kLossFn, kLastLayerOnly };

// Microbatch j's label on the job's device, uploaded like an activation (a plain .to(device) from
// pageable memory would synchronize the compute stream, draining the microbatch's forward), if
// the job needs it: for loss_fn (the fused job), or because layers `r` include the last layer and
// it takes the label (RoundPipeOptions::label_to_last_layer). Else undefined.
at::Tensor label_for(RunContext& ctx, scheduler::LayerRange r, int64_t j, DeviceIo& io, LabelUse use) {
  const bool needed = use == LabelUse::kLossFn || (ctx.label_to_last_layer && r.end == ctx.num_layers);
  if (!needed || ctx.labels.empty() || !ctx.labels[j].defined()) return at::Tensor();
  return io.upload({ctx.labels[j]})[0];
}

// The activations layer l is called with: the last layer gets the label appended when it takes it.
const Activations& layer_inputs(const RunContext& ctx, int64_t l, Activations& acts, const at::Tensor& label) {
  if (ctx.label_to_last_layer && l == ctx.num_layers - 1) acts.push_back(label);
  return acts;
}

// What the steps of a running stage job share: all on the job's stack, used by its worker thread
// only.
struct JobState {
  RunContext& ctx;
  scheduler::LayerRange r;
  Position& pos;
  DeviceIo& io;
  LayerLeases& shells;
  Handovers& handovers;
};

// The fused job's loss on one microbatch: loss_fn on the last layer's output, checked.
at::Tensor call_loss_fn(RunContext& ctx, Position& pos, RunScaleObserver& observer, const Activations& acts,
                        const at::Tensor& label) {
  StepLabel doing(pos, "loss_fn");
  TORCH_CHECK(acts.size() == 1, "the last layer returned ", acts.size(), " tensors; loss_fn takes one output tensor");
  at::Tensor loss;
  {
    amp::detail::ScopedScaleObserver observe(&observer);
    loss = (*ctx.loss_fn)(acts[0], label);
  }
  TORCH_CHECK(loss.defined() && loss.numel() == 1, "loss_fn must return a one-element tensor, got ",
              loss.defined() ? "shape " + c10::str(loss.sizes()) : "an undefined tensor",
              ": reduce the loss to a scalar inside loss_fn (e.g. a sum over the microbatch divided by the full "
              "batch size)");
  TORCH_CHECK(loss.requires_grad(),
              "loss_fn returned a loss that does not require grad: compute it from the "
              "output tensor without detaching it (no .detach(), .item() or NoGradGuard inside loss_fn)");
  return loss;
}

// What a backward or fused job's layer buffers are at its end: the fused job ran the layers'
// forward, so they are the run's final values, handed to the caller; a backward job's recompute
// evolved the forward's snapshots, and they are discarded (Note [Buffers in recompute]).
enum class JobBuffers { kDiscarded, kFinal };

// The ending of a backward or fused job, after its last microbatch: hands everything over, posts
// the found_inf flag of its layers' gradients, then hands the gradients (and final buffers) over.
void finish_gradient_job(JobState& job, JobBuffers buffers) {
  job.handovers.flush_all();
  job.pos.microbatch.reset();
  {
    StepLabel doing(job.pos, "checking gradients for inf/NaN");
    post_found_inf(job.ctx, job.shells, job.io.device());
  }
  for (int64_t l = job.r.begin; l < job.r.end; ++l) {
    job.ctx.grads[l] = param_grads(job.ctx, l, job.shells[l], job.io);
    if (buffers == JobBuffers::kFinal) job.ctx.buffers[l] = buffer_copies(job.shells[l], job.io);
  }
  if (job.ctx.on_grads_ready) job.ctx.on_grads_ready(job.r.begin, job.r.end);
}

// Note [Recompute ahead]: with the stage grain a microbatch is recomputed as soon as the device is
// free and the forward has passed the stage's layers for it, and its gradient is awaited only
// before the backward pass, so the recompute overlaps the wait for the stage downstream (what the
// Python original does; scheduler::SimulateOptions::recompute_ahead). The measuring call awaits
// first, so its timer sees only the work.
bool recomputes_ahead(const RunContext& ctx, size_t stage) {
  return ctx.grain == RecomputeGrain::kStage && stage >= ctx.backward_stage_ms.size();
}

// The gradients of backward stage `stage`'s output on microbatch j, sent by the stage downstream.
Activations await_output_grads(JobState& job, size_t stage, int64_t j) {
  return job.io.upload(job.handovers.await_input(job.ctx.bwd_grad[stage - 1][j]));
}

// Stage grain, microbatch j: recomputes the stage's layers from the stage's saved input, then
// backward from `grads` (awaited here when recomputing ahead). Returns the input's gradients.
Activations stage_grain_backward(JobState& job, size_t stage, int64_t j, bool ahead, Activations grads) {
  RunContext& ctx = job.ctx;
  const scheduler::LayerRange r = job.r;
  // The forward of the stage's layers must be done for this microbatch (the recompute replays its
  // draws, Note [Layer RNG]): the saved input of the next stage down, or the fused tail's input.
  // Awaiting the gradient first implied it.
  if (ahead) {
    job.handovers.await_input(r.end < ctx.num_layers && !ctx.saved[r.end].empty() ? ctx.saved[r.end][j]
                                                                                  : ctx.fwd_out.back()[j]);
  }
  Activations leaves = make_leaves(job.io, job.handovers.await_input(ctx.saved[r.begin][j]), r.begin > 0);
  Activations acts = leaves;
  {
    StepLabel doing(job.pos, "recompute");
    for (int64_t l = r.begin; l < r.end; ++l) {
      job.pos.layer = l;
      acts = run_layer(ctx, job.shells[l], l, j, acts, job.io, PassKind::kReplays);
    }
    job.pos.layer.reset();
  }
  // Unlabelled, as when awaiting first: an upstream failure is reported as such.
  if (ahead) grads = await_output_grads(job, stage, j);
  StepLabel doing(job.pos, "backward");
  backward_paired(acts, grads);
  return leaf_grads(leaves);
}

// Layer grain, microbatch j: for each of the stage's layers, last first, recomputes it from its
// saved input and backward from `grads`. Returns the stage input's gradients.
Activations layer_grain_backward(JobState& job, int64_t j, Activations grads) {
  for (int64_t l = job.r.end - 1; l >= job.r.begin; --l) {
    job.pos.layer = l;
    Activations leaves = make_leaves(job.io, job.handovers.await_input(job.ctx.saved[l][j]), l > 0);
    Activations acts;
    {
      StepLabel doing(job.pos, "recompute");
      acts = run_layer(job.ctx, job.shells[l], l, j, leaves, job.io, PassKind::kReplays);
    }
    StepLabel doing(job.pos, "backward");
    backward_paired(acts, grads);
    grads = leaf_grads(leaves);
  }
  job.pos.layer.reset();
  return grads;
}

// Frees what layers r's first passes on microbatch j saved for their recompute, once it is done.
void clear_recompute_slots(RunContext& ctx, scheduler::LayerRange r, int64_t j) {
  if (ctx.recompute_slots.empty()) return;
  for (int64_t l = r.begin; l < r.end; ++l) ctx.recompute_slots[static_cast<size_t>(l * ctx.num_microbatch + j)] = {};
}

// Backward stage `stage` on microbatch j: recompute and backward of its layers, timed when the
// call measures. Returns the gradients of the stage's input.
Activations backward_microbatch(JobState& job, size_t stage, int64_t j, bool ahead) {
  Activations grads;
  if (!ahead) grads = await_output_grads(job, stage, j);
  StageTimer timer(job.ctx, job.io, stage);
  SideInputScope side = microbatch_side_inputs(job.ctx, j, job.io);
  grads = job.ctx.grain == RecomputeGrain::kStage ? stage_grain_backward(job, stage, j, ahead, std::move(grads))
                                                  : layer_grain_backward(job, j, std::move(grads));
  StepLabel doing(job.pos, "backward");  // the timer's synchronization reports the backward's errors
  timer.stop();
  return grads;
}

// Note [Fused tail recompute]: with the layer grain the fused tail keeps, like a backward stage,
// only its layers' inputs between a microbatch's forward and its backward. It runs its layers but
// the last without autograd, keeping each one's input as a host copy (the first layer's input is
// the stage input, which the tail keeps anyway as the leaves of its gradient), then the last
// layer, the loss and their backward, then each earlier layer, last first: its recompute from the
// kept input and its backward. At a long sequence the tail then holds one layer's intermediates
// instead of the sum over its layers (Note [Memory model] in scheduler/memory_model.cpp), for
// one more forward of those layers per microbatch (SimulateOptions::fused_recompute). As in a
// backward stage, the first pass saves its data for the recompute and the recompute replays it
// (Note [Recompute data]) and both draw from the same seed (Note [Layer RNG]). Layer buffers:
// the recompute starts from the values the first pass started from and the first pass's results
// are put back after it, so running statistics evolve once, as in a plain microbatched forward
// (Note [Buffers in recompute]). The stage timer stops during the recomputes: the measured tail
// stays "forward + backward", the cost the simulator gives every layer's `backward`.
bool fused_tail_recomputes(const RunContext& ctx, scheduler::LayerRange r) {
  return ctx.grain == RecomputeGrain::kLayer && r.size() > 1;
}

// A layer's buffers as they were before its first pass on a microbatch, to run its recompute
// from (Note [Fused tail recompute]). Holds nothing for a layer without buffers.
class BufferRewind {
 public:
  explicit BufferRewind(ShellLease& shell) {
    at::NoGradGuard no_grad;
    for (const auto& b : shell.module().ptr()->buffers()) before_.push_back(b.defined() ? b.clone() : b);
  }
  // Sets the buffers back to their values at construction, keeping the values they had (for
  // restore(), after the recompute's backward: autograd may have saved the buffers the recompute
  // read, and checks that they were not modified since).
  void rewind(ShellLease& shell) {
    if (before_.empty()) return;
    auto buffers = shell.module().ptr()->buffers();
    TORCH_INTERNAL_ASSERT(buffers.size() == before_.size(), "a layer's buffer count changed between its passes");
    at::NoGradGuard no_grad;
    for (size_t k = 0; k < buffers.size(); ++k) {
      after_.push_back(buffers[k].defined() ? buffers[k].clone() : buffers[k]);
      if (buffers[k].defined()) buffers[k].copy_(before_[k]);
    }
  }
  void restore(ShellLease& shell) {
    if (after_.empty()) return;
    auto buffers = shell.module().ptr()->buffers();
    at::NoGradGuard no_grad;
    for (size_t k = 0; k < buffers.size(); ++k) {
      if (buffers[k].defined()) buffers[k].copy_(after_[k]);
    }
  }

 private:
  std::vector<at::Tensor> after_;
  std::vector<at::Tensor> before_;
};

// Layer inputs made leaves on their device (no copy): floating tensors require grad.
Activations device_leaves(const Activations& acts) {
  Activations out;
  out.reserve(acts.size());
  for (const auto& t : acts) {
    if (!t.defined()) {
      out.push_back(t);
      continue;
    }
    at::Tensor leaf = t.detach();
    if (is_float(leaf)) leaf.requires_grad_(true);
    out.push_back(std::move(leaf));
  }
  return out;
}

// The fused tail on microbatch j with the layer grain (Note [Fused tail recompute]), from the
// stage input `leaves`: returns the loss, with the gradients of `leaves` and of the layers'
// parameters accumulated.
at::Tensor fused_layer_grain(JobState& job, int64_t j, const Activations& leaves, const at::Tensor& label,
                             RunScaleObserver& observer, StageTimer& timer) {
  RunContext& ctx = job.ctx;
  const scheduler::LayerRange r = job.r;
  const int64_t last = r.end - 1;
  std::vector<DeviceIo::Pending> kept;  // the inputs of layers r.begin + 1 .. last - 1, host copies
  std::vector<BufferRewind> rewinds;    // layers r.begin .. last - 1
  kept.reserve(static_cast<size_t>(last - r.begin));
  rewinds.reserve(static_cast<size_t>(last - r.begin));
  Activations acts = leaves;
  {
    at::NoGradGuard no_grad;
    for (int64_t l = r.begin; l < last; ++l) {
      job.pos.layer = l;
      if (l > r.begin) kept.push_back(job.io.download_copy_async(acts));
      rewinds.emplace_back(job.shells[l]);
      acts = run_layer(ctx, job.shells[l], l, j, layer_inputs(ctx, l, acts, label), job.io, PassKind::kSaves);
    }
  }
  job.pos.layer = last;
  const Activations last_leaves = device_leaves(acts);
  acts = last_leaves;
  acts = run_layer(ctx, job.shells[last], last, j, layer_inputs(ctx, last, acts, label), job.io, PassKind::kPlain);
  job.pos.layer.reset();
  const at::Tensor loss = call_loss_fn(ctx, job.pos, observer, acts, label);
  Activations grads;
  {
    StepLabel doing(job.pos, "backward");
    loss.backward();
    grads = leaf_grads(last_leaves);
  }
  for (int64_t l = last - 1; l >= r.begin; --l) {
    job.pos.layer = l;
    Activations in =
        l == r.begin ? leaves : make_leaves(job.io, kept[static_cast<size_t>(l - r.begin - 1)].wait(), true);
    kept.resize(static_cast<size_t>(std::max<int64_t>(0, l - r.begin - 1)));  // frees the host copy
    Activations outs;
    {
      StepLabel doing(job.pos, "recompute");
      timer.pause();
      Activations call_in = in;
      rewinds[static_cast<size_t>(l - r.begin)].rewind(job.shells[l]);
      outs = run_layer(ctx, job.shells[l], l, j, layer_inputs(ctx, l, call_in, label), job.io, PassKind::kReplays);
      timer.resume();
    }
    StepLabel doing(job.pos, "backward");
    backward_paired(outs, grads);
    grads = leaf_grads(in);
    rewinds[static_cast<size_t>(l - r.begin)].restore(job.shells[l]);
  }
  job.pos.layer.reset();
  return loss;
}

}  // namespace

void set_cuda_flow_on_cpu_for_testing(bool on) { cuda_flow_on_cpu.store(on); }

void release_layers(RunContext& ctx, int64_t begin, int64_t end) {
  if (!ctx.on_release) return;
  for (int64_t l = begin; l < end; ++l) {
    if (!ctx.released[l].exchange(true)) ctx.on_release(l);
  }
}

void run_forward_stage(RunContext& ctx, size_t stage, scheduler::LayerRange r, c10::Device device) {
  Position pos{"forward", r};
  std::vector<ChannelPtr> outputs;
  if (stage < ctx.fwd_out.size()) outputs.insert(outputs.end(), ctx.fwd_out[stage].begin(), ctx.fwd_out[stage].end());
  for (int64_t l = r.begin; l < r.end; ++l) {
    outputs.insert(outputs.end(), ctx.saved[l].begin(), ctx.saved[l].end());
    outputs.push_back(ctx.buffer_snapshot[l]);
  }
  guarded(ctx, device, pos, outputs, [&] {
    DeviceIo io(device, job_name(pos));
    LayerLeases shells(ctx, r, io, pos);
    for (int64_t l = r.begin; l < r.end; ++l) {
      if (!ctx.buffer_snapshot[l]) continue;
      auto& shell = shells[l];
      io.before_compute(*shell.module().ptr());
      ctx.buffer_snapshot[l]->set(buffer_copies(shell, io));
    }
    at::NoGradGuard no_grad;
    Handovers handovers(io);  // Note [Deferred hand-over]
    for (int64_t j = 0; j < ctx.num_microbatch; ++j) {
      pos.microbatch = j;
      Activations acts = io.upload(stage == 0 ? ctx.inputs[j] : handovers.await_input(ctx.fwd_out[stage - 1][j]));
      const at::Tensor label = label_for(ctx, r, j, io, LabelUse::kLastLayerOnly);
      SideInputScope side = microbatch_side_inputs(ctx, j, io);
      for (int64_t l = r.begin; l < r.end; ++l) {
        pos.layer = l;
        if (!ctx.saved[l].empty()) handovers.post(j, ctx.saved[l][j], io.download_copy_async(acts));
        acts = run_layer(ctx, shells[l], l, j, layer_inputs(ctx, l, acts, label), io,
                         ctx.training ? PassKind::kSaves : PassKind::kPlain);
      }
      pos.layer.reset();
      handovers.flush_before(j);
      if (stage < ctx.fwd_out.size()) {
        handovers.post(j, ctx.fwd_out[stage][j], io.download_async(acts));
      } else if (ctx.output_device.is_cpu()) {
        handovers.post(
            j, [&ctx, j](Activations a) { ctx.outputs[j] = std::move(a); }, io.download_async(acts));
      } else {
        for (const auto& t : acts) ctx.outputs[j].push_back(t.defined() ? t.to(ctx.output_device) : t);
      }
    }
    handovers.flush_all();
    for (int64_t l = r.begin; l < r.end; ++l) ctx.buffers[l] = buffer_copies(shells[l], io);
  });
}

void run_fused_stage(RunContext& ctx, scheduler::LayerRange r, c10::Device device) {
  Position pos{"fused", r};
  std::vector<ChannelPtr> outputs(ctx.bwd_grad[0].begin(), ctx.bwd_grad[0].end());
  guarded(ctx, device, pos, outputs, [&] {
    DeviceIo io(device, job_name(pos));
    LayerLeases shells(ctx, r, io, pos);
    release_after_copy(ctx, r, shells, io, ReleasePoint::kBeforeFirstMicrobatch);
    RunScaleObserver observer(ctx);
    const size_t fwd_stages = ctx.fwd_out.size();
    Handovers handovers(io);  // Note [Deferred hand-over]
    JobState job{ctx, r, pos, io, shells, handovers};
    for (int64_t j = 0; j < ctx.num_microbatch; ++j) {
      pos.microbatch = j;
      Activations leaves = r.begin == 0 ? io.upload(ctx.inputs[j])
                                        : make_leaves(io, handovers.await_input(ctx.fwd_out[fwd_stages - 1][j]),
                                                      /*need_grad=*/true);
      StageTimer timer(ctx, io, 0);
      const at::Tensor label = label_for(ctx, r, j, io, LabelUse::kLossFn);
      SideInputScope side = microbatch_side_inputs(ctx, j, io);
      at::Tensor loss;
      if (fused_tail_recomputes(ctx, r)) {
        loss = fused_layer_grain(job, j, leaves, label, observer, timer);
        clear_recompute_slots(ctx, r, j);
        StepLabel doing(pos, "backward");  // the timer's synchronization reports the backward's errors
        timer.stop();
      } else {
        Activations acts = leaves;
        for (int64_t l = r.begin; l < r.end; ++l) {
          pos.layer = l;
          acts = run_layer(ctx, shells[l], l, j, layer_inputs(ctx, l, acts, label), io, PassKind::kPlain);
        }
        pos.layer.reset();
        loss = call_loss_fn(ctx, pos, observer, acts, label);
        StepLabel doing(pos, "backward");
        loss.backward();
        timer.stop();
      }
      handovers.flush_before(j);
      handovers.post(
          j, [&ctx, j](Activations a) { ctx.losses[j] = a[0].reshape({}); }, io.download_async({loss.detach()}));
      if (r.begin > 0) handovers.post(j, ctx.bwd_grad[0][j], io.download_async(leaf_grads(leaves)));
      if (j == 0) release_after_copy(ctx, r, shells, io, ReleasePoint::kAfterFirstMicrobatch);
    }
    finish_gradient_job(job, JobBuffers::kFinal);
  });
}

void run_backward_stage(RunContext& ctx, size_t stage, scheduler::LayerRange r, c10::Device device) {
  Position pos{"backward", r};
  std::vector<ChannelPtr> outputs;
  if (r.begin > 0) outputs.assign(ctx.bwd_grad[stage].begin(), ctx.bwd_grad[stage].end());
  guarded(ctx, device, pos, outputs, [&] {
    DeviceIo io(device, job_name(pos));
    // Recompute starts from the buffers the forward started from (the shells get the snapshots),
    // and evolves them in the same microbatch order; the results are discarded (Note [Buffers in
    // recompute]).
    LayerLeases shells(ctx, r, io, pos, LayerBuffers::kFromForwardSnapshot);
    release_after_copy(ctx, r, shells, io, ReleasePoint::kBeforeFirstMicrobatch);
    const bool ahead = recomputes_ahead(ctx, stage);  // Note [Recompute ahead]
    Handovers handovers(io);                          // Note [Deferred hand-over]
    JobState job{ctx, r, pos, io, shells, handovers};
    for (int64_t j = 0; j < ctx.num_microbatch; ++j) {
      pos.microbatch = j;
      const Activations grads = backward_microbatch(job, stage, j, ahead);
      clear_recompute_slots(ctx, r, j);
      handovers.flush_before(j);
      if (r.begin > 0) handovers.post(j, ctx.bwd_grad[stage][j], io.download_async(grads));
      if (j == 0) release_after_copy(ctx, r, shells, io, ReleasePoint::kAfterFirstMicrobatch);
    }
    finish_gradient_job(job, JobBuffers::kDiscarded);
  });
}

}  // namespace roundpipe::detail
