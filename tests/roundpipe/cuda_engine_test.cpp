// The engine on a GPU (Note [Stage streams]): every test is a *_CUDA twin of a CPU-device test and
// is skipped by the shared test main when no GPU is visible. Several workers may share one GPU
// (each worker has its own streams), so these run on a single-GPU machine too.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "amp/grad_scaler.h"
#include "optim/adam.h"
#include "roundpipe/round_pipe.h"
#include "roundpipe/stage_trace.h"
#include "tests/common/tensor_compare.h"
#include "tests/roundpipe/test_models.h"

namespace roundpipe {
namespace {

using testing::deep_copy;

std::vector<c10::Device> gpu_workers(int n) { return std::vector<c10::Device>(n, c10::Device(c10::kCUDA, 0)); }

LossFn mse_over(int64_t full_numel) {
  return [full_numel](const torch::Tensor& out, const torch::Tensor& y) {
    return torch::mse_loss(out.to(torch::kFloat), y, torch::Reduction::Sum) / static_cast<double>(full_numel);
  };
}

void step_and_zero(torch::optim::Optimizer& opt) {
  opt.step();
  opt.zero_grad();
}

// fp32 transformer blocks on the GPU vs the plain full-batch loop on the CPU (tolerance: GPU and
// CPU kernels round differently).
TEST(CudaEngineTest, Equivalence_TransformerVsCpuLoop_CUDA) {
  for (auto grain : {RecomputeGrain::kStage, RecomputeGrain::kLayer}) {
    auto model = testing::make_transformer(7, 0.0);
    auto reference = deep_copy(model);
    RoundPipe rp(model, RoundPipeOptions().devices(gpu_workers(2)).seed(3));
    auto opt = [&] {
      OptimizerCtx ctx;
      return torch::optim::SGD(rp.parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    }();
    torch::optim::SGD ref_opt(reference->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    RunConfig cfg;
    cfg.num_microbatch = 3;
    cfg.recompute_grain = grain;
    for (int step = 0; step < 5; ++step) {
      torch::manual_seed(100 + step);
      auto x = torch::randn({12, 5, 16}), y = torch::randn({12, 5, 4});
      rp.forward_backward({x}, y, mse_over(y.numel()), cfg);
      rp.step([&] { step_and_zero(opt); }, StepMode::kSync);
      mse_over(y.numel())(reference->forward(x), y).backward();
      step_and_zero(ref_opt);
      ASSERT_TRUE(testing::tensor_lists_close(rp.module()->parameters(), reference->parameters(), 1e-5, 1e-5))
          << "step " << step << " grain " << static_cast<int>(grain);
    }
  }
}

// Dropout masks come from per-(iteration, microbatch, layer) seeds of the device's Philox
// generator: 1 and 3 workers on the GPU, both grains, give bitwise the same parameters.
TEST(CudaEngineTest, Dropout_BitwiseIndependentOfWorkerCountAndGrain_CUDA) {
  std::vector<torch::Tensor> first;
  for (int workers : {1, 3}) {
    for (auto grain : {RecomputeGrain::kStage, RecomputeGrain::kLayer}) {
      RoundPipe rp(testing::make_transformer(11, 0.2), RoundPipeOptions().devices(gpu_workers(workers)).seed(4242));
      auto opt = [&] {
        OptimizerCtx ctx;
        return torch::optim::SGD(rp.parameters(), 0.05);
      }();
      RunConfig cfg;
      cfg.num_microbatch = 3;
      cfg.recompute_grain = grain;
      for (int step = 0; step < 3; ++step) {
        torch::manual_seed(200 + step);
        auto x = torch::randn({12, 5, 16}), y = torch::randn({12, 5, 4});
        rp.forward_backward({x}, y, mse_over(y.numel()), cfg);
        rp.step([&] { step_and_zero(opt); }, StepMode::kSync);
      }
      auto params = rp.module()->parameters();
      if (first.empty()) {
        first = params;
        continue;
      }
      for (size_t k = 0; k < params.size(); ++k) {
        EXPECT_TRUE(testing::tensors_equal(params[k], first[k])) << "workers " << workers << " param " << k;
      }
    }
  }
}

// Stream-safety stress (scripts/gpu-validate.sh also runs it under compute-sanitizer): random
// layer sizes, 2 workers on one GPU, async optim::Adam, vs the CPU staleness-one loop.
TEST(CudaEngineTest, AsyncStress_RandomLayersMatchStalenessOneLoop_CUDA) {
  auto model = testing::random_mlp(7, 9, 24, 4, 7, 96);
  testing::StaleReference ref(model, [](std::vector<torch::Tensor> p) {
    return std::make_unique<optim::Adam>(std::move(p), optim::AdamOptions(1e-3));
  });
  RoundPipe rp(model, RoundPipeOptions().devices(gpu_workers(2)));
  auto opt = [&] {
    OptimizerCtx ctx;
    return optim::Adam(rp.parameters(), optim::AdamOptions(1e-3));
  }();
  RunConfig cfg;
  cfg.num_microbatch = 4;
  for (int it = 0; it < 50; ++it) {
    torch::manual_seed(300 + it);
    auto x = torch::randn({16, 24}), y = torch::randn({16, 4});
    rp.forward_backward({x}, y, mse_over(y.numel()), cfg);
    rp.step([&] { step_and_zero(opt); });
    ref.iterate(x, y, mse_over(y.numel()));
  }
  rp.synchronize();
  ref.synchronize();
  EXPECT_TRUE(testing::tensor_lists_close(rp.optim_parameters(), ref.master->parameters(), 1e-4, 1e-4));
}

// fp16 compute copies on the GPU, fp32 masters, async step, infs injected through the labels:
// the scale trajectory is the standalone scaler's for the same inf pattern.
TEST(CudaEngineTest, GradScaler_HalfOnGpuTrajectoryMatchesStandalone_CUDA) {
  torch::manual_seed(12);
  torch::nn::Sequential model(torch::nn::Linear(8, 32), torch::nn::Tanh(), torch::nn::Linear(32, 4));
  model->to(torch::kHalf);
  RoundPipe rp(model, RoundPipeOptions().devices(gpu_workers(2)).optim_dtype(torch::kFloat));
  auto opt = [&] {
    OptimizerCtx ctx;
    return torch::optim::SGD(rp.parameters(), 0.01);
  }();
  auto options = amp::GradScalerOptions().init_scale(1024.0).growth_interval(2);
  amp::GradScaler scaler(options), reference(options);
  const double inf = std::numeric_limits<double>::infinity();
  for (int it = 0; it < 10; ++it) {
    const bool bad = it == 3 || it == 7;
    torch::manual_seed(400 + it);
    auto x = torch::randn({8, 8}).to(torch::kHalf), y = torch::randn({8, 4});
    if (bad) y[0][0] = inf;  // an inf label makes the loss and every gradient non-finite
    rp.forward_backward({x}, y, [&](const torch::Tensor& out, const torch::Tensor& t) {
      return scaler.scale(torch::mse_loss(out.to(torch::kFloat), t, torch::Reduction::Sum) / 32.0);
    }, RunConfig());
    rp.step([&] {
      scaler.step(opt);
      opt.zero_grad();
    });
    scaler.update();
    // Standalone reference fed the same finite/inf pattern.
    auto p = torch::zeros({1}, torch::kFloat).set_requires_grad(true);
    torch::optim::SGD ref_opt({p}, 0.0);
    p.mutable_grad() = reference.scale(torch::full({1}, bad ? inf : 1.0));
    reference.step(ref_opt);
    reference.update();
    ASSERT_EQ(scaler.get_scale(), reference.get_scale()) << "iteration " << it;
  }
  rp.synchronize();
  for (const auto& p : rp.optim_parameters()) EXPECT_TRUE(torch::isfinite(p).all().item<bool>());
}

// The stage trace on CUDA: every job's span and bytes; with several layers per stage the uploads
// of later layers run while earlier layers compute.
TEST(CudaEngineTest, StageTrace_RecordsSpansAndUploadOverlap_CUDA) {
  torch::manual_seed(13);
  torch::nn::Sequential model;
  for (int l = 0; l < 8; ++l) model->push_back(torch::nn::Linear(2048, 2048));
  RoundPipe rp(model, RoundPipeOptions().devices(gpu_workers(1)));
  RunConfig cfg;
  cfg.num_microbatch = 2;
  cfg.execute_plan = scheduler::ExecutePlan({{0, 4}}, {{4, 8}, {0, 4}});
  auto x = torch::randn({256, 2048}), y = torch::randn({256, 2048});
  rp.forward_backward({x}, y, mse_over(y.numel()), cfg);  // warm-up (allocator, shells)
  trace::enable(true);
  rp.forward_backward({x}, y, mse_over(y.numel()), cfg);
  rp.synchronize();  // the backward job may start after forward_backward returns
  trace::enable(false);
  const auto spans = trace::collect();
  ASSERT_EQ(spans.size(), 3u);
  const int64_t stage_bytes = 4 * (2048 * 2048 + 2048) * 4;
  for (const auto& s : spans) {
    EXPECT_TRUE(s.device.is_cuda()) << s.job;
    EXPECT_EQ(s.upload_bytes, stage_bytes) << s.job;
    EXPECT_LT(s.upload_begin_ms, s.upload_end_ms) << s.job;
    EXPECT_LT(s.compute_begin_ms, s.compute_end_ms) << s.job;
  }
  EXPECT_GT(trace::upload_overlap_fraction(spans), 0.0) << "no upload overlapped compute";
}

// The compute copies live in exact-size host blocks registered with CUDA (Note [Exact-size pinned
// host memory]): every parameter is pinned, a layer's parameters lie in one span no longer than
// their bytes at 256-byte alignment rounded to a page (the caching host allocator would round
// each up to a power of two), and the async stress above trains from them.
TEST(CudaEngineTest, HostCopies_ExactSizePinnedBlocksPerLayer_CUDA) {
  auto model = testing::random_mlp(3, 4, 24, 4, 5, 700);
  RoundPipe rp(model, RoundPipeOptions().devices(gpu_workers(1)));
  const auto page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  for (const auto& layer : *rp.module()) {
    uintptr_t lo = UINTPTR_MAX, hi = 0, packed = 0;
    for (const auto& p : layer.ptr()->parameters()) {
      EXPECT_TRUE(p.is_pinned()) << layer.ptr()->name();
      const auto begin = reinterpret_cast<uintptr_t>(p.storage().data());
      lo = std::min(lo, begin);
      hi = std::max(hi, begin + p.storage().nbytes());
      packed += (p.storage().nbytes() + 255) / 256 * 256;
    }
    if (hi == 0) continue;  // Tanh
    EXPECT_EQ(lo % page, 0u) << layer.ptr()->name();
    EXPECT_LE(hi - lo, (packed + page - 1) / page * page) << layer.ptr()->name();
  }
}

}  // namespace
}  // namespace roundpipe
