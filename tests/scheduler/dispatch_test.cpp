#include "scheduler/dispatch.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

namespace roundpipe::scheduler {
namespace {

TEST(DispatchTest, RoundRobin_FollowsProgramOrder) {
  ExecutePlan plan({{0, 2}, {2, 3}}, {{3, 4}, {2, 3}, {0, 2}});
  auto order = dispatch_order(plan, RunType::kFused, 3);
  std::vector<DispatchEntry> expected{{StagePhase::kForward, {0, 2}, 0},
                                      {StagePhase::kForward, {2, 3}, 1},
                                      {StagePhase::kFused, {3, 4}, 2},
                                      {StagePhase::kBackward, {2, 3}, 0},
                                      {StagePhase::kBackward, {0, 2}, 1}};
  EXPECT_EQ(order, expected);
}

TEST(DispatchTest, Cursor_ContinuesAcrossCalls) {
  ExecutePlan plan({{0, 1}}, {{1, 2}, {0, 1}});
  auto order = dispatch_order(plan, RunType::kTrain, 2, 1);
  ASSERT_EQ(order.size(), 3u);
  EXPECT_EQ(order[0].device, 1);
  EXPECT_EQ(order[1].device, 0);
  EXPECT_EQ(order[1].phase, StagePhase::kBackward);  // train plans have no fused stage
  EXPECT_EQ(order[2].device, 1);
}

TEST(DispatchTest, BadDevices_AreRejected) {
  ExecutePlan plan({{0, 1}}, {});
  EXPECT_THROW(dispatch_order(plan, RunType::kInfer, 0), c10::Error);
  EXPECT_THROW(dispatch_order(plan, RunType::kInfer, 2, 2), c10::Error);
}

}  // namespace
}  // namespace roundpipe::scheduler
