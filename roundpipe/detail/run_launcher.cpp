#include "roundpipe/detail/run_launcher.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <exception>
#include <future>

namespace roundpipe::detail {

void check_num_microbatch(int64_t num_microbatch, const std::string& where) {
  TORCH_CHECK(num_microbatch >= 1, where, " must be >= 1, got ", num_microbatch);
}

ResolvedRunConfig resolve_run_config(const RunConfig& call, const RunConfig& model, scheduler::RunType type,
                                     int64_t num_devices, int64_t rows) {
  const RunConfig merged = call.merged_over(model);
  ResolvedRunConfig out;
  out.num_microbatch = merged.num_microbatch.value_or(default_num_microbatch(num_devices));
  check_num_microbatch(out.num_microbatch, "num_microbatch");
  if (rows < out.num_microbatch) {
    out.clamped_from = out.num_microbatch;
    out.num_microbatch = rows;
  }
  out.recompute_grain = merged.recompute_grain.value_or(kDefaultRecomputeGrain);
  out.preserve_rng_state = merged.preserve_rng_state.value_or(true);
  out.execute_plan = type == scheduler::RunType::kInfer ? call.execute_plan : merged.execute_plan;
  out.output_device = merged.output_device.value_or(c10::Device(c10::kCPU));
  return out;
}

int64_t batch_rows(const std::vector<at::Tensor>& inputs) {
  for (const auto& t : inputs) {
    if (t.defined() && t.dim() > 0) return t.size(0);
  }
  return -1;
}

std::vector<Activations> split_batch(const std::vector<at::Tensor>& tensors, int64_t num_microbatch,
                                     const std::string& what, const std::string& model_name) {
  const int64_t rows = batch_rows(tensors);
  std::vector<Activations> per_mb(num_microbatch);
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& t = tensors[i];
    if (!t.defined() || t.dim() == 0) {
      for (auto& mb : per_mb) mb.push_back(t);  // replicated
      continue;
    }
    TORCH_CHECK(t.size(0) == rows, "RoundPipe '", model_name, "': ", what, "[", i, "] has ", t.size(0),
                " rows but the batch has ", rows, ": every tensor with a batch dimension must have the same ",
                "size along dim 0 (0-dim tensors are replicated to every microbatch)");
    auto chunks = t.tensor_split(num_microbatch, 0);
    for (int64_t j = 0; j < num_microbatch; ++j) per_mb[j].push_back(chunks[j]);
  }
  return per_mb;
}

std::vector<at::Tensor> split_label(const at::Tensor& label, int64_t rows, int64_t num_microbatch,
                                    const std::string& model_name) {
  if (!label.defined() || label.dim() == 0) return std::vector<at::Tensor>(num_microbatch, label);
  TORCH_CHECK(label.size(0) == rows, "RoundPipe '", model_name, "': forward_backward: the label has ", label.size(0),
              " rows (shape ", label.sizes(), ") but the inputs have ", rows, ": the label is split along dim 0 with ",
              "the inputs, so give it one row per input row (or a 0-dim label, which every microbatch gets whole)");
  auto chunks = label.tensor_split(num_microbatch, 0);
  return {chunks.begin(), chunks.end()};
}

std::vector<SideInputs> split_side_inputs(const SideInputs& side, int64_t rows, int64_t num_microbatch,
                                          const std::string& model_name) {
  std::vector<SideInputs> per_mb(side.empty() ? 0 : static_cast<size_t>(num_microbatch));
  for (const auto& [name, t] : side) {
    TORCH_CHECK(t.defined() && t.dim() > 0 && t.size(0) == rows, "RoundPipe '", model_name, "': side input '", name,
                "' has ", t.defined() && t.dim() > 0 ? std::to_string(t.size(0)) + " rows" : std::string("no rows"),
                " but the inputs have ", rows, ": side inputs are split along dim 0 with the inputs, so give each one ",
                "row per input row (docs/architecture.md, \"Side inputs\")");
    auto chunks = t.tensor_split(num_microbatch, 0);
    for (int64_t j = 0; j < num_microbatch; ++j) per_mb[j].emplace(name, chunks[j]);
  }
  return per_mb;
}

