// GradScaler under faults (docs/reliability.md): inf/NaN storms (every step overflowing for 30
// steps: the scale backs off each time, no step is applied, nothing crashes; training recovers
// once gradients are finite) in sync and async mode, and scaler calls made from the wrong
// thread (inside loss_fn on a device worker, update() inside a step function): a clear error, and
// the scaler and model keep working.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "amp/grad_scaler.h"
#include "roundpipe/devices.h"
#include "roundpipe/round_pipe.h"
#include "tests/common/tensor_compare.h"
#include "tests/reliability/fault_models.h"
#include "tests/reliability/reliability_util.h"
#include "tests/roundpipe/test_models.h"

namespace roundpipe {
namespace {

constexpr unsigned kTestSeconds = 60;
constexpr int kStormSteps = 30;
constexpr int kRecoverySteps = 6;

LossFn scaled_mse(amp::GradScaler& scaler, double n) {
  return [&scaler, n](const torch::Tensor& out, const torch::Tensor& t) {
    return scaler.scale(torch::mse_loss(out, t, torch::Reduction::Sum) / n);
  };
}

std::vector<c10::Device> cpu_devices(int n) { return std::vector<c10::Device>(n, c10::Device(c10::kCPU)); }

std::vector<torch::Tensor> clones(const std::vector<torch::Tensor>& ts) {
  std::vector<torch::Tensor> out;
  for (const auto& t : ts) out.push_back(t.detach().clone());
  return out;
}

bool all_equal(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t k = 0; k < a.size(); ++k) {
    if (!a[k].equal(b[k])) return false;
  }
  return true;
}

// 30 iterations whose gradients are all inf or NaN (alternating), then finite ones. Reference: a
// plain loop with its own GradScaler (sync: parameters after every step; async: a staleness-one
// loop that skips the same steps). During the storm every step is skipped, so the parameters stay
// bitwise at their initial values and the scale halves each iteration.
void storm_case(StepMode mode, const std::vector<c10::Device>& devices, double tolerance) {
  auto poison = std::make_shared<std::atomic<double>>(1.0);
  torch::manual_seed(13);
  torch::nn::Sequential model(torch::nn::Linear(8, 16), torch::nn::Tanh(), testing::Poison(poison),
                              torch::nn::Linear(16, 16), torch::nn::Tanh(), torch::nn::Linear(16, 4));
  // Reference: compute copy C and master M (sync: the same model; async: C lags M by one step).
  auto compute = testing::deep_copy(model);
  auto master = testing::deep_copy(model);
  torch::optim::SGD ref_opt(master->parameters(), 0.05);
  RoundPipe rp(model, RoundPipeOptions().devices(devices));
  auto opt = [&] {
    OptimizerCtx ctx;
    return torch::optim::SGD(rp.parameters(), 0.05);
  }();
  const double init_scale = 65536.0;
  auto options = amp::GradScalerOptions().init_scale(init_scale).growth_interval(2);
  amp::GradScaler scaler(options), ref_scaler(options);
  const auto initial = clones(rp.module()->parameters());
  const double inf = std::numeric_limits<double>::infinity();
  int applied = 0;
  for (int it = 0; it < kStormSteps + kRecoverySteps; ++it) {
    const bool storm = it < kStormSteps;
    poison->store(!storm ? 1.0 : it % 2 == 0 ? inf : std::nan(""));
    torch::manual_seed(130 + it);
    auto x = torch::randn({9, 8}), y = torch::randn({9, 4});
    const double n = static_cast<double>(y.numel());
    rp.forward_backward({x}, y, scaled_mse(scaler, n));
    rp.step([&] {
      if (scaler.step(opt)) ++applied;  // the optimizer thread (async) or this one (sync)
      opt.zero_grad();
    }, mode);
    scaler.update();

    // Reference iteration (staleness one in async mode, DESIGN.md §3): backward on C, then C <- M
    // (async: the values after the previous step), C's gradients into M, M steps; sync: C <- M last.
    ref_scaler.scale(torch::mse_loss(compute->forward(x), y, torch::Reduction::Sum) / n).backward();
    torch::NoGradGuard no_grad_copy;
    auto cp = compute->parameters(), mp = master->parameters();
    if (mode == StepMode::kAsync) {
      for (size_t k = 0; k < cp.size(); ++k) cp[k].copy_(mp[k]);
    }
    for (size_t k = 0; k < cp.size(); ++k) {
      mp[k].mutable_grad() = cp[k].grad();
      cp[k].mutable_grad().reset();
    }
    ref_scaler.step(ref_opt);
    ref_opt.zero_grad();
    ref_scaler.update();
    if (mode == StepMode::kSync) {
      for (size_t k = 0; k < cp.size(); ++k) cp[k].copy_(mp[k]);
    }

    ASSERT_EQ(scaler.get_scale(), ref_scaler.get_scale()) << "iteration " << it;
    if (storm) {
      ASSERT_EQ(scaler.get_scale(), init_scale * std::pow(0.5, it + 1)) << "iteration " << it;
      if (mode == StepMode::kSync) {
        ASSERT_TRUE(all_equal(rp.module()->parameters(), initial)) << "a step was applied at iteration " << it;
      }
    }
    if (it == kStormSteps - 1) {
      rp.synchronize();
      EXPECT_TRUE(all_equal(rp.module()->parameters(), initial)) << "a step was applied during the storm";
      EXPECT_TRUE(all_equal(rp.optim_parameters(), initial)) << "a master changed during the storm";
      EXPECT_EQ(applied, 0);
    }
  }
  rp.synchronize();
  if (mode == StepMode::kAsync) {
    torch::NoGradGuard no_grad;
    auto cp = compute->parameters(), mp = master->parameters();
    for (size_t k = 0; k < cp.size(); ++k) cp[k].copy_(mp[k]);
  }
  EXPECT_EQ(applied, kRecoverySteps);
  EXPECT_FALSE(all_equal(rp.module()->parameters(), initial));  // it trained again
  EXPECT_TRUE(testing::tensor_lists_close(rp.module()->parameters(), compute->parameters(), tolerance));
  EXPECT_TRUE(testing::tensor_lists_close(rp.optim_parameters(), master->parameters(), tolerance));
}

TEST(ScalerFaultsTest, InfNanStorm30Steps_BacksOffSkipsAllThenRecovers_Sync) {
  testing::Watchdog watchdog(kTestSeconds);
  storm_case(StepMode::kSync, cpu_devices(3), 1e-6);
}

TEST(ScalerFaultsTest, InfNanStorm30Steps_BacksOffSkipsAllThenRecovers_Async) {
  testing::Watchdog watchdog(kTestSeconds);
  storm_case(StepMode::kAsync, cpu_devices(3), 1e-6);
}

std::vector<c10::Device> gpus() {
  std::vector<c10::Device> out;
  for (int64_t i = 0; i < cuda_device_count(); ++i) out.emplace_back(c10::kCUDA, i);
  return out;
}

// The same storms with the scale, the flags and the stage jobs on the GPUs (the reference stays on
// the CPU, hence the tolerance; the storm itself is checked bitwise: nothing may change).
TEST(ScalerFaultsTest, InfNanStorm30Steps_BacksOffSkipsAllThenRecovers_Sync_CUDA) {
  testing::Watchdog watchdog(kTestSeconds);
  storm_case(StepMode::kSync, gpus(), 1e-5);
}

TEST(ScalerFaultsTest, InfNanStorm30Steps_BacksOffSkipsAllThenRecovers_Async_CUDA) {
  testing::Watchdog watchdog(kTestSeconds);
  storm_case(StepMode::kAsync, gpus(), 1e-5);
}

void expect_error(const std::function<void()>& call, const std::vector<std::string>& expected, const char* what) {
  try {
    call();
    ADD_FAILURE() << what << ": expected an error";
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    for (const auto& text : expected) EXPECT_NE(msg.find(text), std::string::npos) << what << ": " << msg;
  }
}

// unscale_/step/update inside loss_fn (a device worker) and update() inside a step function (the
// optimizer thread) fail clearly; the failed iterations count for nothing, so the scale and the
// parameters then follow a plain loop that never ran them.
TEST(ScalerFaultsTest, ScalerCalledFromWrongThread_ClearErrorThenUsable) {
  testing::Watchdog watchdog(kTestSeconds);
  torch::manual_seed(14);
  torch::nn::Sequential model = testing::make_mlp(14);
  auto reference = testing::deep_copy(model);
  RoundPipe rp(model, RoundPipeOptions().devices(cpu_devices(3)));
  auto opt = [&] {
    OptimizerCtx ctx;
    return torch::optim::SGD(rp.parameters(), 0.05);
  }();
  torch::optim::SGD ref_opt(reference->parameters(), 0.05);
  auto options = amp::GradScalerOptions().init_scale(1024.0).growth_interval(1);
  amp::GradScaler scaler(options), ref_scaler(options);
  torch::manual_seed(140);
  auto x = torch::randn({9, 8}), y = torch::randn({9, 4});
  const double n = static_cast<double>(y.numel());
  auto good_iteration = [&](StepMode mode) {
    rp.forward_backward({x}, y, scaled_mse(scaler, n));
    rp.step([&] {
      scaler.step(opt);
      opt.zero_grad();
    }, mode);
    scaler.update();
    ref_scaler.scale(torch::mse_loss(reference->forward(x), y, torch::Reduction::Sum) / n).backward();
    ref_scaler.step(ref_opt);
    ref_opt.zero_grad();
    ref_scaler.update();
  };
  good_iteration(StepMode::kAsync);  // installs the scaler's executor and starts the optimizer thread
  rp.synchronize();
  const auto before = testing::Resources::now();

  const std::vector<std::string> in_loss_fn = {"() called inside a RoundPipe loss_fn (on a device worker thread)",
                                               "(loss_fn)"};
  auto loss_calling = [&](const std::function<void()>& call) {
    return [&, call](const torch::Tensor& out, const torch::Tensor& t) {
      auto loss = scaler.scale(torch::mse_loss(out, t, torch::Reduction::Sum) / n);
      call();
      return loss;
    };
  };
  expect_error([&] { rp.forward_backward({x}, y, loss_calling([&] { scaler.unscale_(opt); })); }, in_loss_fn,
               "unscale_ in loss_fn");
  expect_error([&] { rp.forward_backward({x}, y, loss_calling([&] { scaler.step(opt); })); }, in_loss_fn,
               "step in loss_fn");
  expect_error([&] { rp.forward_backward({x}, y, loss_calling([&] { scaler.update(); })); }, in_loss_fn,
               "update in loss_fn");
  for (StepMode mode : {StepMode::kSync, StepMode::kAsync}) {
    rp.forward_backward({x}, y, scaled_mse(scaler, n));
    ref_scaler.scale(torch::mse_loss(reference->forward(x), y, torch::Reduction::Sum) / n).backward();
    expect_error(
        [&] {
          rp.step([&] {
            scaler.step(opt);
            opt.zero_grad();
            scaler.update();  // the wrong thread: update() belongs to the caller
          }, mode);
          rp.synchronize();
        },
        {"GradScaler::update() called inside a RoundPipe step function (on the optimizer thread)"},
        mode == StepMode::kSync ? "update in a sync step function" : "update in an async step function");
    scaler.update();  // where it belongs: the iteration completes normally
    ref_scaler.step(ref_opt);
    ref_opt.zero_grad();
    ref_scaler.update();
  }
  good_iteration(StepMode::kAsync);
  rp.synchronize();
  EXPECT_EQ(scaler.get_scale(), ref_scaler.get_scale());
  EXPECT_EQ(scaler.get_scale(), 1024.0 * 16);  // four finite iterations, growth_interval 1
  EXPECT_TRUE(testing::tensor_lists_close(rp.module()->parameters(), reference->parameters(), 1e-6));
  expect_no_leak(before, testing::Resources::now(), "scaler called from the wrong thread");
}

}  // namespace
}  // namespace roundpipe
