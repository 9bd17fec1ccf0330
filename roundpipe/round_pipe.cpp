#include "roundpipe/round_pipe.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <limits>
#include <mutex>
#include <unordered_map>

#include "amp/grad_scaler.h"
#include "roundpipe/detail/device_worker.h"
#include "roundpipe/detail/stage_jobs.h"
#include "roundpipe/devices.h"
#include "roundpipe/logging.h"
#include "scheduler/dispatch.h"
#include "scheduler/partitioner.h"

namespace roundpipe {

// Note [Layer RNG]:
// Every layer's forward on a microbatch runs with its device's default generator seeded with
// layer_seed(base seed, iteration, microbatch index, layer index), and the generator's previous
// state is restored afterwards. Recompute seeds the same way, so it replays the forward's dropout
// masks, whichever device or thread runs it and whatever the grain: results are independent of
// the device count for a fixed num_microbatch. A plain loop reproduces it by calling
// torch::manual_seed(layer_seed(...)) before each layer. The cost on CPU devices: they share one
// generator, so seeded layer forwards are serialized by a mutex (set preserve_rng_state=false to
// run CPU workers fully in parallel, without deterministic dropout).
//
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
//
// Note [Buffers in recompute]:
// A forward stage snapshots its layers' buffers before its first microbatch; backward stages
// recompute from that snapshot, in the same microbatch order, and discard the result. Only the
// forward (or fused) pass's final buffers are written back to the model, so running statistics
// evolve exactly as in a plain microbatched forward.

namespace {

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

thread_local int optimizer_ctx_depth = 0;
std::atomic<uint64_t> next_flag_batch{1};  // run ids for GradScaler flags, unique in the process

}  // namespace

uint64_t layer_seed(uint64_t base_seed, int64_t iteration, int64_t microbatch, int64_t layer) {
  uint64_t h = splitmix64(base_seed);
  h = splitmix64(h ^ static_cast<uint64_t>(iteration));
  h = splitmix64(h ^ static_cast<uint64_t>(microbatch));
  h = splitmix64(h ^ static_cast<uint64_t>(layer));
  return h >> 1;  // keep it representable as a non-negative int64 (Python's manual_seed range)
}

RunConfig RunConfig::merged_over(const RunConfig& base) const {
  RunConfig out = base;
  if (num_microbatch) out.num_microbatch = num_microbatch;
  if (recompute_grain) out.recompute_grain = recompute_grain;
  if (preserve_rng_state) out.preserve_rng_state = preserve_rng_state;
  if (execute_plan) out.execute_plan = execute_plan;
  if (output_device) out.output_device = output_device;
  return out;
}

OptimizerCtx::OptimizerCtx() { ++optimizer_ctx_depth; }
OptimizerCtx::~OptimizerCtx() { --optimizer_ctx_depth; }
bool OptimizerCtx::active() { return optimizer_ctx_depth > 0; }

struct RoundPipe::Impl {
  torch::nn::Sequential model;
  RoundPipeOptions options;
  std::vector<c10::Device> devices;
  detail::LayerSet layer_set;
  // Compute copies per layer (the model's own parameters) and their master copies (lazy).
  std::vector<std::vector<torch::Tensor>> params;
  std::vector<std::vector<std::string>> param_names;
  std::vector<std::vector<torch::Tensor>> masters;
  // Per master: the gradient buffer (in master_grad_dtype()) reused by every step whose compute
  // copy grads have another dtype (Note [Gradient hand-over]); lazy. Owned by whoever runs
  // consume_grads_layer.
  std::vector<std::vector<torch::Tensor>> master_grad_buffers;
  std::vector<std::unique_ptr<detail::DeviceWorker>> workers;
  int64_t device_cursor = 0;  // round-robin position, continues across calls
  int64_t iteration = 0;
  uint64_t seed = 0;
  const Logger* log = &Logger::get("runtime");

  // Async optimizer (Note [Async step protocol]). `steps` is caller-thread only; the counters and
  // the error are guarded by `sync_mutex`.
  std::unique_ptr<detail::DeviceWorker> optimizer_thread;
  std::vector<std::future<void>> pending_steps;  // caller thread only
  int64_t steps = 0;
  std::mutex sync_mutex;
  std::condition_variable sync_cv;
  std::vector<int64_t> published;
  std::vector<int64_t> consumed;
  std::exception_ptr async_error;

