// The pipeline simulator: predicts the timeline of an ExecutePlan under the dispatch rules the
// runtime really uses (stage jobs posted round-robin in program order, one FIFO job slot per
// device, per-microbatch dependencies at stage boundaries). Pure CPU logic: the planner minimises
// its makespan, a plan preview draws its timeline. The exact model: docs/schedule.md.
#pragma once

#include <cstdint>
#include <vector>

#include "scheduler/dispatch.h"
#include "scheduler/execute_plan.h"
#include "scheduler/partitioner.h"

namespace roundpipe::scheduler {

/// What the simulator charges besides the layers' own times. All times are in the unit of the
/// LayerCost times. Defaults model an ideal runtime (no overheads).
struct SimulateOptions {
  /// Device of the first job in dispatch order (the runtime's round-robin cursor).
  int64_t first_device = 0;
  /// Device time a job spends before its first microbatch (copying its layers to the device). It
  /// does not wait for inputs (the runtime uploads before awaiting microbatch 0).
  double job_overhead = 0;
  /// Delay on every stage-boundary edge, per microbatch (the runtime moves activations and
  /// gradients through host memory, even between two jobs on one device). Not device time.
  double hop_latency = 0;
  /// false: a backward stage recomputes microbatch j only once its gradient has arrived.
  /// true (the runtime with the stage recompute grain, and the Python original): it recomputes
  /// as soon as the device is free and the forward has passed its layers for microbatch j, and
  /// waits for the gradient only before the backward pass. Splits a backward stage's time into
  /// forward (recompute) and the rest.
  bool recompute_ahead = false;
  /// true (the runtime with the layer recompute grain): the fused tail runs its layers but the
  /// last once more, recomputed one at a time in its backward (docs/user-guide.md, "Recompute
  /// grains"): its cost per microbatch is their forward sum more.
  bool fused_recompute = false;
  /// 0 (the runtime today): a stage job runs all num_microbatch microbatches. n > 0: the
  /// iteration is dispatched in rounds of n microbatches, each round posting one job per stage
  /// (what the Python original's simulator does with n = the device count).
  int64_t round_size = 0;

  // Back-to-back iterations (simulate_steady_state only).

  /// Optimizer step time per iteration on the single optimizer thread (async step).
  double step_time = 0;
  /// true: forward_backward returns once every loss is known (the fused stage ended; issue 15,
  /// item 3), so the next iteration is posted while backward stages still run. false: it returns
  /// after the whole iteration (the runtime today).
  bool overlap_backward_tail = true;
  /// true (the runtime): there is one compute copy per layer, so the step publishing the
  /// parameters iteration i+1 uses overwrites layer l only once iteration i's last reader of l
  /// (the backward stage or fused tail holding it) has copied it, at its job's start plus
  /// `job_overhead`; the publish goes in layer order and layer 0's last reader is iteration i's
  /// last backward stage, so iteration i+1 copies no layer before that stage has started.
  /// false: the publish waits for nothing (what the Python original's simulator assumes).
  bool publish_waits_for_readers = true;
  /// 0: simulate until the iterations repeat (exact period; docs/schedule.md).
  /// n > 0: simulate n iterations and average the period over the last n / 2.
  int64_t num_iterations = 0;

  SimulateOptions& set_first_device(int64_t v) {
    first_device = v;
    return *this;
  }
  SimulateOptions& set_job_overhead(double v) {
    job_overhead = v;
    return *this;
  }
  SimulateOptions& set_hop_latency(double v) {
    hop_latency = v;
    return *this;
  }
  SimulateOptions& set_recompute_ahead(bool v) {
    recompute_ahead = v;
    return *this;
  }
  SimulateOptions& set_fused_recompute(bool v) {
    fused_recompute = v;
    return *this;
  }
  SimulateOptions& set_round_size(int64_t v) {
    round_size = v;
    return *this;
  }
  SimulateOptions& set_step_time(double v) {
    step_time = v;
    return *this;
  }
  SimulateOptions& set_overlap_backward_tail(bool v) {
    overlap_backward_tail = v;
    return *this;
  }
  SimulateOptions& set_publish_waits_for_readers(bool v) {
    publish_waits_for_readers = v;
    return *this;
  }
  SimulateOptions& set_num_iterations(int64_t v) {
    num_iterations = v;
    return *this;
  }
};

/// One microbatch of a job on its device: compute from `start` to `end`, except `wait` time
/// inside (with recompute_ahead: between the recompute and the gradient's arrival).
struct MicrobatchSpan {
  double start = 0;
  double end = 0;
  double wait = 0;
};

/// One stage job of the simulated timeline (for plotting and checks).
struct SimulatedJob {
  int64_t iteration = 0;
  int64_t index = 0;             ///< the stage's position in the iteration's dispatch order
  int64_t first_microbatch = 0;  ///< of its round (0 without rounds)
  StagePhase phase = StagePhase::kForward;
  LayerRange layers;
  int64_t device = 0;
  double start = 0;            ///< the device takes the job (its overhead starts)
  double overhead = 0;         ///< device time spent from `start` on the upload (SimulateOptions::job_overhead)
  double end = 0;              ///< its last microbatch ends
  double microbatch_cost = 0;  ///< compute time of one microbatch
  std::vector<MicrobatchSpan> microbatches;
};

/// The predicted timeline and its bubble. Times summed over devices; ratios are of
/// `num_devices x makespan`, and bubble_ratio() == fill + drain + steady + overhead ratios.
struct SimulationResult {
  int64_t num_devices = 0;
  int64_t num_microbatch = 0;
  double makespan = 0;             ///< from 0 (all jobs posted) to the last job's end
  double work = 0;                 ///< compute time: sum over jobs of microbatches x microbatch_cost
  double overhead = 0;             ///< sum of job overheads
  std::vector<double> busy;        ///< per device: compute + overhead
  double fill = 0;                 ///< idle before each device's first job (all of a device's time if it has none)
  double drain = 0;                ///< idle after each device's last microbatch
  double steady = 0;               ///< the other idle time (between and inside jobs)
  std::vector<SimulatedJob> jobs;  ///< in dispatch order (iteration by iteration)

