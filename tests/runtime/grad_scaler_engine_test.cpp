// RoundPipe + amp::GradScaler in kSync mode: scale() runs inside loss_fn on device workers,
// step/update on the caller. Compared with a plain LibTorch loop using the same scaler semantics
// (GradScaler itself is checked bitwise against torch.amp.GradScaler in tests/amp).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <limits>

#include "amp/grad_scaler.h"
#include "roundpipe/round_pipe.h"
#include "tests/common/tensor_compare.h"
#include "tests/runtime/test_models.h"

namespace roundpipe {
namespace {

// Identity whose backward multiplies the gradient by `*poison` (1, inf or nan).
struct PoisonFn : torch::autograd::Function<PoisonFn> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, torch::Tensor x, double poison) {
    ctx->saved_data["poison"] = poison;
    return x.clone();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list g) {
    return {g[0] * ctx->saved_data["poison"].toDouble(), torch::Tensor()};
  }
};

struct PoisonImpl : torch::nn::Cloneable<PoisonImpl> {
  explicit PoisonImpl(std::shared_ptr<std::atomic<double>> poison) : poison_(std::move(poison)) {}
  void reset() override {}
  torch::Tensor forward(const torch::Tensor& x) { return PoisonFn::apply(x, poison_->load()); }
  std::shared_ptr<std::atomic<double>> poison_;
};
TORCH_MODULE(Poison);

TEST(GradScalerEngineTest, SyncStep_ScaleTrajectoryAndParamsMatchPlainLoop) {
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
    rp.forward_backward({x}, y, [&](const torch::Tensor& out, const torch::Tensor& t) {
      return scaler.scale(torch::mse_loss(out, t, torch::Reduction::Sum) / n);
    }, cfg);
    bool stepped = false;
    rp.step([&] {
      stepped = scaler.step(opt);
      opt.zero_grad();
    }, StepMode::kSync);
    scaler.update();

    ref_opt.zero_grad();
    ref_scaler.scale(torch::mse_loss(reference->forward(x), y, torch::Reduction::Sum) / n).backward();
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

}  // namespace
}  // namespace roundpipe