  // Cross-thread GradScaler (Note [Cross-thread GradScaler] in amp/grad_scaler.cpp). Caller
  // thread only. `scaler`: the one the last run's loss_fn used; `pending_iteration`: the scale
  // and per-optimizer states of the gradients awaiting step(); `scaler_executor`: marshals the
  // scaler's unscale_/step calls made outside step functions onto the optimizer thread (the
  // scaler holds a weak reference, which expires with this Impl).
  amp::GradScaler* scaler = nullptr;
  std::shared_ptr<amp::GradScaler::Iteration> pending_iteration;
  std::shared_ptr<const amp::GradScaler::Executor> scaler_executor;

  void wait_counter(const std::vector<int64_t>& counter, int64_t l, int64_t target) {
    std::unique_lock<std::mutex> lock(sync_mutex);
    sync_cv.wait(lock, [&] { return counter[l] >= target; });
  }
  void raise_counter(std::vector<int64_t>& counter, int64_t l, int64_t value) {
    {
      std::lock_guard<std::mutex> lock(sync_mutex);
      counter[l] = std::max(counter[l], value);
    }
    sync_cv.notify_all();
  }
  void raise_all(int64_t value) {
    {
      std::lock_guard<std::mutex> lock(sync_mutex);
      for (auto& c : published) c = std::max(c, value);
      for (auto& c : consumed) c = std::max(c, value);
    }
    sync_cv.notify_all();
  }
  void rethrow_async_error() {
    std::exception_ptr error;
    {
      std::lock_guard<std::mutex> lock(sync_mutex);
      std::swap(error, async_error);
    }
    if (error) std::rethrow_exception(error);
  }
  void drain() {
    for (auto& f : pending_steps) f.wait();
    pending_steps.clear();
  }
  // Writes master values into the compute copies of layer l (caller holds no lock).
  void publish_layer(size_t l) {
    torch::NoGradGuard no_grad;
    for (size_t k = 0; k < params[l].size(); ++k) params[l][k].copy_(masters[l][k]);
  }
  // The dtype of `master`'s .grad: RoundPipeOptions::master_grad_dtype for parameters whose
  // compute copy has that dtype (their gradients go over uncast), else the master's own dtype (so
  // e.g. fp32 norm weights in a bf16 model keep fp32 gradients).
  c10::ScalarType master_grad_dtype(const torch::Tensor& compute, const torch::Tensor& master) const {
    const auto& wanted = options.master_grad_dtype();
    return wanted && compute.scalar_type() == *wanted ? *wanted : master.scalar_type();
  }
  // Moves layer l's gradients from the compute copies into the master .grad (Note [Gradient
  // hand-over]): accumulated in place if the master has one, taken over if dtypes match, else cast
  // into the master's persistent gradient buffer. Optimizer thread (or the caller after drain()).
  void consume_grads_layer(size_t l) {
    torch::NoGradGuard no_grad;
    for (size_t k = 0; k < params[l].size(); ++k) {
      auto& p = params[l][k];
      auto& master = masters[l][k];
      if (!p.grad().defined()) continue;
      const torch::Tensor& g = p.grad();
      const auto grad_dtype = master_grad_dtype(p, master);
      if (master.grad().defined()) {
        master.mutable_grad().add_(g);  // add_ casts a bf16/fp16 g in the same pass
      } else if (g.scalar_type() == grad_dtype && g.device() == master.device()) {
        master.mutable_grad() = g;
      } else {
        torch::Tensor& buffer = master_grad_buffers[l][k];
        if (!buffer.defined()) buffer = torch::empty(master.sizes(), master.options().dtype(grad_dtype));
        buffer.copy_(g);
        master.mutable_grad() = buffer;
      }
      p.mutable_grad().reset();
    }
  }

  int64_t num_layers() const { return static_cast<int64_t>(layer_set.layers.size()); }

  RunConfig resolve(const RunConfig& call) const { return call.merged_over(options.run_config()); }

  // Automatic plans depend only on the layer costs and the device count: computed once per run
  // type and cost model (caller thread only). `costs`: size-based until measured.
  mutable std::optional<scheduler::ExecutePlan> auto_fused_plan, auto_infer_plan;
  mutable std::vector<scheduler::LayerCost> costs;
  bool layer_times_measured = false;
  int64_t memory_budget_bytes = std::numeric_limits<int64_t>::max();  // set at construction

