// step(fn, kAsync): staleness-one semantics (Note [Async step protocol]) and a stress test that
// also runs under ThreadSanitizer (scripts/tsan.sh).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <future>
#include <memory>
#include <mutex>
#include <set>
#include <stdexcept>
#include <thread>

#include "base/thread_budget.h"
#include "optim/adam.h"
#include "roundpipe/detail/device_worker.h"
#include "roundpipe/round_pipe.h"
#include "tests/common/tensor_compare.h"
#include "tests/common/test_macros.h"
#include "tests/roundpipe/test_models.h"

namespace roundpipe {
namespace {

using testing::deep_copy;
using testing::mse_over;
using testing::StaleReference;

std::unique_ptr<torch::optim::Optimizer> make_opt(int which, std::vector<torch::Tensor> params) {
  if (which == 0) return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.05));
  if (which == 2) return std::make_unique<optim::Adam>(params, optim::AdamOptions(1e-2));
  return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(1e-2));
}

TEST(AsyncStepTest, Async_EqualsStalenessOneReference) {
  for (int devices : {1, 3}) {
    for (int which : {0, 1, 2}) {  // SGD, torch::optim::Adam, roundpipe::optim::Adam
      SCOPED_TRACE(::testing::Message() << "devices=" << devices << " opt=" << which);
      auto model = testing::make_mlp(21);
      StaleReference ref(model, [which](std::vector<torch::Tensor> p) { return make_opt(which, std::move(p)); });
      RoundPipe rp(model, RoundPipeOptions().devices(std::vector<c10::Device>(devices, c10::kCPU)));
      auto opt = [&] {
        OptimizerCtx ctx;
        return make_opt(which, rp.parameters());
      }();
      for (int it = 0; it < 10; ++it) {
        torch::manual_seed(500 + it);
        auto x = torch::randn({9, 8}), y = torch::randn({9, 4});
        auto loss = rp.forward_backward({x}, y, mse_over(y.numel()));
        rp.step([&] {
          opt->step();
          opt->zero_grad();
        });
        auto ref_loss = ref.iterate(x, y, mse_over(y.numel()));
        ASSERT_TRUE(testing::tensors_close(loss, ref_loss, 1e-6)) << "iteration " << it;
      }
      rp.synchronize();
      ref.synchronize();
      EXPECT_TRUE(testing::tensor_lists_close(rp.module()->parameters(), ref.compute->parameters(), 1e-6));
      EXPECT_TRUE(testing::tensor_lists_close(rp.optim_parameters(), ref.master->parameters(), 1e-6));
    }
  }
}

// Note [Optimizer thread budget]: the step function runs under half the cores' budget when
// RoundPipe drives GPUs, under none on CPU devices.
void optimizer_thread_budget(c10::Device device) {
  RoundPipe rp(testing::make_mlp(3), RoundPipeOptions().devices({device}));
  auto x = torch::randn({6, 8}), y = torch::randn({6, 4});
  rp.forward_backward({x}, y, mse_over(y.numel()));
  int64_t seen = -1;
  rp.step([&] { seen = base::thread_budget(); });
  rp.synchronize();
  const int64_t half = std::max<int64_t>(1, std::thread::hardware_concurrency() / 2);
  EXPECT_EQ(seen, device.is_cuda() ? half : 0);
}
ROUNDPIPE_DEVICE_TEST(AsyncStepTest, OptimizerThreadBudget_HalfTheCoresWhenDrivingGpus, optimizer_thread_budget)

TEST(AsyncStepTest, StepError_IsRethrownAtNextSyncPoint_ModelStaysUsable) {
  RoundPipe rp(testing::make_mlp(2), RoundPipeOptions().devices({c10::kCPU, c10::kCPU}));
  auto x = torch::randn({6, 8}), y = torch::randn({6, 4});
  rp.forward_backward({x}, y, mse_over(y.numel()));
  rp.step([] { throw std::runtime_error("optimizer exploded"); });
  try {
    rp.synchronize();
    FAIL() << "expected the step's error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("optimizer exploded"), std::string::npos);
  }
  EXPECT_NO_THROW(rp.forward_backward({x}, y, mse_over(y.numel())));
  EXPECT_NO_THROW(rp.step([] {}));
  EXPECT_NO_THROW(rp.synchronize());
}

