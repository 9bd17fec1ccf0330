// RoundPipe: wraps a torch::nn::Sequential so that it trains with its state in host memory while
// stages of layers are streamed round-robin to a pool of devices (CUDA GPUs, or CPU workers).
// Sits on top of scheduler (plans) and amp/optim (used inside step functions).
#pragma once

#include <torch/nn/modules/container/sequential.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "roundpipe/layer_seed.h"
#include "roundpipe/loss_fn.h"
#include "roundpipe/run_config.h"
#include "scheduler/partitioner.h"

namespace roundpipe {

namespace comm {
class ProcessGroup;
}  // namespace comm

/// Options of a RoundPipe model. Validated by the RoundPipe constructor.
struct RoundPipeOptions {
  /// dtype of the master weights the optimizer updates; default: each parameter's own dtype.
  /// float16 masters are refused (here, or for fp16 parameters when the masters are made): keep
  /// float32 masters with fp16 compute copies and amp::GradScaler.
  TORCH_ARG(std::optional<c10::ScalarType>, optim_dtype) = std::nullopt;
  /// dtype of the master gradients step functions see; default: the master's own dtype (each step
  /// casts the compute copies' gradients into one reused buffer per master). Set it to the compute
  /// dtype (e.g. kBFloat16 with bf16 compute copies and fp32 masters) to hand the compute
  /// gradients over as they are: no cast pass and no fp32 gradient buffer (4 B/param of host
  /// memory), and the masters get set_grad_dtype(). It applies to the parameters whose compute
  /// copies have this dtype; the others (e.g. fp32 norm weights) keep master-dtype gradients. The step function's
  /// optimizer must accept such gradients: roundpipe::optim::Adam reads them in its fused pass (bitwise the same
  /// result, tested); other optimizers are untested with it, and GradScaler::unscale_ refuses fp16 gradients (as
  /// torch's does).
  TORCH_ARG(std::optional<c10::ScalarType>, master_grad_dtype) = std::nullopt;
  /// The optimizer updates the compute copies themselves: no separate master copies, which saves
  /// one parameter-sized copy of host memory (4 B/param with fp32 parameters; with bf16 parameters
  /// and roundpipe::optim::Adam's kahan_sum these are bf16 masters with Kahan compensation,
  /// docs/optimizer.md). optim_parameters() then returns the compute copies. Steps must be
  /// StepMode::kSync: an async step would write the parameters the next iteration reads (refused
  /// at step()). optim_dtype and master_grad_dtype must be unset: the masters are the parameters,
  /// in their own dtype, with their own gradients. CPU devices then also compute on the parameters
  /// themselves instead of a copy of each stage's layers per job (at the peak, one copy of each
  /// device's largest stage less: 1.3 B/param measured with 2 devices, 3.9 with 1; docs/benchmarks.md).
  TORCH_ARG(bool, in_place_masters) = false;
  /// Every step is StepMode::kSync (step(fn, StepMode::kAsync) is refused): the compute copies then
  /// change only between runs, so CPU devices compute on them instead of a copy of each stage's
  /// trainable layers per job, as with in_place_masters (docs/architecture.md); for
  /// separate masters, e.g. bf16 compute copies with fp32 masters: one bf16 copy of the model
  /// less at the peak with 2 CPU devices (docs/benchmarks.md). No effect on GPUs, whose jobs copy
  /// the layers into device memory anyway. in_place_masters implies it.
  TORCH_ARG(bool, sync_steps) = false;
  /// Devices of the pool; each entry is one worker thread (CPU entries may repeat). Default:
  /// every visible CUDA device, else one CPU device.
  TORCH_ARG(std::vector<c10::Device>, devices) = {};
  /// Model-level defaults for every call.
  TORCH_ARG(RunConfig, run_config) = {};
  /// Name used in log lines and error messages.
  TORCH_ARG(std::string, name) = "model";
  /// Base seed of the per-layer RNG scheme (docs/user-guide.md, "Dropout and reproducibility"); default: drawn from
  /// torch's default CPU generator at construction, so torch::manual_seed controls it.
  TORCH_ARG(std::optional<uint64_t>, seed) = std::nullopt;
  /// Automatic plans start from size-based cost estimates; with this on, the first
  /// forward_backward that uses the automatic plan also times every layer's forward and every
  /// backward stage's microbatches (on CUDA with a device sync around each, in that call only),
  /// and later calls use the plan whose simulated makespan for the measured times is smallest
  /// (a backward stage's time is shared among its layers in proportion to their forward times;
  /// docs/user-guide.md, "Plans").
  TORCH_ARG(bool, measure_layer_times) = true;
  /// forward_backward returns as soon as the losses are known; the backward stages finish in the
  /// background, so with an async step the next iteration's forward stages fill this one's drain
  /// (docs/user-guide.md, "Overlapping iterations"). The results are bitwise the same either way.
  /// Calls that read gradients (step, synchronize, parameters, module, ...) wait for the backward;
  /// a background error is rethrown by the next call. Off: forward_backward returns after the
  /// whole backward. Always off for the call that measures layer times and with data parallelism.
  TORCH_ARG(bool, overlap_backward) = true;
  /// Bytes of parameters and buffers (plus gradients, for backward stages) one stage may hold on
  /// a device; automatic plans respect it, and a layer that alone exceeds it fails at
  /// construction. Default: half the memory of the smallest CUDA device in `devices` (the rest is
  /// for activations and the allocator), unlimited with CPU devices only.
  TORCH_ARG(std::optional<int64_t>, device_memory_budget_bytes) = std::nullopt;
  /// Data parallelism across processes (docs/distributed.md): every rank of `process_group` wraps
  /// the same model; at construction rank 0's parameters and buffers are copied to every rank;
  /// each forward_backward's gradients are averaged over the ranks (all-reduced in buckets while
  /// the backward still runs) before step() hands them to the optimizer, and a GradScaler's
  /// found_inf is combined over the ranks, so every rank applies the same update. Null (default)
  /// or a one-rank group: no communication.
  TORCH_ARG(std::shared_ptr<comm::ProcessGroup>, process_group) = nullptr;
  /// Gradient bytes per all-reduce bucket with a process group (whole layers per bucket).
  TORCH_ARG(int64_t, grad_bucket_bytes) = 25 << 20;
  /// The last layer is called with each microbatch's label (its rows of forward_backward's label,
  /// uploaded to the layer's device) appended to its activations, and loss_fn receives what it
  /// returns: for a head that computes the loss itself without materializing its output, e.g.
  /// models::LmHead's fused, chunked cross-entropy (docs/user-guide.md, "Long sequences"). The
  /// layer's forward must also accept the activations alone (forward(inputs) calls it so);
  /// forward(inputs, label) passes the label (evaluation). forward_backward then needs a label.
  TORCH_ARG(bool, label_to_last_layer) = false;
};

/// Counters of the data-parallel gradient averaging (RoundPipe::data_parallel_stats).
struct DataParallelStats {
  int64_t world_size = 1;
  int64_t rank = 0;
  /// forward_backward calls whose gradients were averaged.
  int64_t runs = 0;
  /// All-reduces launched for gradients, and their bytes (per rank).
  int64_t buckets = 0;
  int64_t bytes = 0;
  /// forward_backward calls that returned before their gradients were averaged: the all-reduces
  /// then run beside the next iteration (RoundPipeOptions::overlap_backward).
  int64_t overlapped_runs = 0;
  /// Milliseconds spent waiting for gradient all-reduces after the backward had finished (the
  /// communication not hidden behind the backward; behind the next iteration's forward when the
  /// run overlapped it).
  double wait_ms = 0.0;
};

/// A pipeline-parallel wrapper of a torch::nn::Sequential.
///
/// Thread-safety: one RoundPipe is driven by one caller thread at a time (forward_backward,
/// forward, step, synchronize); a second thread calling in while one is inside, or a callback
/// (loss_fn, a layer, a step function) calling back into its model, gets a c10::Error (Note [One
/// caller thread]); the model may change threads between calls. Internally, one worker thread per device runs stage
/// jobs; a run's channels (futures) are the only state shared between workers; buffers are applied to the model by the
/// caller thread once the forward and fused jobs have finished, gradients by the run's tail (the tail thread, or the
/// caller) after every job of the call has finished. Layers must be Cloneable modules (all torch::nn modules are;
/// custom ones derive from torch::nn::Cloneable): every stage job runs on its own copy of its layers on its device.
///
/// Example:
///   RoundPipe model(net, RoundPipeOptions().devices({torch::kCPU, torch::kCPU}));
///   auto opt = [&] { OptimizerCtx ctx; return torch::optim::SGD(model.parameters(), 0.1); }();
///   auto loss = model.forward_backward({x}, y, [&](const torch::Tensor& out, const torch::Tensor& t) {
///     return torch::mse_loss(out, t, torch::Reduction::Sum) / x.size(0); });
///   model.step([&] { opt.step(); opt.zero_grad(); });
class RoundPipe {
 public:
  explicit RoundPipe(torch::nn::Sequential model, RoundPipeOptions options = {});
  ~RoundPipe();
  RoundPipe(const RoundPipe&) = delete;
  RoundPipe& operator=(const RoundPipe&) = delete;