  scheduler::ExecutePlan auto_plan(scheduler::RunType type) const {
    auto& cached = type == scheduler::RunType::kInfer ? auto_infer_plan : auto_fused_plan;
    if (!cached) {
      cached = scheduler::partition(layer_costs(), type,
                                    scheduler::PartitionOptions()
                                        .set_min_stages(static_cast<int64_t>(devices.size()))
                                        .set_memory_budget_bytes(memory_budget_bytes));
    }
    return *cached;
  }

  const std::vector<scheduler::LayerCost>& layer_costs() const {
    if (costs.empty()) costs = scheduler::size_based_costs(layer_bytes(false), layer_bytes(true));
    return costs;
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

  // After the measuring call: costs from the measured forward times (per microbatch), backward
  // 3x forward like the size-based model; the automatic plans are recomputed from them.
  void use_measured_times(const std::vector<double>& forward_ms, int64_t num_micro) {
    auto measured = layer_costs();
    for (size_t l = 0; l < measured.size(); ++l) {
      measured[l].forward = forward_ms[l] / static_cast<double>(num_micro);
      measured[l].backward = 3.0 * measured[l].forward;
    }
    const auto before = auto_plan(scheduler::RunType::kFused);
    costs = std::move(measured);
    auto_fused_plan.reset();
    auto_infer_plan.reset();
    layer_times_measured = true;
    ROUNDPIPE_LOG(*log, kInfo, "RoundPipe '", options.name(), "': plan from measured layer times: ",
                  auto_plan(scheduler::RunType::kFused).to_string(), " (size-based: ", before.to_string(), ")");
  }

  scheduler::ExecutePlan plan_for(const RunConfig& cfg, scheduler::RunType type) const {
    if (cfg.execute_plan) {
      cfg.execute_plan->validate(num_layers(), type);
      return *cfg.execute_plan;
    }
    return auto_plan(type);
  }

  void ensure_masters() {
    if (!masters.empty()) return;
    torch::NoGradGuard no_grad;
    masters.resize(params.size());
    master_grad_buffers.resize(params.size());
    for (size_t l = 0; l < params.size(); ++l) {
      for (const auto& p : params[l]) {
        auto dtype = options.optim_dtype().value_or(p.scalar_type());
        auto master = p.detach().to(c10::kCPU, dtype, /*non_blocking=*/false, /*copy=*/true);
        master.requires_grad_(p.requires_grad());
        const auto grad_dtype = master_grad_dtype(p, master);
        if (grad_dtype != dtype && master.requires_grad()) master.set_grad_dtype(grad_dtype);
        masters[l].push_back(master);
        master_grad_buffers[l].emplace_back();
      }
    }
  }

  // After a successful run whose loss_fn used `scaler`: announces the flags its jobs posted,
  // snapshots the iteration's scale for its step, and (re)installs the executor.
  void attach_scaler(amp::GradScaler& s, const detail::RunContext& ctx) {
    s.expect_found_inf(ctx.scaler_generation.load(), ctx.flag_batch, ctx.flags_posted.load());
    if (&s != scaler) {
      scaler = &s;
      scaler_executor = std::make_shared<const amp::GradScaler::Executor>(
          [this, &s](const std::function<void()>& call) { run_marshalled(s, call); });
    }
    s.set_executor(scaler_executor);
    if (!pending_iteration) pending_iteration = s.capture_iteration();
  }

  // The scaler's unscale_/step called outside a step function: run on the optimizer thread, after
  // queued steps, on this iteration's gradients (moved into the master copies first) and inside
  // its IterationScope; a later step function continues the same per-optimizer state.
  void run_marshalled(amp::GradScaler& s, const std::function<void()>& call) {
    if (optimizer_thread && optimizer_thread->is_current()) {
      // A step function queued without a scaled iteration (no forward_backward since the last step).
      amp::GradScaler::IterationScope scope(s, s.capture_iteration());
      call();
      return;
    }
    rethrow_async_error();
    ensure_masters();
    if (!pending_iteration) pending_iteration = s.capture_iteration();
    if (!optimizer_thread) optimizer_thread = std::make_unique<detail::DeviceWorker>(c10::Device(c10::kCPU));
    optimizer_thread
        ->post([this, &s, &call, iteration = pending_iteration] {
          for (size_t l = params.size(); l-- > 0;) consume_grads_layer(l);
          amp::GradScaler::IterationScope scope(s, iteration);
          call();
        })
        .get();
  }

  std::vector<std::vector<torch::Tensor>> split(const std::vector<torch::Tensor>& tensors, int64_t& num_micro,
                                                const char* what) const;
};

namespace {

// Rows of a batch: size(0) of the first input with a dimension.
int64_t batch_rows(const std::vector<torch::Tensor>& inputs) {
  for (const auto& t : inputs) {
    if (t.defined() && t.dim() > 0) return t.size(0);
  }
  return -1;
}

}  // namespace

std::vector<std::vector<torch::Tensor>> RoundPipe::Impl::split(const std::vector<torch::Tensor>& tensors,
                                                               int64_t& num_micro, const char* what) const {
  const int64_t rows = batch_rows(tensors);
  std::vector<std::vector<torch::Tensor>> per_mb(num_micro);
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& t = tensors[i];
    if (!t.defined() || t.dim() == 0) {
      for (auto& mb : per_mb) mb.push_back(t);  // replicated
      continue;
    }
    TORCH_CHECK(t.size(0) == rows, "RoundPipe '", options.name(), "': ", what, "[", i, "] has ", t.size(0),
                " rows but the batch has ", rows, ": every tensor with a batch dimension must have the same ",
                "size along dim 0 (0-dim tensors are replicated to every microbatch)");
    auto chunks = t.tensor_split(num_micro, 0);
    for (int64_t j = 0; j < num_micro; ++j) per_mb[j].push_back(chunks[j]);
  }
  return per_mb;
}

RoundPipe::RoundPipe(torch::nn::Sequential model, RoundPipeOptions options) : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  TORCH_CHECK(!model.is_empty() && model->size() > 0, "RoundPipe needs a torch::nn::Sequential with at least one layer");
  m.model = model;
  m.options = options;
  m.devices = options.devices().empty() ? default_devices() : options.devices();
  check_devices(m.devices);
  if (options.run_config().num_microbatch) {
    TORCH_CHECK(*options.run_config().num_microbatch >= 1, "RoundPipeOptions::run_config.num_microbatch must be >= 1, got ",
                *options.run_config().num_microbatch);
  }
  std::unordered_map<const void*, int64_t> owner;
  for (const auto& layer : *model) {
    const int64_t l = static_cast<int64_t>(m.layer_set.layers.size());
    m.layer_set.layers.push_back(layer);
    m.layer_set.names.push_back(std::to_string(l) + " (" + layer.ptr()->name() + ")");
    for (const auto& b : layer.ptr()->named_buffers()) {
      TORCH_CHECK(!b.value().requires_grad(), "RoundPipe '", options.name(), "': buffer '", b.key(), "' of layer ",
                  m.layer_set.names.back(), " requires grad; buffers must not (register it as a parameter instead)");
    }
    std::vector<torch::Tensor> ps;
    std::vector<std::string> names;
    for (const auto& p : layer.ptr()->named_parameters()) {
      auto [it, inserted] = owner.emplace(p.value().unsafeGetTensorImpl(), l);
      TORCH_CHECK(inserted || it->second == l, "RoundPipe '", options.name(), "': parameter '", p.key(), "' of layer ",
                  m.layer_set.names.back(), " is shared with layer ", it->second,
                  "; parameters shared between layers are not supported (put both uses in one layer)");
      if (!inserted) continue;
      ps.push_back(p.value());
      names.push_back(std::to_string(l) + "." + p.key());
    }
    m.params.push_back(ps);
    m.param_names.push_back(names);
  }
  if (std::any_of(m.devices.begin(), m.devices.end(), [](const c10::Device& d) { return d.is_cuda(); })) {
    // Host copies in pinned memory, so uploads are asynchronous (Note [Stage streams]).
    torch::NoGradGuard no_grad;
    auto pin = [](torch::Tensor t) {
      if (t.defined() && t.is_cpu() && !t.is_pinned()) t.set_data(t.detach().pin_memory());
    };
    for (auto& p : model->parameters()) pin(p);
    for (auto& b : model->buffers()) pin(b);
  }
  m.layer_set.call_modes = std::make_unique<std::atomic<int>[]>(m.layer_set.layers.size());
  for (size_t l = 0; l < m.layer_set.layers.size(); ++l) m.layer_set.call_modes[l] = 0;
  if (options.seed()) {
    m.seed = *options.seed();
  } else {
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    m.seed = gen.get<at::CPUGeneratorImpl>()->random64();
  }
  if (options.master_grad_dtype()) {
    TORCH_CHECK(c10::isFloatingType(*options.master_grad_dtype()),
                "RoundPipeOptions::master_grad_dtype must be a floating-point dtype (e.g. torch::kBFloat16), got ",
                *options.master_grad_dtype());
  }
  if (options.device_memory_budget_bytes()) {
    TORCH_CHECK(*options.device_memory_budget_bytes() > 0, "RoundPipeOptions::device_memory_budget_bytes must be > 0, got ",
                *options.device_memory_budget_bytes());
    m.memory_budget_bytes = *options.device_memory_budget_bytes();
  } else {
    for (const auto& d : m.devices) {
      if (d.is_cuda()) m.memory_budget_bytes = std::min(m.memory_budget_bytes, cuda_device_memory_bytes(d.index()) / 2);
    }
  }
  if (m.memory_budget_bytes != std::numeric_limits<int64_t>::max()) {
    try {
      m.auto_plan(scheduler::RunType::kFused);  // a layer over the budget fails now, not at the first call
    } catch (const c10::Error& e) {
      TORCH_CHECK(false, "RoundPipe '", options.name(), "': RoundPipeOptions::device_memory_budget_bytes = ",
                  m.memory_budget_bytes, ": ", e.what_without_backtrace());
    }
  }
  m.published.assign(m.params.size(), 0);
  m.consumed.assign(m.params.size(), 0);
  for (const auto& device : m.devices) m.workers.push_back(std::make_unique<detail::DeviceWorker>(device));
  ROUNDPIPE_LOG(*m.log, kInfo, "RoundPipe '", options.name(), "': ", m.num_layers(), " layers on ", m.devices.size(),
                " device(s)");
}