// Note [Gradient hand-over]: gradients of two forward_backward calls reach the master .grad
// accumulated and without copies: the compute copies' own tensors when dtypes match, one reused
// fp32 buffer per master for bf16 compute copies. The step function clips them in place; the next
// iteration must not see that (a plain model on the same parameters is the reference).
TEST(AsyncStepTest, GradientHandOver_AccumulatesWithoutCopies) {
  for (auto dtype : {torch::kFloat, torch::kBFloat16}) {
    SCOPED_TRACE(::testing::Message() << "compute dtype " << dtype);
    auto model = testing::make_mlp(31);
    model->to(dtype);
    RoundPipe rp(model, RoundPipeOptions().devices({c10::kCPU, c10::kCPU}).optim_dtype(torch::kFloat));
    const auto masters = rp.optim_parameters();
    RunConfig cfg;
    cfg.num_microbatch = 1;
    std::vector<const void*> first_buffers;
    const double atol = dtype == torch::kFloat ? 1e-6 : 1e-2;
    for (int it = 0; it < 4; ++it) {
      auto plain = deep_copy(rp.module());  // kSync: the compute copies hold the current values
      std::vector<torch::Tensor> expected(masters.size());
      for (int call = 0; call < 2; ++call) {
        torch::manual_seed(700 + 10 * it + call);
        auto x = torch::randn({6, 8}).to(dtype), y = torch::randn({6, 4}).to(dtype);
        rp.forward_backward({x}, y, mse_over(y.numel()), cfg);
        mse_over(y.numel())(plain->forward(x), y).backward();
      }
      const auto compute = rp.module()->parameters();
      const auto reference = plain->parameters();
      std::vector<const void*> handed(compute.size());
      for (size_t i = 0; i < compute.size(); ++i) {
        ASSERT_TRUE(compute[i].grad().defined());
        handed[i] = compute[i].grad().data_ptr();
        expected[i] = reference[i].grad().to(torch::kFloat);
      }
      rp.step(
          [&] {
            for (size_t i = 0; i < masters.size(); ++i) {
              const auto& g = masters[i].grad();
              ASSERT_TRUE(testing::tensors_close(g, expected[i], atol)) << "iteration " << it << " param " << i;
              if (dtype == torch::kFloat) {
                EXPECT_EQ(g.data_ptr(), handed[i]) << "fp32 gradients are handed over, not copied";
              } else if (it == 0) {
                first_buffers.push_back(g.data_ptr());
              } else {
                EXPECT_EQ(g.data_ptr(), first_buffers[i]) << "the fp32 gradient buffer is reused";
              }
            }
            torch::nn::utils::clip_grad_norm_(masters, 1e-3);  // in place
            torch::NoGradGuard no_grad;
            for (const auto& p : masters) {
              p.sub_(p.grad(), 0.5);
              p.mutable_grad().reset();
            }
          },
          StepMode::kSync);
    }
  }
}

