// Exhaustive plan enumeration shared by the brute-force partitioner and planner tests.
#pragma once

#include <cstdint>
#include <vector>

#include "scheduler/execute_plan.h"

namespace roundpipe::scheduler::testing {

// All tilings of [0, n) into contiguous non-empty stages (ascending).
inline std::vector<std::vector<LayerRange>> all_tilings(int64_t n) {
  std::vector<std::vector<LayerRange>> result;
  if (n == 0) return {{}};
  for (int64_t mask = 0; mask < (int64_t{1} << (n - 1)); ++mask) {
    std::vector<LayerRange> stages;
    int64_t begin = 0;
    for (int64_t i = 1; i < n; ++i) {
      if (mask & (int64_t{1} << (i - 1))) {
        stages.push_back({begin, i});
        begin = i;
      }
    }
    stages.push_back({begin, n});
    result.push_back(stages);
  }
  return result;
}

}  // namespace roundpipe::scheduler::testing
