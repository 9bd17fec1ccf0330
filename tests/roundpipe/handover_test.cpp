// Deferred hand-over (Note [Deferred hand-over], stage_jobs.cpp): CUDA jobs hand a microbatch's
// results to other jobs only after the next microbatch's compute is enqueued, and lease each layer
// when their first microbatch first needs it (Note [Lazy leases]). CPU jobs do the same here
// (set_cuda_flow_on_cpu_for_testing), so the CPU suite runs that control flow: results
// are bitwise those of immediate hand-over, and close to a plain LibTorch loop; forward-only runs,
// overlapping iterations with dropout and errors mid-run behave as without deferral.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "roundpipe/detail/stage_jobs.h"
#include "roundpipe/round_pipe.h"
#include "tests/common/tensor_compare.h"
#include "tests/roundpipe/test_models.h"

namespace roundpipe {
namespace {

using testing::cpu_devices;
using testing::mse_over;

class DeferredHandoverTest : public ::testing::Test {
 protected:
  void SetUp() override { detail::set_cuda_flow_on_cpu_for_testing(true); }
  void TearDown() override { detail::set_cuda_flow_on_cpu_for_testing(false); }
};

struct RunResult {
  std::vector<torch::Tensor> losses, params;
};

// `steps` training iterations of a transformer (dropout `p`) with SGD + momentum, the given step
// mode, plan grain and device count.
RunResult train(bool defer, int devices, RecomputeGrain grain, double p, StepMode mode, int steps) {
  detail::set_cuda_flow_on_cpu_for_testing(defer);
  RoundPipe rp(testing::make_transformer(21, p), RoundPipeOptions().devices(cpu_devices(devices)).seed(99));
  auto opt = [&] {
    OptimizerCtx ctx;
    return torch::optim::SGD(rp.parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  }();
  RunConfig cfg;
  cfg.num_microbatch = 4;
  cfg.recompute_grain = grain;
  RunResult result;
  for (int step = 0; step < steps; ++step) {
    torch::manual_seed(500 + step);
    auto x = torch::randn({8, 5, 16}), y = torch::randn({8, 5, 4});
    result.losses.push_back(rp.forward_backward({x}, y, mse_over(y.numel()), cfg).detach().clone());
    rp.step(
        [&] {
          opt.step();
          opt.zero_grad();
        },
        mode);
  }
  rp.synchronize();
  for (const auto& t : rp.module()->parameters()) result.params.push_back(t.detach().clone());
  detail::set_cuda_flow_on_cpu_for_testing(true);
  return result;
}

void expect_bitwise(const RunResult& a, const RunResult& b) {
  ASSERT_EQ(a.losses.size(), b.losses.size());
  for (size_t i = 0; i < a.losses.size(); ++i) EXPECT_TENSOR_EQ(a.losses[i], b.losses[i]) << "loss " << i;
  ASSERT_EQ(a.params.size(), b.params.size());
  for (size_t i = 0; i < a.params.size(); ++i) EXPECT_TENSOR_EQ(a.params[i], b.params[i]) << "param " << i;
}

// Forward, fused and backward stages, both grains, 1-3 devices: deferred == immediate, bitwise,
// and both match the plain full-batch loop.
TEST_F(DeferredHandoverTest, Training_BitwiseAsImmediateAndCloseToPlainLoop) {
  // The plain loop: same model, data and optimizer, no RoundPipe.
  auto reference = testing::make_transformer(21, 0.0);
  torch::optim::SGD ref_opt(reference->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  for (int step = 0; step < 3; ++step) {
    torch::manual_seed(500 + step);
    auto x = torch::randn({8, 5, 16}), y = torch::randn({8, 5, 4});
    mse_over(y.numel())(reference->forward(x), y).backward();
    ref_opt.step();
    ref_opt.zero_grad();
  }
  for (int devices : {1, 2, 3}) {
    for (auto grain : {RecomputeGrain::kStage, RecomputeGrain::kLayer}) {
      SCOPED_TRACE(std::to_string(devices) + " devices, grain " + std::to_string(static_cast<int>(grain)));
      const auto deferred = train(true, devices, grain, 0.0, StepMode::kSync, 3);
      expect_bitwise(deferred, train(false, devices, grain, 0.0, StepMode::kSync, 3));
      EXPECT_TRUE(testing::tensor_lists_close(deferred.params, reference->parameters(), 1e-5, 1e-5));
    }
  }
}

// Dropout, async steps and overlapping iterations (the backward stages of iteration i still
// running while iteration i+1 starts): bitwise as immediate hand-over.
TEST_F(DeferredHandoverTest, AsyncDropout_BitwiseAsImmediate) {
  for (int devices : {2, 3}) {
    SCOPED_TRACE(std::to_string(devices) + " devices");
    expect_bitwise(train(true, devices, RecomputeGrain::kStage, 0.2, StepMode::kAsync, 5),
                   train(false, devices, RecomputeGrain::kStage, 0.2, StepMode::kAsync, 5));
  }
}

// forward(): the last forward stage's outputs reach the caller through the deferred path.
TEST_F(DeferredHandoverTest, Forward_OutputsBitwiseAsImmediate) {
  auto model = testing::make_transformer(23, 0.0);
  torch::manual_seed(7);
  auto x = torch::randn({9, 5, 16});
  RunConfig cfg;
  cfg.num_microbatch = 3;
  cfg.execute_plan = scheduler::ExecutePlan({{0, 1}, {1, 3}, {3, 4}}, {});
  std::vector<torch::Tensor> outs;
  for (bool defer : {true, false}) {
    detail::set_cuda_flow_on_cpu_for_testing(defer);
    RoundPipe rp(testing::deep_copy(model), RoundPipeOptions().devices(cpu_devices(3)));
    outs.push_back(rp.forward({x}, cfg));
  }
  EXPECT_TENSOR_EQ(outs[0], outs[1]);
  torch::NoGradGuard no_grad;
  EXPECT_TRUE(testing::tensors_close(outs[0], model->forward(x), 1e-6));
}

// A layer that throws on microbatch 2 of 3 while the stage holds microbatch 1's results: the
// caller gets the error naming the layer, nothing hangs, and the next call is right.
TEST_F(DeferredHandoverTest, ErrorMidRun_ReachesCaller_NextCallRight) {
  auto fail = std::make_shared<std::atomic<bool>>(true);
  torch::manual_seed(1);
  torch::nn::Sequential model(torch::nn::Linear(8, 8), torch::nn::Tanh(), testing::Faulty(fail, 3, 2),
                              torch::nn::Linear(8, 4));
  auto reference = testing::deep_copy(model);
  RoundPipe rp(model, RoundPipeOptions().devices(cpu_devices(3)).name("faulty"));
  torch::manual_seed(2);
  auto x = torch::randn({12, 8}), y = torch::randn({12, 4});
  RunConfig cfg;
  cfg.num_microbatch = 3;
  cfg.execute_plan = scheduler::ExecutePlan({{0, 1}, {1, 3}}, {{3, 4}, {2, 3}, {0, 2}});
  for (int rep = 0; rep < 20; ++rep) {
    try {
      rp.forward_backward({x}, y, mse_over(y.numel()), cfg);
      FAIL() << "expected an error at repetition " << rep;
    } catch (const c10::Error& e) {
      const std::string msg = e.what_without_backtrace();
      ASSERT_NE(msg.find("layer 2 (roundpipe::testing::FaultyImpl)"), std::string::npos) << msg;
      ASSERT_NE(msg.find("microbatch 2"), std::string::npos) << msg;
    }
  }
  fail->store(false);
  auto loss = rp.forward_backward({x}, y, mse_over(y.numel()), cfg);
  auto ref_loss = mse_over(y.numel())(reference->forward(x), y);
  ref_loss.backward();
  EXPECT_TRUE(testing::tensors_close(loss, ref_loss.detach(), 1e-6));
  for (size_t k = 0; k < reference->parameters().size(); ++k) {
    EXPECT_TRUE(testing::tensors_close(rp.module()->parameters()[k].grad(), reference->parameters()[k].grad(), 1e-6));
  }
}

}  // namespace
}  // namespace roundpipe