// RoundPipeOptions::master_grad_dtype(kBFloat16): bf16 compute gradients reach roundpipe::optim::Adam
// uncast (no fp32 buffer), and training is bitwise the same as with fp32 master gradients; also
// with gradient clipping, optim::clip_grad_norm on the bf16 gradients against torch's
// clip_grad_norm_ on the fp32 ones (what the launcher does in each case), norms included.
TEST(AsyncStepTest, MasterGradDtype_Bf16GradsReachAdamUncast_SameResult) {
  for (const bool clip : {false, true}) {
    for (StepMode mode : {StepMode::kSync, StepMode::kAsync}) {
      SCOPED_TRACE(::testing::Message() << (mode == StepMode::kSync ? "kSync" : "kAsync") << (clip ? ", clipped" : ""));
      std::vector<std::vector<torch::Tensor>> finals;
      std::vector<std::vector<double>> norms(2);
      for (bool uncast : {false, true}) {
        auto model = testing::make_mlp(41);
        model->to(torch::kBFloat16);
        auto options = RoundPipeOptions().devices({c10::kCPU, c10::kCPU}).optim_dtype(torch::kFloat);
        if (uncast) options.master_grad_dtype(torch::kBFloat16);
        RoundPipe rp(model, options);
        auto opt = [&] {
          OptimizerCtx ctx;
          return optim::Adam(rp.parameters(), optim::AdamOptions(1e-2).weight_decay(0.01));
        }();
        const auto masters = rp.optim_parameters();
        std::atomic<int> wrong_dtype{0};
        for (int it = 0; it < 6; ++it) {
          torch::manual_seed(900 + it);
          auto x = torch::randn({6, 8}).to(torch::kBFloat16), y = torch::randn({6, 4}).to(torch::kBFloat16);
          rp.forward_backward({x}, y, mse_over(y.numel()));
          rp.step(
              [&] {
                for (const auto& p : masters) {
                  if (p.grad().scalar_type() != (uncast ? torch::kBFloat16 : torch::kFloat)) ++wrong_dtype;
                }
                if (clip) {  // max_norm well below the gradients' norm: every step clips
                  norms[uncast].push_back(uncast ? optim::clip_grad_norm(opt, 0.05)
                                                 : torch::nn::utils::clip_grad_norm_(masters, 0.05));
                }
                opt.step();
                opt.zero_grad();
              },
              mode);
        }
        rp.synchronize();
        EXPECT_EQ(wrong_dtype.load(), 0);
        finals.emplace_back();
        for (const auto& p : masters) finals.back().push_back(p.detach().clone());
      }
      ASSERT_EQ(finals[0].size(), finals[1].size());
      for (size_t i = 0; i < finals[0].size(); ++i) EXPECT_TENSOR_EQ(finals[1][i], finals[0][i]) << "param " << i;
      EXPECT_EQ(norms[1], norms[0]);
      if (clip) {
        ASSERT_EQ(norms[0].size(), 6u);
        for (double n : norms[0]) EXPECT_GT(n, 0.05);
      }
    }
  }
}

// master_grad_dtype applies only to parameters whose compute copies have that dtype: an fp32 model
// keeps fp32 master gradients (no lossy rounding to bf16).
TEST(AsyncStepTest, MasterGradDtype_OtherComputeDtypesKeepMasterDtypeGrads) {
  RoundPipe rp(testing::make_mlp(43),
               RoundPipeOptions().devices({c10::kCPU}).optim_dtype(torch::kFloat).master_grad_dtype(torch::kBFloat16));
  auto x = torch::randn({6, 8}), y = torch::randn({6, 4});
  rp.forward_backward({x}, y, mse_over(y.numel()));
  const auto masters = rp.optim_parameters();
  std::vector<torch::Tensor> expected;
  for (const auto& p : rp.module()->parameters()) expected.push_back(p.grad().clone());
  rp.step(
      [&] {
        for (size_t i = 0; i < masters.size(); ++i) {
          EXPECT_EQ(masters[i].grad().scalar_type(), torch::kFloat);
          EXPECT_TENSOR_EQ(masters[i].grad(), expected[i]);
        }
      },
      StepMode::kSync);
}