RoundPipe::~RoundPipe() {
  // Queued steps reference the Impl: finish them (errors are dropped: a destructor cannot throw).
  impl_->drain();
}

namespace {

using scheduler::RunType;

}  // namespace

torch::Tensor RoundPipe::forward_backward(const std::vector<torch::Tensor>& inputs, const torch::Tensor& label,
                                          const LossFn& loss_fn, const RunConfig& config) {
  Impl& m = *impl_;
  m.rethrow_async_error();
  TORCH_CHECK(static_cast<bool>(loss_fn), "forward_backward needs a loss_fn");
  TORCH_CHECK(!inputs.empty(), "forward_backward needs at least one input tensor");
  const RunConfig cfg = m.resolve(config);
  int64_t num_micro = cfg.num_microbatch.value_or(static_cast<int64_t>(m.devices.size()) + 1);
  TORCH_CHECK(num_micro >= 1, "num_microbatch must be >= 1, got ", num_micro);
  const int64_t rows = batch_rows(inputs);
  TORCH_CHECK(rows > 0, "forward_backward: no input has a batch dimension with rows (got ", rows, ")");
  if (rows < num_micro) {
    ROUNDPIPE_LOG(*m.log, kWarn, "RoundPipe '", m.options.name(), "': batch of ", rows, " rows is smaller than num_microbatch ",
                  num_micro, "; using ", rows, " microbatches");
    num_micro = rows;
  }
  const scheduler::ExecutePlan plan = m.plan_for(cfg, RunType::kFused);
  const auto L = m.num_layers();

  detail::RunContext ctx;
  ctx.model = &m.layer_set;
  ctx.model_name = m.options.name();
  ctx.num_layers = L;
  ctx.num_microbatch = num_micro;
  ctx.iteration = m.iteration;
  ctx.seed = m.seed;
  ctx.preserve_rng = cfg.preserve_rng_state.value_or(true);
  ctx.training = true;
  ctx.grain = cfg.recompute_grain.value_or(RecomputeGrain::kStage);
  ctx.inputs = m.split(inputs, num_micro, "inputs");
  if (label.defined() && label.dim() > 0) {
    TORCH_CHECK(label.size(0) == rows, "label has ", label.size(0), " rows but the inputs have ", rows);
    auto chunks = label.tensor_split(num_micro, 0);
    ctx.labels.assign(chunks.begin(), chunks.end());
  } else {
    ctx.labels.assign(num_micro, label);
  }
  ctx.loss_fn = &loss_fn;
  ctx.autocast = amp::AutocastState::capture();
  ctx.flag_batch = next_flag_batch.fetch_add(1);
  const bool measure = !cfg.execute_plan && m.options.measure_layer_times() && !m.layer_times_measured;
  if (measure) ctx.forward_ms.assign(static_cast<size_t>(L), 0.0);
  const int64_t steps_before = m.steps;
  ctx.wait_layer_ready = [&m, steps_before](int64_t l) { m.wait_counter(m.published, l, steps_before); };
  auto channels = [&](size_t n) {
    std::vector<detail::ChannelPtr> v;
    for (size_t j = 0; j < n; ++j) v.push_back(std::make_shared<detail::Channel>());
    return v;
  };
  const auto& fwd = plan.forward_stages();
  const auto& bwd = plan.backward_stages();
  const int64_t fused_begin = bwd.front().begin;
  for (size_t s = 0; s < fwd.size(); ++s) ctx.fwd_out.push_back(channels(num_micro));
  ctx.saved.resize(L);
  ctx.buffer_snapshot.resize(L);
  for (int64_t l = 0; l < fused_begin; ++l) {
    ctx.buffer_snapshot[l] = std::make_shared<detail::Channel>();
    bool keep = ctx.grain == RecomputeGrain::kLayer;
    for (size_t i = 1; i < bwd.size(); ++i) keep = keep || bwd[i].begin == l;
    if (keep) ctx.saved[l] = channels(num_micro);
  }
  for (size_t i = 0; i < bwd.size(); ++i) ctx.bwd_grad.push_back(channels(num_micro));
  ctx.losses.resize(num_micro);
  ctx.grads.resize(L);
  ctx.buffers.resize(L);

  const auto order = scheduler::dispatch_order(plan, RunType::kFused, static_cast<int64_t>(m.devices.size()),
                                               m.device_cursor);
  m.device_cursor = (m.device_cursor + static_cast<int64_t>(order.size())) % static_cast<int64_t>(m.devices.size());
  ++m.iteration;  // the iteration index is consumed even if the call fails
  std::vector<std::future<void>> jobs;
  size_t fwd_index = 0, bwd_index = 0;
  for (const auto& entry : order) {
    auto& worker = *m.workers[entry.device];
    const c10::Device device = worker.device();
    const auto layers = entry.layers;
    switch (entry.phase) {
      case scheduler::StagePhase::kForward: {
        const size_t s = fwd_index++;
        jobs.push_back(worker.post([&ctx, s, layers, device] { detail::run_forward_stage(ctx, s, layers, device); }));
        break;
      }
      case scheduler::StagePhase::kFused:
        ++bwd_index;
        jobs.push_back(worker.post([&ctx, layers, device] { detail::run_fused_stage(ctx, layers, device); }));
        break;
      case scheduler::StagePhase::kBackward: {
        const size_t s = bwd_index++;
        jobs.push_back(worker.post([&ctx, s, layers, device] { detail::run_backward_stage(ctx, s, layers, device); }));
        break;
      }
    }
  }
  // Wait for every job (ctx lives on this stack frame), then report the root cause: the first
  // failing job in program order (downstream jobs fail with the same error).
  std::exception_ptr error;
  for (auto& job : jobs) {
    try {
      job.get();
    } catch (...) {
      if (!error) error = std::current_exception();
    }
  }
  if (error) std::rethrow_exception(error);

  // Success: apply gradients (accumulate until step) and buffers to the model.
  torch::NoGradGuard no_grad;
  for (int64_t l = 0; l < L; ++l) {
    m.wait_counter(m.consumed, l, steps_before);  // step k's job has taken the previous grads
    for (size_t k = 0; k < ctx.grads[l].size() && k < m.params[l].size(); ++k) {
      const auto& g = ctx.grads[l][k];
      auto& p = m.params[l][k];
      if (!g.defined() || !p.requires_grad()) continue;
      if (p.grad().defined()) {
        p.mutable_grad().add_(g);  // add_ casts in the same pass
      } else {
        p.mutable_grad() = g.to(p.device(), p.scalar_type());  // handed over, no copy (Note [Gradient hand-over])
      }
    }
    auto buffers = m.layer_set.layers[l].ptr()->buffers();
    for (size_t k = 0; k < ctx.buffers[l].size() && k < buffers.size(); ++k) buffers[k].copy_(ctx.buffers[l][k]);
  }
  if (amp::GradScaler* scaler = ctx.scaler.load()) m.attach_scaler(*scaler, ctx);
  if (measure) m.use_measured_times(ctx.forward_ms, num_micro);
  torch::Tensor total = ctx.losses[0].clone();
  for (int64_t j = 1; j < num_micro; ++j) total.add_(ctx.losses[j]);
  return total;
}