  /// Splits `inputs` and `label` along dim 0 into microbatches, runs forward, loss and backward
  /// through the pipeline, accumulates gradients (until `step`), and returns the sum of the
  /// per-microbatch losses on the CPU. Errors in any stage (layer, loss_fn) are rethrown naming
  /// the layer, phase and microbatch; the model is left unchanged by a failed call. With
  /// RoundPipeOptions::overlap_backward (default) it returns once the losses are known and the
  /// backward stages finish in the background: an error there is rethrown by the next call into
  /// the model (its step function is skipped), and the gradients are complete for every reader
  /// that goes through the model (step, synchronize, parameters, module); a tensor kept from
  /// before needs synchronize() before its .grad is read.
  torch::Tensor forward_backward(const std::vector<torch::Tensor>& inputs, const torch::Tensor& label,
                                 const LossFn& loss_fn, const RunConfig& config = {});

  /// Inference: no autograd, the inference plan (config.execute_plan of this call, else automatic;
  /// a model-level plan is a training plan and is not used here), outputs merged along dim 0 (on
  /// config.output_device, default CPU). Runs in the module's current train/eval mode.
  torch::Tensor forward(const std::vector<torch::Tensor>& inputs, const RunConfig& config = {});
  /// Inference with RoundPipeOptions::label_to_last_layer: as above, the last layer also gets each
  /// microbatch's rows of `label` (e.g. a head that returns its summed loss: evaluation without
  /// logits). 0-dim outputs are stacked into [num_microbatch] instead of concatenated.
  torch::Tensor forward(const std::vector<torch::Tensor>& inputs, const torch::Tensor& label,
                        const RunConfig& config = {});

