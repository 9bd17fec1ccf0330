// Per-call and per-model execution settings of RoundPipe (microbatching, recompute, plans).
#pragma once

#include <c10/core/Device.h>

#include <cstdint>
#include <optional>

#include "scheduler/execute_plan.h"
#include "scheduler/simulator.h"

namespace roundpipe {

/// How much of the forward pass a backward stage keeps and recomputes.
/// kStage: only each backward stage's first input is kept; the stage is recomputed as a whole.
/// kLayer: every layer's input is kept (in host memory); layers are recomputed one at a time, in
/// the fused tail too, whose layers but the last then run twice (lower peak memory, more
/// transfers; docs/user-guide.md, "Recompute grains").
enum class RecomputeGrain { kStage, kLayer };

/// kAsync: `step` queues the optimizer on a background thread and returns at once.
/// kSync: `step` runs the optimizer before returning.
enum class StepMode { kSync, kAsync };

// The engine's model of itself (docs/architecture.md, "One forward_backward call"): what an unset
// setting resolves to and how the scheduler's simulator describes a run. The runtime's planner,
// `roundpipe plan` and the tests ask here instead of spelling the rules again.

/// Microbatches per call when RunConfig::num_microbatch is unset: one more than the devices, so
/// that every device has a microbatch while the first one's next stage is being copied in. A
/// call whose batch has fewer rows uses one microbatch per row.
int64_t default_num_microbatch(int64_t num_devices);

/// The recompute grain when RunConfig::recompute_grain is unset.
inline constexpr RecomputeGrain kDefaultRecomputeGrain = RecomputeGrain::kStage;

/// The simulator's options that describe how the runtime runs a training call with `grain`:
/// backward stages recompute ahead with the stage grain (docs/architecture.md, "One forward_backward call", step 7),
/// and with `iterations_overlap` (RoundPipeOptions:: overlap_backward without data parallelism) forward_backward
/// returns once its losses are known, so back-to-back iterations overlap. Job and hop overheads are left at zero.
scheduler::SimulateOptions engine_simulate_options(RecomputeGrain grain, bool iterations_overlap);

/// Settings of one call. Unset fields inherit: call > model (RoundPipeOptions::run_config) >
/// default.
struct RunConfig {
  std::optional<int64_t> num_microbatch;          ///< default: default_num_microbatch(devices)
  std::optional<RecomputeGrain> recompute_grain;  ///< default: kDefaultRecomputeGrain
  std::optional<bool> preserve_rng_state;         ///< default: true (docs/user-guide.md, "Dropout and reproducibility")
  std::optional<scheduler::ExecutePlan> execute_plan;  ///< default: automatic
  std::optional<c10::Device> output_device;            ///< default: CPU (forward() outputs)

  /// Fields set here override those of `base`.
  RunConfig merged_over(const RunConfig& base) const;
};

}  // namespace roundpipe