torch::Tensor RoundPipe::forward(const std::vector<torch::Tensor>& inputs, const RunConfig& config) {
  Impl& m = *impl_;
  m.rethrow_async_error();
  TORCH_CHECK(!inputs.empty(), "forward needs at least one input tensor");
  const RunConfig cfg = m.resolve(config);
  int64_t num_micro = cfg.num_microbatch.value_or(static_cast<int64_t>(m.devices.size()) + 1);
  TORCH_CHECK(num_micro >= 1, "num_microbatch must be >= 1, got ", num_micro);
  const int64_t rows = batch_rows(inputs);
  TORCH_CHECK(rows > 0, "forward: no input has a batch dimension with rows (got ", rows, ")");
  num_micro = std::min(num_micro, rows);
  // A model-level execute_plan is a training plan; inference uses a call-level plan or its own.
  RunConfig infer_cfg = cfg;
  infer_cfg.execute_plan = config.execute_plan;
  const scheduler::ExecutePlan plan = m.plan_for(infer_cfg, RunType::kInfer);
  const auto L = m.num_layers();

  detail::RunContext ctx;
  ctx.model = &m.layer_set;
  ctx.model_name = m.options.name();
  ctx.num_layers = L;
  ctx.num_microbatch = num_micro;
  ctx.iteration = m.iteration;
  ctx.seed = m.seed;
  ctx.preserve_rng = cfg.preserve_rng_state.value_or(true);
  ctx.training = false;
  ctx.output_device = cfg.output_device.value_or(c10::Device(c10::kCPU));
  ctx.autocast = amp::AutocastState::capture();
  ctx.inputs = m.split(inputs, num_micro, "inputs");
  const int64_t steps_before = m.steps;
  ctx.wait_layer_ready = [&m, steps_before](int64_t l) { m.wait_counter(m.published, l, steps_before); };
  const auto& fwd = plan.forward_stages();
  for (size_t s = 0; s + 1 < fwd.size(); ++s) {
    std::vector<detail::ChannelPtr> v;
    for (int64_t j = 0; j < num_micro; ++j) v.push_back(std::make_shared<detail::Channel>());
    ctx.fwd_out.push_back(v);
  }
  ctx.saved.resize(L);
  ctx.buffer_snapshot.resize(L);
  ctx.outputs.resize(num_micro);
  ctx.buffers.resize(L);
  const auto order = scheduler::dispatch_order(plan, RunType::kInfer, static_cast<int64_t>(m.devices.size()),
                                               m.device_cursor);
  m.device_cursor = (m.device_cursor + static_cast<int64_t>(order.size())) % static_cast<int64_t>(m.devices.size());
  std::vector<std::future<void>> jobs;
  for (size_t s = 0; s < order.size(); ++s) {
    auto& worker = *m.workers[order[s].device];
    const c10::Device device = worker.device();
    const auto layers = order[s].layers;
    jobs.push_back(worker.post([&ctx, s, layers, device] { detail::run_forward_stage(ctx, s, layers, device); }));
  }
  std::exception_ptr error;
  for (auto& job : jobs) {
    try {
      job.get();
    } catch (...) {
      if (!error) error = std::current_exception();
    }
  }
  if (error) std::rethrow_exception(error);
  torch::NoGradGuard no_grad;
  for (int64_t l = 0; l < L; ++l) {
    auto buffers = m.layer_set.layers[l].ptr()->buffers();
    for (size_t k = 0; k < ctx.buffers[l].size() && k < buffers.size(); ++k) buffers[k].copy_(ctx.buffers[l][k]);
  }
  std::vector<torch::Tensor> outs;
  for (auto& acts : ctx.outputs) {
    TORCH_CHECK(acts.size() == 1, "forward: the last layer returned ", acts.size(), " tensors; forward() merges one");
    outs.push_back(acts[0]);
  }
  return torch::cat(outs, 0);
}

