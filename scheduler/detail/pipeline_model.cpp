#include "scheduler/detail/pipeline_model.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <numeric>

namespace roundpipe::scheduler::detail {

CostPrefix::CostPrefix(const std::vector<LayerCost>& costs) : fwd(costs.size() + 1, 0.0), bwd(costs.size() + 1, 0.0) {
  for (size_t i = 0; i < costs.size(); ++i) {
    fwd[i + 1] = fwd[i] + costs[i].forward;
    bwd[i + 1] = bwd[i] + costs[i].backward;
  }
}

void append_job(std::vector<JobSpec>& jobs, StagePhase phase, LayerRange layers, const CostPrefix& prefix,
                int64_t forward_jobs) {
  JobSpec job;
  job.phase = phase;
  job.layers = layers;
  // Every stage consumes the output of the stage posted just before it: forward s of forward
  // s-1, the fused tail (or a train plan's first backward stage) of the last forward stage,
  // backward i of backward i-1.
  job.input_job = static_cast<int64_t>(jobs.size()) - 1;
  if (phase == StagePhase::kForward) {
    job.cost = prefix.forward(layers);
  } else {
    job.cost = prefix.backward(layers);
  }
  if (phase == StagePhase::kBackward) {
    job.recompute = std::min(prefix.forward(layers), job.cost);
    // Forward stages tile [0, tail) in ascending order: the one holding layers.begin.
    int64_t lo = 0, hi = forward_jobs;
    while (lo < hi) {
      const int64_t mid = (lo + hi) / 2;
      if (jobs[mid].layers.end <= layers.begin) lo = mid + 1; else hi = mid;
    }
    if (lo < forward_jobs && jobs[lo].layers.contains(layers.begin)) job.saved_job = lo;
  }
  jobs.push_back(job);
}

std::vector<JobSpec> compile(const ExecutePlan& plan, RunType type, const CostPrefix& prefix) {
  std::vector<JobSpec> jobs;
  jobs.reserve(plan.forward_stages().size() + plan.backward_stages().size());
  for (const auto& r : plan.forward_stages()) append_job(jobs, StagePhase::kForward, r, prefix, 0);
  const auto forward_jobs = static_cast<int64_t>(jobs.size());
  for (size_t i = 0; i < plan.backward_stages().size(); ++i) {
    const bool fused = type == RunType::kFused && i == 0;
    append_job(jobs, fused ? StagePhase::kFused : StagePhase::kBackward, plan.backward_stages()[i], prefix,
               forward_jobs);
  }
  return jobs;
}

int64_t steady_state_iterations(int64_t num_jobs, int64_t num_devices, int64_t requested, int64_t* measured) {
  if (requested > 0) {
    *measured = std::max<int64_t>(1, requested / 2);
    return requested;
  }
  // The device of a job repeats every `cycle` iterations (the cursor advances num_jobs per
  // iteration): average over whole cycles, at least 4 iterations, after as many warm-up ones.
  const int64_t cycle = num_devices / std::gcd(num_jobs, num_devices);
  const int64_t window = cycle * ((4 + cycle - 1) / cycle);
  *measured = window;
  return 2 * window;
}

PipelineModel::PipelineModel(RunType type, int64_t num_devices, int64_t num_microbatch, SimulateOptions options)
    : type_(type), num_devices_(num_devices), num_microbatch_(num_microbatch), options_(options) {}

const PipelineModel::Output& PipelineModel::run(const std::vector<JobSpec>& jobs, int64_t iterations,
                                                std::vector<SimulatedJob>* record) {
  const auto J = static_cast<int64_t>(jobs.size());
  const int64_t M = num_microbatch_, D = num_devices_;
  device_free_.assign(D, 0.0);
  mb_end_.resize(static_cast<size_t>(J * M));
  out_.iteration_end.assign(iterations, 0.0);
  out_.iteration_return.assign(iterations, 0.0);
  out_.sum_job_end = 0;
  const double hop = options_.hop_latency;
  double gate = 0;           // the current iteration's jobs are posted and may copy their layers
  double step_end = 0;       // the previous iteration's optimizer step
  int64_t device = options_.first_device;
  for (int64_t it = 0; it < iterations; ++it) {
    double end = 0, fused_end = 0;
    for (int64_t k = 0; k < J; ++k) {
      const JobSpec& job = jobs[k];
      const int64_t d = device;
      device = (device + 1) % D;
      const double start = std::max(device_free_[d], gate);
      double t = start + options_.job_overhead;
      double* ends = &mb_end_[static_cast<size_t>(k * M)];
      const double* input = job.input_job >= 0 ? &mb_end_[static_cast<size_t>(job.input_job * M)] : nullptr;
      const double* saved = options_.recompute_ahead && job.saved_job >= 0 && job.recompute > 0
                                ? &mb_end_[static_cast<size_t>(job.saved_job * M)]
                                : nullptr;
      SimulatedJob* rec = nullptr;
      if (record) {
        record->push_back(SimulatedJob{it, k, job.phase, job.layers, d, start, 0.0, job.cost, {}});
        rec = &record->back();
        rec->microbatches.reserve(static_cast<size_t>(M));
      }
      for (int64_t j = 0; j < M; ++j) {
        const double ready = input ? input[j] + hop : gate;
        double s, w = 0;
        if (saved) {
          s = std::max(t, saved[j] + hop);
          const double recomputed = s + job.recompute;
          const double b = std::max(recomputed, ready);
          w = b - recomputed;
          t = b + (job.cost - job.recompute);
        } else {
          s = std::max(t, ready);
          t = s + job.cost;
        }
        ends[j] = t;
        if (rec) rec->microbatches.push_back(MicrobatchSpan{s, t, w});
      }
      if (rec) rec->end = t;
      device_free_[d] = t;
      end = std::max(end, t);
      if (job.phase == StagePhase::kFused) fused_end = t;
      if (it == 0) out_.sum_job_end += t;
    }
    out_.iteration_end[it] = end;
    const double returned = type_ == RunType::kFused && options_.overlap_backward_tail ? fused_end : end;
    out_.iteration_return[it] = returned;
    if (type_ == RunType::kInfer) {
      gate = returned;  // no optimizer: the next call posts its jobs when this one returns
    } else {
      // Step `it` is queued when the call returns and runs after step it-1 on the optimizer
      // thread; it first publishes the parameters the next iteration uses (staleness one), then
      // waits for this iteration's gradients and runs for step_time.
      const double step_start = std::max(step_end, returned);
      step_end = std::max(step_start, end) + options_.step_time;
      gate = step_start;
    }
  }
  return out_;
}

double PipelineModel::makespan(const std::vector<JobSpec>& jobs) { return run(jobs, 1).iteration_end[0]; }

double period_of(const std::vector<double>& iteration_end, int64_t measured) {
  const auto n = static_cast<int64_t>(iteration_end.size());
  const double before = n == measured ? 0.0 : iteration_end[n - 1 - measured];
  return (iteration_end[n - 1] - before) / static_cast<double>(measured);
}

double PipelineModel::period(const std::vector<JobSpec>& jobs) {
  int64_t measured = 0;
  const int64_t n =
      steady_state_iterations(static_cast<int64_t>(jobs.size()), num_devices_, options_.num_iterations, &measured);
  return period_of(run(jobs, n).iteration_end, measured);
}

}  // namespace roundpipe::scheduler::detail
