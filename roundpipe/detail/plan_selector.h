// The runtime's glue to the scheduler: per-layer costs, the per-device memory budget and the
// cache of automatic plans (internal).
#pragma once

#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "scheduler/execute_plan.h"
#include "scheduler/partitioner.h"
#include "scheduler/simulator.h"

namespace roundpipe::detail {

/// Chooses the plan of each run: the call's (or model's) own, else an automatic plan. Until layer
/// times are measured, the automatic plan is partitioned from size-based costs (the
/// partitioner's cost model: fast, and bytes say little about time anyway); once measured, it is
/// the training plan that the simulator rates best (scheduler::plan_by_simulation at the measured
/// num_microbatch, docs/schedule.md): for synchronous steps the one with the shortest isolated
/// iteration, for asynchronous steps with overlapping iterations the one with the shortest mean
/// time per iteration of back-to-back runs (PlanObjective::kSteadyState).
///
/// Thread-safety: the caller thread only (plans are computed between runs).
class PlanSelector {
 public:
  /// `param_bytes[l]` / `grad_bytes[l]`: layer l's parameter + buffer bytes / trainable parameter
  /// bytes. `memory_budget_bytes`: per stage and device (max() = unlimited).
  /// `engine`: how the runtime runs, as the simulator models it (roundpipe::engine_simulate_options
  /// for the model's recompute grain; its overlap_backward_tail: forward_backward returns before
  /// its backward stages end, so back-to-back iterations overlap). Per-job and per-hop overheads
  /// are zero there, which they are not: on CPU device workers sharing two cores `pipeline_bench
  /// paper` measures 1-5 points more bubble than this model predicts (docs/benchmarks.md).
  /// `kinds[l]`: layer l's module type
  /// (layers of one type and size share their measured times, Note [Smoothing measured times]).
  PlanSelector(std::vector<int64_t> param_bytes, std::vector<int64_t> grad_bytes, std::vector<std::string> kinds,
          int64_t num_devices, int64_t memory_budget_bytes, scheduler::SimulateOptions engine);

  int64_t num_layers() const { return static_cast<int64_t>(param_bytes_.size()); }
  int64_t memory_budget_bytes() const { return memory_budget_bytes_; }
  /// `plan` validated against the model (a given plan), else the automatic plan for `type`.
  scheduler::ExecutePlan plan_for(const std::optional<scheduler::ExecutePlan>& plan, scheduler::RunType type) const;
  /// The automatic plan for `type` (cached until the costs change).
  scheduler::ExecutePlan auto_plan(scheduler::RunType type) const;
  const std::vector<scheduler::LayerCost>& layer_costs() const;
  /// Whether layer times were measured (RoundPipeOptions::measure_layer_times).
  bool measured() const { return measured_; }
  /// Whether the next automatic training run should time the layers: never measured yet, or
  /// request_remeasure() since the last measurement.
  bool wants_measurement() const { return !measured_ || remeasure_; }
  /// RoundPipe::remeasure_layer_times.
  void request_remeasure() { remeasure_ = true; }
  /// Plans training runs for asynchronous (back-to-back, overlapping) or synchronous steps: the
  /// mode of the caller's last step(). Returns whether the automatic training plan's objective
  /// changed (measured costs and overlapping iterations only).
  bool set_async_steps(bool async);
  /// The automatic training plan with its simulated figures, for the log.
  std::string describe_auto_plan() const;
  /// Replaces the costs by measured times, drops the cached plans and plans again by simulation
  /// for `num_microbatch` microbatches. `forward_ms[l]`: layer l's forward summed over the
  /// microbatches. `backward_stage_ms[s]`: backward stage s of the current automatic plan (the
  /// one the measuring call ran), summed over the microbatches; it is shared among the stage's
  /// layers in proportion to their forward times (evenly if those are all zero) and becomes their
  /// LayerCost::backward. Layers of one kind and size whose times are close share their median
  /// (Note [Smoothing measured times]). A re-measurement (request_remeasure) keeps the costs and
  /// plans unless some layer's time moved materially (Note [Re-measuring]), and says so. Returns a line describing the new plan and the old one with their
  /// simulated figures, for the log.
  std::string use_measured_times(const std::vector<double>& forward_ms, const std::vector<double>& backward_stage_ms,
                                 int64_t num_microbatch);

 private:
  std::vector<int64_t> param_bytes_;
  std::vector<int64_t> grad_bytes_;
  std::vector<std::string> kinds_;
  int64_t num_devices_;
  int64_t memory_budget_bytes_;
  scheduler::SimulateOptions engine_;
  bool async_steps_ = false;
  bool measured_ = false;
  bool remeasure_ = false;
  int64_t measured_num_microbatch_ = 0;  // the call that measured the costs
  std::vector<scheduler::ExecutePlan> seeds_;  // starting plans for the simulation planner
  mutable std::vector<scheduler::LayerCost> costs_;  // lazy
  mutable std::optional<scheduler::ExecutePlan> auto_fused_plan_, auto_async_plan_, auto_infer_plan_;

  bool plans_for_steady_state() const { return measured_ && async_steps_ && engine_.overlap_backward_tail; }
  std::string describe_plan(const scheduler::ExecutePlan& plan, bool steady) const;
};

}  // namespace roundpipe::detail
