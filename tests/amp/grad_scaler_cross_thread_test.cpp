// The cross-thread protocol of amp::GradScaler (Note [Cross-thread GradScaler]): flags posted
// from other threads drive update(), deferred updates, iteration scopes and the executor that
// marshals unscale_/step. The reference is a standalone GradScaler fed the same inf pattern
// (itself checked bitwise against torch.amp.GradScaler in grad_scaler_conformance_test).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <future>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "amp/detail/grad_scaler_access.h"
#include "amp/detail/scaler_core.h"
#include "amp/grad_scaler.h"
#include "tests/common/test_macros.h"

namespace roundpipe::amp {
namespace {

torch::TensorOptions f32(const c10::Device& device) { return torch::TensorOptions().dtype(torch::kFloat).device(device); }

// Records the generation of the last scale() call on this thread.
struct GenerationProbe final : detail::ScaleObserver {
  GradScaler* scaler = nullptr;
  int64_t generation = -1;
  void on_scale(GradScaler& s, int64_t g) override {
    scaler = &s;
    generation = g;
  }
};

int64_t scale_and_get_generation(GradScaler& scaler, const c10::Device& device) {
  GenerationProbe probe;
  detail::ScopedScaleObserver observe(&probe);
  scaler.scale(torch::ones({}, f32(device)));
  EXPECT_EQ(probe.scaler, &scaler);
  return probe.generation;
}

torch::Tensor flag(double value, const c10::Device& device) { return torch::full({1}, value, f32(device)); }

// One plain iteration of a standalone scaler whose only gradient is finite (`bad` = 0), inf or
// nan: scale, unscale_, update.
void standalone_iteration(GradScaler& reference, double bad, const c10::Device& device) {
  auto p = torch::zeros({1}, f32(device)).set_requires_grad(true);
  torch::optim::SGD opt({p}, 1.0);
  p.mutable_grad() = reference.scale(torch::full({1}, bad == 0.0 ? 1.0 : bad, f32(device)));
  reference.unscale_(opt);
  reference.update();
}

void flags_drive_update_case(const c10::Device& device) {
  auto options = GradScalerOptions().init_scale(1024.0).growth_interval(2);
  GradScaler scaler(options), reference(options);
  const double inf = std::numeric_limits<double>::infinity();
  const std::vector<double> pattern = {0, 0, inf, 0, std::nan(""), 0, 0, 0};
  uint64_t run = 1;
  for (size_t it = 0; it < pattern.size(); ++it) {
    const int64_t g = scale_and_get_generation(scaler, device);
    EXPECT_EQ(g, static_cast<int64_t>(it));
    // Three stages of an announced run; the bad value in the middle one.
    for (int stage = 0; stage < 3; ++stage) detail::GradScalerAccess::post_found_inf(scaler, g, run, flag(stage == 1 ? pattern[it] : 0.0, device));
    detail::GradScalerAccess::expect_found_inf(scaler, g, run, 3);
    // A failed run: posted an inf, never announced, must not count.
    detail::GradScalerAccess::post_found_inf(scaler, g, run + 1, flag(inf, device));
    run += 2;
    scaler.update();

    standalone_iteration(reference, pattern[it], device);
    ASSERT_EQ(scaler.get_scale(), reference.get_scale()) << "iteration " << it;
    ASSERT_EQ(scaler.state_dict().growth_tracker, reference.state_dict().growth_tracker) << "iteration " << it;
  }
  // Nothing announced and no optimizer unscaled: torch's error.
  scale_and_get_generation(scaler, device);
  EXPECT_THROW_WITH(scaler.update(), "No inf checks were recorded prior to update.");
}
ROUNDPIPE_DEVICE_TEST(GradScalerCrossThreadTest, PostedFlags_DriveUpdateLikeStandalone, flags_drive_update_case)

void iteration_scope_case(const c10::Device& device) {
  GradScaler scaler(GradScalerOptions().init_scale(8.0));
  auto param = torch::zeros({2}, f32(device)).set_requires_grad(true);
  torch::optim::SGD opt({param}, 1.0);
  param.mutable_grad() = scaler.scale(torch::ones({2}, f32(device)));  // grads scaled by 8
  auto iteration = detail::GradScalerAccess::capture_iteration(scaler);
  scaler.update(64.0);  // the live scale moves on
  {
    detail::IterationScope scope(scaler, iteration);
    scaler.unscale_(opt);  // with the iteration's 8, not the live 64
    EXPECT_THROW_WITH(scaler.unscale_(opt), "unscale_() has already been called on this optimizer");
  }
  EXPECT_TRUE(torch::equal(param.grad().cpu(), torch::ones({2})));
  {
    detail::IterationScope scope(scaler, iteration);  // the same iteration: state carries over
    EXPECT_TRUE(scaler.step(opt));                         // no second unscale
    EXPECT_THROW_WITH(scaler.step(opt), "step() has already been called since the last update().");
  }
  EXPECT_TRUE(torch::equal(param.detach().cpu(), torch::full({2}, -1.0)));
  // The live per-optimizer state was never touched: a live unscale_ runs, with the live scale.
  param.mutable_grad() = torch::full({2}, 64.0, f32(device));
  scaler.unscale_(opt);
  EXPECT_TRUE(torch::equal(param.grad().cpu(), torch::ones({2})));
  // A scope of an iteration that was never scaled fails like torch.
  GradScaler fresh;
  detail::IterationScope scope(fresh, detail::GradScalerAccess::capture_iteration(fresh));
  EXPECT_THROW_WITH(fresh.step(opt), "Attempted step but _scale is None.");
}
ROUNDPIPE_DEVICE_TEST(GradScalerCrossThreadTest, IterationScope_UsesSnapshotAndPrivateStates, iteration_scope_case)

TEST(GradScalerCrossThreadTest, Update_ReturnsBeforeFlagsArriveAndCompletesInNextScale) {
  const c10::Device cpu(c10::kCPU);
  GradScaler scaler(GradScalerOptions().init_scale(1024.0).growth_interval(1));
  const int64_t g = scale_and_get_generation(scaler, cpu);
  detail::GradScalerAccess::post_found_inf(scaler, g, 7, flag(0.0, cpu));
  detail::GradScalerAccess::expect_found_inf(scaler, g, 7, 2);
  std::promise<void> update_returned;
  // The second flag is posted only after update() has returned: update() must not wait for it.
  std::thread late_worker([&, f = update_returned.get_future()]() mutable {
    f.wait();
    detail::GradScalerAccess::post_found_inf(scaler, g, 7, flag(std::numeric_limits<double>::infinity(), cpu));
  });
  scaler.update();
  update_returned.set_value();
  // The next scale(), on another thread, waits for the late flag and applies the backoff first.
  double scaled = 0.0;
  int64_t next_generation = -1;
  std::thread next_iteration([&] {
    GenerationProbe probe;
    detail::ScopedScaleObserver observe(&probe);
    scaled = scaler.scale(torch::ones({})).item<double>();
    next_generation = probe.generation;
  });
  next_iteration.join();
  late_worker.join();
  EXPECT_EQ(scaled, 512.0);  // backoff 0.5, not growth to 2048
  EXPECT_EQ(next_generation, 1);
  EXPECT_EQ(scaler.get_scale(), 512.0);
  EXPECT_EQ(scaler.state_dict().growth_tracker, 0);
  // The following update uses this iteration's flags only.
  detail::GradScalerAccess::post_found_inf(scaler, 1, 8, flag(0.0, cpu));
  detail::GradScalerAccess::expect_found_inf(scaler, 1, 8, 1);
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), 1024.0);
}

