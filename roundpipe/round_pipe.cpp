// RoundPipe: the model's layers and devices, and the two entry points built on one run path
// (detail/run_launcher), the optimizer side (detail/step_pipeline) and the planner glue
// (detail/plan_selector).
#include "roundpipe/round_pipe.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>
#include <utility>

#include "amp/autocast_guard.h"
#include "amp/detail/grad_scaler_access.h"
#include "amp/grad_scaler.h"
#include "base/logging.h"
#include "comm/process_group.h"
#include "roundpipe/detail/caller_guard.h"
#include "roundpipe/detail/device_worker.h"
#include "roundpipe/detail/grad_sync.h"
#include "roundpipe/detail/host_blocks.h"
#include "roundpipe/detail/master_checks.h"
#include "roundpipe/detail/plan_selector.h"
#include "roundpipe/detail/run_launcher.h"
#include "roundpipe/detail/stage_jobs.h"
#include "roundpipe/detail/step_pipeline.h"
#include "roundpipe/devices.h"
#include "roundpipe/side_inputs.h"

namespace roundpipe {

// Note [Buffers in recompute]:
// A forward stage snapshots its layers' buffers before its first microbatch; backward stages
// recompute from that snapshot, in the same microbatch order, and discard the result. Only the
// forward (or fused) pass's final buffers are written back to the model, so running statistics
// evolve exactly as in a plain microbatched forward.

namespace {

using scheduler::RunType;

thread_local int optimizer_ctx_depth = 0;
// The model whose async step function runs on this thread (its optimizer thread), else null
// (Note [One caller thread]).
thread_local const void* async_step_of = nullptr;
std::atomic<uint64_t> next_flag_batch{1};  // run ids for GradScaler flags, unique in the process

// A run's gradient sync (data parallelism), abandoned (GradSync::abandon: this rank's collectives
// are out of step) when the guard goes out of scope before finish() or release(). Empty without a
// sync. Used on the thread that owns the sync at that point: the caller, then the run's tail.
class PendingGradSync {
 public:
  PendingGradSync() = default;
  PendingGradSync(detail::GradSync* sync, std::shared_ptr<detail::GradSync::Run> run)
      : sync_(sync), run_(std::move(run)) {}
  ~PendingGradSync() {
    if (sync_ != nullptr) sync_->abandon(*run_);
  }
  PendingGradSync(PendingGradSync&& other) noexcept
      : sync_(std::exchange(other.sync_, nullptr)), run_(std::move(other.run_)) {}
  PendingGradSync(const PendingGradSync&) = delete;
  PendingGradSync& operator=(const PendingGradSync&) = delete;
  PendingGradSync& operator=(PendingGradSync&&) = delete;

  /// The run's jobs succeeded: averages its gradients over the ranks and combines its found_inf
  /// flags (GradSync::finish). Returns the combined found_inf ([1]).
  at::Tensor finish(const detail::RunContext& ctx) {
    detail::GradSync* sync = std::exchange(sync_, nullptr);
    // Note [found_inf across ranks]: the scaler's skip decision and its next scale come from the
    // found_inf flags of the run's backward jobs, computed on this rank's gradients before the
    // average. They are combined here (max over the ranks, one flag), so every rank skips the same
    // steps and keeps the same scale, exactly as one process with the whole batch would. The
    // all-reduce runs with or without a scaler, so every rank issues the same collectives.
    const at::Tensor deferred = ctx.scaler_link.deferred_found_inf();
    at::Tensor found =
        deferred.defined() ? deferred.to(at::kFloat).reshape({1}).contiguous() : at::zeros({1}, at::kFloat);
    return sync->finish(*run_, std::move(found));
  }
  explicit operator bool() const { return sync_ != nullptr; }

 private:
  detail::GradSync* sync_ = nullptr;
  std::shared_ptr<detail::GradSync::Run> run_;
};

// The tail of a training run (Note [Run tails] in step_pipeline.cpp), detached or not, on the step
// pipeline's tail thread: waits for the run's backward jobs, then averages the gradients over the
// ranks (with a sync: its found_inf flags combined and posted as one) and hands them over,
// accumulated until step. A failed run hands nothing over: its sync is abandoned, the GradScaler
// flags announced for it are dropped (as for a run never announced, so that no update waits for
// flags that never come), and the error is rethrown.
struct RunTail {
  std::shared_ptr<detail::RunContext> ctx;
  std::shared_ptr<detail::RunJobs> jobs;
  detail::StepPipeline* steps = nullptr;
  const detail::LayerSet* layers = nullptr;
  int64_t steps_before = 0;
  std::shared_ptr<PendingGradSync> sync = nullptr;  // released to the tail by the caller, or null
  amp::GradScaler* flags_announced_to = nullptr;    // a detached run's scaler, told to expect its flags

