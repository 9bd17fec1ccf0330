// The simulator's core, shared by simulate() and the planner (internal): a plan compiled to
// per-job costs and dependencies, and one pass over the jobs in dispatch order.
#pragma once

#include <cstdint>
#include <utility>
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
  int64_t saved_job = -1;  ///< forward job after whose microbatch j this backward stage may recompute j; -1: none
};

/// Prefix sums of the layers' forward / backward times (size L + 1), and whether the fused tail
/// recomputes its layers but the last (SimulateOptions::fused_recompute).
struct CostPrefix {
  explicit CostPrefix(const std::vector<LayerCost>& costs, bool fused_recompute = false);
  double forward(LayerRange r) const { return fwd[r.end] - fwd[r.begin]; }
  double backward(LayerRange r) const { return bwd[r.end] - bwd[r.begin]; }
  std::vector<double> fwd, bwd;
  bool fused_recompute = false;
};

/// Appends the job of one stage to `jobs` (which holds the stages before it in dispatch order),
/// linking it to its producer. `forward_jobs`: the number of forward stages (they come first).
void append_job(std::vector<JobSpec>& jobs, StagePhase phase, LayerRange layers, const CostPrefix& prefix,
                int64_t forward_jobs);

/// The jobs of one iteration of `plan` in dispatch order.
std::vector<JobSpec> compile(const ExecutePlan& plan, RunType type, const CostPrefix& prefix);

/// Runs jobs through the model; reuses its buffers across calls (not thread-safe).
class PipelineModel {
 public:
  PipelineModel(RunType type, int64_t num_devices, int64_t num_microbatch, SimulateOptions options);

  /// Iterations simulate_steady_state runs at most to find the periodic regime.
  static constexpr int64_t kMaxSteadyIterations = 256;

  struct Output {
    std::vector<double> iteration_end;
    std::vector<double> iteration_return;
    double sum_job_end = 0;  ///< over iteration 0's jobs (a tie-break for the planner)
    // steady() only:
    double period = 0;
    int64_t measured = 0;   ///< iterations the period spans
    bool periodic = false;  ///< a repeating state was found: `period` is exact
  };

  /// Simulates `iterations` back-to-back iterations of `jobs`; appends every job to `record`
  /// when it is not null.
  const Output& run(const std::vector<JobSpec>& jobs, int64_t iterations, std::vector<SimulatedJob>* record = nullptr);
  /// Makespan of one isolated iteration.
  double makespan(const std::vector<JobSpec>& jobs);
  /// Back-to-back iterations until they repeat (or options.num_iterations of them).
  const Output& steady(const std::vector<JobSpec>& jobs, std::vector<SimulatedJob>* record = nullptr);
  /// steady(jobs).period.
  double period(const std::vector<JobSpec>& jobs);

  int64_t num_devices() const { return num_devices_; }
  int64_t num_microbatch() const { return num_microbatch_; }

 private:
  RunType type_;
  int64_t num_devices_;
  int64_t num_microbatch_;
  SimulateOptions options_;
  std::vector<std::pair<int64_t, int64_t>> rounds_;  // microbatch ranges, one job per stage each
  // Simulation state between iterations.
  std::vector<double> device_free_;
  std::vector<double> mb_end_;          // [job][microbatch] of the current iteration
  double gate_ = 0;                     // the next iteration's jobs are posted
  std::vector<double> job_gate_;        // [job] the next iteration's job k may copy its layers (empty: at gate_)
  std::vector<double> release_;         // [job] this iteration's last reader of the job's layers has its copy
  std::vector<double> publish_at_;      // [layer] scratch
  int64_t num_layers_ = 0;              // of the jobs reset() was given
  double step_end_ = 0;                 // the last iteration's optimizer step
  int64_t device_ = 0;                  // the cursor
  std::vector<double> states_, gates_;  // per iteration, for steady()
  Output out_;

  void reset(const std::vector<JobSpec>& jobs);
  void iterate(const std::vector<JobSpec>& jobs, std::vector<SimulatedJob>* record);
};

}  // namespace roundpipe::scheduler::detail
