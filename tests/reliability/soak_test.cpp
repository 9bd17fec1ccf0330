// Soak (docs/reliability.md): 2,000 async iterations of a small model on 3 CPU devices. Memory
// is steady (RSS growth, or under ASan/TSan the sanitizer allocator's bytes in use, and live CPU
// tensor memory after warm-up under stated bounds) and the
// final parameters are bitwise equal to an independent reference: a plain LibTorch loop that
// reproduces the async step's staleness one (compute copy <- master before each iteration) and
// RoundPipe's microbatching (three microbatches, forward and backward one after another,
// gradients accumulating in microbatch order), with no RoundPipe code involved.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "roundpipe/round_pipe.h"
#include "tests/reliability/reliability_util.h"
#include "tests/roundpipe/test_models.h"

namespace roundpipe {
namespace {

constexpr int kIterations = 2000;
constexpr int kWarmup = 200;
constexpr int64_t kMicrobatches = 3;
constexpr int64_t kRssGrowthBound = 16ll << 20;  // 16 MiB after warm-up (testing::process_memory_bytes)
constexpr unsigned kTestSeconds = 300;

torch::Tensor microbatch_loss(const torch::Tensor& out, const torch::Tensor& y, int64_t full_numel) {
  return torch::mse_loss(out, y, torch::Reduction::Sum) / static_cast<double>(full_numel);
}

TEST(SoakTest, Async2000Iterations_SteadyMemoryAndBitwiseEqualToPlainLoop) {
  testing::Watchdog watchdog(kTestSeconds);
  const char* env = std::getenv("ROUNDPIPE_SOAK_ITERATIONS");  // shorter under sanitizers
  const int iterations = env != nullptr ? std::atoi(env) : kIterations;
  const int warmup = std::min(kWarmup, iterations / 4);
  torch::nn::Sequential model = testing::make_mlp(17);
  torch::manual_seed(170);
  const auto xs = torch::randn({iterations, 6, 8});
  const auto ys = torch::randn({iterations, 6, 4});

  // Reference (DESIGN.md §3): compute copy C, master M. Iteration k: microbatched backward on C;
  // C <- M (the values after step k-1); M.grad <- C's gradients; M steps. Both sides synchronize
  // once after warm-up (C <- M), where the memory baseline is taken.
  auto compute = testing::deep_copy(model);
  auto master = testing::deep_copy(model);
  torch::optim::Adam ref_opt(master->parameters(), torch::optim::AdamOptions(1e-3));
  auto publish = [&] {
    torch::NoGradGuard no_grad;
    auto cp = compute->parameters(), mp = master->parameters();
    for (size_t k = 0; k < cp.size(); ++k) cp[k].copy_(mp[k]);
  };
  for (int it = 0; it < iterations; ++it) {
    auto xm = xs[it].tensor_split(kMicrobatches, 0), ym = ys[it].tensor_split(kMicrobatches, 0);
    for (int64_t j = 0; j < kMicrobatches; ++j) {
      microbatch_loss(compute->forward(xm[j]), ym[j], ys[it].numel()).backward();
    }
    publish();
    auto cp = compute->parameters(), mp = master->parameters();
    for (size_t k = 0; k < cp.size(); ++k) {
      mp[k].mutable_grad() = cp[k].grad();
      cp[k].mutable_grad().reset();
    }
    ref_opt.step();
    ref_opt.zero_grad();
    if (it + 1 == warmup) publish();
  }

  RoundPipe rp(model, RoundPipeOptions().devices({c10::kCPU, c10::kCPU, c10::kCPU}));
  auto opt = [&] {
    OptimizerCtx ctx;
    return torch::optim::Adam(rp.parameters(), torch::optim::AdamOptions(1e-3));
  }();
  RunConfig cfg;
  cfg.num_microbatch = kMicrobatches;
  const LossFn loss_fn = [](const torch::Tensor& out, const torch::Tensor& y) {
    return microbatch_loss(out, y, y.numel() * kMicrobatches);
  };
  int64_t rss_after_warmup = 0;
  testing::CpuMemory cpu_after_warmup;
  int64_t threads_after_warmup = 0;
  for (int it = 0; it < iterations; ++it) {
    rp.forward_backward({xs[it]}, ys[it], loss_fn, cfg);
    rp.step([&] {
      opt.step();
      opt.zero_grad();
    });
    if (it + 1 == warmup) {
      rp.synchronize();  // a quiescent point for the baseline (the reference publishes here too)
      rss_after_warmup = testing::process_memory_bytes();
      cpu_after_warmup = testing::live_cpu_memory();
      threads_after_warmup = testing::thread_count();
    }
  }
  rp.synchronize();
  const auto cpu_end = testing::live_cpu_memory();
  const int64_t rss_end = testing::process_memory_bytes();
  RecordProperty("rss_growth_bytes", std::to_string(rss_end - rss_after_warmup));
  RecordProperty("iterations", std::to_string(iterations));
  std::cout << "[soak] " << iterations << " async iterations; memory (testing::process_memory_bytes) after warm-up "
            << rss_after_warmup
            << " B, at the end " << rss_end << " B (growth " << rss_end - rss_after_warmup
            << " B); live CPU tensors " << cpu_after_warmup.blocks << " blocks / " << cpu_after_warmup.bytes
            << " B after warm-up, " << cpu_end.blocks << " / " << cpu_end.bytes << " B at the end\n";
  EXPECT_LT(rss_end - rss_after_warmup, kRssGrowthBound);
  EXPECT_LE(cpu_end.blocks, cpu_after_warmup.blocks);  // steady: no tensor accumulates
  EXPECT_LE(cpu_end.bytes, cpu_after_warmup.bytes);
  EXPECT_EQ(testing::thread_count(), threads_after_warmup);

  // Bitwise: compute copies equal the reference's masters after the final synchronize.
  auto ours = rp.module()->parameters();
  auto theirs = master->parameters();
  ASSERT_EQ(ours.size(), theirs.size());
  for (size_t k = 0; k < ours.size(); ++k) {
    EXPECT_TRUE(ours[k].equal(theirs[k])) << "parameter " << k << " differs by "
                                          << (ours[k] - theirs[k]).abs().max().item<double>();
  }
  auto masters = rp.optim_parameters();
  for (size_t k = 0; k < masters.size(); ++k) EXPECT_TRUE(masters[k].equal(theirs[k])) << "master " << k;
}

}  // namespace
}  // namespace roundpipe