  void operator()() const {
    PendingGradSync pending = sync ? std::move(*sync) : PendingGradSync();
    if (const std::exception_ptr error = detail::finish_backward(*ctx, *jobs)) {
      if (flags_announced_to != nullptr) {
        ctx->scaler_link.drop_announced_flags(*flags_announced_to);
      }
      std::rethrow_exception(error);
    }
    if (pending) {
      const at::Tensor found = pending.finish(*ctx);
      amp::GradScaler* scaler = ctx->scaler_link.scaler();
      if (scaler != nullptr && scaler->is_enabled()) ctx->scaler_link.post_combined(found.reshape({}));
    }
    steps->accept_grads(*layers, ctx->grads, steps_before);
  }
};

torch::nn::Sequential checked_model(torch::nn::Sequential model) {
  TORCH_CHECK(!model.is_empty() && model->size() > 0,
              "RoundPipe needs a torch::nn::Sequential with at least one layer");
  return model;
}

std::vector<c10::Device> checked_devices(const RoundPipeOptions& options) {
  std::vector<c10::Device> devices = options.devices().empty() ? default_devices() : options.devices();
  check_devices(devices);
  return devices;
}

// The base seed of layer_seed when RoundPipeOptions::seed is unset: drawn from the CPU generator.
uint64_t draw_seed() {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get<at::CPUGeneratorImpl>()->random64();
}

}  // namespace

OptimizerCtx::OptimizerCtx() { ++optimizer_ctx_depth; }
OptimizerCtx::~OptimizerCtx() { --optimizer_ctx_depth; }
bool OptimizerCtx::active() { return optimizer_ctx_depth > 0; }

// Owned by the caller thread; the members below that others touch say so.
// Members without a comment saying otherwise are set by the constructor and fixed after it.
struct RoundPipe::Impl {
  Impl(torch::nn::Sequential model, RoundPipeOptions options);

  const torch::nn::Sequential model;
  const RoundPipeOptions options;
  const std::vector<c10::Device> devices;
  detail::LayerSet layer_set;  // immutable after construction, but for what LayerSet says
  // Compute copies per layer (the model's own parameters), distinct within the model.
  std::vector<std::vector<torch::Tensor>> params;
  std::vector<std::vector<std::string>> param_names;
  std::vector<std::unique_ptr<detail::DeviceWorker>> workers;
  int64_t device_cursor = 0;  // round-robin position, continues across calls
  int64_t iteration = 0;      // changed by training calls and set_iteration
  uint64_t seed = 0;
  bool warned_small_batch = false;  // changed by the first call that clamps num_microbatch
  const Logger* const log = &Logger::get("runtime");
  std::unique_ptr<detail::PlanSelector> planner;
  std::unique_ptr<detail::GradSync> grad_sync;  // with a process group of more than one rank
  int64_t overlapped_runs = 0;                  // detached runs with a grad_sync
  detail::CallerGuard caller_guard;             // Note [One caller thread]
  std::unique_ptr<detail::StepPipeline> steps;  // declared last: destroyed (drained) first

  int64_t num_layers() const { return static_cast<int64_t>(layer_set.layers.size()); }
  bool drives_gpus() const {
    return std::any_of(devices.begin(), devices.end(), [](const c10::Device& d) { return d.is_cuda(); });
  }
  // Data parallelism: gradients are averaged over the ranks of the process group.
  bool data_parallel() const { return options.process_group() && options.process_group()->world_size() > 1; }

  // The constructor's steps, in order.
  void check_options() const;
  void build_layer_set();
  void add_layer(const torch::nn::AnyModule& layer, std::unordered_map<const void*, detail::ParamRef>& owner);
  void pin_host_copies();
  int64_t device_memory_budget() const;
  void make_planner();

  // forward_backward's steps.
  PendingGradSync begin_grad_sync(detail::RunContext& ctx);
  void claim_backward_shells(detail::RunContext& ctx, int64_t fused_begin);
  [[noreturn]] void fail_run(const std::shared_ptr<detail::RunContext>& ctx,
                             const std::shared_ptr<detail::RunJobs>& jobs, const std::exception_ptr& head_error);

