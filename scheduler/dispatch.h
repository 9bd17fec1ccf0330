// Dispatch order: which stage runs when, and on which device (round-robin over a stateless pool).
#pragma once

#include <cstdint>
#include <vector>

#include "scheduler/execute_plan.h"

namespace roundpipe::scheduler {

enum class StagePhase { kForward, kFused, kBackward };

const char* to_string(StagePhase phase);

/// One stage job: a phase, its layers, and the device (index into the device list) it runs on.
struct DispatchEntry {
  StagePhase phase = StagePhase::kForward;
  LayerRange layers;
  int64_t device = 0;
  bool operator==(const DispatchEntry& o) const {
    return phase == o.phase && layers == o.layers && device == o.device;
  }
};

/// The program order of `plan` (forward stages ascending, then the fused tail for kFused, then
/// backward stages deepest first), each assigned round-robin to devices starting at
/// `first_device` (the caller keeps a cursor across calls, as the pool is shared).
std::vector<DispatchEntry> dispatch_order(const ExecutePlan& plan, RunType type, int64_t num_devices,
                                          int64_t first_device = 0);

}  // namespace roundpipe::scheduler
