// The simulator's core, shared by simulate() and the planner (internal): a plan compiled to
// per-job costs and dependencies, and one pass over the jobs in dispatch order.
#pragma once

#include <cstdint>
#include <vector>

#include "scheduler/simulator.h"

namespace roundpipe::scheduler::detail {

/// One stage job of an iteration, as the simulator needs it.
struct JobSpec {
  StagePhase phase = StagePhase::kForward;
  LayerRange layers;
  double cost = 0;         ///< compute per microbatch
  double recompute = 0;    ///< the part of `cost` a backward stage may run ahead (its forward sum)
  int64_t input_job = -1;  ///< job whose microbatch j this job's microbatch j consumes; -1: the batch
  int64_t saved_job = -1;  ///< forward job that saves this backward stage's input; -1: none
};

/// Prefix sums of the layers' forward / backward times (size L + 1).
struct CostPrefix {
  explicit CostPrefix(const std::vector<LayerCost>& costs);
  double forward(LayerRange r) const { return fwd[r.end] - fwd[r.begin]; }
  double backward(LayerRange r) const { return bwd[r.end] - bwd[r.begin]; }
  std::vector<double> fwd, bwd;
};

/// Appends the job of one stage to `jobs` (which holds the stages before it in dispatch order),
/// linking it to its producer. `forward_jobs`: the number of forward stages (they come first).
void append_job(std::vector<JobSpec>& jobs, StagePhase phase, LayerRange layers, const CostPrefix& prefix,
                int64_t forward_jobs);

/// The jobs of one iteration of `plan` in dispatch order.
std::vector<JobSpec> compile(const ExecutePlan& plan, RunType type, const CostPrefix& prefix);

/// Iterations to simulate for a steady-state period with `num_jobs` jobs per iteration:
/// `requested` (SimulateOptions::num_iterations) or, if 0, the default. Sets `*measured` to how
/// many final ones the period is averaged over (by default a whole number of cursor cycles).
int64_t steady_state_iterations(int64_t num_jobs, int64_t num_devices, int64_t requested, int64_t* measured);

/// The period over the last `measured` of `iteration_end`.
double period_of(const std::vector<double>& iteration_end, int64_t measured);

/// Runs jobs through the model; reuses its buffers across calls (not thread-safe).
class PipelineModel {
 public:
  PipelineModel(RunType type, int64_t num_devices, int64_t num_microbatch, SimulateOptions options);

  struct Output {
    std::vector<double> iteration_end;
    std::vector<double> iteration_return;
    double sum_job_end = 0;  ///< over iteration 0's jobs (a tie-break for the planner)
  };

  /// Simulates `iterations` back-to-back iterations of `jobs`; appends every job to `record`
  /// when it is not null.
  const Output& run(const std::vector<JobSpec>& jobs, int64_t iterations,
                    std::vector<SimulatedJob>* record = nullptr);
  /// Makespan of one isolated iteration.
  double makespan(const std::vector<JobSpec>& jobs);
  /// Steady-state period (options.num_iterations, or the default).
  double period(const std::vector<JobSpec>& jobs);

  int64_t num_devices() const { return num_devices_; }
  int64_t num_microbatch() const { return num_microbatch_; }

 private:
  RunType type_;
  int64_t num_devices_;
  int64_t num_microbatch_;
  SimulateOptions options_;
  std::vector<double> device_free_;
  std::vector<double> mb_end_;  // [job][microbatch] of the current iteration
  Output out_;
};

}  // namespace roundpipe::scheduler::detail