  // The entry of forward_backward, forward, step and synchronize (Note [One caller thread]): one
  // thread at a time, and never one of the model's own threads, where a callback calling back in
  // would wait for itself (a device worker waits for its own job, the optimizer thread drains
  // its own step).
  detail::CallerGuard::Scope enter(const char* entry) {
    for (const auto& worker : workers) {
      TORCH_CHECK(!worker->is_current(), "RoundPipe '", options.name(), "': ", entry,
                  " called from inside a loss_fn or a layer, on the model's device worker for ", worker->device(),
                  "; callbacks run on RoundPipe's threads and must not call back into the model: call ", entry,
                  " from your own thread after forward_backward returns");
    }
    TORCH_CHECK(async_step_of != this, "RoundPipe '", options.name(), "': ", entry,
                " called from inside a step function, on the model's optimizer thread (it would wait for "
                "itself); call ",
                entry, " from your own thread after step() returns");
    return caller_guard.enter(entry, options.name());
  }

  // Per layer: parameter + buffer bytes, or with `grads_only` the trainable parameters' bytes.
  std::vector<int64_t> layer_bytes(bool grads_only) const {
    std::vector<int64_t> out;
    for (int64_t l = 0; l < num_layers(); ++l) {
      int64_t b = 0;
      auto module = layer_set.layers[l].ptr();
      for (const auto& p : module->parameters()) {
        if (!grads_only || p.requires_grad()) b += p.nbytes();
      }
      if (!grads_only) {
        for (const auto& buf : module->buffers()) b += buf.nbytes();
      }
      out.push_back(b);
    }
    return out;
  }

  // Gradients on the compute copies are complete once every run tail has finished (Note [Run
  // tails]); readers that hand out the compute copies wait for that, except on the model's own
  // threads (a step function: its step already waited for the tails before it).
  void settle_grads() {
    if (async_step_of == this) return;
    for (const auto& worker : workers) {
      if (worker->is_current()) return;
    }
    steps->wait_tails();
  }

  // [layer][position in the layer's parameters()]: the parameters CPU devices' stage jobs compute
  // on without a copy (Note [Shared host parameters] in detail/device_io.cpp), per owner (Note
  // [Shared parameters]: a tied parameter is shared where its owner is). Empty when every device
  // is a GPU (they always copy).
  std::vector<std::vector<bool>> cpu_shared_parameters() {
    std::vector<std::vector<bool>> out;
    if (std::all_of(devices.begin(), devices.end(), [](const c10::Device& d) { return d.is_cuda(); })) return out;
    const std::vector<std::vector<bool>> shareable = steps->shareable_parameters();
    out.resize(static_cast<size_t>(num_layers()));
    for (size_t l = 0; l < out.size(); ++l) {
      for (const int64_t u : layer_set.use_of_position[l]) {
        const detail::ParamRef& owner = layer_set.uses[l][static_cast<size_t>(u)];
        out[l].push_back(shareable[static_cast<size_t>(owner.layer)][static_cast<size_t>(owner.index)]);
      }
    }
    return out;
  }