  /// Moves this iteration's gradients into the master copies (cast to master_grad_dtype, by
  /// default optim_dtype, added to their .grad; docs/architecture.md, "step"), runs `step_fn`
  /// (optimizer step, zero_grad, ...), then writes the master values back into the compute copies. kSync: before
  /// returning. kAsync: on the optimizer thread (docs/user-guide.md, "Async vs sync step": staleness one). A non-empty
  /// `step_fn` that leaves every master and master gradient untouched in 8 consecutive steps with gradients pending (an
  /// optimizer built on the compute copies) fails the step (docs/errors.md).
  void step(std::function<void()> step_fn, StepMode mode = StepMode::kAsync);

  /// Waits for queued optimizer steps; afterwards master and compute copies hold the values after
  /// the last step. Rethrows an error of a queued step.
  void synchronize();

  /// Master copies (dtype optim_dtype, CPU) in layer order; created on first call (with
  /// RoundPipeOptions::in_place_masters: the compute copies themselves). Parameters
  /// that do not require grad at that point (frozen, e.g. LoRA's base weights) get none and are
  /// not listed: they cost no master copy, gradient or optimizer state.
  std::vector<torch::Tensor> optim_parameters();
  std::vector<std::pair<std::string, torch::Tensor>> optim_named_parameters();
  /// Inside an OptimizerCtx: optim_parameters(); otherwise the compute copies.
  std::vector<torch::Tensor> parameters();

  const std::vector<c10::Device>& devices() const;
  int64_t num_layers() const;
  /// The plan the next forward_backward call would use (fused plan) with `config`.
  scheduler::ExecutePlan plan(const RunConfig& config = {}) const;
  /// The per-layer costs the automatic plans are partitioned from: size-based (bytes) until
  /// layer times were measured (RoundPipeOptions::measure_layer_times), then milliseconds.
  std::vector<scheduler::LayerCost> layer_costs() const;
  /// The next forward_backward that uses the automatic plan times the layers again (as the first
  /// one did; RoundPipeOptions::measure_layer_times). The costs and the plans change only if a
  /// layer's forward or backward time moved materially: by more than 10% of its old value and
  /// of the mean layer time (docs/user-guide.md, "Plans"). For workloads whose costs change:
  /// another sequence length, layers unfrozen. Caller thread; no effect with measurement off.
  void remeasure_layer_times();
  /// The wrapped model (its parameters are the compute copies).
  torch::nn::Sequential module();
  /// Number of completed forward_backward calls (the iteration index of layer_seed).
  int64_t iteration() const;
  /// Sets the iteration index the next forward_backward seeds its layers with (layer_seed), so
  /// that a run resumed from a checkpoint draws the dropout masks the uninterrupted run would:
  /// save iteration() with the checkpoint and restore it here before the first call. Caller
  /// thread; `iteration` >= 0.
  void set_iteration(int64_t iteration);
  /// The base seed of layer_seed.
  uint64_t seed() const;
  /// Data parallelism counters (world size 1 and zeros without a process group).
  DataParallelStats data_parallel_stats() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// While alive on a thread, RoundPipe::parameters() returns master copies, so that optimizers
/// constructed in its scope update the master weights. Thread-local, nestable.
class OptimizerCtx {
 public:
  OptimizerCtx();
  ~OptimizerCtx();
  OptimizerCtx(const OptimizerCtx&) = delete;
  OptimizerCtx& operator=(const OptimizerCtx&) = delete;
  static bool active();
};

}  // namespace roundpipe