// Note [In-place masters]: the compute copies are the masters. A plain loop (one model, the
// optimizer on its parameters, whole-batch loss) is the reference: with one microbatch the layers
// compute the same operations, so sync steps give bitwise the same parameters, and
// optim_parameters() are the module's own tensors, with no second copy anywhere.
TEST(AsyncStepTest, InPlaceMasters_SyncStepsEqualPlainLoop) {
  for (auto dtype : {torch::kFloat, torch::kBFloat16}) {
    SCOPED_TRACE(::testing::Message() << "dtype=" << dtype);
    auto model = testing::make_mlp(61);
    model->to(dtype);
    auto plain = deep_copy(model);
    // bf16 masters need compensation (optim::AdamOptions::kahan_sum); fp32 ones are unaffected by it.
    const auto options = optim::AdamOptions(1e-2).kahan_sum(dtype == torch::kBFloat16);
    optim::Adam plain_opt(plain->parameters(), options);
    RunConfig one_microbatch;
    one_microbatch.num_microbatch = 1;
    RoundPipe rp(model,
                 RoundPipeOptions().devices({c10::kCPU, c10::kCPU}).run_config(one_microbatch).in_place_masters(true));
    const auto masters = rp.optim_parameters();
    const auto params = rp.module()->parameters();
    ASSERT_EQ(masters.size(), params.size());
    for (size_t i = 0; i < masters.size(); ++i) {
      EXPECT_TRUE(masters[i].is_same(params[i])) << "param " << i << " has a separate master copy";
    }
    optim::Adam opt(masters, options);
    for (int it = 0; it < 8; ++it) {
      torch::manual_seed(700 + it);
      auto x = torch::randn({9, 8}).to(dtype), y = torch::randn({9, 4}).to(dtype);
      auto loss = rp.forward_backward({x}, y, mse_over(y.numel()));
      rp.step(
          [&] {
            opt.step();
            opt.zero_grad();
          },
          StepMode::kSync);
      auto plain_loss = mse_over(y.numel())(plain->forward(x), y);
      plain_loss.backward();
      plain_opt.step();
      plain_opt.zero_grad();
      ASSERT_TRUE(testing::tensors_close(loss.to(torch::kFloat), plain_loss.detach().to(torch::kFloat)))
          << "iteration " << it;
    }
    rp.synchronize();
    const auto got = rp.module()->parameters(), want = plain->parameters();
    for (size_t i = 0; i < got.size(); ++i) EXPECT_TENSOR_EQ(got[i], want[i]) << "param " << i;
    for (size_t i = 0; i < masters.size(); ++i) EXPECT_TRUE(masters[i].is_same(rp.module()->parameters()[i]));
  }
}

// The data addresses a layer's weight had in its passes (forward and recompute), from any thread.
struct AddressLog {
  void add(const void* address) {
    std::lock_guard<std::mutex> lock(mutex);
    seen.insert(address);
  }
  std::set<const void*> addresses() {
    std::lock_guard<std::mutex> lock(mutex);
    return seen;
  }
  void clear() {
    std::lock_guard<std::mutex> lock(mutex);
    seen.clear();
  }
  std::mutex mutex;
  std::set<const void*> seen;
};

struct AddressProbeImpl : torch::nn::Cloneable<AddressProbeImpl> {
  explicit AddressProbeImpl(std::shared_ptr<AddressLog> log) : log(std::move(log)) { reset(); }
  void reset() override { linear = register_module("linear", torch::nn::Linear(8, 8)); }
  torch::Tensor forward(const torch::Tensor& x) {
    log->add(linear->weight.const_data_ptr());
    return torch::tanh(linear(x));
  }
  std::shared_ptr<AddressLog> log;
  torch::nn::Linear linear{nullptr};
};
TORCH_MODULE(AddressProbe);

// Note [Shared host parameters]: with in-place masters the CPU devices' stage jobs compute on the
// model's parameter tensors themselves; otherwise every job works on copies of its own.
TEST(AsyncStepTest, InPlaceMasters_CpuDevicesComputeOnTheParameters) {
  for (const bool in_place : {false, true}) {
    SCOPED_TRACE(::testing::Message() << "in_place_masters=" << in_place);
    auto log = std::make_shared<AddressLog>();
    torch::manual_seed(64);
    auto model =
        torch::nn::Sequential(AddressProbe(log), AddressProbe(log), AddressProbe(log), torch::nn::Linear(8, 4));
    RunConfig two_microbatches;
    two_microbatches.num_microbatch = 2;
    RoundPipe rp(
        model,
        RoundPipeOptions().devices({c10::kCPU, c10::kCPU}).run_config(two_microbatches).in_place_masters(in_place));
    std::set<const void*> weights;
    for (const auto& p : rp.module()->parameters()) weights.insert(p.const_data_ptr());
    auto x = torch::randn({6, 8}), y = torch::randn({6, 4});
    for (int it = 0; it < 2; ++it) {
      rp.forward_backward({x}, y, mse_over(y.numel()));
      rp.step([] {}, StepMode::kSync);
    }
    rp.forward({x});
    const std::set<const void*> seen = log->addresses();
    ASSERT_FALSE(seen.empty());
    for (const void* address : seen) {
      EXPECT_EQ(weights.count(address), in_place ? 1u : 0u) << "a pass read the weight at " << address;
    }
    if (in_place) {
      EXPECT_EQ(seen.size(), 3u);  // one address per probe layer
    }
  }
}