  // The run path shared by forward and forward_backward, up to the dispatch: resolves the call's
  // settings, splits the batch and fills `ctx` (with the entry point's own fields: loss_fn, flag
  // batch). Returns the resolved settings and the plan to run.
  std::pair<detail::ResolvedRunConfig, scheduler::ExecutePlan> prepare(
      detail::RunContext& ctx, RunType type, const char* entry, const std::vector<torch::Tensor>& inputs,
      const torch::Tensor& label, const RunConfig& call, bool measure_if_automatic) {
    TORCH_CHECK(!inputs.empty(), entry, " needs at least one input tensor");
    const int64_t rows = detail::batch_rows(inputs);
    TORCH_CHECK(rows > 0, entry, ": no input has a batch dimension with rows (got ", rows, ")");
    auto cfg = detail::resolve_run_config(call, options.run_config(), type, static_cast<int64_t>(devices.size()), rows);
    if (cfg.clamped_from) {
      const auto level = warned_small_batch ? LogLevel::kDebug : LogLevel::kWarn;
      warned_small_batch = true;
      if (log->enabled(level)) {
        log->log(level, detail::log_concat("RoundPipe '", options.name(), "': ", entry, ": batch of ", rows,
                                           " rows is smaller than num_microbatch ", *cfg.clamped_from, "; using ", rows,
                                           " microbatches"));
      }
    }
    scheduler::ExecutePlan plan = planner->plan_for(cfg.execute_plan, type);
    const int64_t M = cfg.num_microbatch;
    ctx.model = &layer_set;
    ctx.model_name = options.name();
    ctx.num_layers = num_layers();
    ctx.num_microbatch = M;
    ctx.iteration = iteration;
    ctx.seed = seed;
    ctx.preserve_rng = cfg.preserve_rng_state;
    ctx.training = type == RunType::kFused;
    ctx.grain = cfg.recompute_grain;
    ctx.output_device = cfg.output_device;
    ctx.autocast = amp::AutocastState::capture();
    ctx.inputs = detail::split_batch(inputs, M, "inputs", options.name());
    ctx.label_to_last_layer = options.label_to_last_layer();
    ctx.cpu_shared_parameters = cpu_shared_parameters();
    TORCH_CHECK(!ctx.label_to_last_layer || label.defined() || !ctx.training, "RoundPipe '", options.name(),
                "': ", entry, " needs a label: RoundPipeOptions::label_to_last_layer passes it to the last layer");
    if (ctx.training || label.defined()) ctx.labels = detail::split_label(label, rows, M, options.name());
    ctx.side_inputs = detail::split_side_inputs(SideInputScope::current(), rows, M, options.name());
    if (ctx.training) {
      if (measure_if_automatic && !cfg.execute_plan) {
        ctx.forward_ms.assign(static_cast<size_t>(num_layers()), 0.0);
        ctx.backward_stage_ms.assign(plan.backward_stages().size(), 0.0);
      }
    }
    const int64_t steps_before = steps->steps();
    ctx.wait_layer_ready = [this, steps_before](int64_t l) { steps->wait_published(l, steps_before); };
    if (ctx.training) ++iteration;  // the iteration index is consumed even if the call fails
    return {cfg, std::move(plan)};
  }
};

RoundPipe::Impl::Impl(torch::nn::Sequential model_in, RoundPipeOptions options_in)
    : model(checked_model(std::move(model_in))), options(std::move(options_in)), devices(checked_devices(options)) {
  check_options();
  build_layer_set();
  if (drives_gpus()) pin_host_copies();
  seed = options.seed() ? *options.seed() : draw_seed();
  make_planner();
  if (data_parallel()) {
    detail::broadcast_model(*options.process_group(), options.name(), layer_set);
    grad_sync =
        std::make_unique<detail::GradSync>(options.process_group(), layer_set, params, options.grad_bucket_bytes());
  }
  // Note [Optimizer thread budget] (step_pipeline.cpp): half the cores when driving GPUs.
  const int64_t optimizer_threads = drives_gpus() ? std::max<int64_t>(1, std::thread::hardware_concurrency() / 2) : 0;
  steps = std::make_unique<detail::StepPipeline>(&params, options.optim_dtype(), options.master_grad_dtype(),
                                                 optimizer_threads, options.in_place_masters(), options.sync_steps());
  for (const auto& device : devices) workers.push_back(std::make_unique<detail::DeviceWorker>(device));
  ROUNDPIPE_LOG(*log, kInfo, "RoundPipe '", options.name(), "': ", num_layers(), " layers on ", devices.size(),
                " device(s)");
}

// Every option a bad value of which would fail later, checked at construction.
void RoundPipe::Impl::check_options() const {
  if (options.run_config().num_microbatch) {
    detail::check_num_microbatch(*options.run_config().num_microbatch, "RoundPipeOptions::run_config.num_microbatch");
  }
  if (options.optim_dtype()) detail::check_master_dtype(*options.optim_dtype(), "RoundPipeOptions::optim_dtype");
  if (options.master_grad_dtype()) {
    TORCH_CHECK(c10::isFloatingType(*options.master_grad_dtype()),
                "RoundPipeOptions::master_grad_dtype must be a floating-point dtype (e.g. torch::kBFloat16), got ",
                *options.master_grad_dtype());
  }
  TORCH_CHECK(!options.in_place_masters() || (!options.optim_dtype() && !options.master_grad_dtype()),
              "RoundPipeOptions::in_place_masters: the masters are the parameters themselves, in their own dtype, "
              "so optim_dtype and master_grad_dtype must be unset (got optim_dtype ",
              options.optim_dtype() ? c10::toString(*options.optim_dtype()) : "unset", ", master_grad_dtype ",
              options.master_grad_dtype() ? c10::toString(*options.master_grad_dtype()) : "unset",
              "): cast the model to the master dtype you want instead (e.g. model->to(torch::kBFloat16) with "
              "optim::AdamOptions::kahan_sum)");
  if (options.device_memory_budget_bytes()) {
    TORCH_CHECK(*options.device_memory_budget_bytes() > 0,
                "RoundPipeOptions::device_memory_budget_bytes must be > 0, got ",
                *options.device_memory_budget_bytes());
  }
}

void RoundPipe::Impl::build_layer_set() {
  std::unordered_map<const void*, detail::ParamRef> owner;  // by TensorImpl (Note [Shared parameters])
  for (const auto& layer : *model) add_layer(layer, owner);
  layer_set.call_modes = std::make_unique<std::atomic<int>[]>(layer_set.layers.size());
  for (size_t l = 0; l < layer_set.layers.size(); ++l) layer_set.call_modes[l] = 0;
}

// Appends `layer` to layer_set, params and param_names; `owner`: every parameter seen so far.
void RoundPipe::Impl::add_layer(const torch::nn::AnyModule& layer,
                                std::unordered_map<const void*, detail::ParamRef>& owner) {
  const int64_t l = num_layers();
  layer_set.layers.push_back(layer);
  layer_set.names.push_back(std::to_string(l) + " (" + layer.ptr()->name() + ")");
  for (const auto& b : layer.ptr()->named_buffers()) {
    TORCH_CHECK(!b.value().requires_grad(), "RoundPipe '", options.name(), "': buffer '", b.key(), "' of layer ",
                layer_set.names.back(), " requires grad; buffers must not (register it as a parameter instead)");
  }
  std::vector<torch::Tensor> ps;
  std::vector<std::string> names;
  std::vector<detail::ParamRef> uses;
  std::vector<int64_t> use_of_position;
  for (const auto& p : layer.ptr()->named_parameters()) {
    const detail::ParamRef ref{l, static_cast<int64_t>(ps.size())};
    // Note [Shared parameters]: a parameter belongs to the first layer that holds it (its master,
    // optimizer state and name are that layer's); a later layer that holds it too (tied
    // embeddings) or a second position in the same layer is one more use of it. Each stage job
    // sends one gradient per use (LayerSet::uses), which the caller adds into the owner's .grad:
    // the gradient is the sum over all uses. The owner comes first, so the async protocol's
    // per-layer waits cover it: published[l] >= k implies published[owner] >= k (the step job
    // publishes in layer order), and the caller waits for consumed[owner] before adding.
    auto [it, inserted] = owner.emplace(p.value().unsafeGetTensorImpl(), ref);
    if (inserted) {
      ps.push_back(p.value());
      names.push_back(std::to_string(l) + "." + p.key());
    }
    const detail::ParamRef& used = it->second;
    auto u = std::find_if(uses.begin(), uses.end(),
                          [&](const detail::ParamRef& r) { return r.layer == used.layer && r.index == used.index; });
    if (u == uses.end()) u = uses.insert(uses.end(), used);
    use_of_position.push_back(static_cast<int64_t>(u - uses.begin()));
  }
  params.push_back(ps);
  param_names.push_back(names);
  layer_set.uses.push_back(uses);
  layer_set.use_of_position.push_back(use_of_position);
}

// Host copies in pinned memory, so uploads are asynchronous (Note [Stage streams]): one exact-size
// registered block per layer (Note [Exact-size pinned host memory]); what that leaves pageable (a
// refused registration, tensors outside the layers) goes through the caching host allocator.
void RoundPipe::Impl::pin_host_copies() {
  torch::NoGradGuard no_grad;
  const auto packed = detail::pack_layers(layer_set.layers, detail::cuda_host_pinner());
  constexpr double kMiB = 1024.0 * 1024.0;
  ROUNDPIPE_LOG(*log, kInfo, "RoundPipe '", options.name(), "': compute copies pinned in ", packed.blocks,
                " exact-size host blocks, ", packed.block_bytes / kMiB, " MiB (", packed.power_of_two_bytes / kMiB,
                " MiB through the caching host allocator)",
                packed.refused_groups > 0 ? "; " + std::to_string(packed.refused_groups) + " layers refused" : "");
  layer_set.grad_buffers = std::make_shared<detail::HostBufferPool>(detail::cuda_host_pinner());
  auto pin = [](torch::Tensor t) {
    if (t.defined() && t.is_cpu() && !t.is_pinned()) t.set_data(t.detach().pin_memory());
  };
  for (auto& p : model->parameters()) pin(p);
  for (auto& b : model->buffers()) pin(b);
}

// The planner's per-device memory budget: the option, else half the smallest GPU's memory, else
// none (max).
int64_t RoundPipe::Impl::device_memory_budget() const {
  if (options.device_memory_budget_bytes()) return *options.device_memory_budget_bytes();
  int64_t budget = std::numeric_limits<int64_t>::max();
  for (const auto& d : devices) {
    if (d.is_cuda()) budget = std::min(budget, cuda_device_memory_bytes(d.index()) / 2);
  }
  return budget;
}

void RoundPipe::Impl::make_planner() {
  const int64_t budget = device_memory_budget();
  // Overlapping iterations: forward_backward returns before its backward (and, with data
  // parallelism, its gradient all-reduces) ends (Note [Overlapping iterations]).
  const bool iterations_overlap = options.overlap_backward();
  std::vector<std::string> kinds;
  for (const auto& layer : layer_set.layers) kinds.push_back(layer.ptr()->name());
  planner = std::make_unique<detail::PlanSelector>(
      layer_bytes(false), layer_bytes(true), std::move(kinds), static_cast<int64_t>(devices.size()), budget,
      engine_simulate_options(options.run_config().recompute_grain.value_or(kDefaultRecomputeGrain),
                              iterations_overlap));
  if (budget == std::numeric_limits<int64_t>::max()) return;
  try {
    planner->auto_plan(RunType::kFused);  // a layer over the budget fails now, not at the first call
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "RoundPipe '", options.name(), "': RoundPipeOptions::device_memory_budget_bytes = ", budget,
                ": ", e.what_without_backtrace());
  }
}

