// Parameters shared by several uses: a module held twice by one layer (tied weights inside a layer)
// and, since issue 13, one weight used by two layers (tied embeddings), against plain loops.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>

#include "roundpipe/round_pipe.h"
#include "tests/common/tensor_compare.h"

namespace roundpipe {
namespace {

std::vector<c10::Device> cpu_devices(int n) { return std::vector<c10::Device>(n, c10::Device(c10::kCPU)); }

// Sum-reduced loss over a microbatch divided by the full batch's element count.
LossFn mse_over(int64_t full_numel) {
  return [full_numel](const torch::Tensor& out, const torch::Tensor& y) {
    return torch::mse_loss(out, y, torch::Reduction::Sum) / static_cast<double>(full_numel);
  };
}

// A layer that holds one module twice (tied weights inside a layer), between two plain layers.
torch::nn::Sequential tied_inside_model() {
  torch::manual_seed(21);
  torch::nn::Linear shared(8, 8);
  return torch::nn::Sequential(torch::nn::Linear(8, 8), torch::nn::Sequential(shared, torch::nn::Tanh(), shared),
                               torch::nn::Linear(8, 4));
}

// Each distinct parameter once, in first-appearance order (parameters() lists a shared one twice).
std::vector<torch::Tensor> distinct(const std::vector<torch::Tensor>& params) {
  std::vector<torch::Tensor> out;
  for (const auto& p : params) {
    if (std::none_of(out.begin(), out.end(), [&](const torch::Tensor& q) { return q.is_same(p); })) out.push_back(p);
  }
  return out;
}

TEST(RoundPipeTest, TiedWeightsInsideALayer_GradientIsTheSumOfBothUses) {
  auto model = tied_inside_model();
  auto reference = tied_inside_model();
  RoundPipe rp(model, RoundPipeOptions().devices(cpu_devices(2)).seed(3));
  ASSERT_EQ(rp.parameters().size(), 6u);  // the shared Linear's weight and bias count once
  auto optimizer = [&] {
    OptimizerCtx ctx;
    return torch::optim::SGD(rp.parameters(), torch::optim::SGDOptions(0.1));
  }();
  auto ref_params = distinct(reference->parameters());
  torch::optim::SGD ref_optimizer(ref_params, torch::optim::SGDOptions(0.1));
  RunConfig cfg;
  cfg.num_microbatch = 3;
  for (int64_t step = 0; step < 3; ++step) {
    torch::manual_seed(1000 + step);
    auto x = torch::randn({12, 8}), y = torch::randn({12, 4});
    rp.forward_backward({x}, y, mse_over(y.numel()), cfg);
    rp.step([&] {
      optimizer.step();
      optimizer.zero_grad();
    }, StepMode::kSync);
    ref_optimizer.zero_grad();
    torch::mse_loss(reference->forward(x), y).backward();
    ref_optimizer.step();
    ASSERT_TRUE(testing::tensor_lists_close(rp.parameters(), ref_params, 1e-6)) << "step " << step;
  }
  // Both uses still share one tensor in the wrapped model.
  auto inner = model[1]->as<torch::nn::Sequential>();
  EXPECT_TRUE((*inner)[0]->parameters()[0].is_same((*inner)[2]->parameters()[0]));
}

}  // namespace
}  // namespace roundpipe
