// RoundPipe + amp::GradScaler in kSync mode: scale() runs inside loss_fn on device workers,
// step/update on the caller. Compared with a plain LibTorch loop using the same scaler semantics
// (GradScaler itself is checked bitwise against torch.amp.GradScaler in tests/amp).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <limits>

#include "amp/grad_scaler.h"
#include "roundpipe/round_pipe.h"
#include "tests/common/python_oracle.h"
#include "tests/common/tensor_compare.h"
#include "tests/roundpipe/test_models.h"

namespace roundpipe {
namespace {

using testing::Poison;

// loss_fn: the scaled sum-reduced MSE over a microbatch divided by the batch's element count `n`.
LossFn scaled_mse(amp::GradScaler& scaler, double n) {
  return [&scaler, n](const torch::Tensor& out, const torch::Tensor& t) {
    return scaler.scale(torch::mse_loss(out.to(torch::kFloat), t, torch::Reduction::Sum) / n);
  };
}

// kSync: a plain loop; with `clip`, unscale_ on the caller's thread (marshalled to the optimizer
// thread) and clipping of the master gradients before the step, as in torch's recipe.
void sync_case(bool clip) {
  auto poison = std::make_shared<std::atomic<double>>(1.0);
  torch::manual_seed(2);
  torch::nn::Sequential model(torch::nn::Linear(8, 16), torch::nn::Tanh(), Poison(poison), torch::nn::Linear(16, 16),
                              torch::nn::Tanh(), torch::nn::Linear(16, 4));
  auto reference = testing::deep_copy(model);
  RoundPipe rp(model, RoundPipeOptions().devices({c10::kCPU, c10::kCPU, c10::kCPU}));
  auto opt = [&] {
    OptimizerCtx ctx;
    return torch::optim::SGD(rp.parameters(), 0.01);
  }();
  torch::optim::SGD ref_opt(reference->parameters(), 0.01);
  auto options = amp::GradScalerOptions().init_scale(1024.0).growth_interval(2);
  amp::GradScaler scaler(options), ref_scaler(options);
  const double inf = std::numeric_limits<double>::infinity();
  int skipped = 0;
  for (int it = 0; it < 14; ++it) {
    poison->store(it == 3 || it == 7 ? inf : it == 10 ? std::nan("") : 1.0);
    torch::manual_seed(70 + it);
    auto x = torch::randn({10, 8}), y = torch::randn({10, 4});
    const double n = static_cast<double>(y.numel());
    RunConfig cfg;
    cfg.num_microbatch = 4;
    rp.forward_backward({x}, y, scaled_mse(scaler, n), cfg);
    if (clip) {
      scaler.unscale_(opt);
      torch::nn::utils::clip_grad_norm_(rp.optim_parameters(), 0.5);
    }
    bool stepped = false;
    rp.step([&] {
      stepped = scaler.step(opt);
      opt.zero_grad();
    }, StepMode::kSync);
    scaler.update();

    ref_opt.zero_grad();
    ref_scaler.scale(torch::mse_loss(reference->forward(x), y, torch::Reduction::Sum) / n).backward();
    if (clip) {
      ref_scaler.unscale_(ref_opt);
      torch::nn::utils::clip_grad_norm_(reference->parameters(), 0.5);
    }
    const bool ref_stepped = ref_scaler.step(ref_opt);
    ref_scaler.update();

    ASSERT_EQ(stepped, ref_stepped) << "iteration " << it;
    ASSERT_EQ(scaler.get_scale(), ref_scaler.get_scale()) << "iteration " << it;
    ASSERT_EQ(scaler.state_dict().growth_tracker, ref_scaler.state_dict().growth_tracker) << "iteration " << it;
    ASSERT_TRUE(testing::tensor_lists_close(rp.module()->parameters(), reference->parameters(), 1e-6)) << "iteration " << it;
    skipped += stepped ? 0 : 1;
  }
  EXPECT_EQ(skipped, 3);  // the inf, inf and nan iterations
}

TEST(GradScalerEngineTest, SyncStep_ScaleTrajectoryAndParamsMatchPlainLoop) { sync_case(false); }

TEST(GradScalerEngineTest, SyncStep_UnscaleOnCallerThreadWithClipping) { sync_case(true); }

// The staleness-one reference of DESIGN.md §3 with a standalone scaler: compute model C (in
// `dtype`), fp32 master model M; iteration k: grads of C (holding the masters after step k-2),
// then C <- M (after step k-1), M.grad <- those grads in fp32, `step_fn` (unscale_/clip/step on
// M), update.
struct StalenessOneLoop {
  torch::nn::Sequential compute, master;
  torch::optim::SGD opt;
  amp::GradScaler scaler;
  c10::ScalarType dtype;
  StalenessOneLoop(const torch::nn::Sequential& model, amp::GradScalerOptions options, c10::ScalarType dtype)
      : compute(testing::deep_copy(model)),
        master(testing::deep_copy(model)),
        opt(master->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9)),
        scaler(options),
        dtype(dtype) {
    compute->to(dtype);
    master->to(dtype);  // masters start from the compute copies' values, as RoundPipe's do
    master->to(torch::kFloat);
  }
  bool iteration(const torch::Tensor& x, const torch::Tensor& y, bool clip) {
    const double n = static_cast<double>(y.numel());
    scaler.scale(torch::mse_loss(compute->forward(x.to(dtype)).to(torch::kFloat), y, torch::Reduction::Sum) / n)
        .backward();
    {
      torch::NoGradGuard no_grad;
      auto cp = compute->parameters(), mp = master->parameters();
      for (size_t k = 0; k < cp.size(); ++k) {
        cp[k].copy_(mp[k]);
        mp[k].mutable_grad() = cp[k].grad().to(torch::kFloat);
        cp[k].mutable_grad().reset();
      }
    }
    if (clip) {
      scaler.unscale_(opt);
      torch::nn::utils::clip_grad_norm_(master->parameters(), 0.5);
    }
    const bool stepped = scaler.step(opt);
    opt.zero_grad();
    scaler.update();
    return stepped;
  }
  void finish() {
    torch::NoGradGuard no_grad;
    auto cp = compute->parameters(), mp = master->parameters();
    for (size_t k = 0; k < cp.size(); ++k) cp[k].copy_(mp[k]);
  }
};

// torch.amp.GradScaler("cpu")'s scale after each update for iterations whose gradients are finite
// (0), inf or nan as in `pattern`.
std::vector<double> torch_scale_trajectory(const std::vector<double>& pattern, double init_scale,
                                           int64_t growth_interval) {
  static const char* kSnippet = R"(
s = torch.amp.GradScaler("cpu", init_scale=float(inputs['init'].item()), growth_interval=int(inputs['interval'].item()))
p = torch.zeros(1, requires_grad=True)
opt = torch.optim.SGD([p], lr=0.0)
scales = []
for v in inputs['pattern'].tolist():
    p.grad = s.scale(torch.full((1,), 1.0 if v == 0 else v))
    s.step(opt)
    s.update()
    scales.append(s.get_scale())
outputs['scales'] = torch.tensor(scales, dtype=torch.float64)
)";
  auto out = testing::run_python(kSnippet, {{"pattern", torch::tensor(pattern, torch::kDouble)},
                                            {"init", torch::tensor(init_scale, torch::kDouble)},
                                            {"interval", torch::tensor(growth_interval, torch::kLong)}});
  auto scales = out.at("scales").contiguous();
  return std::vector<double>(scales.data_ptr<double>(), scales.data_ptr<double>() + scales.numel());
}