TEST(GradScalerCrossThreadTest, Update_NewScaleIgnoresFlagsStillInFlight) {
  const c10::Device cpu(c10::kCPU);
  GradScaler scaler(GradScalerOptions().init_scale(1024.0).growth_interval(1));
  const int64_t g = scale_and_get_generation(scaler, cpu);
  detail::GradScalerAccess::expect_found_inf(scaler, g, 1, 1);
  scaler.update(100.0);  // like torch: an explicit scale ignores found_inf
  detail::GradScalerAccess::post_found_inf(scaler, g, 1, flag(std::numeric_limits<double>::infinity(), cpu));  // late, dropped
  EXPECT_EQ(scaler.get_scale(), 100.0);
  EXPECT_THROW_WITH(detail::GradScalerAccess::expect_found_inf(scaler, g, 2, 1), "already ran");
}

// Many workers post at once (lock-free queue), the caller updates; run under ThreadSanitizer.
TEST(GradScalerCrossThreadTest, ConcurrentPosts_TrajectoryMatchesStandalone) {
  const c10::Device cpu(c10::kCPU);
  auto options = GradScalerOptions().init_scale(65536.0).growth_interval(3);
  GradScaler scaler(options), reference(options);
  const int kThreads = 4, kFlagsPerThread = 25, kIterations = 40;
  for (int it = 0; it < kIterations; ++it) {
    const int64_t g = scale_and_get_generation(scaler, cpu);
    const bool bad = it % 7 == 3;
    std::vector<std::thread> workers;
    for (int t = 0; t < kThreads; ++t) {
      workers.emplace_back([&, t] {
        for (int k = 0; k < kFlagsPerThread; ++k) {
          const bool poison = bad && t == 2 && k == 11;
          detail::GradScalerAccess::post_found_inf(scaler, g, static_cast<uint64_t>(it), flag(poison ? 1.0 : 0.0, cpu));
        }
      });
    }
    // Announced while the posts are in flight; update() may defer, get_scale() completes it.
    detail::GradScalerAccess::expect_found_inf(scaler, g, static_cast<uint64_t>(it), kThreads * kFlagsPerThread);
    scaler.update();
    for (auto& w : workers) w.join();
    standalone_iteration(reference, bad ? std::numeric_limits<double>::infinity() : 0.0, cpu);
    ASSERT_EQ(scaler.get_scale(), reference.get_scale()) << "iteration " << it;
  }
}

