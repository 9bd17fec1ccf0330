#include "roundpipe/detail/planner.h"

#include <utility>

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

scheduler::ExecutePlan Planner::auto_plan(scheduler::RunType type) const {
  auto& cached = type == scheduler::RunType::kInfer ? auto_infer_plan_ : auto_fused_plan_;
  if (!cached) {
    cached = scheduler::partition(layer_costs(), type,
                                  scheduler::PartitionOptions()
                                      .set_min_stages(num_devices_)
                                      .set_memory_budget_bytes(memory_budget_bytes_));
  }
  return *cached;
}

const std::vector<scheduler::LayerCost>& Planner::layer_costs() const {
  if (costs_.empty()) costs_ = scheduler::size_based_costs(param_bytes_, grad_bytes_);
  return costs_;
}

std::string Planner::use_measured_times(const std::vector<double>& forward_ms, int64_t num_microbatch) {
  auto measured = layer_costs();
  for (size_t l = 0; l < measured.size(); ++l) {
    measured[l].forward = forward_ms[l] / static_cast<double>(num_microbatch);
    measured[l].backward = 3.0 * measured[l].forward;
  }
  const auto before = auto_plan(scheduler::RunType::kFused);
  costs_ = std::move(measured);
  auto_fused_plan_.reset();
  auto_infer_plan_.reset();
  measured_ = true;
  return auto_plan(scheduler::RunType::kFused).to_string() + " (size-based: " + before.to_string() + ")";
}

}  // namespace roundpipe::detail
