#include "roundpipe/detail/plan_selector.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <utility>

#include "scheduler/planner.h"
#include "scheduler/simulator.h"

namespace roundpipe::detail {

PlanSelector::PlanSelector(std::vector<int64_t> param_bytes, std::vector<int64_t> grad_bytes, std::vector<std::string> kinds,
                 int64_t num_devices, int64_t memory_budget_bytes, scheduler::SimulateOptions engine)
    : param_bytes_(std::move(param_bytes)),
      grad_bytes_(std::move(grad_bytes)),
      kinds_(std::move(kinds)),
      num_devices_(num_devices),
      memory_budget_bytes_(memory_budget_bytes),
      engine_(engine) {}

scheduler::ExecutePlan PlanSelector::plan_for(const std::optional<scheduler::ExecutePlan>& plan,
                                         scheduler::RunType type) const {
  if (plan) {
    plan->validate(num_layers(), type);
    return *plan;
  }
  return auto_plan(type);
}

namespace {

// Note [Smoothing measured times]:
// One timed call gives each layer's time with some noise (scheduling, caches, a sleep's
// overshoot), and the planner follows it: two equal transformer blocks timed 3% apart can get
// plans that simulate 1-2 points of bubble worse on their true, equal costs. Layers of the same
// module type with the same parameter and gradient bytes are usually the same computation, so
// each such group (3 layers or more) shares its median time, for the layers whose time is within
// kSmoothingTolerance of it. A layer of the same shape that really costs more (a global-attention
// layer among sliding-window ones, an LM head of a kind used elsewhere) is farther from the
// median and keeps its own time.
constexpr double kSmoothingTolerance = 0.15;
constexpr double kMaterialChange = 0.10;

void smooth_within_groups(std::vector<double>& ms, const std::vector<std::string>& group_of) {
  std::map<std::string, std::vector<size_t>> groups;
  for (size_t l = 0; l < ms.size(); ++l) groups[group_of[l]].push_back(l);
  for (const auto& [key, members] : groups) {
    if (members.size() < 3) continue;
    std::vector<double> times;
    for (size_t l : members) times.push_back(ms[l]);
    std::nth_element(times.begin(), times.begin() + static_cast<std::ptrdiff_t>(times.size() / 2), times.end());
    const double median = times[times.size() / 2];
    for (size_t l : members) {
      if (std::abs(ms[l] - median) <= kSmoothingTolerance * median) ms[l] = median;
    }
  }
}

std::string describe(const scheduler::SimulationResult& sim) {
  char text[96];
  std::snprintf(text, sizeof(text), "simulated %.1f ms per iteration, bubble %.1f%%", sim.makespan,
                100.0 * sim.bubble_ratio());
  return text;
}

std::string describe(const scheduler::SteadyStateResult& sim) {
  char text[128];
  std::snprintf(text, sizeof(text), "simulated %.1f ms per back-to-back iteration, bubble %.1f%%", sim.period,
                100.0 * sim.bubble_ratio());
  return text;
}

}  // namespace

scheduler::ExecutePlan PlanSelector::auto_plan(scheduler::RunType type) const {
  const bool steady = type != scheduler::RunType::kInfer && plans_for_steady_state();
  auto& cached = type == scheduler::RunType::kInfer ? auto_infer_plan_ : steady ? auto_async_plan_ : auto_fused_plan_;
  if (!cached) {
    if (measured_) {
      cached = scheduler::plan_by_simulation(
                   layer_costs(), type,
                   scheduler::PlannerOptions()
                       .set_num_devices(num_devices_)
                       .set_num_microbatch(measured_num_microbatch_)
                       .set_memory_budget_bytes(memory_budget_bytes_)
                       .set_objective(steady ? scheduler::PlanObjective::kSteadyState
                                             : scheduler::PlanObjective::kIsolated)
                       .set_simulate(engine_)
                       .set_seeds(seeds_))
                   .plan;
    } else {
      cached = scheduler::partition(layer_costs(), type,
                                    scheduler::PartitionOptions()
                                        .set_min_stages(num_devices_)
                                        .set_memory_budget_bytes(memory_budget_bytes_));
    }
  }
  return *cached;
}

const std::vector<scheduler::LayerCost>& PlanSelector::layer_costs() const {
  if (costs_.empty()) costs_ = scheduler::size_based_costs(param_bytes_, grad_bytes_);
  return costs_;
}

std::string PlanSelector::use_measured_times(const std::vector<double>& forward_ms,
                                       const std::vector<double>& backward_stage_ms, int64_t num_microbatch) {
  const auto before = auto_plan(scheduler::RunType::kFused);  // the plan the measuring call ran
  const bool remeasured = measured_;
  TORCH_INTERNAL_ASSERT(forward_ms.size() == static_cast<size_t>(num_layers()) &&
                        backward_stage_ms.size() == before.backward_stages().size());
  const double per_mb = 1.0 / static_cast<double>(num_microbatch);
  auto measured = layer_costs();
  std::vector<double> forward(forward_ms.size()), backward(forward_ms.size());
  for (size_t l = 0; l < measured.size(); ++l) forward[l] = forward_ms[l] * per_mb;
  for (size_t s = 0; s < backward_stage_ms.size(); ++s) {
    const scheduler::LayerRange r = before.backward_stages()[s];
    double forward_sum = 0;
    for (int64_t l = r.begin; l < r.end; ++l) forward_sum += forward_ms[static_cast<size_t>(l)];
    for (int64_t l = r.begin; l < r.end; ++l) {
      const double share = forward_sum > 0 ? forward_ms[static_cast<size_t>(l)] / forward_sum
                                           : 1.0 / static_cast<double>(r.size());
      backward[static_cast<size_t>(l)] = backward_stage_ms[s] * share * per_mb;
    }
  }
  std::vector<std::string> group_of(measured.size());
  for (size_t l = 0; l < measured.size(); ++l) {
    group_of[l] = kinds_[l] + "/" + std::to_string(param_bytes_[l]) + "/" + std::to_string(grad_bytes_[l]);
  }
  smooth_within_groups(forward, group_of);
  smooth_within_groups(backward, group_of);
  for (size_t l = 0; l < measured.size(); ++l) {
    measured[l].forward = forward[l];
    measured[l].backward = backward[l];
  }
  if (measured_) {
    // Note [Re-measuring]: the plan is recomputed only when the costs changed materially: some
    // layer's forward or backward time moved by more than kMaterialChange of its old value and
    // of the mean layer time (so the jitter of a tiny layer does not count), per microbatch.
    remeasure_ = false;
    const auto& old = costs_;
    double mean = 0;
    for (const auto& c : old) mean += (c.forward + c.backward) / (2.0 * static_cast<double>(old.size()));
    bool material = num_microbatch != measured_num_microbatch_;
    for (size_t l = 0; l < old.size() && !material; ++l) {
      auto moved = [&](double was, double now) {
        return std::abs(now - was) > kMaterialChange * std::max(was, mean);
      };
      material = moved(old[l].forward, measured[l].forward) || moved(old[l].backward, measured[l].backward);
    }
    if (!material) {
      return "unchanged (no layer time moved by more than " + std::to_string(static_cast<int>(100 * kMaterialChange)) +
             "%): " + describe_auto_plan();
    }
  }
  remeasure_ = false;
  seeds_ = {before};  // the search starts from it too: never rated worse than the plan it replaces
  costs_ = std::move(measured);
  auto_fused_plan_.reset();
  auto_async_plan_.reset();
  auto_infer_plan_.reset();
  measured_ = true;
  measured_num_microbatch_ = num_microbatch;
  return describe_auto_plan() + (remeasured ? "; the previous plan " : "; the size-based plan ") +
         before.to_string() + ": " + describe_plan(before, plans_for_steady_state());
}

bool PlanSelector::set_async_steps(bool async) {
  const bool before = plans_for_steady_state();
  async_steps_ = async;
  return before != plans_for_steady_state();
}

std::string PlanSelector::describe_plan(const scheduler::ExecutePlan& plan, bool steady) const {
  const auto& model = engine_;
  const auto M = measured_num_microbatch_;
  if (steady) {
    return describe(scheduler::simulate_steady_state(plan, scheduler::RunType::kFused, layer_costs(), num_devices_, M,
                                                     model));
  }
  return describe(scheduler::simulate(plan, scheduler::RunType::kFused, layer_costs(), num_devices_, M, model));
}

std::string PlanSelector::describe_auto_plan() const {
  const auto plan = auto_plan(scheduler::RunType::kFused);
  if (!measured_) return plan.to_string() + " (from parameter sizes; not yet measured)";
  const bool steady = plans_for_steady_state();
  return plan.to_string() + " for " + (steady ? "asynchronous" : "synchronous") + " steps (" +
         describe_plan(plan, steady) + " at " + std::to_string(measured_num_microbatch_) + " microbatches)";
}

}  // namespace roundpipe::detail
