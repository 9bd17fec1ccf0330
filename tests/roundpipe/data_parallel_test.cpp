// Data parallelism across processes (RoundPipeOptions::process_group): 2 ranks over Gloo on
// 127.0.0.1, 2 CPU devices each. Five steps with per-rank batch B give parameters equal on both
// ranks and equal to one process trained with batch 2B, in sync and async step modes, with the
// all-reduces overlapping the next iteration and a collective of the caller's own after every
// call; an inf on one rank only makes both ranks skip that step and back off the scale identically.
#include <gtest/gtest.h>
#include <torch/serialize.h>
#include <torch/torch.h>

#include <atomic>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <limits>
#include <map>
#include <string>

#include "amp/grad_scaler.h"
#include "comm/process_group.h"
#include "roundpipe/round_pipe.h"
#include "tests/common/multi_process.h"
#include "tests/common/tensor_compare.h"
#include "tests/common/test_macros.h"
#include "tests/roundpipe/test_models.h"

namespace roundpipe {
namespace {

using roundpipe::testing::describe;
using roundpipe::testing::run_ranks;

constexpr int64_t kRowsPerRank = 6;
constexpr int kSteps = 5;
constexpr int kPoisonStep = 2;

struct Trained {
  torch::Tensor params;  // every parameter, flattened and concatenated
  torch::Tensor scales;  // the GradScaler's scale after each step
  torch::Tensor losses;  // forward_backward's loss per step (this rank's)
  torch::Tensor norms;   // the gradient norm clipping saw per step
};

// Trains make_mlp for kSteps steps on this rank's rows of a global batch of world * kRowsPerRank
// rows (drawn the same way for any world size), with a GradScaler, gradient clipping and Adam. With `poison_rank`
// >= 0, that rank's loss is multiplied by inf at kPoisonStep (world 1: the only rank).
// Rank 1 starts from other weights than rank 0: the process group's broadcast must fix that.
// `devices`: each rank's (default two CPU workers).
Trained train(const std::shared_ptr<comm::ProcessGroup>& group, StepMode mode, int64_t poison_rank,
              std::vector<c10::Device> devices = {c10::kCPU, c10::kCPU}) {
  const int64_t world = group ? group->world_size() : 1;
  const int64_t rank = group ? group->rank() : 0;
  RoundPipe model(testing::make_mlp(rank == 0 ? 11 : 12),
                  RoundPipeOptions().devices(devices).process_group(group).seed(5));
  auto opt = [&] {
    OptimizerCtx ctx;
    return torch::optim::Adam(model.parameters(), torch::optim::AdamOptions(0.01));
  }();
  amp::GradScaler scaler(amp::GradScalerOptions().init_scale(256.0).growth_interval(2));
  std::vector<double> scales, losses;
  std::vector<double> norms(kSteps, 0.0);  // written by step job `step` only, read after synchronize
  const double inf = std::numeric_limits<double>::infinity();
  for (int step = 0; step < kSteps; ++step) {
    torch::manual_seed(100 + step);
    auto x = torch::randn({2 * kRowsPerRank, 8});
    auto y = torch::randn({2 * kRowsPerRank, 4});
    const int64_t rows = kRowsPerRank * 2 / world;
    x = x.narrow(0, rank * rows, rows);
    y = y.narrow(0, rank * rows, rows);
    const double factor = step == kPoisonStep && rank == poison_rank ? inf : 1.0;
    const double n = static_cast<double>(y.numel());  // this rank's elements: the mean over the rank's rows
    RunConfig cfg;
    cfg.num_microbatch = 3;
    auto loss = model.forward_backward(
        {x}, y,
        [&](const torch::Tensor& out, const torch::Tensor& t) {
          return scaler.scale(torch::mse_loss(out, t, torch::Reduction::Sum) / n * factor);
        },
        cfg);
    if (group) {
      // A collective of the caller's own on the same group, as the launcher's loss average: it must
      // not interleave with the gradient all-reduces still running behind this call.
      auto mean = loss.detach().reshape({1}).to(torch::kDouble).contiguous();
      group->all_reduce(mean).wait();
    }
    model.step(
        [&, step] {
          // Clipping to a norm below the gradients' sees the averaged gradients: the global norm.
          scaler.unscale_(opt);
          norms[step] = torch::nn::utils::clip_grad_norm_(opt.parameters(), 0.05);
          scaler.step(opt);
          opt.zero_grad();
        },
        mode);
    scaler.update();
    scales.push_back(scaler.get_scale());
    losses.push_back(loss.item<double>());
  }
  model.synchronize();
  if (group && group->world_size() > 1) {
    // Every call but the first (it measures the layer times) returned before its gradients were
    // averaged: the all-reduces overlapped the next iteration.
    const DataParallelStats stats = model.data_parallel_stats();
    EXPECT_EQ(stats.runs, kSteps);
    EXPECT_EQ(stats.overlapped_runs, kSteps - 1);
  }
  std::vector<torch::Tensor> flat;
  for (const auto& p : model.module()->parameters()) flat.push_back(p.detach().reshape(-1));
  return {torch::cat(flat), torch::tensor(scales, torch::kDouble), torch::tensor(losses, torch::kDouble),
          torch::tensor(norms, torch::kDouble)};
}

void save(const Trained& t, const std::string& path) {
  auto bytes = torch::pickle_save(c10::IValue(std::vector<torch::Tensor>{t.params, t.scales, t.losses, t.norms}));
  std::ofstream(path, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

Trained load(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  auto list = torch::pickle_load(bytes).toTensorVector();
  return {list.at(0), list.at(1), list.at(2), list.at(3)};
}

StepMode env_mode() {
  return std::string(std::getenv("ROUNDPIPE_TEST_MODE")) == "sync" ? StepMode::kSync : StepMode::kAsync;
}

// With ROUNDPIPE_TEST_CUDA set: the rank's GPU (testing::nccl_test_gpu) and NCCL.
std::vector<c10::Device> env_devices() {
  if (std::getenv("ROUNDPIPE_TEST_CUDA") != nullptr) return {c10::Device(c10::kCUDA, testing::nccl_test_gpu())};
  return {c10::kCPU, c10::kCPU};
}

TEST(DataParallelWorker, DISABLED_Train) {
  const auto devices = env_devices();
  auto group = comm::ProcessGroup::from_env(comm::ProcessGroupOptions()
                                                .timeout(std::chrono::seconds(60))
                                                .device(devices.front().is_cuda() ? devices.front() : c10::kCPU));
  const Trained t = train(group, env_mode(), std::atoi(std::getenv("ROUNDPIPE_TEST_POISON")), devices);
  save(t, std::string(std::getenv("ROUNDPIPE_TEST_OUT")) + "/rank" + std::to_string(group->rank()) + ".pt");
}

void two_ranks_match_one_process(StepMode mode, int64_t poison_rank, bool cuda = false) {
  const std::string dir = testing::make_temp_dir("roundpipe-dp-");
  std::map<std::string, std::string> env{{"ROUNDPIPE_TEST_MODE", mode == StepMode::kSync ? "sync" : "async"},
                                         {"ROUNDPIPE_TEST_POISON", std::to_string(poison_rank)},
                                         {"ROUNDPIPE_TEST_OUT", dir}};
  if (cuda) env["ROUNDPIPE_TEST_CUDA"] = "1";
  auto results = run_ranks("DataParallelWorker.DISABLED_Train", 2, env);
  for (const auto& r : results) ASSERT_TRUE(r.passed()) << describe(results);
  const Trained r0 = load(dir + "/rank0.pt"), r1 = load(dir + "/rank1.pt");
  // The reference: one process, the whole batch; the poisoned step poisons its whole loss.
  const Trained ref = train(
      nullptr, mode, poison_rank >= 0 ? 0 : -1,
      cuda ? std::vector<c10::Device>{c10::Device(c10::kCUDA, 0)} : std::vector<c10::Device>{c10::kCPU, c10::kCPU});
  EXPECT_TRUE(torch::equal(r0.params, r1.params))
      << "the ranks diverged: max diff " << testing::max_abs_diff(r0.params, r1.params);
  EXPECT_LE(testing::max_abs_diff(r0.params, ref.params), 1e-6);
  EXPECT_TRUE(torch::equal(r0.scales, r1.scales)) << r0.scales << r1.scales;
  EXPECT_TRUE(torch::equal(r0.scales, ref.scales)) << r0.scales << ref.scales;
  // Clipping was active, and saw the global norm on every rank.
  EXPECT_GT(ref.norms.nan_to_num(0, 0, 0).max().item<double>(), 0.05) << ref.norms;
  EXPECT_TRUE(torch::allclose(r0.norms.nan_to_num(0, 0, 0), ref.norms.nan_to_num(0, 0, 0), 1e-5))
      << r0.norms << ref.norms;
  EXPECT_TRUE(torch::equal(r0.norms.nan_to_num(0, 0, 0), r1.norms.nan_to_num(0, 0, 0)));
  // Each rank's loss is its own rows' mean (scaled); their average is the one-process loss, up to
  // float32 rounding of the differently grouped sums.
  if (poison_rank < 0) {
    EXPECT_LE(testing::max_abs_diff((r0.losses + r1.losses) / 2, ref.losses),
              1e-6 * ref.losses.abs().max().item<double>());
  }
  if (poison_rank >= 0) {
    EXPECT_EQ(ref.scales[kPoisonStep].item<double>(), ref.scales[kPoisonStep - 1].item<double>() / 2)
        << "the poisoned step backs off the scale";
  }
}

TEST(DataParallelTest, TwoRanks_SyncStep_MatchOneProcessWithTwiceTheBatch) {
  two_ranks_match_one_process(StepMode::kSync, -1);
}

TEST(DataParallelTest, TwoRanks_AsyncStep_MatchOneProcessWithTwiceTheBatch) {
  two_ranks_match_one_process(StepMode::kAsync, -1);
}

TEST(DataParallelTest, InfOnOneRankOnly_BothSkipAndBackOffIdentically) {
  two_ranks_match_one_process(StepMode::kAsync, 1);
}

// NCCL, a GPU per rank (TF32 is off by default in LibTorch: fp32 matmuls).
TEST(DataParallelTest, TwoRanks_AsyncStep_Nccl_CUDA) {
  if (const auto why = testing::nccl_test_skip_reason(2); !why.empty()) GTEST_SKIP() << why;
  two_ranks_match_one_process(StepMode::kAsync, 1, true);
}

// Worker: rank 1 builds a model with another layer width.
TEST(DataParallelWorker, DISABLED_MismatchedModels) {
  auto group = comm::ProcessGroup::from_env(comm::ProcessGroupOptions().timeout(std::chrono::seconds(30)));
  torch::nn::Sequential net(torch::nn::Linear(4, group->rank() == 0 ? 4 : 5));
  EXPECT_THROW_WITH(RoundPipe(net, RoundPipeOptions().devices({c10::kCPU}).process_group(group)),
                    "built a different model than another rank");
}

TEST(DataParallelTest, DifferentModelsOnTheRanks_FailClearlyOnEveryRank) {
  auto results = run_ranks("DataParallelWorker.DISABLED_MismatchedModels", 2, {}, std::chrono::seconds(60));
  for (const auto& r : results) EXPECT_TRUE(r.passed()) << describe(results);
}

// Throws in its backward: the failure injected on one rank.
struct ThrowInBackward : torch::autograd::Function<ThrowInBackward> {
  static torch::Tensor forward(torch::autograd::AutogradContext*, const torch::Tensor& x) { return x.clone(); }
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext*, torch::autograd::tensor_list) {
    TORCH_CHECK(false, "injected backward failure");
  }
};

// A parameter-free layer (so the ranks' models still agree) whose backward throws once `fail` is
// set; its shells share the flag.
struct FailSwitchImpl : torch::nn::Cloneable<FailSwitchImpl> {
  std::shared_ptr<std::atomic<bool>> fail = std::make_shared<std::atomic<bool>>(false);
  void reset() override {}
  torch::Tensor forward(const torch::Tensor& x) { return fail->load() ? ThrowInBackward::apply(x) : x; }
};
TORCH_MODULE(FailSwitch);

// Worker: rank 1's backward fails at step 2, after forward_backward returned (the runs overlap,
// so the error comes from the run's tail). Rank 1 gets that error at a later call and refuses
// every call after it; rank 0, whose all-reduces rank 1 never joins, fails within its timeout
// naming the all-reduce. Nothing hangs.
TEST(DataParallelWorker, DISABLED_BackwardFailsOnOneRank) {
  auto group = comm::ProcessGroup::from_env(
      comm::ProcessGroupOptions().timeout(std::chrono::seconds(10)).heartbeat_seconds(0.2));
  const bool failing = group->rank() == 1;
  FailSwitch fail_switch;
  torch::manual_seed(3);
  // The switch takes an input that needs a gradient (a Linear's output) and sits in a backward
  // stage, not the fused tail.
  torch::nn::Sequential net(torch::nn::Linear(8, 16), fail_switch, torch::nn::Tanh(), torch::nn::Linear(16, 4));
  RunConfig cfg;
  cfg.execute_plan = scheduler::ExecutePlan({{0, 2}}, {{2, 4}, {0, 2}});
  RoundPipe model(net,
                  RoundPipeOptions().devices({c10::kCPU, c10::kCPU}).process_group(group).measure_layer_times(false));
  auto opt = [&] {
    OptimizerCtx ctx;
    return torch::optim::SGD(model.parameters(), 0.1);
  }();
  const LossFn loss = [](const torch::Tensor& out, const torch::Tensor& t) { return torch::mse_loss(out, t); };
  auto x = torch::randn({6, 8}), y = torch::randn({6, 4});
  std::string error;
  int failed_at = -1;
  for (int step = 0; step < 8 && error.empty(); ++step) {
    if (failing && step == 2) fail_switch->fail->store(true);
    try {
      model.forward_backward({x}, y, loss, cfg);
      model.step([&] {
        opt.step();
        opt.zero_grad();
      });
    } catch (const c10::Error& e) {
      error = e.what_without_backtrace();
      failed_at = step;
    }
  }
  if (error.empty()) {
    try {
      model.synchronize();
    } catch (const c10::Error& e) {
      error = e.what_without_backtrace();
    }
  }
  if (failing) {
    EXPECT_NE(error.find("injected backward failure"), std::string::npos) << error;
    // forward_backward returned: the error is rethrown by a later entry point (step or the next call).
    EXPECT_GE(failed_at, 2);
    EXPECT_GE(model.data_parallel_stats().overlapped_runs, 3);
    // A run that began before the error surfaced may fail the same way: its error comes out at a
    // later entry point. After those, every call refuses.
    fail_switch->fail->store(false);
    for (int k = 0; k < 4; ++k) {
      try {
        model.synchronize();
        break;
      } catch (const c10::Error&) {
      }
    }
    EXPECT_THROW_WITH(model.forward_backward({x}, y, loss, cfg), "out of step with the other ranks");
  } else {
    EXPECT_NE(error.find("all_reduce failed on rank 0"), std::string::npos) << error;
  }
}

TEST(DataParallelTest, BackwardFailsOnOneRank_WhileOverlapped_BothFailClearly) {
  auto results = run_ranks("DataParallelWorker.DISABLED_BackwardFailsOnOneRank", 2, {}, std::chrono::seconds(90));
  for (const auto& r : results) EXPECT_TRUE(r.passed()) << describe(results);
}

TEST(DataParallelTest, OneRankGroup_IsAPlainRun) {
  auto group = comm::ProcessGroup::create(comm::LaunchEnv{});
  const Trained with = train(group, StepMode::kSync, -1);
  const Trained without = train(nullptr, StepMode::kSync, -1);
  EXPECT_TRUE(torch::equal(with.params, without.params));
}

}  // namespace
}  // namespace roundpipe