void RoundPipe::step(std::function<void()> step_fn, StepMode mode) {
  Impl& m = *impl_;
  m.rethrow_async_error();
  m.ensure_masters();
  const int64_t k = ++m.steps;
  if (m.pending_iteration) {
    // The step function runs inside the scope of the iteration its gradients come from.
    step_fn = [scaler = m.scaler, iteration = std::move(m.pending_iteration), fn = std::move(step_fn)] {
      amp::GradScaler::IterationScope scope(*scaler, iteration);
      if (fn) fn();
    };
  }
  if (mode == StepMode::kSync) {
    m.drain();
    m.rethrow_async_error();
    for (size_t l = 0; l < m.params.size(); ++l) m.consume_grads_layer(l);
    if (step_fn) step_fn();
    for (size_t l = 0; l < m.params.size(); ++l) m.publish_layer(l);
    m.raise_all(k);
    return;
  }
  if (!m.optimizer_thread) m.optimizer_thread = std::make_unique<detail::DeviceWorker>(c10::Device(c10::kCPU));
  m.pending_steps.push_back(m.optimizer_thread->post([&m, k, fn = std::move(step_fn)] {
    try {
      for (size_t l = 0; l < m.params.size(); ++l) {
        m.publish_layer(l);
        m.raise_counter(m.published, static_cast<int64_t>(l), k);
      }
      for (size_t l = m.params.size(); l-- > 0;) {
        m.consume_grads_layer(l);
        m.raise_counter(m.consumed, static_cast<int64_t>(l), k);
      }
      if (fn) fn();
    } catch (...) {
      {
        std::lock_guard<std::mutex> lock(m.sync_mutex);
        if (!m.async_error) m.async_error = std::current_exception();
      }
      m.raise_all(k);
    }
  }));
}

