#include "roundpipe/launcher/lr_schedule.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>

#include "tests/common/python_oracle.h"
#include "tests/common/test_macros.h"

namespace roundpipe::launcher {
namespace {

TEST(LrScheduleTest, Warmup_RisesLinearlyFromTheFirstStep) {
  LrSchedule s(1.0, 0.1, /*warmup_steps=*/10, /*total_steps=*/110, LrDecay::kCosine);
  EXPECT_DOUBLE_EQ(s.at(0), 0.1);
  EXPECT_DOUBLE_EQ(s.at(4), 0.5);
  EXPECT_DOUBLE_EQ(s.at(9), 1.0);
  EXPECT_DOUBLE_EQ(s.at(10), 1.0);  // p = 0: the peak
}

TEST(LrScheduleTest, Decay_MatchesClosedForm) {
  LrSchedule linear(1.0, 0.1, 10, 110, LrDecay::kLinear);
  LrSchedule cosine(1.0, 0.1, 10, 110, LrDecay::kCosine);
  LrSchedule constant(1.0, 0.1, 10, 110, LrDecay::kConstant);
  // step 35: p = 0.25; step 60: p = 0.5; step 110: p = 1.
  EXPECT_DOUBLE_EQ(linear.at(35), 0.1 + 0.9 * 0.75);
  EXPECT_NEAR(cosine.at(35), 0.1 + 0.9 * (1 + std::sqrt(0.5)) / 2, 1e-15);
  EXPECT_DOUBLE_EQ(linear.at(60), 0.55);
  EXPECT_NEAR(cosine.at(60), 0.55, 1e-15);
  EXPECT_DOUBLE_EQ(linear.at(110), 0.1);
  EXPECT_DOUBLE_EQ(cosine.at(110), 0.1);
  EXPECT_DOUBLE_EQ(cosine.at(500), 0.1);  // past the end: the floor
  EXPECT_DOUBLE_EQ(constant.at(60), 1.0);
  EXPECT_DOUBLE_EQ(constant.at(109), 1.0);
}

TEST(LrScheduleTest, NoWarmup_StartsAtPeak) {
  LrSchedule s(3e-4, 0.0, 0, 100, LrDecay::kLinear);
  EXPECT_DOUBLE_EQ(s.at(0), 3e-4);
  EXPECT_DOUBLE_EQ(s.at(50), 1.5e-4);
  // Warmup as long as the run: the decay span is clamped to 1 step.
  LrSchedule all_warmup(1.0, 0.0, 5, 5, LrDecay::kLinear);
  EXPECT_DOUBLE_EQ(all_warmup.at(4), 1.0);
  EXPECT_DOUBLE_EQ(all_warmup.at(5), 1.0);
  EXPECT_DOUBLE_EQ(all_warmup.at(6), 0.0);
}

TEST(LrScheduleTest, Constructor_RejectsBadSettings) {
  EXPECT_THROW_WITH(LrSchedule(0.0, 0.0, 0, 10, LrDecay::kConstant), "optimizer.lr must be > 0");
  EXPECT_THROW_WITH(LrSchedule(1.0, 2.0, 0, 10, LrDecay::kConstant), "schedule.min_lr");
  EXPECT_THROW_WITH(LrSchedule(1.0, 0.0, -1, 10, LrDecay::kConstant), "schedule.warmup_steps");
  EXPECT_THROW_WITH(LrSchedule(1.0, 0.0, 0, 0, LrDecay::kConstant), "train.steps");
}

TEST(LrScheduleTest, EveryStep_MatchesPythonReference) {
  ROUNDPIPE_REQUIRE_ORACLE();
  const int64_t warmup = 7, total = 53, steps = 60;
  const double lr = 3e-4, min_lr = 2e-5;
  auto out = roundpipe::testing::run_python(R"(
import math
def ref(step, decay, lr=3e-4, min_lr=2e-5, warmup=7, total=53):
    if step < warmup:
        return lr * (step + 1) / warmup
    p = min(max((step - warmup) / max(1, total - warmup), 0.0), 1.0)
    if decay == 'constant':
        return lr
    if decay == 'linear':
        return min_lr + (lr - min_lr) * (1 - p)
    return min_lr + (lr - min_lr) * 0.5 * (1 + math.cos(math.pi * p))
for d in ('constant', 'linear', 'cosine'):
    outputs[d] = torch.tensor([ref(s, d) for s in range(60)], dtype=torch.float64)
)");
  for (auto [name, decay] : {std::pair<const char*, LrDecay>{"constant", LrDecay::kConstant},
                             {"linear", LrDecay::kLinear},
                             {"cosine", LrDecay::kCosine}}) {
    LrSchedule s(lr, min_lr, warmup, total, decay);
    at::Tensor expected = out.at(name);
    for (int64_t step = 0; step < steps; ++step) {
      EXPECT_NEAR(s.at(step), expected[step].item<double>(), 1e-15) << name << " step " << step;
    }
  }
}

}  // namespace
}  // namespace roundpipe::launcher
