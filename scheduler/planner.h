// The simulation-based planner: chooses the forward and backward stage partitions (and, when
// the caller lets it, num_microbatch) whose simulated makespan (or steady-state period) is
// smallest, under the per-device memory budget. Pure CPU logic on top of simulator.h; the
// runtime calls it with measured layer costs and caches the plan.
#pragma once

#include <cstdint>
#include <limits>
#include <vector>

#include "scheduler/execute_plan.h"
#include "scheduler/partitioner.h"
#include "scheduler/simulator.h"

namespace roundpipe::scheduler {

/// What the planner minimises.
/// - kIsolated: the makespan of one isolated iteration (simulate()): for synchronous steps.
/// - kSteadyState: the mean time per iteration of a run of `run_iterations` back-to-back
///   iterations, period + (makespan - period) / run_iterations (simulate_steady_state()): for
///   asynchronous steps. The first iteration's fill and the last's drain weigh in a little, so
///   of two plans with about the same period the one with the shorter makespan wins.
/// - kMeasuredWindow: the mean time per iteration of `run_iterations` back-to-back iterations
///   timed after a warm-up and up to a final synchronize(), period + drain / run_iterations, with
///   drain = a steady iteration's end - its return (docs/schedule.md, "Steady state, end to end"): the
///   fill is not charged, the last iteration's drain is. For a benchmark's window (issue 32); the
///   runtime plans asynchronous steps with kSteadyState.
enum class PlanObjective { kIsolated, kSteadyState, kMeasuredWindow };

struct PlannerOptions {
  /// Devices the plan runs on (the runtime's device count).
  int64_t num_devices = 1;
  /// > 0: plan for exactly this many microbatches. 0: the planner chooses it in
  /// [1, max_num_microbatch] (docs/schedule.md).
  int64_t num_microbatch = 0;
  /// Upper bound when the planner chooses num_microbatch (the batch's rows); required then.
  int64_t max_num_microbatch = 0;
  /// The microbatch count the given per-microbatch costs were measured at; required when the
  /// planner chooses num_microbatch (costs scale by costs_num_microbatch / M; overheads do not).
  int64_t costs_num_microbatch = 0;
  /// When choosing: the smallest num_microbatch whose objective is within this fraction of the
  /// best one wins (fewer, larger microbatches run more efficiently than the model says).
  double num_microbatch_tolerance = 0.02;
  /// Bytes one stage may hold on a device, as in PartitionOptions. Default: unlimited.
  int64_t memory_budget_bytes = std::numeric_limits<int64_t>::max();
  PlanObjective objective = PlanObjective::kIsolated;
  /// kSteadyState: the run length over which the makespan is amortized; kMeasuredWindow: the
  /// number of iterations measured.
  int64_t run_iterations = 100;
  /// The runtime's overheads and iteration model, passed to the simulator.
  SimulateOptions simulate;
  /// Enumerate every plan (exact) when there are at most this many (kFused: 8 layers give 5461).
  int64_t exhaustive_limit = 8192;
  /// Simulations the heuristic search may run (per call: num_microbatch candidates share it).
  int64_t max_evaluations = 100000;
  /// Simulation work the heuristic search may spend (per call, shared likewise), counted in
  /// job-microbatches (a simulation of J jobs, M microbatches and I iterations counts J x M x I;
  /// about 10 ns each): bounds the planning time deterministically (the default: 0.15-0.5 s).
  int64_t max_simulated_microbatches = 50'000'000;
  /// Extra starting plans for the heuristic search (e.g. the previous plan, when the costs
  /// changed). Plans that do not fit the model, type or budget are ignored.
  std::vector<ExecutePlan> seeds;

  PlannerOptions& set_num_devices(int64_t v) { num_devices = v; return *this; }
  PlannerOptions& set_num_microbatch(int64_t v) { num_microbatch = v; return *this; }
  PlannerOptions& set_max_num_microbatch(int64_t v) { max_num_microbatch = v; return *this; }
  PlannerOptions& set_costs_num_microbatch(int64_t v) { costs_num_microbatch = v; return *this; }
  PlannerOptions& set_num_microbatch_tolerance(double v) { num_microbatch_tolerance = v; return *this; }
  PlannerOptions& set_memory_budget_bytes(int64_t v) { memory_budget_bytes = v; return *this; }
  PlannerOptions& set_objective(PlanObjective v) { objective = v; return *this; }
  PlannerOptions& set_run_iterations(int64_t v) { run_iterations = v; return *this; }
  PlannerOptions& set_simulate(const SimulateOptions& v) { simulate = v; return *this; }
  PlannerOptions& set_exhaustive_limit(int64_t v) { exhaustive_limit = v; return *this; }
  PlannerOptions& set_max_evaluations(int64_t v) { max_evaluations = v; return *this; }
  PlannerOptions& set_max_simulated_microbatches(int64_t v) { max_simulated_microbatches = v; return *this; }
  PlannerOptions& set_seeds(std::vector<ExecutePlan> v) { seeds = std::move(v); return *this; }
};

/// The planner's choice and its simulated figures (with the costs scaled to num_microbatch).
struct PlannedSchedule {
  ExecutePlan plan;
  int64_t num_microbatch = 0;
  double makespan = 0;       ///< simulated makespan of one isolated iteration
  double period = 0;         ///< simulated steady-state period
  double bubble = 0;         ///< isolated bubble ratio
  double steady_bubble = 0;  ///< steady-state bubble ratio
  int64_t evaluations = 0;   ///< simulations run
  bool exhaustive = false;   ///< every plan was simulated: the plan is optimal under the model
};

/// The plan for `type` (kInfer, kTrain or kFused) minimising `options.objective` under the
/// simulator (docs/schedule.md), ties broken as docs/schedule.md says.
/// Exact when the plan space is at most `exhaustive_limit`, else a heuristic search (Note
/// [Simulation-based planning] in planner.cpp) that starts from the partitioner's plan, so it
/// never returns a plan the simulator rates worse than partition()'s.
/// Throws c10::Error on invalid costs or options, or when a layer alone exceeds the budget.
/// Deterministic (same inputs, same plan) and thread-safe (no shared state).
PlannedSchedule plan_by_simulation(const std::vector<LayerCost>& costs, RunType type,
                                   const PlannerOptions& options);

}  // namespace roundpipe::scheduler