void RoundPipe::synchronize() {
  Impl& m = *impl_;
  m.drain();
  if (!m.masters.empty()) {
    for (size_t l = 0; l < m.params.size(); ++l) m.publish_layer(l);
  }
  m.raise_all(m.steps);
  m.rethrow_async_error();
}

std::vector<torch::Tensor> RoundPipe::optim_parameters() {
  impl_->ensure_masters();
  std::vector<torch::Tensor> out;
  for (const auto& layer : impl_->masters) out.insert(out.end(), layer.begin(), layer.end());
  return out;
}

std::vector<std::pair<std::string, torch::Tensor>> RoundPipe::optim_named_parameters() {
  impl_->ensure_masters();
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (size_t l = 0; l < impl_->masters.size(); ++l) {
    for (size_t k = 0; k < impl_->masters[l].size(); ++k) out.emplace_back(impl_->param_names[l][k], impl_->masters[l][k]);
  }
  return out;
}

std::vector<torch::Tensor> RoundPipe::parameters() {
  if (OptimizerCtx::active()) return optim_parameters();
  std::vector<torch::Tensor> out;
  for (const auto& layer : impl_->params) out.insert(out.end(), layer.begin(), layer.end());
  return out;
}

const std::vector<c10::Device>& RoundPipe::devices() const { return impl_->devices; }
int64_t RoundPipe::num_layers() const { return impl_->num_layers(); }
scheduler::ExecutePlan RoundPipe::plan(const RunConfig& config) const {
  return impl_->plan_for(impl_->resolve(config), RunType::kFused);
}
torch::nn::Sequential RoundPipe::module() { return impl_->model; }
std::vector<scheduler::LayerCost> RoundPipe::layer_costs() const { return impl_->layer_costs(); }
int64_t RoundPipe::iteration() const { return impl_->iteration; }
uint64_t RoundPipe::seed() const { return impl_->seed; }

}  // namespace roundpipe