// Note [Shared host parameters]: with RoundPipeOptions::sync_steps and separate masters (bf16
// compute copies, fp32 masters) the CPU devices' stage jobs compute on the compute copies
// themselves, and training is bitwise that of the same RoundPipe copying them; async steps are
// refused.
TEST(AsyncStepTest, SyncSteps_CpuDevicesComputeOnTheComputeCopies_SameTraining) {
  std::vector<std::vector<torch::Tensor>> finals;
  for (const bool sync_steps : {false, true}) {
    SCOPED_TRACE(::testing::Message() << "sync_steps=" << sync_steps);
    auto log = std::make_shared<AddressLog>();
    torch::manual_seed(66);
    auto model =
        torch::nn::Sequential(AddressProbe(log), AddressProbe(log), AddressProbe(log), torch::nn::Linear(8, 4));
    model->to(torch::kBFloat16);
    RunConfig two_microbatches;
    two_microbatches.num_microbatch = 2;
    RoundPipe rp(model, RoundPipeOptions()
                            .devices({c10::kCPU, c10::kCPU})
                            .run_config(two_microbatches)
                            .optim_dtype(torch::kFloat)
                            .sync_steps(sync_steps));
    auto opt = [&] {
      OptimizerCtx ctx;
      return optim::Adam(rp.parameters(), optim::AdamOptions(1e-2));
    }();
    std::set<const void*> weights;
    for (const auto& p : rp.module()->parameters()) weights.insert(p.const_data_ptr());
    for (int it = 0; it < 4; ++it) {
      torch::manual_seed(700 + it);
      auto x = torch::randn({6, 8}).to(torch::kBFloat16), y = torch::randn({6, 4}).to(torch::kBFloat16);
      rp.forward_backward({x}, y, mse_over(y.numel()));
      rp.step(
          [&] {
            opt.step();
            opt.zero_grad();
          },
          StepMode::kSync);
    }
    const std::set<const void*> seen = log->addresses();
    ASSERT_FALSE(seen.empty());
    for (const void* address : seen) {
      EXPECT_EQ(weights.count(address), sync_steps ? 1u : 0u) << "a pass read the weight at " << address;
    }
    if (sync_steps) {
      EXPECT_EQ(seen.size(), 3u);  // one address per probe layer
      rp.forward_backward({torch::randn({6, 8}).to(torch::kBFloat16)}, torch::zeros({6, 4}, torch::kBFloat16),
                          mse_over(24));
      EXPECT_THROW_WITH(rp.step([] {}, StepMode::kAsync), "RoundPipeOptions::sync_steps");
    }
    finals.emplace_back();
    for (const auto& p : rp.optim_parameters()) finals.back().push_back(p.detach().clone());
  }
  ASSERT_EQ(finals[0].size(), finals[1].size());
  for (size_t i = 0; i < finals[0].size(); ++i) EXPECT_TENSOR_EQ(finals[1][i], finals[0][i]) << "param " << i;
}