RoundPipe::RoundPipe(torch::nn::Sequential model, RoundPipeOptions options)
    : impl_(std::make_unique<Impl>(std::move(model), std::move(options))) {}

RoundPipe::~RoundPipe() = default;

// Note [Overlapping iterations]:
// forward_backward returns once its forward and fused jobs have finished: the losses are known and
// every buffer's final value has been written back. Its backward jobs go on; the rest of the run
// (waiting for them, handing the gradients over) is its tail, queued on the step pipeline's tail
// thread (Note [Run tails] in step_pipeline.cpp). With data parallelism the tail also waits for
// the run's gradient all-reduces and averages them (Note [Gradient buckets] in grad_sync.h): they
// overlap the next iteration's forward like the backward itself. The GradScaler learns the number
// of found_inf flags to expect (one per backward stage; with data parallelism the one the tail
// combines over the ranks) at once, so update() works as before; a tail that fails drops its
// flags (GradScalerAccess::drop_run), as a failed run always did. Backward stages
// copy buffers from the forward's snapshots, never from the model, so writing the buffers back
// does not race them. The background jobs must not touch what the caller's thread may use
// meanwhile: they lease no new shell (the caller leases theirs before the dispatch, since
// cloning a layer draws from the CPU generator) and reseed no generator (Note [Draws in the
// tail]). The run is not detached, and the caller waits for its tail, when the gradients must be
// complete before returning (the call that measures layer times: the planner reads them), when a
// layer of a backward stage drew random numbers in its forward (dropout in training mode: its
// recompute reseeds the device's default generator, which the caller's thread may be drawing
// from), or with RoundPipeOptions::overlap_backward off.
torch::Tensor RoundPipe::forward_backward(const std::vector<torch::Tensor>& inputs, const torch::Tensor& label,
                                          const LossFn& loss_fn, const RunConfig& config) {
  Impl& m = *impl_;
  const auto entered = m.enter("forward_backward");
  m.steps->rethrow_async_error();
  TORCH_CHECK(static_cast<bool>(loss_fn), "forward_backward needs a loss_fn");
  auto run_ctx = std::make_shared<detail::RunContext>();  // owned by the run's tail from dispatch on
  detail::RunContext& ctx = *run_ctx;
  ctx.loss_fn = &loss_fn;  // called by the fused job only, which finishes before this returns
  ctx.scaler_link.set_flag_batch(next_flag_batch.fetch_add(1));
  const int64_t steps_before = m.steps->steps();
  const bool measure = m.options.measure_layer_times() && m.planner->wants_measurement();
  PendingGradSync sync = m.begin_grad_sync(ctx);  // abandoned if this call fails
  const auto [cfg, plan] = m.prepare(ctx, RunType::kFused, "forward_backward", inputs, label, config, measure);
  const int64_t fused_begin = plan.backward_stages().front().begin;
  bool detached = m.options.overlap_backward() && ctx.forward_ms.empty();
  if (detached) m.claim_backward_shells(ctx, fused_begin);
  detail::StepPipeline* steps = m.steps.get();
  ctx.on_release = [steps](int64_t l) { steps->release_layer(l); };
  auto jobs =
      std::make_shared<detail::RunJobs>(detail::launch_run(ctx, plan, RunType::kFused, m.workers, &m.device_cursor));
  // From here on, exactly one tail is posted. (The jobs may already have released layers: the
  // counts are read only by a step queued after this call.)
  steps->begin_run();
  if (const std::exception_ptr head_error = detail::wait_jobs(jobs->jobs, 0, jobs->head)) {
    m.fail_run(run_ctx, jobs, head_error);
  }
  detail::write_back_buffers(ctx, m.layer_set);  // written by the forward and fused jobs
  // A layer of a backward stage that drew random numbers in its forward is recomputed with its
  // device's default generator reseeded (Note [Layer RNG]): not while the caller may draw from it.
  for (int64_t i = 0; detached && i < fused_begin * cfg.num_microbatch; ++i) detached = !ctx.rng_used[i].load();
  amp::GradScaler* scaler = ctx.scaler_link.scaler();
  torch::Tensor total = ctx.losses[0].clone();
  for (int64_t j = 1; j < cfg.num_microbatch; ++j) total.add_(ctx.losses[j]);
  RunTail tail{run_ctx, jobs, steps, &m.layer_set, steps_before};
  if (sync) tail.sync = std::make_shared<PendingGradSync>(std::move(sync));
  if (detached) {
    // The scaler expects a flag per backward stage (with data parallelism: the one the tail
    // combines over the ranks); a failed tail drops them.
    const bool flags = scaler != nullptr && scaler->is_enabled();
    const int64_t per_run = m.grad_sync ? 1 : static_cast<int64_t>(plan.backward_stages().size());
    const int64_t expected_flags = flags ? per_run : 0;
    if (scaler != nullptr) steps->attach_scaler(*scaler, ctx.scaler_link, expected_flags);
    if (expected_flags > 0) tail.flags_announced_to = scaler;
    if (m.grad_sync) ++m.overlapped_runs;
    steps->post_tail(tail, /*detached=*/true);
    return total;
  }
  steps->post_tail(tail, /*detached=*/false).get();
  if (scaler != nullptr) {
    // With data parallelism the tail posted the one combined flag (when the scaler is enabled).
    const bool combined = m.grad_sync != nullptr && scaler->is_enabled();
    steps->attach_scaler(*scaler, ctx.scaler_link, combined ? 1 : ctx.scaler_link.flags_posted());
  }
  if (!ctx.forward_ms.empty()) {
    const std::string plans = m.planner->use_measured_times(ctx.forward_ms, ctx.backward_stage_ms, cfg.num_microbatch);
    ROUNDPIPE_LOG(*m.log, kInfo, "RoundPipe '", m.options.name(), "': plan from measured layer times: ", plans);
  }
  return total;
}

