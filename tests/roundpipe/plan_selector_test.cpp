// detail::PlanSelector with synthetic measurements (deterministic, unlike wall-clock timing): the
// smoothing of equal layers' times (Note [Smoothing measured times]), re-measuring that keeps
// the plan unless the costs moved materially (Note [Re-measuring]), and the objective that
// follows the step mode.
#include "roundpipe/detail/plan_selector.h"

#include <gtest/gtest.h>

#include <limits>
#include <string>
#include <vector>

#include "roundpipe/run_config.h"
#include "scheduler/planner.h"
#include "scheduler/simulator.h"

namespace roundpipe::detail {
namespace {

constexpr int64_t kM = 4;  // microbatches of the measuring calls

// Six layers: an embedding-like layer, four equal blocks, a head; 2 devices.
PlanSelector make_planner() {
  return PlanSelector({100, 400, 400, 400, 400, 800}, {100, 400, 400, 400, 400, 800},
                 {"Embedding", "Block", "Block", "Block", "Block", "Linear"}, 2,
                 std::numeric_limits<int64_t>::max(),
                 engine_simulate_options(RecomputeGrain::kStage, /*iterations_overlap=*/true));
}

// Summed over kM microbatches: forward per layer, and per backward stage of `plan`, the sum of
// its layers' `backward` per microbatch.
void measure(PlanSelector& planner, const std::vector<double>& forward, const std::vector<double>& backward) {
  const auto plan = planner.auto_plan(scheduler::RunType::kFused);
  std::vector<double> forward_ms, stage_ms;
  for (double f : forward) forward_ms.push_back(f * kM);
  for (const auto& r : plan.backward_stages()) {
    double b = 0;
    for (int64_t l = r.begin; l < r.end; ++l) b += backward[static_cast<size_t>(l)];
    stage_ms.push_back(b * kM);
  }
  planner.use_measured_times(forward_ms, stage_ms, kM);
}

std::string optimum(const PlanSelector& planner, scheduler::PlanObjective objective) {
  const auto planned = scheduler::plan_by_simulation(
      planner.layer_costs(), scheduler::RunType::kFused,
      scheduler::PlannerOptions().set_num_devices(2).set_num_microbatch(kM).set_objective(objective).set_simulate(
          engine_simulate_options(RecomputeGrain::kStage, /*iterations_overlap=*/true)));
  EXPECT_TRUE(planned.exhaustive);
  return planned.plan.to_string();
}

TEST(PlanSelectorTest, EqualLayersShareTheMedianOfCloseTimes) {
  PlanSelector planner = make_planner();
  // Blocks timed 10, 10.5, 9.6, 10.2 (within 15% of the median); the head is its own kind.
  measure(planner, {1, 10, 10.5, 9.6, 10.2, 30}, {3, 30, 31.5, 28.8, 30.6, 90});
  const auto costs = planner.layer_costs();
  for (int l = 2; l <= 4; ++l) EXPECT_EQ(costs[l].forward, costs[1].forward) << "layer " << l;
  EXPECT_NEAR(costs[1].forward, 10.2, 1e-9);  // the upper median of the four
  EXPECT_EQ(costs[0].forward, 1);
  EXPECT_EQ(costs[5].forward, 30);
  // A block 3x slower than the others (same kind and size) keeps its own time.
  PlanSelector other = make_planner();
  measure(other, {1, 10, 30, 10, 10, 30}, {3, 30, 90, 30, 30, 90});
  EXPECT_EQ(other.layer_costs()[2].forward, 30);
  EXPECT_EQ(other.layer_costs()[1].forward, 10);
}

TEST(PlanSelectorTest, RemeasureKeepsThePlanUnlessTheCostsMovedMaterially) {
  PlanSelector planner = make_planner();
  EXPECT_TRUE(planner.wants_measurement());
  const std::vector<double> forward{1, 10, 10, 10, 10, 30}, backward{3, 30, 30, 30, 30, 90};
  measure(planner, forward, backward);
  EXPECT_FALSE(planner.wants_measurement());
  const auto costs = planner.layer_costs();
  const auto plan = planner.auto_plan(scheduler::RunType::kFused).to_string();
  EXPECT_EQ(plan, optimum(planner, scheduler::PlanObjective::kIsolated));

  // Every time 8% higher (noise or drift below 10%): costs and plan stay.
  planner.request_remeasure();
  EXPECT_TRUE(planner.wants_measurement());
  std::vector<double> f8, b8;
  for (double f : forward) f8.push_back(f * 1.08);
  for (double b : backward) b8.push_back(b * 1.08);
  measure(planner, f8, b8);
  EXPECT_FALSE(planner.wants_measurement());
  for (size_t l = 0; l < costs.size(); ++l) {
    EXPECT_EQ(planner.layer_costs()[l].forward, costs[l].forward) << "layer " << l;
    EXPECT_EQ(planner.layer_costs()[l].backward, costs[l].backward) << "layer " << l;
  }
  EXPECT_EQ(planner.auto_plan(scheduler::RunType::kFused).to_string(), plan);

  // The embedding layer 5x slower (4 ms above its old 1 ms, more than 10% of the mean layer
  // time, ~2.4 ms): material; the costs follow and the plan is the optimum for them.
  planner.request_remeasure();
  measure(planner, {5, 10, 10, 10, 10, 30}, {15, 30, 30, 30, 30, 90});
  EXPECT_EQ(planner.layer_costs()[0].forward, 5);
  EXPECT_EQ(planner.auto_plan(scheduler::RunType::kFused).to_string(),
            optimum(planner, scheduler::PlanObjective::kIsolated));
}

TEST(PlanSelectorTest, AsyncStepsPlanBackToBackIterations) {
  PlanSelector planner = make_planner();
  EXPECT_FALSE(planner.set_async_steps(true));  // nothing measured: the size-based plan either way
  planner.set_async_steps(false);
  measure(planner, {1, 10, 10, 10, 10, 30}, {3, 30, 30, 30, 30, 90});
  EXPECT_EQ(planner.auto_plan(scheduler::RunType::kFused).to_string(),
            optimum(planner, scheduler::PlanObjective::kIsolated));
  EXPECT_TRUE(planner.set_async_steps(true));
  EXPECT_EQ(planner.auto_plan(scheduler::RunType::kFused).to_string(),
            optimum(planner, scheduler::PlanObjective::kSteadyState));
  EXPECT_FALSE(planner.set_async_steps(true));
  EXPECT_TRUE(planner.set_async_steps(false));
  EXPECT_EQ(planner.auto_plan(scheduler::RunType::kFused).to_string(),
            optimum(planner, scheduler::PlanObjective::kIsolated));
  // Without overlapping iterations the objective never changes.
  PlanSelector serial({100, 400, 400, 400, 400, 800}, {100, 400, 400, 400, 400, 800},
                      {"Embedding", "Block", "Block", "Block", "Block", "Linear"}, 2,
                      std::numeric_limits<int64_t>::max(),
                      engine_simulate_options(RecomputeGrain::kStage, /*iterations_overlap=*/false));
  measure(serial, {1, 10, 10, 10, 10, 30}, {3, 30, 30, 30, 30, 90});
  EXPECT_FALSE(serial.set_async_steps(true));
}

}  // namespace
}  // namespace roundpipe::detail
