#include "scheduler/detail/pipeline_model.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>

namespace roundpipe::scheduler::detail {

CostPrefix::CostPrefix(const std::vector<LayerCost>& costs, bool fused_recompute)
    : fwd(costs.size() + 1, 0.0), bwd(costs.size() + 1, 0.0), fused_recompute(fused_recompute) {
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
  if (phase == StagePhase::kFused && prefix.fused_recompute && layers.size() > 1) {
    job.cost += prefix.forward({layers.begin, layers.end - 1});
  }
  if (phase == StagePhase::kBackward) {
    job.recompute = std::min(prefix.forward(layers), job.cost);
    // The recompute needs the forward of all its layers done for the microbatch (the runtime
    // awaits the input of the layer after them: Note [Recompute ahead] in stage_jobs.cpp).
    // Forward stages tile [0, tail) in ascending order: the one holding layers.end - 1.
    const int64_t last = layers.end - 1;
    int64_t lo = 0, hi = forward_jobs;
    while (lo < hi) {
      const int64_t mid = (lo + hi) / 2;
      if (jobs[mid].layers.end <= last)
        lo = mid + 1;
      else
        hi = mid;
    }
    if (lo < forward_jobs && jobs[lo].layers.contains(last)) job.saved_job = lo;
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

namespace {

// Microbatches [first, last) of `job` from device time `t` (updated): each after its input
// (`input`, or the gate), with `saved` the recompute runs ahead (Note [Pipeline simulator]).
void run_microbatches(const JobSpec& job, int64_t first, int64_t last, const double* input, const double* saved,
                      double hop, double gate, double* ends, double& t, SimulatedJob* rec) {
  for (int64_t j = first; j < last; ++j) {
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
}

}  // namespace

PipelineModel::PipelineModel(RunType type, int64_t num_devices, int64_t num_microbatch, SimulateOptions options)
    : type_(type), num_devices_(num_devices), num_microbatch_(num_microbatch), options_(options) {
  const int64_t round = options_.round_size > 0 ? std::min(options_.round_size, num_microbatch_) : num_microbatch_;
  for (int64_t first = 0; first < num_microbatch_; first += round) {
    rounds_.emplace_back(first, std::min(num_microbatch_, first + round));
  }
}

void PipelineModel::reset(const std::vector<JobSpec>& jobs) {
  device_free_.assign(num_devices_, 0.0);
  mb_end_.resize(jobs.size() * static_cast<size_t>(num_microbatch_));
  out_.iteration_end.clear();
  out_.iteration_return.clear();
  out_.sum_job_end = 0;
  out_.periodic = false;
  gate_ = 0;
  job_gate_.clear();
  step_end_ = 0;
  device_ = options_.first_device;
  num_layers_ = 0;
  for (const auto& job : jobs) num_layers_ = std::max(num_layers_, job.layers.end);
}

void PipelineModel::iterate(const std::vector<JobSpec>& jobs, std::vector<SimulatedJob>* record) {
  const auto J = static_cast<int64_t>(jobs.size());
  const int64_t M = num_microbatch_, D = num_devices_;
  const double hop = options_.hop_latency;
  const auto it = static_cast<int64_t>(out_.iteration_end.size());
  double end = 0, fused_end = 0;
  release_.assign(static_cast<size_t>(J), 0.0);
  for (const auto& [first, last] : rounds_) {
    for (int64_t k = 0; k < J; ++k) {
      const JobSpec& job = jobs[k];
      const int64_t d = device_;
      device_ = (device_ + 1) % D;
      const double start = std::max({device_free_[d], gate_, job_gate_.empty() ? 0.0 : job_gate_[k]});
      double t = start + options_.job_overhead;
      double* ends = &mb_end_[static_cast<size_t>(k * M)];
      const double* input = job.input_job >= 0 ? &mb_end_[static_cast<size_t>(job.input_job * M)] : nullptr;
      const double* saved = options_.recompute_ahead && job.saved_job >= 0 && job.recompute > 0
                                ? &mb_end_[static_cast<size_t>(job.saved_job * M)]
                                : nullptr;
      SimulatedJob* rec = nullptr;
      if (record) {
        record->push_back(
            SimulatedJob{it, k, first, job.phase, job.layers, d, start, options_.job_overhead, 0.0, job.cost, {}});
        rec = &record->back();
        rec->microbatches.reserve(static_cast<size_t>(last - first));
      }
      if (!rec && !saved && input) {
        // The planner's hot loop: no recording, no recompute ahead.
        const double cost = job.cost;
        for (int64_t j = first; j < last; ++j) {
          t = std::max(t, input[j] + hop) + cost;
          ends[j] = t;
        }
      } else {
        run_microbatches(job, first, last, input, saved, hop, gate_, ends, t, rec);
      }
      if (rec) rec->end = t;
      device_free_[d] = t;
      end = std::max(end, t);
      if (job.phase == StagePhase::kFused) fused_end = std::max(fused_end, t);
      // The last reader of its layers has its copy once the upload is done.
      if (job.phase != StagePhase::kForward) release_[k] = std::max(release_[k], start + options_.job_overhead);
      if (it == 0) out_.sum_job_end += t;
    }
  }
  out_.iteration_end.push_back(end);
  const double returned = type_ == RunType::kFused && options_.overlap_backward_tail ? fused_end : end;
  out_.iteration_return.push_back(returned);
  if (type_ == RunType::kInfer) {
    gate_ = returned;  // no optimizer: the next call posts its jobs when this one returns
  } else {
    // Step `it` is queued when the call returns and runs after step it-1 on the optimizer
    // thread; it first publishes the parameters the next iteration uses (staleness one), in
    // layer order, each layer once this iteration's last reader has copied it (layer 0's is
    // copied last), then waits for this iteration's gradients and runs for step_time.
    const double step_start = std::max(step_end_, returned);
    gate_ = step_start;
    double published = step_start;
    job_gate_.clear();
    if (options_.publish_waits_for_readers) {
      // Layer l is published at the latest release among layers 0..l (a prefix maximum over the
      // layers); job k of the next iteration waits for its last layer's publish.
      publish_at_.assign(static_cast<size_t>(num_layers_), step_start);
      for (int64_t k = 0; k < J; ++k) {
        if (jobs[k].phase == StagePhase::kForward) continue;
        for (int64_t l = jobs[k].layers.begin; l < jobs[k].layers.end; ++l) {
          publish_at_[l] = std::max(publish_at_[l], release_[k]);
        }
      }
      for (size_t l = 1; l < publish_at_.size(); ++l) publish_at_[l] = std::max(publish_at_[l], publish_at_[l - 1]);
      published = publish_at_.back();
      job_gate_.resize(static_cast<size_t>(J));
      for (int64_t k = 0; k < J; ++k) job_gate_[k] = publish_at_[static_cast<size_t>(jobs[k].layers.end - 1)];
    }
    step_end_ = std::max(published, end) + options_.step_time;
  }
}

const PipelineModel::Output& PipelineModel::run(const std::vector<JobSpec>& jobs, int64_t iterations,
                                                std::vector<SimulatedJob>* record) {
  reset(jobs);
  for (int64_t it = 0; it < iterations; ++it) iterate(jobs, record);
  return out_;
}

double PipelineModel::makespan(const std::vector<JobSpec>& jobs) { return run(jobs, 1).iteration_end[0]; }

const PipelineModel::Output& PipelineModel::steady(const std::vector<JobSpec>& jobs,
                                                   std::vector<SimulatedJob>* record) {
  reset(jobs);
  if (options_.num_iterations > 0) {
    for (int64_t it = 0; it < options_.num_iterations; ++it) iterate(jobs, record);
    const int64_t n = options_.num_iterations, measured = std::max<int64_t>(1, n / 2);
    const double before = n == measured ? 0.0 : out_.iteration_end[n - 1 - measured];
    out_.period = (out_.iteration_end[n - 1] - before) / static_cast<double>(measured);
    out_.measured = measured;
    return out_;
  }
  // The model is max-plus linear, so iterations become periodic: find two iterations after
  // which the state (cursor, and device and optimizer times relative to the next gate; times
  // before the gate no longer matter) is the same; the period is the gate's advance per
  // iteration between them (Note [Pipeline simulator]).
  const auto width = static_cast<size_t>(num_devices_ + 2) + jobs.size();
  states_.clear();
  gates_.clear();
  for (int64_t it = 0; it < kMaxSteadyIterations; ++it) {
    iterate(jobs, record);
    const double scale = 1e-9 * std::max(1.0, out_.iteration_end.back() / static_cast<double>(it + 1));
    const size_t at = states_.size();
    states_.push_back(static_cast<double>(device_));
    for (double t : device_free_) states_.push_back(std::max(0.0, t - gate_));
    states_.push_back(std::max(0.0, step_end_ - gate_));
    for (size_t k = 0; k < width - static_cast<size_t>(num_devices_ + 2); ++k) {
      states_.push_back(k < job_gate_.size() ? std::max(0.0, job_gate_[k] - gate_) : 0.0);
    }
    gates_.push_back(gate_);
    for (int64_t back = it - 1; back >= 0; --back) {
      const size_t other = static_cast<size_t>(back) * width;
      bool same = states_[other] == states_[at];
      for (size_t i = 1; same && i < width; ++i) same = std::abs(states_[other + i] - states_[at + i]) <= scale;
      if (same) {
        out_.periodic = true;
        out_.measured = it - back;
        out_.period = (gate_ - gates_[back]) / static_cast<double>(it - back);
        return out_;
      }
    }
  }
  // No repetition within the limit: average over the second half.
  const int64_t n = kMaxSteadyIterations, measured = n / 2;
  out_.period = (out_.iteration_end[n - 1] - out_.iteration_end[n - 1 - measured]) / static_cast<double>(measured);
  out_.measured = measured;
  return out_;
}

double PipelineModel::period(const std::vector<JobSpec>& jobs) { return steady(jobs).period; }

}  // namespace roundpipe::scheduler::detail