// Note [Shared host parameters]: in every step mode, CPU devices' stage jobs compute on frozen
// parameters without a master (LoRA's base weights) and copy the others, including a parameter
// frozen after its master exists (steps still publish into it). Losses match the staleness-one
// reference (async) or a plain loop (sync).
TEST(AsyncStepTest, FrozenParameters_CpuDevicesComputeOnThemInEveryStepMode) {
  for (const StepMode mode : {StepMode::kSync, StepMode::kAsync}) {
    const bool async = mode == StepMode::kAsync;
    SCOPED_TRACE(::testing::Message() << (async ? "async" : "sync"));
    std::vector<std::shared_ptr<AddressLog>> logs;
    for (int i = 0; i < 3; ++i) logs.push_back(std::make_shared<AddressLog>());
    torch::manual_seed(65);
    auto model = torch::nn::Sequential(AddressProbe(logs[0]), AddressProbe(logs[1]), AddressProbe(logs[2]),
                                       torch::nn::Linear(8, 4));
    for (int i = 0; i < 2; ++i) model[i]->as<AddressProbe>()->linear->weight.requires_grad_(false);  // probe 2 trains
    StaleReference stale(model, [](std::vector<torch::Tensor> p) { return make_opt(0, std::move(p)); });
    auto plain = deep_copy(model);
    auto plain_opt = make_opt(0, plain->parameters());
    for (int i = 0; i < 3; ++i) {  // the references' probes log elsewhere
      plain[i]->as<AddressProbe>()->log = std::make_shared<AddressLog>();
      stale.compute[i]->as<AddressProbe>()->log = std::make_shared<AddressLog>();
    }
    RunConfig two_microbatches;
    two_microbatches.num_microbatch = 2;
    RoundPipe rp(model, RoundPipeOptions().devices({c10::kCPU, c10::kCPU}).run_config(two_microbatches));
    auto opt = make_opt(0, rp.optim_parameters());
    std::vector<const void*> weights;  // the module's own probe weights
    for (int i = 0; i < 3; ++i) weights.push_back(model[i]->as<AddressProbe>()->linear->weight.const_data_ptr());
    auto train = [&](int iterations, int seed) {
      for (int it = 0; it < iterations; ++it) {
        torch::manual_seed(seed + it);
        auto x = torch::randn({6, 8}), y = torch::randn({6, 4});
        auto loss = rp.forward_backward({x}, y, mse_over(y.numel()));
        rp.step(
            [&] {
              opt->step();
              opt->zero_grad();
            },
            mode);
        torch::Tensor want;
        if (async) {
          want = stale.iterate(x, y, mse_over(y.numel()));
        } else {
          want = mse_over(y.numel())(plain->forward(x), y);
          want.backward();
          plain_opt->step();
          plain_opt->zero_grad();
        }
        ASSERT_TRUE(testing::tensors_close(loss, want.detach(), 1e-6)) << "iteration " << it;
      }
      rp.forward({torch::randn({6, 8})});
    };
    train(4, 900);
    for (int i = 0; i < 2; ++i) EXPECT_EQ(logs[i]->addresses(), std::set<const void*>{weights[i]}) << "probe " << i;
    EXPECT_EQ(logs[2]->addresses().count(weights[2]), 0u) << "the trainable weight was not copied";
    // Frozen now, but it has a master: async steps publish into it, so jobs still copy it.
    rp.module()[2]->as<AddressProbe>()->linear->weight.requires_grad_(false);
    plain[2]->as<AddressProbe>()->linear->weight.requires_grad_(false);
    stale.compute[2]->as<AddressProbe>()->linear->weight.requires_grad_(false);
    logs[2]->clear();
    train(3, 950);
    EXPECT_FALSE(logs[2]->addresses().empty());
    EXPECT_EQ(logs[2]->addresses().count(weights[2]), 0u) << "a weight with a master was shared";
    rp.synchronize();  // the last async step has used `opt`, which is destroyed before `rp`
  }
}

TEST(AsyncStepTest, InPlaceMasters_AsyncStepAndMasterDtypesRefused) {
  RoundPipe rp(testing::make_mlp(62), RoundPipeOptions().devices({c10::kCPU}).in_place_masters(true));
  auto x = torch::randn({6, 8}), y = torch::randn({6, 4});
  rp.forward_backward({x}, y, mse_over(y.numel()));
  EXPECT_THROW_WITH(rp.step([] {}, StepMode::kAsync), "StepMode::kSync");
  EXPECT_NO_THROW(rp.step([] {}, StepMode::kSync));
  EXPECT_THROW_WITH(
      RoundPipe(testing::make_mlp(63),
                RoundPipeOptions().devices({c10::kCPU}).in_place_masters(true).optim_dtype(torch::kFloat)),
      "optim_dtype and master_grad_dtype must be unset");
}

