#include "roundpipe/detail/planner.h"

#include <c10/util/Exception.h>

#include <cstdio>
#include <utility>

#include "scheduler/planner.h"
#include "scheduler/simulator.h"

namespace roundpipe::detail {

Planner::Planner(std::vector<int64_t> param_bytes, std::vector<int64_t> grad_bytes, int64_t num_devices,
                 int64_t memory_budget_bytes)
    : param_bytes_(std::move(param_bytes)),
      grad_bytes_(std::move(grad_bytes)),
      num_devices_(num_devices),
      memory_budget_bytes_(memory_budget_bytes) {}

scheduler::ExecutePlan Planner::plan_for(const std::optional<scheduler::ExecutePlan>& plan,
                                         scheduler::RunType type) const {
  if (plan) {
    plan->validate(num_layers(), type);
    return *plan;
  }
  return auto_plan(type);
}

namespace {

// The runtime as the simulator models it today: forward_backward returns after the whole
// iteration (issue 15 item 3 is not built), no recompute ahead, one job per stage. Per-job and
// per-hop overheads are left at zero, which they are not: `pipeline_bench paper` measures 6-26
// points more bubble than this model predicts (docs/benchmarks.md); calibrating them is open.
scheduler::SimulateOptions runtime_model() {
  return scheduler::SimulateOptions().set_overlap_backward_tail(false);
}

std::string describe(const scheduler::SimulationResult& sim) {
  char text[96];
  std::snprintf(text, sizeof(text), "simulated %.1f ms per iteration, bubble %.1f%%", sim.makespan,
                100.0 * sim.bubble_ratio());
  return text;
}

}  // namespace

scheduler::ExecutePlan Planner::auto_plan(scheduler::RunType type) const {
  auto& cached = type == scheduler::RunType::kInfer ? auto_infer_plan_ : auto_fused_plan_;
  if (!cached) {
    if (measured_) {
      cached = scheduler::plan_by_simulation(layer_costs(), type,
                                             scheduler::PlannerOptions()
                                                 .set_num_devices(num_devices_)
                                                 .set_num_microbatch(measured_num_microbatch_)
                                                 .set_memory_budget_bytes(memory_budget_bytes_)
                                                 .set_objective(scheduler::PlanObjective::kIsolated)
                                                 .set_simulate(runtime_model())
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

const std::vector<scheduler::LayerCost>& Planner::layer_costs() const {
  if (costs_.empty()) costs_ = scheduler::size_based_costs(param_bytes_, grad_bytes_);
  return costs_;
}

std::string Planner::use_measured_times(const std::vector<double>& forward_ms,
                                       const std::vector<double>& backward_stage_ms, int64_t num_microbatch) {
  const auto before = auto_plan(scheduler::RunType::kFused);  // the plan the measuring call ran
  TORCH_INTERNAL_ASSERT(forward_ms.size() == static_cast<size_t>(num_layers()) &&
                        backward_stage_ms.size() == before.backward_stages().size());
  const double per_mb = 1.0 / static_cast<double>(num_microbatch);
  auto measured = layer_costs();
  for (size_t l = 0; l < measured.size(); ++l) measured[l].forward = forward_ms[l] * per_mb;
  for (size_t s = 0; s < backward_stage_ms.size(); ++s) {
    const scheduler::LayerRange r = before.backward_stages()[s];
    double forward_sum = 0;
    for (int64_t l = r.begin; l < r.end; ++l) forward_sum += forward_ms[static_cast<size_t>(l)];
    for (int64_t l = r.begin; l < r.end; ++l) {
      const double share = forward_sum > 0 ? forward_ms[static_cast<size_t>(l)] / forward_sum
                                           : 1.0 / static_cast<double>(r.size());
      measured[static_cast<size_t>(l)].backward = backward_stage_ms[s] * share * per_mb;
    }
  }
  seeds_ = {before};  // the search starts from it too: never rated worse than the size-based plan
  costs_ = std::move(measured);
  auto_fused_plan_.reset();
  auto_infer_plan_.reset();
  measured_ = true;
  measured_num_microbatch_ = num_microbatch;
  const auto after = auto_plan(scheduler::RunType::kFused);
  auto simulate = [&](const scheduler::ExecutePlan& plan) {
    return describe(scheduler::simulate(plan, scheduler::RunType::kFused, costs_, num_devices_, num_microbatch,
                                        runtime_model()));
  };
  return after.to_string() + " (" + simulate(after) + " at " + std::to_string(num_microbatch) +
         " microbatches; the size-based plan " + before.to_string() + ": " + simulate(before) + ")";
}

}  // namespace roundpipe::detail