// Data parallelism: starts the gradient sync of the run `ctx` (earlier runs' tails may still be
// running: Note [Gradient buckets]), whose jobs report their layers' final gradients to it and
// defer their found_inf flags.
PendingGradSync RoundPipe::Impl::begin_grad_sync(detail::RunContext& ctx) {
  detail::GradSync* sync = grad_sync.get();
  if (sync == nullptr) return PendingGradSync();
  auto run = sync->begin(&ctx.grads);
  ctx.on_grads_ready = [sync, r = run.get()](int64_t begin, int64_t end) { sync->layers_ready(*r, begin, end); };
  ctx.scaler_link.defer_flags();
  return PendingGradSync(sync, std::move(run));
}

// Shells for the backward stages (layers [0, fused_begin)) of a detached run, leased here: a
// backward job that had to clone a layer would draw from the CPU generator in the background
// (Note [Draws in the tail] in stage_jobs.cpp).
void RoundPipe::Impl::claim_backward_shells(detail::RunContext& ctx, int64_t fused_begin) {
  ctx.claimed.resize(static_cast<size_t>(fused_begin));
  for (int64_t l = 0; l < fused_begin; ++l) ctx.claimed[l].emplace(layer_set.shells, l);
}

// A forward or the fused job failed: the backward jobs fail with the same error; waits for them
// (they reference ctx) in a tail, so the releases stay in run order, then reports the root cause.
void RoundPipe::Impl::fail_run(const std::shared_ptr<detail::RunContext>& ctx,
                               const std::shared_ptr<detail::RunJobs>& jobs, const std::exception_ptr& head_error) {
  steps->post_tail([ctx, jobs] { detail::finish_backward(*ctx, *jobs); }, /*detached=*/false).wait();
  std::rethrow_exception(head_error);
}

