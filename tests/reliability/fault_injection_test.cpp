// Fault injection (docs/reliability.md): an exception thrown in every place user code runs inside
// RoundPipe (a layer's forward, recompute, backward, loss_fn, step functions sync and async)
// reaches the caller as a clear error, no thread hangs (each test runs under a Watchdog), no
// thread, file descriptor or CPU tensor is left behind, and the model then trains on exactly as a
// plain LibTorch loop that skipped the failed call. Three CPU devices; the *_CUDA twin runs the
// same cases on the GPUs.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <vector>

#include "roundpipe/devices.h"
#include "roundpipe/round_pipe.h"
#include "tests/common/tensor_compare.h"
#include "tests/reliability/fault_models.h"
#include "tests/reliability/reliability_util.h"
#include "tests/roundpipe/test_models.h"

namespace roundpipe {
namespace {

using testing::InjectAt;

constexpr unsigned kTestSeconds = 60;

LossFn mse_over(int64_t full_numel) {
  return [full_numel](const torch::Tensor& out, const torch::Tensor& y) {
    return torch::mse_loss(out, y, torch::Reduction::Sum) / static_cast<double>(full_numel);
  };
}

struct Batch {
  torch::Tensor x, y;
};

Batch batch(int64_t k) {
  torch::manual_seed(4000 + k);
  return {torch::randn({9, 8}), torch::randn({9, 4})};
}

// Where a fault is injected.
enum class Site { kForward, kRecompute, kBackward, kLossFn, kStepSync, kStepAsync };

struct FaultCase {
  const char* name;
  Site site;
  std::vector<const char*> expected;  // substrings of the caller's error message
};

const std::vector<FaultCase>& fault_cases() {
  static const std::vector<FaultCase> cases = {
      {"layer forward", Site::kForward,
       {"RoundPipe 'faults': forward stage [0, 3)", "layer 1 (roundpipe::testing::InjectImpl)", "microbatch 0",
        "injected forward failure"}},
      {"recompute", Site::kRecompute,
       {"RoundPipe 'faults': backward stage [0, 3)", "layer 1 (roundpipe::testing::InjectImpl)", "(recompute)",
        "injected recompute failure"}},
      {"backward", Site::kBackward,
       {"RoundPipe 'faults': backward stage [0, 3)", "microbatch 0 (backward)", "injected backward failure"}},
      {"loss_fn", Site::kLossFn, {"RoundPipe 'faults': fused stage [3, 6)", "(loss_fn): injected loss failure"}},
      {"step_fn sync", Site::kStepSync, {"injected step failure"}},
      {"step_fn async", Site::kStepAsync, {"injected step failure"}},
  };
  return cases;
}

void expect_message(const std::string& msg, const FaultCase& c) {
  for (const char* text : c.expected) EXPECT_NE(msg.find(text), std::string::npos) << c.name << ": " << msg;
}

// One case: a warm-up iteration, three failing calls, one recovery iteration, all on the model
// Linear, Inject, Tanh, Linear, Tanh, Linear with forward stage [0, 3), fused [3, 6) and backward
// [0, 3) on `devices`. The reference is a plain loop that skips the failed calls (a failed step
// leaves its gradients in place, as a throwing optimizer.step() does in LibTorch).
void fault_case(const FaultCase& c, const std::vector<c10::Device>& devices) {
  SCOPED_TRACE(c.name);
  auto mode = std::make_shared<std::atomic<int>>(0);
  torch::manual_seed(3);
  torch::nn::Sequential model(torch::nn::Linear(8, 16), testing::Inject(mode), torch::nn::Tanh(),
                              torch::nn::Linear(16, 16), torch::nn::Tanh(), torch::nn::Linear(16, 4));
  auto reference = testing::deep_copy(model);
  torch::optim::SGD ref_opt(reference->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  RoundPipe rp(model, RoundPipeOptions().devices(devices).name("faults"));
  auto opt = [&] {
    OptimizerCtx ctx;
    return torch::optim::SGD(rp.parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  }();
  RunConfig cfg;
  cfg.num_microbatch = 3;
  cfg.execute_plan = scheduler::ExecutePlan({{0, 3}}, {{3, 6}, {0, 3}});
  const c10::Device input_device = devices[0];
  auto good_step = [&] {
    opt.step();
    opt.zero_grad();
  };
  auto iterate = [&](const Batch& b) {  // async + synchronize: a sync step that starts the optimizer thread
    rp.forward_backward({b.x.to(input_device)}, b.y.to(input_device), mse_over(b.y.numel()), cfg);
    rp.step(good_step, StepMode::kAsync);
    rp.synchronize();
  };
  auto ref_backward = [&](const Batch& b) {
    mse_over(b.y.numel())(reference->forward(b.x), b.y).backward();
  };
  auto ref_step = [&] {
    ref_opt.step();
    ref_opt.zero_grad();
  };

  const Batch failing = batch(1);
  iterate(batch(0));
  ref_backward(batch(0));
  ref_step();
  const auto before = testing::Resources::now();

  const LossFn throwing_loss = [](const torch::Tensor&, const torch::Tensor&) -> torch::Tensor {
    TORCH_CHECK(false, "injected loss failure");
    return torch::Tensor();
  };
  const bool step_fault = c.site == Site::kStepSync || c.site == Site::kStepAsync;
  if (step_fault) {
    rp.forward_backward({failing.x.to(input_device)}, failing.y.to(input_device), mse_over(failing.y.numel()), cfg);
    ref_backward(failing);  // its gradients stay (no step ran)
  }
  for (int rep = 0; rep < 3; ++rep) {
    mode->store(static_cast<int>(c.site == Site::kForward     ? InjectAt::kForward
                                 : c.site == Site::kRecompute ? InjectAt::kRecompute
                                 : c.site == Site::kBackward  ? InjectAt::kBackward
                                                              : InjectAt::kNone));
    try {
      if (c.site == Site::kStepSync) {
        rp.step([] { TORCH_CHECK(false, "injected step failure"); }, StepMode::kSync);
      } else if (c.site == Site::kStepAsync) {
        rp.step([] { TORCH_CHECK(false, "injected step failure"); }, StepMode::kAsync);
        rp.synchronize();  // the sync point that rethrows it
      } else {
        rp.forward_backward({failing.x.to(input_device)}, failing.y.to(input_device),
                            c.site == Site::kLossFn ? throwing_loss : mse_over(failing.y.numel()), cfg);
        // A backward stage's error may come after forward_backward returned (Note [Overlapping
        // iterations]): the next call into the model rethrows it.
        rp.synchronize();
      }
      ADD_FAILURE() << c.name << ": expected an error at repetition " << rep;
    } catch (const c10::Error& e) {
      expect_message(e.what_without_backtrace(), c);
    }
    mode->store(0);
  }
  // The failed calls left no gradient behind (a failed run's gradients are dropped).
  if (!step_fault) {
    for (const auto& p : rp.module()->parameters()) EXPECT_FALSE(p.grad().defined()) << c.name;
  }

  // Usable afterwards: the next iteration matches the plain loop.
  iterate(batch(2));
  ref_backward(batch(2));
  ref_step();
  expect_no_leak(before, testing::Resources::now(), c.name);
  EXPECT_TRUE(testing::tensor_lists_close(rp.module()->parameters(), reference->parameters(), 1e-6)) << c.name;
  EXPECT_TRUE(testing::tensor_lists_close(rp.optim_parameters(), reference->parameters(), 1e-6)) << c.name;
}

std::vector<c10::Device> cpu_devices(int n) { return std::vector<c10::Device>(n, c10::Device(c10::kCPU)); }

TEST(FaultInjectionTest, EveryFaultSite_ClearErrorNoLeakModelUsable) {
  testing::Watchdog watchdog(kTestSeconds);
  for (const auto& c : fault_cases()) fault_case(c, cpu_devices(3));
}

TEST(FaultInjectionTest, EveryFaultSite_ClearErrorNoLeakModelUsable_CUDA) {
  testing::Watchdog watchdog(kTestSeconds);
  std::vector<c10::Device> gpus;
  for (int64_t i = 0; i < cuda_device_count(); ++i) gpus.emplace_back(c10::kCUDA, i);
  // One GPU still exercises the CUDA paths (uploads, downloads, streams); three stage jobs run on it.
  for (const auto& c : fault_cases()) fault_case(c, gpus);
}

// A callback calling back into its own model would wait for itself (a loss_fn on a device
// worker, a step function on the optimizer thread): a clear error instead of a deadlock.
TEST(FaultInjectionTest, CallbackCallingItsModel_ClearErrorNoDeadlock) {
  testing::Watchdog watchdog(kTestSeconds);
  torch::nn::Sequential model = testing::make_mlp(5);
  auto reference = testing::deep_copy(model);
  RoundPipe rp(model, RoundPipeOptions().devices(cpu_devices(3)).name("reentrant"));
  auto opt = [&] {
    OptimizerCtx ctx;
    return torch::optim::SGD(rp.parameters(), 0.05);
  }();
  torch::optim::SGD ref_opt(reference->parameters(), 0.05);
  const Batch b = batch(0), next = batch(1);
  rp.forward_backward({b.x}, b.y, mse_over(b.y.numel()));
  rp.step([&] { opt.step(); opt.zero_grad(); });
  rp.synchronize();
  const auto before = testing::Resources::now();

  const LossFn calls_forward = [&](const torch::Tensor& out, const torch::Tensor& y) {
    rp.forward({b.x});
    return mse_over(y.numel())(out, y);
  };
  try {
    rp.forward_backward({b.x}, b.y, calls_forward);
    ADD_FAILURE() << "expected an error";
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    EXPECT_NE(msg.find("RoundPipe 'reentrant': forward called from inside a loss_fn or a layer"), std::string::npos)
        << msg;
    EXPECT_NE(msg.find("(loss_fn)"), std::string::npos) << msg;
  }
  for (const char* call : {"synchronize", "step", "forward_backward"}) {
    rp.forward_backward({b.x}, b.y, mse_over(b.y.numel()));
    rp.step([&, call] {
      if (std::string(call) == "synchronize") rp.synchronize();
      if (std::string(call) == "step") rp.step([] {});
      if (std::string(call) == "forward_backward") rp.forward_backward({b.x}, b.y, mse_over(b.y.numel()));
    });
    try {
      rp.synchronize();
      ADD_FAILURE() << "expected an error from " << call;
    } catch (const c10::Error& e) {
      const std::string msg = e.what_without_backtrace();
      EXPECT_NE(msg.find(std::string("RoundPipe 'reentrant': ") + call + " called from inside a step function"),
                std::string::npos)
          << msg;
    }
    rp.step([&] { opt.zero_grad(); }, StepMode::kSync);  // drop the failed step's gradients
  }
  // Usable afterwards, like a plain loop that ran the warm-up step only.
  ref_opt.zero_grad();
  mse_over(b.y.numel())(reference->forward(b.x), b.y).backward();
  ref_opt.step();
  ref_opt.zero_grad();
  EXPECT_TRUE(testing::tensor_lists_close(rp.module()->parameters(), reference->parameters(), 1e-6));
  {
    auto loss = rp.forward_backward({next.x}, next.y, mse_over(next.y.numel()));
    torch::NoGradGuard no_grad;
    EXPECT_TRUE(testing::tensors_close(loss, mse_over(next.y.numel())(reference->forward(next.x), next.y), 1e-6));
  }
  rp.step([&] { opt.zero_grad(); }, StepMode::kSync);
  expect_no_leak(before, testing::Resources::now(), "callbacks calling their model");
}

}  // namespace
}  // namespace roundpipe