// An executor (the runtime's optimizer thread, here a plain thread) runs unscale_/step called
// outside any scope, inside a scope of its choosing.
TEST(GradScalerCrossThreadTest, Executor_MarshalsCallsOutsideScopes) {
  GradScaler scaler(GradScalerOptions().init_scale(4.0));
  auto param = torch::zeros({2}).set_requires_grad(true);
  torch::optim::SGD opt({param}, 1.0);
  param.mutable_grad() = scaler.scale(torch::ones({2}));
  auto iteration = detail::GradScalerAccess::capture_iteration(scaler);
  std::vector<std::thread::id> ran_on;
  auto executor = std::make_shared<const detail::Executor>([&](const std::function<void()>& call) {
    std::thread([&] {
      ran_on.push_back(std::this_thread::get_id());
      detail::IterationScope scope(scaler, iteration);
      call();
    }).join();
  });
  detail::GradScalerAccess::set_executor(scaler, executor);
  scaler.unscale_(opt);
  EXPECT_TRUE(torch::equal(param.grad(), torch::ones({2})));
  EXPECT_TRUE(scaler.step(opt));  // continues the iteration's state: no second unscale
  EXPECT_TRUE(torch::equal(param.detach(), torch::full({2}, -1.0)));
  ASSERT_EQ(ran_on.size(), 2u);
  EXPECT_NE(ran_on[0], std::this_thread::get_id());
  executor.reset();  // expired: calls run on the caller again, on the live state
  param.mutable_grad() = torch::full({2}, 4.0);
  scaler.unscale_(opt);
  EXPECT_TRUE(torch::equal(param.grad(), torch::ones({2})));
  EXPECT_EQ(ran_on.size(), 2u);
}

}  // namespace
}  // namespace roundpipe::amp
