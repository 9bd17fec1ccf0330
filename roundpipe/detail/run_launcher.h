// One run path for forward and forward_backward: the run's resolved settings, the split of the
// batch into microbatches, and the dispatch of a plan's stage jobs onto the device workers
// (internal).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <exception>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "roundpipe/detail/device_worker.h"
#include "roundpipe/detail/stage_jobs.h"
#include "roundpipe/run_config.h"
#include "scheduler/dispatch.h"
#include "scheduler/execute_plan.h"

namespace roundpipe::detail {

/// A call's RunConfig merged over the model's and resolved to concrete values, once per call.
struct ResolvedRunConfig {
  int64_t num_microbatch = 1;
  /// The num_microbatch asked for, when the batch had fewer rows and num_microbatch was lowered.
  std::optional<int64_t> clamped_from;
  RecomputeGrain recompute_grain = kDefaultRecomputeGrain;
  bool preserve_rng_state = true;
  /// The plan given for this run; unset = automatic. Inference runs take only a call-level plan
  /// (a model-level plan is a training plan).
  std::optional<scheduler::ExecutePlan> execute_plan;
  c10::Device output_device = c10::kCPU;
};

/// The one check of num_microbatch; `where` names the setting in the message.
void check_num_microbatch(int64_t num_microbatch, const std::string& where);

/// Resolves `call` over `model` (call > model > default) for a run of `type` with `num_devices`
/// devices on a batch of `rows` rows: num_microbatch defaults to num_devices + 1 and is lowered to
/// `rows` when the batch is smaller (reported in `clamped_from`).
ResolvedRunConfig resolve_run_config(const RunConfig& call, const RunConfig& model, scheduler::RunType type,
                                     int64_t num_devices, int64_t rows);

/// Rows of a batch: size(0) of the first input with a dimension; -1 if none has one.
int64_t batch_rows(const std::vector<at::Tensor>& inputs);

/// Splits `label` along dim 0 like inputs of `rows` rows (a 0-dim or undefined label is
/// replicated to every microbatch); checks that it has `rows` rows.
std::vector<at::Tensor> split_label(const at::Tensor& label, int64_t rows, int64_t num_microbatch,
                                    const std::string& model_name);

/// Splits every tensor with a batch dimension into `num_microbatch` pieces along dim 0 (0-dim and
/// undefined tensors are replicated); [microbatch][tensor]. `what` names the tensors in errors.
std::vector<Activations> split_batch(const std::vector<at::Tensor>& tensors, int64_t num_microbatch,
                                     const std::string& what, const std::string& model_name);

/// Splits every side input (roundpipe/side_inputs.h) along dim 0 into `num_microbatch` pieces like
/// inputs of `rows` rows; [microbatch]. Checks that each has `rows` rows.
std::vector<SideInputs> split_side_inputs(const SideInputs& side, int64_t rows, int64_t num_microbatch,
                                          const std::string& model_name);

/// The posted stage jobs of a run, in program order: [0, head) are the forward and fused jobs
/// (all of them for inference), the rest the backward jobs.
struct RunJobs {
  std::vector<std::future<void>> jobs;
  size_t head = 0;
};

/// Creates the channels `plan` needs in `ctx` (ctx.num_layers, num_microbatch and grain set) and
/// posts its stage jobs in program order onto `workers` round-robin from `*device_cursor`
/// (advanced past them). The jobs reference `ctx`: wait for all of them before it goes.
RunJobs launch_run(RunContext& ctx, const scheduler::ExecutePlan& plan, scheduler::RunType type,
                   const std::vector<std::unique_ptr<DeviceWorker>>& workers, int64_t* device_cursor);

/// Waits for jobs[begin, end) and returns the first failure in program order (null if none).
std::exception_ptr wait_jobs(std::vector<std::future<void>>& jobs, size_t begin, size_t end);

/// A training run's tail starts here: waits for its backward jobs (jobs[head, end)), releases
/// every layer they did not (a failed job; Note [Run tails]) and returns their first failure.
std::exception_ptr finish_backward(RunContext& ctx, RunJobs& run);

/// launch_run, then waits for every job and rethrows the first failure in program order.
void execute_run(RunContext& ctx, const scheduler::ExecutePlan& plan, scheduler::RunType type,
                 const std::vector<std::unique_ptr<DeviceWorker>>& workers, int64_t* device_cursor);

/// After a successful run: the buffers of the layers' forward (or fused) pass into the model.
void write_back_buffers(const RunContext& ctx, const LayerSet& layers);

}  // namespace roundpipe::detail