  double capacity() const { return static_cast<double>(num_devices) * makespan; }
  /// 1 - work / (num_devices x makespan); 0 for an empty timeline.
  double bubble_ratio() const { return capacity() > 0 ? 1.0 - work / capacity() : 0.0; }
  double fill_ratio() const { return capacity() > 0 ? fill / capacity() : 0.0; }
  double drain_ratio() const { return capacity() > 0 ? drain / capacity() : 0.0; }
  double steady_ratio() const { return capacity() > 0 ? steady / capacity() : 0.0; }
  double overhead_ratio() const { return capacity() > 0 ? overhead / capacity() : 0.0; }
};

/// Back-to-back iterations of one plan.
struct SteadyStateResult {
  double period = 0;              ///< time per iteration once the pipeline repeats
  double work_per_iteration = 0;  ///< compute time of one iteration
  int64_t num_devices = 0;
  int64_t num_iterations = 0;            ///< simulated
  int64_t measured_iterations = 0;       ///< the last ones, over which `period` is averaged
  bool periodic = false;                 ///< the iterations repeat exactly: `period` is exact
  std::vector<double> iteration_end;     ///< per iteration: its last job's end
  std::vector<double> iteration_return;  ///< per iteration: when its forward_backward returns
  /// Every simulated iteration's jobs (up to 256 iterations by default: set
  /// SimulateOptions::num_iterations to bound it for a preview).
  SimulationResult timeline;

  /// 1 - work_per_iteration / (num_devices x period).
  double bubble_ratio() const {
    return period > 0 ? 1.0 - work_per_iteration / (static_cast<double>(num_devices) * period) : 0.0;
  }
  /// The time per iteration a caller measures over iterations [first, last] of a finite run
  /// (docs/schedule.md, "Steady state, end to end"): its clock starts when it posts iteration `first`
  /// (the return of iteration first - 1; 0 for the first) and stops when iteration `last` has
  /// ended (RoundPipe::synchronize), so it includes that iteration's drain once. Requires
  /// 0 <= first <= last < num_iterations (set SimulateOptions::num_iterations to last + 1).
  double mean_iteration_time(int64_t first, int64_t last) const;
  /// 1 - work_per_iteration / (num_devices x mean_iteration_time(first, last)).
  double window_bubble_ratio(int64_t first, int64_t last) const;
};

/// Simulates one isolated run of `plan` (validated for `costs.size()` layers and `type`) with
/// `num_microbatch` microbatches on `num_devices` devices. A forward stage costs the sum of its
/// layers' `forward` per microbatch; a backward stage and the fused tail the sum of `backward`
/// (recompute + backward, resp. forward + backward: equal when a recompute costs a forward).
/// Throws c10::Error on an invalid plan, counts or options. A pure function: thread-safe.
SimulationResult simulate(const ExecutePlan& plan, RunType type, const std::vector<LayerCost>& costs,
                          int64_t num_devices, int64_t num_microbatch, const SimulateOptions& options = {});

/// Simulates back-to-back iterations of `plan` (each posted when the previous call returns, the
/// device cursor continuing, each iteration's jobs starting only after the optimizer published
/// the parameters it uses: staleness one) and reports the steady-state period. Thread-safe.
SteadyStateResult simulate_steady_state(const ExecutePlan& plan, RunType type, const std::vector<LayerCost>& costs,
                                        int64_t num_devices, int64_t num_microbatch,
                                        const SimulateOptions& options = {});

}  // namespace roundpipe::scheduler
