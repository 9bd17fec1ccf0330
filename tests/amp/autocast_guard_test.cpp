// AutocastGuard and AutocastState: the thread-local autocast settings they set and restore, the
// dtypes ops actually produce under them, and re-applying a captured state on another thread.
#include "amp/autocast_guard.h"

#include <ATen/autocast_mode.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <thread>

namespace roundpipe::amp {
namespace {

TEST(AutocastGuardTest, CpuBf16_MatmulRunsInBf16AndRestores) {
  auto a = torch::randn({4, 4});
  auto b = torch::randn({4, 4});
  ASSERT_FALSE(at::autocast::is_autocast_enabled(c10::kCPU));
  {
    AutocastGuard guard(c10::kCPU, c10::kBFloat16);
    EXPECT_TRUE(at::autocast::is_autocast_enabled(c10::kCPU));
    EXPECT_EQ(at::autocast::get_autocast_dtype(c10::kCPU), c10::kBFloat16);
    auto c = torch::matmul(a, b);
    EXPECT_EQ(c.scalar_type(), torch::kBFloat16);
    EXPECT_TRUE(torch::equal(c, torch::matmul(a.to(torch::kBFloat16), b.to(torch::kBFloat16))));
    EXPECT_EQ(torch::mse_loss(c, c).scalar_type(), torch::kFloat);  // fp32-listed op
    EXPECT_FALSE(at::autocast::is_autocast_enabled(c10::kCUDA));     // other device type untouched
  }
  EXPECT_FALSE(at::autocast::is_autocast_enabled(c10::kCPU));
  EXPECT_EQ(torch::matmul(a, b).scalar_type(), torch::kFloat);
}

TEST(AutocastGuardTest, Nested_RestoresOuterStateAndDtype) {
  const auto outer_dtype = at::autocast::get_autocast_dtype(c10::kCPU);
  {
    AutocastGuard outer(c10::kCPU, c10::kBFloat16);
    {
      AutocastGuard inner(c10::kCPU, c10::kHalf);
      EXPECT_EQ(at::autocast::get_autocast_dtype(c10::kCPU), c10::kHalf);
      {
        AutocastGuard off(c10::kCPU, c10::kBFloat16, /*enabled=*/false);
        EXPECT_FALSE(at::autocast::is_autocast_enabled(c10::kCPU));
        EXPECT_EQ(torch::matmul(torch::ones({2, 2}), torch::ones({2, 2})).scalar_type(), torch::kFloat);
      }
      EXPECT_TRUE(at::autocast::is_autocast_enabled(c10::kCPU));
    }
    EXPECT_TRUE(at::autocast::is_autocast_enabled(c10::kCPU));
    EXPECT_EQ(at::autocast::get_autocast_dtype(c10::kCPU), c10::kBFloat16);
  }
  EXPECT_FALSE(at::autocast::is_autocast_enabled(c10::kCPU));
  EXPECT_EQ(at::autocast::get_autocast_dtype(c10::kCPU), outer_dtype);
  // Back at nesting 0: the next region starts from nesting 1 again.
  EXPECT_EQ(at::autocast::increment_nesting(), 1);
  EXPECT_EQ(at::autocast::decrement_nesting(), 0);
}

TEST(AutocastGuardTest, CastCache_ClearedWhenOutermostRegionExits) {
  // Weights that require grad are cached across ops inside a region (like torch's autocast);
  // leaving the outermost region drops the cache, so later regions see updated weights.
  auto w = torch::ones({2, 2}, torch::requires_grad());
  auto x = torch::ones({2, 2});
  {
    AutocastGuard guard(c10::kCPU, c10::kBFloat16);
    EXPECT_EQ(torch::matmul(x, w).sum().item<float>(), 8.0f);
  }
  {
    torch::NoGradGuard no_grad;
    w.mul_(2);
  }
  {
    AutocastGuard guard(c10::kCPU, c10::kBFloat16);
    EXPECT_EQ(torch::matmul(x, w).sum().item<float>(), 16.0f);
  }
}

TEST(AutocastGuardTest, UnsupportedDtype_Throws) {
  EXPECT_THROW(AutocastGuard(c10::kCPU, c10::kDouble), c10::Error);
  EXPECT_THROW(AutocastGuard(c10::kMPS, c10::kHalf), c10::Error);
  EXPECT_FALSE(at::autocast::is_autocast_enabled(c10::kCPU));
}

TEST(AutocastStateTest, CaptureAndGuard_ReapplyOnWorkerThread) {
  AutocastState captured;
  {
    AutocastGuard guard(c10::kCPU, c10::kBFloat16);
    captured = AutocastState::capture();
  }
  EXPECT_TRUE(captured.cpu_enabled);
  EXPECT_EQ(captured.cpu_dtype, c10::kBFloat16);
  EXPECT_FALSE(captured.cuda_enabled);
  EXPECT_TRUE(captured.any_enabled());

  c10::ScalarType on_worker_plain = c10::kDouble, on_worker_guarded = c10::kDouble, after_guard = c10::kDouble;
  std::thread worker([&] {
    auto a = torch::ones({2, 2});
    on_worker_plain = torch::matmul(a, a).scalar_type();  // autocast TLS is per thread: off here
    {
      AutocastState::Guard guard(captured);
      on_worker_guarded = torch::matmul(a, a).scalar_type();
    }
    after_guard = torch::matmul(a, a).scalar_type();
  });
  worker.join();
  EXPECT_EQ(on_worker_plain, torch::kFloat);
  EXPECT_EQ(on_worker_guarded, torch::kBFloat16);
  EXPECT_EQ(after_guard, torch::kFloat);

  const auto before = AutocastState::capture();
  EXPECT_FALSE(before.any_enabled());
  captured.apply();
  EXPECT_TRUE(at::autocast::is_autocast_enabled(c10::kCPU));
  before.apply();
  EXPECT_FALSE(at::autocast::is_autocast_enabled(c10::kCPU));
}

TEST(AutocastGuardTest, CudaFp16_MatmulRunsInHalf_CUDA) {
  auto a = torch::randn({8, 8}, torch::kCUDA);
  {
    AutocastGuard guard(c10::kCUDA, c10::kHalf);
    EXPECT_EQ(torch::matmul(a, a).scalar_type(), torch::kHalf);
    EXPECT_EQ(torch::matmul(a.cpu(), a.cpu()).scalar_type(), torch::kFloat);  // CPU autocast is off
    auto state = AutocastState::capture();
    EXPECT_TRUE(state.cuda_enabled);
    EXPECT_EQ(state.cuda_dtype, c10::kHalf);
    EXPECT_FALSE(state.cpu_enabled);
  }
  EXPECT_EQ(torch::matmul(a, a).scalar_type(), torch::kFloat);
  {
    AutocastGuard guard(c10::kCUDA, c10::kBFloat16);
    EXPECT_EQ(torch::matmul(a, a).scalar_type(), torch::kBFloat16);
  }
}

}  // namespace
}  // namespace roundpipe::amp