torch::Tensor RoundPipe::forward(const std::vector<torch::Tensor>& inputs, const RunConfig& config) {
  return forward(inputs, torch::Tensor(), config);
}

torch::Tensor RoundPipe::forward(const std::vector<torch::Tensor>& inputs, const torch::Tensor& label,
                                 const RunConfig& config) {
  Impl& m = *impl_;
  const auto entered = m.enter("forward");
  m.steps->rethrow_async_error();
  TORCH_CHECK(!label.defined() || m.options.label_to_last_layer(), "RoundPipe '", m.options.name(),
              "': forward was given a label, but only a last layer that takes it uses one: set "
              "RoundPipeOptions::label_to_last_layer, or call forward(inputs) for the outputs");
  detail::RunContext ctx;
  const auto prepared =
      m.prepare(ctx, RunType::kInfer, "forward", inputs, label, config, /*measure_if_automatic=*/false);
  detail::execute_run(ctx, prepared.second, RunType::kInfer, m.workers, &m.device_cursor);
  detail::write_back_buffers(ctx, m.layer_set);
  std::vector<torch::Tensor> outs;
  for (auto& acts : ctx.outputs) {
    TORCH_CHECK(acts.size() == 1, "forward: the last layer returned ", acts.size(), " tensors; forward() merges one");
    outs.push_back(acts[0]);
  }
  // 0-dim outputs (a loss per microbatch, e.g. a head given the label) cannot be concatenated.
  return outs.front().dim() == 0 ? torch::stack(outs) : torch::cat(outs, 0);
}

