#include "scheduler/detail/layer_costs.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>

namespace roundpipe::scheduler::detail {

void check_layer_costs(const std::vector<LayerCost>& costs, RunType type, int64_t memory_budget_bytes,
                       const std::string& cost_prefix, const std::string& budget_prefix) {
  for (size_t i = 0; i < costs.size(); ++i) {
    const LayerCost& c = costs[i];
    TORCH_CHECK(std::isfinite(c.forward) && std::isfinite(c.backward) && c.forward >= 0 && c.backward >= 0 &&
                    c.bytes >= 0 && c.backward_bytes >= 0,
                cost_prefix, "layer ", i, " has an invalid cost estimate (forward ", c.forward, ", backward ",
                c.backward, ", bytes ", c.bytes, ", backward_bytes ", c.backward_bytes,
                "): times must be finite and >= 0, sizes >= 0");
    const int64_t need = type == RunType::kInfer ? c.bytes : std::max(c.bytes, c.backward_bytes);
    TORCH_CHECK(need <= memory_budget_bytes, budget_prefix, "layer ", i, " needs ", need, " bytes on a device",
                type == RunType::kInfer ? "" : " (with its gradients)", " but the per-stage memory budget is ",
                memory_budget_bytes,
                " bytes: split the layer into smaller layers, or raise the budget (more device memory)");
  }
}

}  // namespace roundpipe::scheduler::detail
