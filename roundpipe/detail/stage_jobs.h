// The per-call state shared by stage jobs, and the jobs themselves (internal).
#pragma once

#include <torch/nn/modules/container/any.h>

#include <atomic>
#include <chrono>
#include <exception>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "amp/autocast_guard.h"
#include "roundpipe/detail/device_io.h"
#include "roundpipe/detail/layer_call.h"
#include "roundpipe/detail/layer_shells.h"
#include "roundpipe/detail/scaler_link.h"
#include "roundpipe/loss_fn.h"
#include "roundpipe/recompute_data.h"
#include "roundpipe/run_config.h"
#include "roundpipe/side_inputs.h"
#include "scheduler/execute_plan.h"

namespace roundpipe::detail {

/// A single-assignment value passed from one stage job to another (activations, gradients,
/// saved inputs, buffer snapshots). Exactly one job (the producer) calls set/fail; any thread
/// may get(), which blocks until set and rethrows the producer's error.
class Channel {
 public:
  Channel() : future_(promise_.get_future().share()) {}
  void set(Activations value) {
    promise_.set_value(std::move(value));
    done_ = true;
  }
  void fail(const std::exception_ptr& error) {
    if (!done_) {
      promise_.set_exception(error);
      done_ = true;
    }
  }
  const Activations& get() const { return future_.get(); }
  /// Whether get() would return (or throw) at once.
  bool ready() const { return future_.wait_for(std::chrono::seconds(0)) == std::future_status::ready; }

