// Per-call and per-model execution settings of RoundPipe (microbatching, recompute, plans).
#pragma once

#include <c10/core/Device.h>

#include <cstdint>
#include <optional>

#include "scheduler/execute_plan.h"

namespace roundpipe {

/// How much of the forward pass a backward stage keeps and recomputes.
/// kStage: only each backward stage's first input is kept; the stage is recomputed as a whole.
/// kLayer: every layer's input is kept; layers are recomputed one at a time (lower peak memory,
/// more transfers).
enum class RecomputeGrain { kStage, kLayer };

/// kAsync: `step` queues the optimizer on a background thread and returns at once.
/// kSync: `step` runs the optimizer before returning.
enum class StepMode { kSync, kAsync };

/// Settings of one call. Unset fields inherit: call > model (RoundPipeOptions::run_config) >
/// default.
struct RunConfig {
  std::optional<int64_t> num_microbatch;          ///< default: number of devices + 1
  std::optional<RecomputeGrain> recompute_grain;  ///< default: kStage
  std::optional<bool> preserve_rng_state;         ///< default: true (docs/user-guide.md, "Dropout and reproducibility")
  std::optional<scheduler::ExecutePlan> execute_plan;  ///< default: automatic
  std::optional<c10::Device> output_device;       ///< default: CPU (forward() outputs)

  /// Fields set here override those of `base`.
  RunConfig merged_over(const RunConfig& base) const;
};

}  // namespace roundpipe