// Async: scale() on workers, scaler.step on the optimizer thread, update() on the caller (never
// waiting for the optimizer thread); with `clip`, unscale_ on the caller's thread (marshalled to
// the optimizer thread) and gradient clipping of the master gradients there.
// `dtype`: the compute copies' dtype (fp32 masters either way); kHalf is DESIGN.md's typical loop.
void async_case(bool clip, c10::ScalarType dtype = torch::kFloat) {
  auto poison = std::make_shared<std::atomic<double>>(1.0);
  torch::manual_seed(4);
  torch::nn::Sequential model(torch::nn::Linear(8, 16), torch::nn::Tanh(), Poison(poison), torch::nn::Linear(16, 16),
                              torch::nn::Tanh(), torch::nn::Linear(16, 4));
  auto options = amp::GradScalerOptions().init_scale(1024.0).growth_interval(2);
  StalenessOneLoop ref(model, options, dtype);
  model->to(dtype);
  RoundPipe rp(model, RoundPipeOptions().devices({c10::kCPU, c10::kCPU, c10::kCPU}).optim_dtype(torch::kFloat));
  // fp32: the same operations up to the microbatch split; half: fp16 rounding of the split sums.
  const double atol = dtype == torch::kFloat ? 1e-6 : 2e-3;
  auto opt = [&] {
    OptimizerCtx ctx;
    return torch::optim::SGD(rp.parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  }();
  amp::GradScaler scaler(options);
  const double inf = std::numeric_limits<double>::infinity();
  const int iterations = 14;
  std::vector<int> stepped(iterations, -1);  // written by step job `it` only, read after synchronize
  std::vector<int> ref_stepped(iterations);
  std::vector<double> pattern, scales;
  for (int it = 0; it < iterations; ++it) {
    pattern.push_back(it == 2 || it == 8 ? inf : it == 11 ? std::nan("") : 0.0);
    poison->store(pattern.back() == 0.0 ? 1.0 : pattern.back());
    torch::manual_seed(90 + it);
    auto x = torch::randn({10, 8}), y = torch::randn({10, 4});
    const double n = static_cast<double>(y.numel());
    RunConfig cfg;
    cfg.num_microbatch = 4;
    rp.forward_backward({x.to(dtype)}, y, scaled_mse(scaler, n), cfg);
    if (clip) {
      scaler.unscale_(opt);  // caller's thread: runs on the optimizer thread, on the master grads
      torch::nn::utils::clip_grad_norm_(rp.optim_parameters(), 0.5);
    }
    rp.step([&, it] {
      stepped[it] = scaler.step(opt) ? 1 : 0;
      opt.zero_grad();
    });
    scaler.update();
    scales.push_back(scaler.get_scale());

    ref_stepped[it] = ref.iteration(x, y, clip) ? 1 : 0;
    ASSERT_EQ(scaler.get_scale(), ref.scaler.get_scale()) << "scale after iteration " << it;
    ASSERT_EQ(scaler.state_dict().growth_tracker, ref.scaler.state_dict().growth_tracker) << "iteration " << it;
  }
  rp.synchronize();
  ref.finish();
  EXPECT_EQ(stepped, ref_stepped);
  EXPECT_EQ(std::count(stepped.begin(), stepped.end(), 0), 3);
  EXPECT_TRUE(testing::tensor_lists_close(rp.module()->parameters(), ref.compute->parameters(), atol));
  EXPECT_TRUE(testing::tensor_lists_close(rp.optim_parameters(), ref.master->parameters(), atol));
  if (testing::python_oracle_available()) {
    EXPECT_EQ(scales, torch_scale_trajectory(pattern, 1024.0, 2)) << "scale trajectory vs torch.amp.GradScaler";
  } else {
    ROUNDPIPE_REQUIRE_ORACLE();
  }
}

TEST(GradScalerEngineTest, AsyncStep_ScaleTrajectoryExactAndParamsMatchStalenessOneLoop) { async_case(false); }

TEST(GradScalerEngineTest, AsyncStep_UnscaleOnCallerThreadWithClipping) { async_case(true); }

TEST(GradScalerEngineTest, AsyncStep_HalfComputeCopiesFloatMasters) { async_case(false, torch::kHalf); }

// Identity that throws in backward-stage recompute (grad mode on) while `*fail` is set.
struct RecomputeFaultImpl : torch::nn::Cloneable<RecomputeFaultImpl> {
  explicit RecomputeFaultImpl(std::shared_ptr<std::atomic<bool>> fail) : fail_(std::move(fail)) {}
  void reset() override {}
  torch::Tensor forward(const torch::Tensor& x) {
    TORCH_CHECK(!(fail_->load() && torch::GradMode::is_enabled()), "injected recompute failure");
    return x;
  }
  std::shared_ptr<std::atomic<bool>> fail_;
};
TORCH_MODULE(RecomputeFault);

// A run that fails after the fused stage posted an inf flag (and after forward_backward announced
// its flags): its flag (like its gradients) must not reach the next update. The reference skips the failed iteration entirely.
TEST(GradScalerEngineTest, FailedRun_FlagsDropped) {
  auto poison = std::make_shared<std::atomic<double>>(1.0);
  auto fail = std::make_shared<std::atomic<bool>>(false);
  torch::manual_seed(5);
  torch::nn::Sequential model(torch::nn::Linear(8, 16), RecomputeFault(fail), torch::nn::Tanh(),
                              torch::nn::Linear(16, 16), Poison(poison), torch::nn::Linear(16, 4));
  auto reference = testing::deep_copy(model);
  RoundPipe rp(model, RoundPipeOptions().devices({c10::kCPU, c10::kCPU}));
  auto opt = [&] {
    OptimizerCtx ctx;
    return torch::optim::SGD(rp.parameters(), 0.01);
  }();
  torch::optim::SGD ref_opt(reference->parameters(), 0.01);
  auto options = amp::GradScalerOptions().init_scale(256.0).growth_interval(1);
  amp::GradScaler scaler(options), ref_scaler(options);
  RunConfig cfg;
  cfg.num_microbatch = 3;
  cfg.execute_plan = scheduler::ExecutePlan({{0, 3}}, {{3, 6}, {0, 3}});  // fault in the backward stage
  for (int it = 0; it < 4; ++it) {
    torch::manual_seed(30 + it);
    auto x = torch::randn({6, 8}), y = torch::randn({6, 4});
    const double n = static_cast<double>(y.numel());
    auto loss_fn = scaled_mse(scaler, n);
    if (it == 1) {  // fails after the fused stage checked its inf gradients
      poison->store(std::numeric_limits<double>::infinity());
      fail->store(true);
      // The backward stage fails after forward_backward returned (Note [Overlapping iterations]):
      // the announced run is dropped, and synchronize() rethrows its error.
      EXPECT_THROW(
          {
            rp.forward_backward({x}, y, loss_fn, cfg);
            rp.synchronize();
          },
          c10::Error);
      poison->store(1.0);
      fail->store(false);
    }
    rp.forward_backward({x}, y, loss_fn, cfg);
    rp.step([&] {
      scaler.step(opt);
      opt.zero_grad();
    }, StepMode::kSync);
    scaler.update();

    ref_opt.zero_grad();
    ref_scaler.scale(torch::mse_loss(reference->forward(x), y, torch::Reduction::Sum) / n).backward();
    ref_scaler.step(ref_opt);
    ref_scaler.update();
    ASSERT_EQ(scaler.get_scale(), ref_scaler.get_scale()) << "iteration " << it;
    ASSERT_TRUE(testing::tensor_lists_close(rp.module()->parameters(), reference->parameters(), 1e-6)) << "iteration " << it;
  }
  EXPECT_EQ(scaler.get_scale(), 256.0 * 16);  // grew every iteration: no inf ever counted
}

}  // namespace
}  // namespace roundpipe