namespace {

std::vector<ChannelPtr> channels(int64_t n) {
  std::vector<ChannelPtr> v;
  for (int64_t j = 0; j < n; ++j) v.push_back(std::make_shared<Channel>());
  return v;
}

// The channels and result slots of a run of `plan`: forward outputs between forward stages (and
// into the fused tail), saved stage inputs for recompute, gradients between backward stages.
void make_channels(RunContext& ctx, const scheduler::ExecutePlan& plan, scheduler::RunType type) {
  const int64_t L = ctx.num_layers, M = ctx.num_microbatch;
  const auto& fwd = plan.forward_stages();
  ctx.saved.resize(L);
  ctx.buffer_snapshot.resize(L);
  ctx.buffers.resize(L);
  if (type == scheduler::RunType::kInfer) {
    for (size_t s = 0; s + 1 < fwd.size(); ++s) ctx.fwd_out.push_back(channels(M));
    ctx.outputs.resize(M);
    return;
  }
  const auto& bwd = plan.backward_stages();
  const int64_t fused_begin = bwd.front().begin;
  for (size_t s = 0; s < fwd.size(); ++s) ctx.fwd_out.push_back(channels(M));
  for (int64_t l = 0; l < fused_begin; ++l) {
    ctx.buffer_snapshot[l] = std::make_shared<Channel>();
    bool keep = ctx.grain == RecomputeGrain::kLayer;
    for (size_t i = 1; i < bwd.size(); ++i) keep = keep || bwd[i].begin == l;
    if (keep) ctx.saved[l] = channels(M);
  }
  for (size_t i = 0; i < bwd.size(); ++i) ctx.bwd_grad.push_back(channels(M));
  ctx.losses.resize(M);
  ctx.grads.resize(L);
  ctx.released = std::make_unique<std::atomic<bool>[]>(static_cast<size_t>(L));
  for (int64_t l = 0; l < L; ++l) ctx.released[l] = false;
  ctx.rng_used = std::make_unique<std::atomic<bool>[]>(static_cast<size_t>(L * M));
  for (int64_t i = 0; i < L * M; ++i) ctx.rng_used[i] = false;
  ctx.recompute_slots.resize(static_cast<size_t>(L * M));
}

}  // namespace

RunJobs launch_run(RunContext& ctx, const scheduler::ExecutePlan& plan, scheduler::RunType type,
                   const std::vector<std::unique_ptr<DeviceWorker>>& workers, int64_t* device_cursor) {
  make_channels(ctx, plan, type);
  const auto num_devices = static_cast<int64_t>(workers.size());
  const auto order = scheduler::dispatch_order(plan, type, num_devices, *device_cursor);
  *device_cursor = (*device_cursor + static_cast<int64_t>(order.size())) % num_devices;
  RunJobs out;
  size_t fwd_index = 0, bwd_index = 0;
  for (const auto& entry : order) {
    auto& worker = *workers[entry.device];
    const c10::Device device = worker.device();
    const auto layers = entry.layers;
    switch (entry.phase) {
      case scheduler::StagePhase::kForward: {
        const size_t s = fwd_index++;
        out.jobs.push_back(worker.post([&ctx, s, layers, device] { run_forward_stage(ctx, s, layers, device); }));
        out.head = out.jobs.size();
        break;
      }
      case scheduler::StagePhase::kFused:
        ++bwd_index;
        out.jobs.push_back(worker.post([&ctx, layers, device] { run_fused_stage(ctx, layers, device); }));
        out.head = out.jobs.size();
        break;
      case scheduler::StagePhase::kBackward: {
        const size_t s = bwd_index++;
        out.jobs.push_back(worker.post([&ctx, s, layers, device] { run_backward_stage(ctx, s, layers, device); }));
        break;
      }
    }
  }
  return out;
}

std::exception_ptr wait_jobs(std::vector<std::future<void>>& jobs, size_t begin, size_t end) {
  std::exception_ptr error;
  for (size_t i = begin; i < end; ++i) {
    try {
      jobs[i].get();
    } catch (...) {
      if (!error) error = std::current_exception();
    }
  }
  return error;
}

std::exception_ptr finish_backward(RunContext& ctx, RunJobs& run) {
  std::exception_ptr error = wait_jobs(run.jobs, run.head, run.jobs.size());
  release_layers(ctx, 0, ctx.num_layers);
  return error;
}

void execute_run(RunContext& ctx, const scheduler::ExecutePlan& plan, scheduler::RunType type,
                 const std::vector<std::unique_ptr<DeviceWorker>>& workers, int64_t* device_cursor) {
  RunJobs run = launch_run(ctx, plan, type, workers, device_cursor);
  // Wait for every job (they reference ctx), then report the root cause: the first failing job
  // in program order (downstream jobs fail with the same error).
  if (auto error = wait_jobs(run.jobs, 0, run.jobs.size())) std::rethrow_exception(error);
}

void write_back_buffers(const RunContext& ctx, const LayerSet& layers) {
  at::NoGradGuard no_grad;
  for (size_t l = 0; l < ctx.buffers.size(); ++l) {
    if (ctx.buffers[l].empty()) continue;
    auto buffers = layers.layers[l].ptr()->buffers();
    TORCH_INTERNAL_ASSERT(ctx.buffers[l].size() == buffers.size(), "layer ", layers.names[l], ": ",
                          ctx.buffers[l].size(), " buffer values for ", buffers.size(), " buffers");
    for (size_t k = 0; k < buffers.size(); ++k) buffers[k].copy_(ctx.buffers[l][k]);
  }
}

}  // namespace roundpipe::detail
