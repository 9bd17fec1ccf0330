#include "scheduler/partitioner.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <functional>
#include <limits>
#include <random>

#include "tests/scheduler/plan_enumeration.h"

namespace roundpipe::scheduler {
namespace {

using testing::all_tilings;

// Brute force: the minimum plan_cost over every valid plan of `type`.
double brute_force_cost(const std::vector<LayerCost>& costs, RunType type, const PartitionOptions& options) {
  const auto n = static_cast<int64_t>(costs.size());
  double best = std::numeric_limits<double>::infinity();
  auto consider = [&](const ExecutePlan& plan) { best = std::min(best, plan_cost(plan, costs, options)); };
  if (type == RunType::kInfer) {
    for (auto& fwd : all_tilings(n)) consider(ExecutePlan(fwd, {}));
  } else if (type == RunType::kTrain) {
    for (auto& fwd : all_tilings(n)) {
      for (auto& bwd : all_tilings(n)) consider(ExecutePlan(fwd, {bwd.rbegin(), bwd.rend()}));
    }
  } else {
    for (int64_t tail = 0; tail < n; ++tail) {
      for (auto& fwd : all_tilings(tail)) {
        for (auto& bwd : all_tilings(tail)) {
          std::vector<LayerRange> backward{{tail, n}};
          backward.insert(backward.end(), bwd.rbegin(), bwd.rend());
          consider(ExecutePlan(fwd, backward));
        }
      }
    }
  }
  return best;
}

TEST(PartitionerTest, SizeBasedCosts_BackwardIsThreeTimesForward) {
  auto costs = size_based_costs({100, 0}, {100, 0});
  EXPECT_DOUBLE_EQ(costs[0].forward, 100);
  EXPECT_DOUBLE_EQ(costs[0].backward, 300);
  EXPECT_EQ(costs[0].backward_bytes, 200);
  EXPECT_DOUBLE_EQ(costs[1].forward, 1);  // parameter-free layers still cost something
}

TEST(PartitionerTest, UniformLayers_ForwardStagesHoldThreeTimesTheLayers) {
  // 24 equal layers, size-based: a backward layer costs 3 forward layers.
  auto costs = size_based_costs(std::vector<int64_t>(24, 1000), std::vector<int64_t>(24, 1000));
  auto plan = partition(costs, RunType::kTrain, PartitionOptions().set_min_stages(8));
  plan.validate(24, RunType::kTrain);
  ASSERT_FALSE(plan.forward_stages().empty());
  ASSERT_FALSE(plan.backward_stages().empty());
  const double fwd_layers = 24.0 / plan.forward_stages().size();
  const double bwd_layers = 24.0 / plan.backward_stages().size();
  EXPECT_DOUBLE_EQ(fwd_layers / bwd_layers, 3.0) << plan.to_string();
  // Every stage takes the same time.
  EXPECT_DOUBLE_EQ(plan_cost(plan, costs, PartitionOptions().set_min_stages(8)),
                   static_cast<double>(std::max<int64_t>(plan.num_stages(), 8)) * 3000);
}

TEST(PartitionerTest, FusedPlan_TailEndsAtLastLayerAndIsValid) {
  auto costs = size_based_costs(std::vector<int64_t>(10, 7), std::vector<int64_t>(10, 7));
  auto plan = partition(costs, RunType::kFused, PartitionOptions().set_min_stages(4));
  EXPECT_NO_THROW(plan.validate(10, RunType::kFused));
  EXPECT_EQ(plan.backward_stages().front().end, 10);
}

TEST(PartitionerTest, MemoryBudget_IsRespected) {
  std::vector<int64_t> bytes{40, 40, 40, 40, 40, 40};
  auto costs = size_based_costs(bytes, bytes);
  auto options = PartitionOptions().set_min_stages(1).set_memory_budget_bytes(160);
  auto plan = partition(costs, RunType::kFused, options);
  plan.validate(6, RunType::kFused);
  for (const auto& r : plan.forward_stages()) EXPECT_LE(r.size() * 40, 160) << plan.to_string();
  for (const auto& r : plan.backward_stages()) EXPECT_LE(r.size() * 80, 160) << plan.to_string();
  EXPECT_TRUE(std::isfinite(plan_cost(plan, costs, options)));
}

TEST(PartitionerTest, LayerLargerThanBudget_IsAnErrorNamingTheLayer) {
  std::vector<int64_t> bytes{10, 500, 10};
  auto costs = size_based_costs(bytes, bytes);
  try {
    partition(costs, RunType::kFused, PartitionOptions().set_memory_budget_bytes(600));
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    EXPECT_NE(msg.find("layer 1 needs 1000 bytes"), std::string::npos) << msg;
    EXPECT_NE(msg.find("budget is 600 bytes"), std::string::npos) << msg;
  }
}

TEST(PartitionerTest, InvalidInputs_AreRejected) {
  EXPECT_THROW(partition({}, RunType::kFused), c10::Error);
  auto costs = size_based_costs({1, 2}, {1, 2});
  EXPECT_THROW(partition(costs, RunType::kFused, PartitionOptions().set_min_stages(0)), c10::Error);
  costs[0].forward = -1;
  EXPECT_THROW(partition(costs, RunType::kFused), c10::Error);
}

TEST(PartitionerTest, MinStagesOne_PrefersASingleFusedStage) {
  // With one device there is nothing to pipeline: the whole model as one fused stage is optimal.
  auto costs = size_based_costs({5, 9, 2, 7}, {5, 9, 2, 7});
  auto plan = partition(costs, RunType::kFused, PartitionOptions().set_min_stages(1));
  EXPECT_EQ(plan, ExecutePlan({}, {{0, 4}}));
}

// Brute-force check on small random instances: the partitioner's plan is optimal under its own
// cost model (the issue asks for within 10%; the algorithm is exact, so we check exactness).
TEST(PartitionerTest, RandomInstances_MatchBruteForceOptimum) {
  std::mt19937_64 rng(1234);
  std::uniform_real_distribution<double> time(0.5, 10.0);
  std::uniform_int_distribution<int64_t> size(1, 50);
  int checked = 0;
  for (int trial = 0; trial < 300; ++trial) {
    const int64_t n = 1 + trial % 7;
    std::vector<LayerCost> costs(n);
    for (auto& c : costs) {
      c.forward = time(rng);
      c.backward = trial % 3 == 0 ? 3 * c.forward : time(rng);  // also non-proportional costs
      c.bytes = size(rng);
      c.backward_bytes = c.bytes + size(rng);
    }
    PartitionOptions options;
    options.min_stages = 1 + trial % 5;
    if (trial % 2 == 0) options.memory_budget_bytes = 100 + trial % 60;
    for (RunType type : {RunType::kInfer, RunType::kTrain, RunType::kFused}) {
      if (type == RunType::kTrain && n > 6) continue;  // 2^(n-1) squared plans
      ExecutePlan plan;
      try {
        plan = partition(costs, type, options);
      } catch (const c10::Error&) {
        // Only allowed when a single layer exceeds the budget.
        int64_t biggest = 0;
        for (auto& c : costs) biggest = std::max(biggest, type == RunType::kInfer ? c.bytes : c.backward_bytes);
        EXPECT_GT(biggest, options.memory_budget_bytes);
        continue;
      }
      ASSERT_NO_THROW(plan.validate(n, type));
      const double ours = plan_cost(plan, costs, options);
      const double best = brute_force_cost(costs, type, options);
      EXPECT_LE(ours, best * (1 + 1e-9)) << "trial " << trial << " " << to_string(type) << ": "
                                         << plan.to_string() << " costs " << ours << ", optimum " << best;
      ++checked;
    }
  }
  EXPECT_GT(checked, 600);
}

TEST(PartitionerTest, LargeModel_PartitionsQuickly) {
  // 400 layers: O(L^2 log L) candidates; this must finish (no timing assertion here, see bench/).
  std::mt19937_64 rng(7);
  std::uniform_int_distribution<int64_t> size(1000, 100000);
  std::vector<int64_t> bytes(400);
  for (auto& b : bytes) b = size(rng);
  auto costs = size_based_costs(bytes, bytes);
  auto plan = partition(costs, RunType::kFused, PartitionOptions().set_min_stages(4));
  EXPECT_NO_THROW(plan.validate(400, RunType::kFused));
}

}  // namespace
}  // namespace roundpipe::scheduler