TEST(AsyncStepTest, MasterGradDtype_MustBeFloating) {
  try {
    RoundPipe rp(testing::make_mlp(1), RoundPipeOptions().devices({c10::kCPU}).master_grad_dtype(torch::kInt));
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("master_grad_dtype must be a floating-point dtype"), std::string::npos);
  }
}

// Many iterations, random layer sizes, 3 CPU devices, async steps: must finish, match the
// staleness-one reference, and be clean under ThreadSanitizer.
TEST(AsyncStepTest, Stress_RandomLayers200Iterations) {
  auto model = testing::random_mlp(3, 9, 6, 3, 9, 24);
  StaleReference ref(model, [](std::vector<torch::Tensor> p) { return make_opt(0, std::move(p)); });
  RoundPipe rp(model, RoundPipeOptions().devices({c10::kCPU, c10::kCPU, c10::kCPU}));
  auto opt = [&] {
    OptimizerCtx ctx;
    return make_opt(0, rp.parameters());
  }();
  const int iterations =
      std::getenv("ROUNDPIPE_STRESS_ITERATIONS") ? std::atoi(std::getenv("ROUNDPIPE_STRESS_ITERATIONS")) : 200;
  for (int it = 0; it < iterations; ++it) {
    torch::manual_seed(it);
    auto x = torch::randn({7, 6}), y = torch::randn({7, 3});
    RunConfig cfg;
    cfg.num_microbatch = 1 + it % 5;
    cfg.recompute_grain = it % 2 ? RecomputeGrain::kLayer : RecomputeGrain::kStage;
    auto loss = rp.forward_backward({x}, y, mse_over(y.numel()), cfg);
    rp.step([&] {
      opt->step();
      opt->zero_grad();
    });
    auto ref_loss = ref.iterate(x, y, mse_over(y.numel()));
    ASSERT_TRUE(testing::tensors_close(loss, ref_loss, 1e-5)) << "iteration " << it;
  }
  rp.synchronize();
  ref.synchronize();
  EXPECT_TRUE(testing::tensor_lists_close(rp.module()->parameters(), ref.compute->parameters(), 1e-5));
}

// synchronize() waits on the optimizer thread's futures and the leak checks of the reliability
// tests count live tensors right after it: a job's captures (an iteration's scale copy) must be
// destroyed on the worker before its future is ready. (They used to live in the future's shared
// state: freed by whichever of waiter and pool let go last, sometimes after the wait returned.)
TEST(DeviceWorkerTest, JobCapturesDestroyedOnWorkerBeforeFutureReady) {
  struct Destruction {
    std::atomic<bool> done{false};
    std::thread::id thread;
  };
  struct SlowToDestroy {
    explicit SlowToDestroy(Destruction* d) : destruction(d) {}
    SlowToDestroy(const SlowToDestroy&) = delete;
    SlowToDestroy& operator=(const SlowToDestroy&) = delete;
    ~SlowToDestroy() {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));  // widens any window to fail in
      destruction->thread = std::this_thread::get_id();
      destruction->done.store(true);
    }
    Destruction* destruction;
  };
  detail::DeviceWorker worker{c10::Device(c10::kCPU)};
  for (bool throws : {false, false, true}) {
    Destruction destruction;
    auto captured = std::make_shared<SlowToDestroy>(&destruction);
    std::promise<void> go;
    auto future = worker.post([captured, throws, started = go.get_future().share()] {
      started.wait();
      if (throws) throw std::runtime_error("job failed");
    });
    captured.reset();  // the job now holds the only reference
    go.set_value();
    if (throws) {
      EXPECT_THROW(future.get(), std::runtime_error);
    } else {
      future.get();
    }
    ASSERT_TRUE(destruction.done.load()) << "captures still alive after the future became ready";
    EXPECT_NE(destruction.thread, std::this_thread::get_id()) << "captures destroyed by the waiter, not the worker";
  }
}

}  // namespace
}  // namespace roundpipe
