#include "scheduler/execute_plan.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

namespace roundpipe::scheduler {
namespace {

// Expects validate() to throw with a message containing `needle`.
void expect_invalid(const ExecutePlan& plan, int64_t layers, RunType type, const std::string& needle) {
  try {
    plan.validate(layers, type);
    ADD_FAILURE() << "plan " << plan.to_string() << " was accepted for " << layers << " layers ("
                  << to_string(type) << "), expected an error mentioning '" << needle << "'";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find(needle), std::string::npos)
        << "message: " << e.what_without_backtrace() << "\nexpected to contain: " << needle;
  }
}

TEST(ExecutePlanTest, Validate_AcceptsDocExample) {
  ExecutePlan plan({{0, 3}}, {{3, 4}, {2, 3}, {1, 2}, {0, 1}});
  EXPECT_NO_THROW(plan.validate(4, RunType::kFused));
  EXPECT_EQ(plan.num_stages(), 5);
  EXPECT_EQ(plan.to_string(), "fwd [0, 3) | bwd [3, 4) [2, 3) [1, 2) [0, 1)");
}

TEST(ExecutePlanTest, Validate_AcceptsAsymmetricTrainAndInfer) {
  EXPECT_NO_THROW(ExecutePlan({{0, 4}, {4, 6}}, {{5, 6}, {3, 5}, {0, 3}}).validate(6, RunType::kTrain));
  EXPECT_NO_THROW(ExecutePlan({{0, 2}, {2, 6}}, {}).validate(6, RunType::kInfer));
  // A fused tail covering the whole model: no forward stage at all.
  EXPECT_NO_THROW(ExecutePlan({}, {{0, 3}}).validate(3, RunType::kFused));
}

TEST(ExecutePlanTest, Validate_RejectsEmptyRange) {
  expect_invalid(ExecutePlan({{0, 2}, {2, 2}, {2, 4}}, {{3, 4}, {0, 3}}), 4, RunType::kTrain,
                 "forward stage 1 [2, 2) is empty");
  expect_invalid(ExecutePlan({{0, 3}}, {{3, 4}, {1, 1}, {0, 3}}), 4, RunType::kFused,
                 "backward stage 1 [1, 1) is empty");
}

TEST(ExecutePlanTest, Validate_RejectsGap) {
  expect_invalid(ExecutePlan({{0, 2}, {3, 4}}, {}), 4, RunType::kInfer,
                 "forward stage 1 [3, 4) leaves a gap: layers [2, 3)");
  expect_invalid(ExecutePlan({{0, 4}}, {{2, 4}, {0, 1}}), 4, RunType::kTrain,
                 "backward stage 0 [2, 4) leaves a gap: layers [1, 2)");
}

TEST(ExecutePlanTest, Validate_RejectsOverlap) {
  expect_invalid(ExecutePlan({{0, 3}, {2, 4}}, {}), 4, RunType::kInfer,
                 "forward stage 1 [2, 4) overlaps the previous forward stage: layers [2, 3)");
}

TEST(ExecutePlanTest, Validate_RejectsNotStartingAtZero) {
  expect_invalid(ExecutePlan({{1, 4}}, {}), 4, RunType::kInfer, "forward stage 0 [1, 4) must start at layer 0");
}

TEST(ExecutePlanTest, Validate_RejectsIncompleteCoverage) {
  expect_invalid(ExecutePlan({{0, 3}}, {}), 4, RunType::kInfer, "must cover layers up to 4 but end at 3");
  expect_invalid(ExecutePlan({{0, 5}}, {}), 4, RunType::kInfer, "[0, 5) is outside the model's layers [0, 4)");
}

TEST(ExecutePlanTest, Validate_RejectsFusedTailNotAtEnd) {
  // The Python original does not check this (study §9.21); we do.
  expect_invalid(ExecutePlan({{0, 2}}, {{2, 3}, {0, 2}}), 4, RunType::kFused,
                 "fused stage (backward stage 0) [2, 3) must end at the last layer");
}

TEST(ExecutePlanTest, Validate_RejectsForwardPastFusedTail) {
  expect_invalid(ExecutePlan({{0, 3}}, {{2, 4}, {0, 2}}), 4, RunType::kFused,
                 "forward stages end at layer 3, past layer 2");
  expect_invalid(ExecutePlan({{0, 1}}, {{1, 4}, {0, 1}}), 4, RunType::kInfer,
                 "inference plan has no backward stages");
}

TEST(ExecutePlanTest, Validate_RejectsMissingFusedTailAndNoLayers) {
  expect_invalid(ExecutePlan({{0, 4}}, {}), 4, RunType::kFused, "needs at least one backward stage");
  expect_invalid(ExecutePlan({}, {}), 0, RunType::kInfer, "at least one layer");
}

TEST(ExecutePlanTest, PerLayer_IsValidForEveryType) {
  for (RunType type : {RunType::kInfer, RunType::kTrain, RunType::kFused}) {
    for (int64_t layers : {1, 2, 7}) {
      auto plan = ExecutePlan::per_layer(layers, type);
      EXPECT_NO_THROW(plan.validate(layers, type)) << plan.to_string();
    }
  }
  EXPECT_EQ(ExecutePlan::per_layer(3, RunType::kFused),
            ExecutePlan({{0, 1}, {1, 2}}, {{2, 3}, {1, 2}, {0, 1}}));
}

}  // namespace
}  // namespace roundpipe::scheduler