 private:
  std::promise<Activations> promise_;
  std::shared_future<Activations> future_;
  bool done_ = false;  // producer-only
};
using ChannelPtr = std::shared_ptr<Channel>;

/// A parameter of the model: entry `index` of the parameter list of layer `layer`, its owner.
struct ParamRef {
  int64_t layer = 0;
  int64_t index = 0;
};

class HostBufferPool;

/// The model's layers as the engine runs them. Immutable after construction, except
/// `call_modes` (atomics) and the tensors' data (written only by the caller thread between
/// calls, or by the optimizer through the per-layer protocol) and `shells` (its own mutex).
struct LayerSet {
  std::vector<torch::nn::AnyModule> layers;
  std::vector<std::string> names;  // "3 (Linear)"
  std::unique_ptr<std::atomic<int>[]> call_modes;
  /// [layer][u]: the distinct parameters layer l uses, in order of first appearance in
  /// layers[l]->parameters() (a module held twice by a layer is one parameter here).
  std::vector<std::vector<ParamRef>> uses;
  /// [layer][position in layers[l]->parameters()] -> u, the index into uses[l].
  std::vector<std::vector<int64_t>> use_of_position;
  mutable LayerShells shells{&layers};  // the stage jobs' module copies (Note [Layer shells])
  /// CUDA runs: where jobs download parameter gradients (Note [Exact-size pinned host memory]);
  /// null on CPU devices. Thread-safe.
  std::shared_ptr<HostBufferPool> grad_buffers;
};

/// Note [Run context parts]: the state of one forward_backward / forward call, in five parts, each
/// with one synchronization rule; RunContext is all of them (jobs take RunContext&).
///
/// RunSettings: written by the caller while it prepares the run, before any of its jobs is
/// posted; read-only afterwards (every job reads it without synchronization).
struct RunSettings {
  const LayerSet* model = nullptr;
  std::string model_name;
  int64_t num_layers = 0;
  int64_t num_microbatch = 0;
  int64_t iteration = 0;
  uint64_t seed = 0;
  bool preserve_rng = true;
  bool training = true;
  RecomputeGrain grain = RecomputeGrain::kStage;
  std::vector<Activations> inputs;  // [mb]
  std::vector<at::Tensor> labels;   // [mb]
  /// [mb] the rows of the caller's side inputs (Note [Side inputs] in stage_jobs.cpp); empty when
  /// the call has none.
  std::vector<SideInputs> side_inputs;
  /// Called by the fused job only (which finishes before the call returns).
  const LossFn* loss_fn = nullptr;
  /// RoundPipeOptions::label_to_last_layer: the last layer is called with labels[mb] appended.
  bool label_to_last_layer = false;
  /// [layer][position in layers[l]->parameters()]: the parameters CPU devices' layer shells share
  /// with the layer instead of copying them (Note [Shared host parameters] in device_io.cpp);
  /// empty: copy every parameter.
  std::vector<std::vector<bool>> cpu_shared_parameters;
  c10::Device output_device = c10::kCPU;
  /// The caller's autocast state (CPU and CUDA), applied on the worker threads for every job.
  amp::AutocastState autocast;
};

/// RunHooks: set by the caller before the jobs are posted, called by the jobs from their worker
/// threads; each hook is thread-safe on its own. Any may be empty.
struct RunHooks {
  /// Called by a stage job before it copies layer `l`: blocks until the layer's compute copy
  /// holds the parameters this iteration must use (Note [Async step protocol]).
  std::function<void(int64_t)> wait_layer_ready;
  /// Data parallelism (Note [Gradient buckets]): called by a backward or fused job once layers
  /// [begin, end) have their final gradients in `grads`.
  std::function<void(int64_t, int64_t)> on_grads_ready;
  /// Training runs with overlap (Note [Run tails] in step_pipeline.cpp): called once per layer
  /// (through release_layers) when the run's last reader of the layer has its copy.
  std::function<void(int64_t)> on_release;
  std::unique_ptr<std::atomic<bool>[]> released;  // [layer], with on_release: exchanged once per layer
};

/// RunChannels: hand-overs between the jobs, each value written once by one job and read by the
/// jobs after it (Channel's promise, or an atomic flag). Sized by the caller before posting.
struct RunChannels {
  std::vector<std::vector<ChannelPtr>> fwd_out;   // [forward stage][mb]
  std::vector<std::vector<ChannelPtr>> saved;     // [layer][mb]; empty when not kept
  std::vector<ChannelPtr> buffer_snapshot;        // [layer]; null when not needed
  std::vector<std::vector<ChannelPtr>> bwd_grad;  // [backward stage][mb]
  /// Training runs: [layer * num_microbatch + mb] what the layer's forward-stage pass on the
  /// microbatch saved for its recompute (Note [Recompute data] in roundpipe/recompute_data.h):
  /// written by the forward job, then read and cleared by the backward job that recomputes it
  /// (after the backward gradient channel that orders them).
  std::vector<RecomputeSlot> recompute_slots;
  /// Training runs: [layer * num_microbatch + mb] whether the layer's first pass drew random
  /// numbers on the microbatch (Note [Draws in the tail] in stage_jobs.cpp): set by that pass
  /// before its output goes downstream, read by the recompute and by the caller.
  std::unique_ptr<std::atomic<bool>[]> rng_used;
  /// Training runs: [layer] a shell claimed by the caller for the backward stage of the layer, so
  /// that no backward job clones a layer (which draws from the CPU generator) in the background
  /// (Note [Shell claims]). Filled before posting; taken (moved out) by that one job; the rest
  /// withdrawn with the context.
  std::vector<std::optional<ShellClaim>> claimed;
};

/// RunResults: each slot written by exactly one job, read by the caller after every job that
/// writes it has finished.
struct RunResults {
  std::vector<at::Tensor> losses;                // [mb]                 fused job
  std::vector<Activations> outputs;              // [mb]                 last forward job (inference)
  std::vector<std::vector<at::Tensor>> grads;    // [layer][u] (uses[l]) job running its backward
  std::vector<std::vector<at::Tensor>> buffers;  // [layer][buffer]      job running its forward
  /// When non-empty: [layer] milliseconds of the layer's forward summed over microbatches, timed
  /// in its forward or fused job (the one job that runs the layer's first pass).
  std::vector<double> forward_ms;
  /// When non-empty (measuring, with forward_ms): [backward stage] milliseconds of the stage's
  /// passes summed over microbatches: recompute + backward for a backward stage, forward + loss +
  /// backward for the fused tail (stage 0).
  std::vector<double> backward_stage_ms;
};

/// One call's state: its settings, hooks, channels and results, and the GradScaler hand-off
/// (Note [Run scaler link] in scaler_link.h).
struct RunContext : RunSettings, RunHooks, RunChannels, RunResults {
  ScalerLink scaler_link;
};

/// Calls ctx.on_release for each layer of [begin, end) not released yet (any thread).
void release_layers(RunContext& ctx, int64_t begin, int64_t end);

/// Tests only: CPU jobs defer their hand-overs (Note [Deferred hand-over]) and lease their layers
/// lazily (Note [Lazy leases]) as CUDA jobs do, so the CPU suite runs that control flow.
/// Process-wide; set it while no run is in flight.
void set_cuda_flow_on_cpu_for_testing(bool on);

void run_forward_stage(RunContext& ctx, size_t stage, scheduler::LayerRange layers, c10::Device device);
void run_fused_stage(RunContext& ctx, scheduler::LayerRange layers, c10::Device device);
void run_backward_stage(RunContext& ctx, size_t stage, scheduler::LayerRange layers, c10::Device device);

}  // namespace roundpipe::detail
