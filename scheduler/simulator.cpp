#include "scheduler/simulator.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>

#include "scheduler/detail/pipeline_model.h"

namespace roundpipe::scheduler {

// Note [Pipeline simulator]:
// The model follows the runtime (roundpipe/detail/run_launcher.cpp, stage_jobs.cpp):
// - Jobs. One job per stage, in dispatch_order(): forward stages ascending, then the fused tail
//   (kFused) and the backward stages deepest first. Job k of an iteration goes to device
//   (cursor + k) mod D; the cursor starts at `first_device` and continues across iterations.
// - Devices. Each device runs its jobs one at a time in posting order (a FIFO worker). A job
//   takes its device at max(device free, gate), where the gate is 0 for an isolated run (all
//   jobs are posted at once); it spends `job_overhead` (layer copies, not waiting for inputs),
//   then runs microbatches 0..M-1 in order, each once its input is there.
// - Costs per microbatch: a forward stage, the sum of its layers' LayerCost::forward; the fused
//   tail and a backward stage, the sum of LayerCost::backward. `backward` is "recompute +
//   backward", and the fused tail runs forward + backward without recompute: the same time when
//   a recompute costs what the forward costs, which is how layer times are measured (the
//   original's timer also books the fused pass as "fwd" and "re"). With `fused_recompute` (the
//   layer grain) the fused tail also recomputes its layers but the last: + their forward sum.
// - Dependencies, per microbatch j, each plus `hop_latency`: forward stage s after forward
//   stage s-1; the fused tail (or a train plan's first backward stage) after the last forward
//   stage; backward stage i after backward stage i-1 (the fused tail is backward stage 0). The
//   saved stage input a backward stage recomputes from exists by then (its forward stage ran
//   microbatch j before the stages after it). With `recompute_ahead` a backward stage's
//   microbatch recomputes (its forward sum) as soon as the device is free and the forward has
//   passed its layers for microbatch j (taken as the end of microbatch j of the forward stage
//   holding its last layer: the runtime awaits the input of the layer after them, which may come
//   earlier, inside that stage), and waits for the gradient before the rest.
// - kTrain is modelled as one call: the output gradient of microbatch j is there as soon as the
//   output is (the runtime only runs kInfer and kFused plans).
// - Bubble: work is compute only; per device, idle = makespan - busy (compute + overhead), fill
//   the idle before it first gets busy, drain the idle after its last microbatch, steady the
//   rest (waits between and inside jobs). A job that took its device but waits for microbatch 0
//   and has no overhead does not end the device's fill. bubble = 1 - work / (D x makespan), and
//   bubble x D x makespan = fill + drain + steady + overhead.
// - Back-to-back iterations (simulate_steady_state). Iteration i+1's jobs are posted after
//   iteration i's (so they queue behind them on every device) when forward_backward i returns:
//   once the fused tail ended (`overlap_backward_tail`, issue 15 item 3), else when iteration i
//   ended. The async step i is queued then, runs after step i-1 on the optimizer thread, first
//   publishes the parameters after step i-1 (RoundPipe's staleness one: iteration i+1 waits for
//   that publish before copying any layer), then waits for iteration i's gradients and takes
//   `step_time`. So iteration i+1's gate is max(return of i, end of step i-1), and step i-1
//   ends after iteration i-1 ended: with step_time 0 only the device slots and the data
//   dependencies constrain. With `publish_waits_for_readers` (the runtime: one compute copy per
//   layer) the publish of layer l also waits for iteration i's last reader of l (the backward
//   or fused job holding it) to have its copy, at its start + job_overhead; the publish goes in
//   layer order, so job k of iteration i+1 starts no earlier than the latest of these releases
//   over layers 0 .. its last layer. kInfer runs have no step: the gate is the previous return.
//   The model is max-plus linear (only max and +), so the iterations become periodic: after each
//   iteration the state is the cursor and the device-free, step-end and per-job publish times
//   relative to the next gate (clamped at 0: earlier times no longer matter); when it equals the state after an
//   earlier iteration (to 1e-9 relative), the period is the gate's advance per iteration between
//   the two, exactly (a plan of 15 jobs on 8 devices repeats every 3 iterations: averaging a
//   fixed window instead was off by up to 4 points of bubble). Without a repeat within 256
//   iterations, the average over the second half. The steady-state bubble is
//   1 - work per iteration / (D x period).
// - Rounds (`round_size` n > 0, not the runtime today): each iteration posts, for microbatches
//   [0, n), [n, 2n), ..., one job per stage in dispatch order; the dependencies stay per
//   microbatch, so round r's stage s waits for round r's stage s-1.

namespace {

void check_inputs(const ExecutePlan& plan, RunType type, const std::vector<LayerCost>& costs, int64_t num_devices,
                  int64_t num_microbatch, const SimulateOptions& options) {
  TORCH_CHECK(!costs.empty(), "simulate: the model has no layers (costs is empty)");
  plan.validate(static_cast<int64_t>(costs.size()), type);
  TORCH_CHECK(num_devices >= 1, "simulate: num_devices must be >= 1, got ", num_devices);
  TORCH_CHECK(num_microbatch >= 1, "simulate: num_microbatch must be >= 1, got ", num_microbatch);
  TORCH_CHECK(options.first_device >= 0 && options.first_device < num_devices, "simulate: first_device ",
              options.first_device, " is not in [0, ", num_devices, ")");
  TORCH_CHECK(std::isfinite(options.job_overhead) && options.job_overhead >= 0,
              "simulate: job_overhead must be finite and >= 0, got ", options.job_overhead);
  TORCH_CHECK(std::isfinite(options.hop_latency) && options.hop_latency >= 0,
              "simulate: hop_latency must be finite and >= 0, got ", options.hop_latency);
  TORCH_CHECK(std::isfinite(options.step_time) && options.step_time >= 0,
              "simulate: step_time must be finite and >= 0, got ", options.step_time);
  TORCH_CHECK(options.num_iterations >= 0, "simulate: num_iterations must be >= 0 (0: automatic), got ",
              options.num_iterations);
  TORCH_CHECK(options.round_size >= 0, "simulate: round_size must be >= 0 (0: one job per stage), got ",
              options.round_size);
  for (size_t i = 0; i < costs.size(); ++i) {
    const LayerCost& c = costs[i];
    TORCH_CHECK(std::isfinite(c.forward) && std::isfinite(c.backward) && c.forward >= 0 && c.backward >= 0,
                "simulate: layer ", i, " has an invalid time (forward ", c.forward, ", backward ", c.backward,
                "): times must be finite and >= 0");
  }
}

// Fills the totals, per-device busy time and bubble split of `result` from its jobs.
void account(SimulationResult& result, double job_overhead) {
  const int64_t D = result.num_devices;
  result.busy.assign(D, 0.0);
  std::vector<double> first(D, -1.0), last(D, 0.0);
  result.makespan = result.work = result.overhead = 0;
  for (const auto& job : result.jobs) {
    const double compute = job.microbatch_cost * static_cast<double>(job.microbatches.size());
    result.work += compute;
    result.overhead += job_overhead;
    result.busy[job.device] += compute + job_overhead;
    result.makespan = std::max(result.makespan, job.end);
    // A device is busy from its first job's overhead, or else its first microbatch (a job may
    // hold the device while it waits for microbatch 0: that is fill, not work).
    const double busy_from = job_overhead > 0 || job.microbatches.empty() ? job.start : job.microbatches.front().start;
    if (first[job.device] < 0) first[job.device] = busy_from;  // jobs are in posting order
    last[job.device] = std::max(last[job.device], job.end);
  }
  result.fill = result.drain = result.steady = 0;
  for (int64_t d = 0; d < D; ++d) {
    if (first[d] < 0) {
      result.fill += result.makespan;  // a device without jobs idles throughout
      continue;
    }
    const double idle = result.makespan - result.busy[d];
    const double fill = first[d], drain = result.makespan - last[d];
    result.fill += fill;
    result.drain += drain;
    result.steady += std::max(0.0, idle - fill - drain);  // clamp rounding noise
  }
}

}  // namespace

SimulationResult simulate(const ExecutePlan& plan, RunType type, const std::vector<LayerCost>& costs,
                          int64_t num_devices, int64_t num_microbatch, const SimulateOptions& options) {
  check_inputs(plan, type, costs, num_devices, num_microbatch, options);
  const detail::CostPrefix prefix(costs, options.fused_recompute);
  const auto jobs = detail::compile(plan, type, prefix);
  detail::PipelineModel model(type, num_devices, num_microbatch, options);
  SimulationResult result;
  result.num_devices = num_devices;
  result.num_microbatch = num_microbatch;
  model.run(jobs, 1, &result.jobs);
  account(result, options.job_overhead);
  return result;
}

SteadyStateResult simulate_steady_state(const ExecutePlan& plan, RunType type, const std::vector<LayerCost>& costs,
                                        int64_t num_devices, int64_t num_microbatch, const SimulateOptions& options) {
  check_inputs(plan, type, costs, num_devices, num_microbatch, options);
  const detail::CostPrefix prefix(costs, options.fused_recompute);
  const auto jobs = detail::compile(plan, type, prefix);
  detail::PipelineModel model(type, num_devices, num_microbatch, options);
  SteadyStateResult result;
  result.num_devices = num_devices;
  result.timeline.num_devices = num_devices;
  result.timeline.num_microbatch = num_microbatch;
  const auto& out = model.steady(jobs, &result.timeline.jobs);
  result.num_iterations = static_cast<int64_t>(out.iteration_end.size());
  result.measured_iterations = out.measured;
  result.periodic = out.periodic;
  result.period = out.period;
  result.iteration_end = out.iteration_end;
  result.iteration_return = out.iteration_return;
  account(result.timeline, options.job_overhead);
  result.work_per_iteration = result.timeline.work / static_cast<double>(result.num_iterations);
  return result;
}

// Note [Measured windows]:
// A caller that starts its clock when it posts iteration `first` (the return of iteration
// first - 1) and stops it when synchronize() finds iteration `last` ended measures the N = last -
// first + 1 return-to-return intervals up to the return of `last` (N periods once the iterations
// repeat) plus the drain of `last` (its return to its end): about period + drain / N each. The
// steady-state plans have few long stages, so their drain (the backward after the last loss) is
// 0.36-0.79 of a period on the paper workloads (docs/benchmarks.md, "Steady state, end
// to end"): with N = 10 that adds 3-8 points of bubble that no steady state removes. The
// `period` above excludes it; this window is what such a measurement should be compared with.
double SteadyStateResult::mean_iteration_time(int64_t first, int64_t last) const {
  TORCH_CHECK(first >= 0 && first <= last && last < static_cast<int64_t>(iteration_end.size()),
              "mean_iteration_time: need 0 <= first <= last < ", iteration_end.size(),
              " simulated iterations, got first ", first, ", last ", last,
              " (set SimulateOptions::num_iterations to at least last + 1)");
  const double start = first == 0 ? 0.0 : iteration_return[static_cast<size_t>(first - 1)];
  return (iteration_end[static_cast<size_t>(last)] - start) / static_cast<double>(last - first + 1);
}

double SteadyStateResult::window_bubble_ratio(int64_t first, int64_t last) const {
  const double t = mean_iteration_time(first, last);
  return t > 0 ? 1.0 - work_per_iteration / (static_cast<double>(num_devices) * t) : 0.0;
}

}  // namespace roundpipe::scheduler