void RoundPipe::step(std::function<void()> step_fn, StepMode mode) {
  const auto entered = impl_->enter("step");
  if (mode == StepMode::kAsync && step_fn) {
    step_fn = [impl = impl_.get(), fn = std::move(step_fn)] {
      async_step_of = impl;  // marks the optimizer thread for Impl::enter
      try {
        fn();
      } catch (...) {
        async_step_of = nullptr;
        throw;
      }
      async_step_of = nullptr;
    };
  }
  impl_->steps->step(std::move(step_fn), mode);
  if (impl_->planner->set_async_steps(mode == StepMode::kAsync)) {
    // The automatic plan follows the step mode (docs/schedule.md, "In RoundPipe").
    ROUNDPIPE_LOG(*impl_->log, kInfo, "RoundPipe '", impl_->options.name(),
                  "': automatic plan: ", impl_->planner->describe_auto_plan());
  }
}

void RoundPipe::synchronize() {
  const auto entered = impl_->enter("synchronize");
  impl_->steps->synchronize();
}

std::vector<torch::Tensor> RoundPipe::optim_parameters() {
  impl_->settle_grads();
  std::vector<torch::Tensor> out;
  for (const auto& layer : impl_->steps->masters()) {
    for (const auto& master : layer) {
      if (master.defined()) out.push_back(master);  // frozen parameters have none
    }
  }
  return out;
}

std::vector<std::pair<std::string, torch::Tensor>> RoundPipe::optim_named_parameters() {
  impl_->settle_grads();
  const auto& masters = impl_->steps->masters();
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (size_t l = 0; l < masters.size(); ++l) {
    for (size_t k = 0; k < masters[l].size(); ++k) {
      if (masters[l][k].defined()) out.emplace_back(impl_->param_names[l][k], masters[l][k]);
    }
  }
  return out;
}

std::vector<torch::Tensor> RoundPipe::parameters() {
  if (OptimizerCtx::active()) return optim_parameters();
  impl_->settle_grads();
  std::vector<torch::Tensor> out;
  for (const auto& layer : impl_->params) out.insert(out.end(), layer.begin(), layer.end());
  return out;
}

const std::vector<c10::Device>& RoundPipe::devices() const { return impl_->devices; }
int64_t RoundPipe::num_layers() const { return impl_->num_layers(); }
scheduler::ExecutePlan RoundPipe::plan(const RunConfig& config) const {
  return impl_->planner->plan_for(config.merged_over(impl_->options.run_config()).execute_plan, RunType::kFused);
}
torch::nn::Sequential RoundPipe::module() {
  impl_->settle_grads();
  return impl_->model;
}
std::vector<scheduler::LayerCost> RoundPipe::layer_costs() const { return impl_->planner->layer_costs(); }
void RoundPipe::remeasure_layer_times() {
  const auto entered = impl_->enter("remeasure_layer_times");
  impl_->planner->request_remeasure();
}
int64_t RoundPipe::iteration() const { return impl_->iteration; }
void RoundPipe::set_iteration(int64_t iteration) {
  const auto entered = impl_->enter("set_iteration");
  TORCH_CHECK(iteration >= 0, "RoundPipe '", impl_->options.name(), "': set_iteration(", iteration,
              "): the iteration index must be >= 0 (pass a value iteration() returned)");
  impl_->iteration = iteration;
}
uint64_t RoundPipe::seed() const { return impl_->seed; }
DataParallelStats RoundPipe::data_parallel_stats() const {
  DataParallelStats out;
  if (const auto& group = impl_->options.process_group()) {
    out.world_size = group->world_size();
    out.rank = group->rank();
  }
  if (impl_->grad_sync) {
    const auto s = impl_->grad_sync->stats();
    out.runs = s.runs;
    out.buckets = s.buckets;
    out.bytes = s.bytes;
    out.wait_ms = s.wait_ms;
    out.overlapped_runs = impl_->overlapped_runs;
  }
  return out;
}

}  // namespace roundpipe
