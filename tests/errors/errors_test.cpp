// The input validation catalogue (docs/errors.md): one test per row that no module's own suite
// covers, each asserting the message a user sees (and, where RoundPipe accepts the input, the
// result against a plain LibTorch loop).
#include <gtest/gtest.h>
#include <stdlib.h>
#include <torch/torch.h>
#include <unistd.h>

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "base/config.h"
#include "base/logging.h"
#include "roundpipe/devices.h"
#include "roundpipe/round_pipe.h"
#include "tests/common/tensor_compare.h"
#include "tests/common/test_macros.h"

namespace roundpipe {
namespace {

std::vector<c10::Device> cpu_devices(int n) { return std::vector<c10::Device>(n, c10::Device(c10::kCPU)); }

torch::nn::Sequential make_mlp(int64_t seed) {
  torch::manual_seed(seed);
  return torch::nn::Sequential(torch::nn::Linear(8, 16), torch::nn::Tanh(), torch::nn::Linear(16, 4));
}

// Sum-reduced loss over a microbatch divided by the full batch's element count.
LossFn mse_over(int64_t full_numel) {
  return [full_numel](const torch::Tensor& out, const torch::Tensor& y) {
    return torch::mse_loss(out, y, torch::Reduction::Sum) / static_cast<double>(full_numel);
  };
}

RunConfig microbatches(int64_t n) {
  RunConfig cfg;
  cfg.num_microbatch = n;
  return cfg;
}

TEST(ErrorsTest, EmptySequential_Refused) {
  EXPECT_THROW_WITH(RoundPipe(torch::nn::Sequential(), RoundPipeOptions().devices(cpu_devices(1))),
                    "RoundPipe needs a torch::nn::Sequential with at least one layer");
  EXPECT_THROW_WITH(RoundPipe(torch::nn::Sequential(nullptr), RoundPipeOptions().devices(cpu_devices(1))),
                    "RoundPipe needs a torch::nn::Sequential with at least one layer");
}

TEST(ErrorsTest, ZeroDevices_EmptyListMeansTheDefaultDevices) {
  // RoundPipeOptions::devices({}) is the documented default (every visible GPU, else the CPU).
  RoundPipe rp(make_mlp(1), RoundPipeOptions().devices({}));
  EXPECT_EQ(rp.devices(), default_devices());
  // check_devices, the validator behind the option, refuses an empty list outright.
  EXPECT_THROW_WITH(check_devices({}), "RoundPipeOptions::devices is empty: give at least one device");
}

TEST(ErrorsTest, DeviceThatDoesNotExist_NamesIndexAndVisibleCount) {
  const int64_t n = cuda_device_count();
  const c10::Device missing(c10::kCUDA, static_cast<c10::DeviceIndex>(n));
  const std::string prefix = "RoundPipeOptions::devices[1] = cuda:" + std::to_string(n);
  if (ROUNDPIPE_WITH_CUDA) {
    EXPECT_THROW_WITH(RoundPipe(make_mlp(1), RoundPipeOptions().devices({c10::kCPU, missing})),
                      prefix + " but only " + std::to_string(n) + " CUDA device(s) are visible: ");
    EXPECT_THROW_WITH(RoundPipe(make_mlp(1), RoundPipeOptions().devices({c10::kCPU, missing})),
                      n == 0 ? "use CPU devices" : "use indices 0 to");
  } else {
    EXPECT_THROW_WITH(RoundPipe(make_mlp(1), RoundPipeOptions().devices({c10::kCPU, missing})),
                      prefix + " but this build of RoundPipe has no CUDA support");
  }
  EXPECT_THROW_WITH(RoundPipe(make_mlp(1), RoundPipeOptions().devices({c10::Device(c10::kMeta)})),
                    "RoundPipeOptions::devices[0] = meta is not supported: use CPU or CUDA devices");
}

TEST(ErrorsTest, NumMicrobatchBelowOne_Refused) {
  RunConfig zero;
  zero.num_microbatch = 0;
  EXPECT_THROW_WITH(RoundPipe(make_mlp(1), RoundPipeOptions().devices(cpu_devices(1)).run_config(zero)),
                    "RoundPipeOptions::run_config.num_microbatch must be >= 1, got 0");
  RoundPipe rp(make_mlp(1), RoundPipeOptions().devices(cpu_devices(2)));
  auto x = torch::randn({6, 8}), y = torch::randn({6, 4});
  EXPECT_THROW_WITH(rp.forward_backward({x}, y, mse_over(y.numel()), microbatches(-2)),
                    "num_microbatch must be >= 1, got -2");
  EXPECT_THROW_WITH(rp.forward({x}, microbatches(0)), "num_microbatch must be >= 1, got 0");
}

// A log file that receives every RoundPipe logger's lines from now on (removed at the end).
class LogCapture {
 public:
  LogCapture() {
    char name[] = "/tmp/roundpipe_errors_log_XXXXXX";
    const int fd = mkstemp(name);
    EXPECT_GE(fd, 0);
    close(fd);
    path_ = name;
    add_log_file(path_);
  }
  ~LogCapture() { unlink(path_.c_str()); }
  std::string text() const {
    std::ifstream in(path_);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }

 private:
  std::string path_;
};

TEST(ErrorsTest, BatchSmallerThanMicrobatchCount_WarnsAndUsesOneRowPerMicrobatch) {
  if (!Logger::get("runtime").enabled(LogLevel::kWarn)) GTEST_SKIP() << "warnings are off (ROUNDPIPE_LOG_LEVEL)";
  LogCapture log;
  auto model = make_mlp(2);
  auto reference = make_mlp(2);
  RoundPipe rp(model, RoundPipeOptions().devices(cpu_devices(2)).name("small"));
  auto x = torch::randn({2, 8}), y = torch::randn({2, 4});
  auto loss = rp.forward_backward({x}, y, mse_over(y.numel()), microbatches(4));
  EXPECT_TRUE(testing::tensors_close(loss, mse_over(y.numel())(reference->forward(x), y).detach(), 1e-6));
  EXPECT_NE(log.text().find("RoundPipe 'small': forward_backward: batch of 2 rows is smaller than num_microbatch 4; "
                            "using 2 microbatches"),
            std::string::npos)
      << log.text();
}

TEST(ErrorsTest, RowsDifferBetweenInputsOrLabel_Refused) {
  RoundPipe rp(make_mlp(1), RoundPipeOptions().devices(cpu_devices(2)).name("rows"));
  auto x = torch::randn({12, 8}), y = torch::randn({5, 4});
  EXPECT_THROW_WITH(rp.forward_backward({x}, y, mse_over(y.numel())),
                    "RoundPipe 'rows': forward_backward: the label has 5 rows (shape [5, 4]) but the inputs have 12: "
                    "the label is split along dim 0 with the inputs, so give it one row per input row");
  EXPECT_THROW_WITH(rp.forward_backward({x, torch::randn({5, 8})}, torch::randn({12, 4}), mse_over(48)),
                    "RoundPipe 'rows': inputs[1] has 5 rows but the batch has 12: every tensor with a batch "
                    "dimension must have the same size along dim 0");
  // A 0-dim label is handed whole to every microbatch.
  EXPECT_NO_THROW(rp.forward_backward({x}, torch::tensor(0.5), [](const torch::Tensor& out, const torch::Tensor& t) {
    return (out - t).pow(2).sum();
  }));
}

TEST(ErrorsTest, LossNotAScalar_Refused) {
  RoundPipe rp(make_mlp(1), RoundPipeOptions().devices(cpu_devices(2)).name("loss"));
  auto x = torch::randn({6, 8}), y = torch::randn({6, 4});
  auto per_element = [](const torch::Tensor& out, const torch::Tensor& t) {
    return torch::mse_loss(out, t, torch::Reduction::None);
  };
  EXPECT_THROW_WITH(rp.forward_backward({x}, y, per_element, microbatches(2)),
                    "(loss_fn): loss_fn must return a one-element tensor, got shape [3, 4]: reduce the loss to a "
                    "scalar inside loss_fn");
  auto undefined = [](const torch::Tensor&, const torch::Tensor&) { return torch::Tensor(); };
  EXPECT_THROW_WITH(rp.forward_backward({x}, y, undefined, microbatches(2)),
                    "loss_fn must return a one-element tensor, got an undefined tensor");
  auto detached = [](const torch::Tensor& out, const torch::Tensor& t) {
    return torch::mse_loss(out, t, torch::Reduction::Sum).detach();
  };
  EXPECT_THROW_WITH(rp.forward_backward({x}, y, detached, microbatches(2)),
                    "loss_fn returned a loss that does not require grad");
  // The model is still usable and nothing was accumulated by the failed calls.
  for (const auto& p : rp.module()->parameters()) EXPECT_FALSE(p.grad().defined());
  EXPECT_NO_THROW(rp.forward_backward({x}, y, mse_over(y.numel())));
}

TEST(ErrorsTest, InputOfWrongDtype_ErrorNamesLayerAndDtypes) {
  RoundPipe rp(make_mlp(1), RoundPipeOptions().devices(cpu_devices(2)).name("dtype"));
  auto x = torch::randn({6, 8}, torch::kDouble), y = torch::randn({6, 4});
  try {
    rp.forward_backward({x}, y, mse_over(y.numel()), microbatches(2));
    FAIL() << "a double input to a float model was accepted";
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    EXPECT_NE(msg.find("RoundPipe 'dtype': "), std::string::npos) << msg;
    EXPECT_NE(msg.find("layer 0 (torch::nn::Linear"), std::string::npos) << msg;
    EXPECT_NE(msg.find("microbatch 0"), std::string::npos) << msg;
    EXPECT_NE(msg.find("Double"), std::string::npos) << msg;
  }
  EXPECT_THROW_WITH(rp.forward({torch::ones({6, 8}, torch::kLong)}), "layer 0 (torch::nn::Linear");
}

TEST(ErrorsTest, InputWithoutData_ErrorNamesStage) {
  RoundPipe rp(make_mlp(1), RoundPipeOptions().devices(cpu_devices(2)).name("meta"));
  auto x = torch::empty({6, 8}, torch::kMeta), y = torch::randn({6, 4});
  EXPECT_THROW_WITH(rp.forward_backward({x}, y, mse_over(y.numel()), microbatches(2)),
                    "RoundPipe 'meta': fused stage [0, 3) on cpu, microbatch 0: Cannot copy out of meta tensor");
}

// Inputs and labels on another device than the stage's are copied to it: a CUDA batch trains a
// model on CPU workers exactly as a CPU batch does.
TEST(ErrorsTest, InputOnAnotherDevice_CopiedToTheStageDevice_CUDA) {
  auto reference = make_mlp(3);
  RoundPipe rp(make_mlp(3), RoundPipeOptions().devices(cpu_devices(2)));
  auto x = torch::randn({6, 8}), y = torch::randn({6, 4});
  auto loss = rp.forward_backward({x.to(torch::kCUDA)}, y.to(torch::kCUDA), mse_over(y.numel()), microbatches(3));
  auto ref_loss = mse_over(y.numel())(reference->forward(x), y);
  ref_loss.backward();
  EXPECT_TRUE(testing::tensors_close(loss, ref_loss.detach(), 1e-6));
  for (size_t k = 0; k < reference->parameters().size(); ++k) {
    EXPECT_TRUE(testing::tensors_close(rp.module()->parameters()[k].grad(), reference->parameters()[k].grad(), 1e-6));
  }
}

TEST(ErrorsTest, PlanWithGapOrOverlap_RefusedThroughRoundPipe) {
  torch::manual_seed(4);
  RoundPipe rp(torch::nn::Sequential(torch::nn::Linear(8, 8), torch::nn::Tanh(), torch::nn::Linear(8, 4)),
               RoundPipeOptions().devices(cpu_devices(2)));
  auto x = torch::randn({6, 8}), y = torch::randn({6, 4});
  RunConfig gap = microbatches(2);
  gap.execute_plan = scheduler::ExecutePlan({{0, 1}, {2, 3}}, {{2, 3}, {0, 2}});
  EXPECT_THROW_WITH(rp.forward_backward({x}, y, mse_over(y.numel()), gap),
                    "forward stage 1 [2, 3) leaves a gap: layers [1, 2)");
  RunConfig overlap = microbatches(2);
  overlap.execute_plan = scheduler::ExecutePlan({{0, 2}, {1, 3}}, {});
  EXPECT_THROW_WITH(rp.forward({x}, overlap),
                    "forward stage 1 [1, 3) overlaps the previous forward stage: layers [1, 2)");
}

// The mistake: an optimizer on the compute copies (module()->parameters()) sees no gradient at
// step time (RoundPipe has moved them to the masters), so it never trains. With kAsync such an
// optimizer would also race with the caller thread over the compute copies' .grad, so the async
// case uses one on tensors of another model: the same "masters untouched" symptom.
void optimizer_on_compute_copies_case(StepMode mode) {
  RoundPipe rp(make_mlp(5), RoundPipeOptions().devices(cpu_devices(2)).name("wrong_opt"));
  torch::nn::Sequential other = make_mlp(5);
  torch::optim::SGD wrong(mode == StepMode::kSync ? rp.module()->parameters() : other->parameters(), 0.1);
  auto x = torch::randn({6, 8}), y = torch::randn({6, 4});
  const std::string message =
      "RoundPipe::step: the step function left every master weight and its gradient untouched in 8 consecutive "
      "steps with gradients pending: is the optimizer built on the compute copies";
  auto step_fn = [&] {
    wrong.step();
    wrong.zero_grad();
  };
  try {
    for (int it = 0; it < 2 * 8; ++it) {
      rp.forward_backward({x}, y, mse_over(y.numel()));
      rp.step(step_fn, mode);
    }
    rp.synchronize();
    FAIL() << "an optimizer that never touched the masters went unnoticed";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("Build it on model.optim_parameters()"), std::string::npos) << e.what();
  }
  // The model stays usable (no run waits for the failed step) and the right optimizer trains.
  auto right = [&] {
    OptimizerCtx ctx;
    return torch::optim::SGD(rp.parameters(), 0.1);
  }();
  auto before = rp.forward({x}).clone();
  for (int it = 0; it < 2 * 8; ++it) {
    rp.forward_backward({x}, y, mse_over(y.numel()));
    rp.step([&] {
      right.step();
      right.zero_grad();
    }, mode);
  }
  rp.synchronize();
  EXPECT_FALSE(torch::equal(rp.forward({x}), before));
}

TEST(ErrorsTest, OptimizerOnComputeCopies_Refused_Sync) { optimizer_on_compute_copies_case(StepMode::kSync); }
TEST(ErrorsTest, OptimizerOnComputeCopies_Refused_Async) { optimizer_on_compute_copies_case(StepMode::kAsync); }

TEST(ErrorsTest, StepFunctionThatSkipsSomeSteps_Accepted) {
  // Fewer untouched steps in a row than the limit, an empty step function, and a step function
  // that only zeroes the gradients are all legitimate.
  RoundPipe rp(make_mlp(6), RoundPipeOptions().devices(cpu_devices(2)));
  auto opt = [&] {
    OptimizerCtx ctx;
    return torch::optim::SGD(rp.parameters(), 0.1);
  }();
  auto x = torch::randn({6, 8}), y = torch::randn({6, 4});
  for (int it = 0; it < 3 * 8; ++it) {
    rp.forward_backward({x}, y, mse_over(y.numel()));
    if (it % 8 == 7) {
      rp.step([&] {
        opt.step();
        opt.zero_grad();
      });
    } else if (it % 3 == 0) {
      rp.step(nullptr);
    } else {
      rp.step([] {});
    }
  }
  EXPECT_NO_THROW(rp.synchronize());
  for (int it = 0; it < 2 * 8; ++it) {
    rp.forward_backward({x}, y, mse_over(y.numel()));
    rp.step([&] { opt.zero_grad(); });
  }
  EXPECT_NO_THROW(rp.synchronize());
}

TEST(ErrorsTest, SyncStepFunctionThrows_ErrorReachesCallerAndModelStaysUsable) {
  auto reference = make_mlp(7);
  RoundPipe rp(make_mlp(7), RoundPipeOptions().devices(cpu_devices(2)));
  auto x = torch::randn({6, 8}), y = torch::randn({6, 4});
  rp.forward_backward({x}, y, mse_over(y.numel()));
  EXPECT_THROW_WITH(rp.step([] { TORCH_CHECK(false, "optimizer exploded"); }, StepMode::kSync), "optimizer exploded");
  // The failed step published nothing; the next call must not wait for it (it used to hang).
  auto out = rp.forward({x});
  EXPECT_TRUE(testing::tensors_close(out, reference->forward(x).detach(), 1e-6));
  EXPECT_NO_THROW(rp.forward_backward({x}, y, mse_over(y.numel())));
}

TEST(ErrorsTest, Fp16MasterWeights_Refused) {
  EXPECT_THROW_WITH(RoundPipe(make_mlp(1), RoundPipeOptions().devices(cpu_devices(1)).optim_dtype(torch::kHalf)),
                    "RoundPipeOptions::optim_dtype is float16 (torch::kHalf): float16 master weights lose small "
                    "updates");
  EXPECT_THROW_WITH(RoundPipe(make_mlp(1), RoundPipeOptions().devices(cpu_devices(1)).optim_dtype(torch::kHalf)),
                    "Keep float32 masters (RoundPipeOptions().optim_dtype(torch::kFloat32)) with float16 compute "
                    "copies, and scale the loss with roundpipe::amp::GradScaler");
  EXPECT_THROW_WITH(RoundPipe(make_mlp(1), RoundPipeOptions().devices(cpu_devices(1)).optim_dtype(torch::kInt)),
                    "RoundPipeOptions::optim_dtype is Int: master weights need a floating-point dtype");
  // fp16 compute copies without optim_dtype would get fp16 masters: refused when the masters are
  // made (inference alone never makes them), accepted with fp32 masters.
  auto half = make_mlp(1);
  half->to(torch::kHalf);
  RoundPipe rp(half, RoundPipeOptions().devices(cpu_devices(1)));
  EXPECT_THROW_WITH(rp.optim_parameters(),
                    "the master copy of layer 0's parameter 0 (in the parameter's own dtype: "
                    "RoundPipeOptions::optim_dtype is unset) is float16");
  EXPECT_THROW_WITH(rp.step([] {}, StepMode::kSync), "is float16");
  auto half_fp32_masters = make_mlp(1);
  half_fp32_masters->to(torch::kHalf);
  RoundPipe ok(half_fp32_masters, RoundPipeOptions().devices(cpu_devices(1)).optim_dtype(torch::kFloat));
  for (const auto& m : ok.optim_parameters()) EXPECT_EQ(m.scalar_type(), torch::kFloat);
}

}  // namespace
}  // namespace roundpipe
