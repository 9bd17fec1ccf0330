#include "scheduler/dispatch.h"

#include <c10/util/Exception.h>

namespace roundpipe::scheduler {

const char* to_string(StagePhase phase) {
  switch (phase) {
    case StagePhase::kForward: return "forward";
    case StagePhase::kFused: return "fused";
    case StagePhase::kBackward: return "backward";
  }
  return "unknown";
}

std::vector<DispatchEntry> dispatch_order(const ExecutePlan& plan, RunType type, int64_t num_devices,
                                          int64_t first_device) {
  TORCH_CHECK(num_devices > 0, "dispatch_order: need at least one device, got ", num_devices);
  TORCH_CHECK(first_device >= 0 && first_device < num_devices, "dispatch_order: first_device ",
              first_device, " is not in [0, ", num_devices, ")");
  std::vector<DispatchEntry> order;
  int64_t device = first_device;
  auto add = [&](StagePhase phase, const LayerRange& layers) {
    order.push_back({phase, layers, device});
    device = (device + 1) % num_devices;
  };
  for (const auto& r : plan.forward_stages()) add(StagePhase::kForward, r);
  for (size_t i = 0; i < plan.backward_stages().size(); ++i) {
    const bool fused = type == RunType::kFused && i == 0;
    add(fused ? StagePhase::kFused : StagePhase::kBackward, plan.backward_stages()[i]);
  }
  return order;
}

}  // namespace roundpipe::scheduler
