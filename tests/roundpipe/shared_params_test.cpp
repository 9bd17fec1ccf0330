// Parameters with several uses (Note [Shared parameters]): a weight used twice by one layer, and
// one weight used by two layers in different stages (tied embeddings), against plain loops.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>

#include "roundpipe/round_pipe.h"
#include "tests/common/tensor_compare.h"
#include "tests/roundpipe/test_models.h"

namespace roundpipe {
namespace {

using testing::cpu_devices;
using testing::mse_over;

// y = x W^T + b with a weight it is given (tying) and a bias of its own. Its clone (made by
// reset() + copy, as RoundPipe's layer shells are) holds its own copy of the weight.
struct TiedProjectionImpl : torch::nn::Cloneable<TiedProjectionImpl> {
  explicit TiedProjectionImpl(torch::Tensor shared)
      : weight(register_parameter("weight", std::move(shared))),
        bias(register_parameter("bias", torch::zeros({weight.size(0)}))) {}
  void reset() override {
    weight = register_parameter("weight", weight.detach().clone(), weight.requires_grad());
    bias = register_parameter("bias", bias.detach().clone(), bias.requires_grad());
  }
  torch::Tensor forward(const torch::Tensor& x) { return torch::linear(x, weight, bias); }
  torch::Tensor weight, bias;
};
TORCH_MODULE(TiedProjection);

// One layer, two uses of one weight: kSameModule registers one Linear under two names (a clone
// of the layer shares it too); kTiedWeight uses the Linear's weight again in a TiedProjection (a
// clone of the layer holds two separate copies).
enum class Tie { kSameModule, kTiedWeight };

struct TwiceImpl : torch::nn::Cloneable<TwiceImpl> {
  explicit TwiceImpl(Tie tie) : tie(tie) { reset(); }
  void reset() override {
    first = register_module("first", torch::nn::Linear(8, 8));
    if (tie == Tie::kSameModule) {
      register_module("second", first);
    } else {
      projection = register_module("second", TiedProjection(first->weight));
    }
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = torch::tanh(first(x));
    return tie == Tie::kSameModule ? first(h) : projection(h);
  }
  Tie tie;
  torch::nn::Linear first{nullptr};
  TiedProjection projection{nullptr};
};
TORCH_MODULE(Twice);

torch::nn::Sequential tied_inside_model(Tie tie) {
  torch::manual_seed(21);
  return torch::nn::Sequential(torch::nn::Linear(8, 8), Twice(tie), torch::nn::Linear(8, 4));
}

// Each distinct parameter once, in first-appearance order (parameters() lists a shared one twice).
std::vector<torch::Tensor> distinct(const std::vector<torch::Tensor>& params) {
  std::vector<torch::Tensor> out;
  for (const auto& p : params) {
    if (std::none_of(out.begin(), out.end(), [&](const torch::Tensor& q) { return q.is_same(p); })) out.push_back(p);
  }
  return out;
}

void tied_inside_case(Tie tie, size_t distinct_params) {
  SCOPED_TRACE(tie == Tie::kSameModule ? "same module twice" : "tied weight");
  auto model = tied_inside_model(tie);
  auto reference = tied_inside_model(tie);
  RoundPipe rp(model, RoundPipeOptions().devices(cpu_devices(2)).seed(3));
  ASSERT_EQ(rp.parameters().size(), distinct_params);  // the shared weight counts once
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
  auto twice = model[1]->as<TwiceImpl>();
  if (tie == Tie::kTiedWeight) {
    EXPECT_TRUE(twice->first->weight.is_same(twice->projection->weight));
  }
}

TEST(RoundPipeTest, TiedWeightsInsideALayer_GradientIsTheSumOfBothUses) {
  tied_inside_case(Tie::kSameModule, 6);  // Linear, shared Linear, Linear: 3 x (weight, bias)
  tied_inside_case(Tie::kTiedWeight, 7);  // the second Linear keeps its own bias
}

// A model whose first and last layers share one weight (tied embeddings): an Embedding, and an LM
// head that projects with the embedding's weight.
struct TiedHeadImpl : torch::nn::Cloneable<TiedHeadImpl> {
  explicit TiedHeadImpl(torch::Tensor shared) : weight(register_parameter("weight", std::move(shared))) {}
  void reset() override {
    // clone(): a copy of its own (RoundPipe's shells are clones; their values are uploaded).
    if (weight.defined()) weight = register_parameter("weight", weight.detach().clone(), weight.requires_grad());
  }
  torch::Tensor forward(const torch::Tensor& h) { return torch::matmul(h, weight.t()); }
  torch::Tensor weight;
};
TORCH_MODULE(TiedHead);

torch::nn::Sequential tied_across_model() {
  torch::manual_seed(22);
  torch::nn::Embedding embedding(16, 8);
  return torch::nn::Sequential(embedding, torch::nn::Linear(8, 8), torch::nn::Tanh(), torch::nn::Linear(8, 8),
                               TiedHead(embedding->weight));
}

LossFn token_loss(int64_t tokens) {
  return [tokens](const torch::Tensor& logits, const torch::Tensor& y) {
    namespace F = torch::nn::functional;
    return F::cross_entropy(logits.reshape({-1, 16}), y.reshape({-1}), F::CrossEntropyFuncOptions().reduction(torch::kSum)) /
           static_cast<double>(tokens);
  };
}

// One master weight and one optimizer state for the shared weight, its gradient the sum of both
// uses, both layers computing with it: equal to a plain loop (sync) and to the staleness-one loop
// (async), on 3 CPU devices where the two uses run in different stages.
void tied_across_case(StepMode mode) {
  SCOPED_TRACE(mode == StepMode::kSync ? "sync" : "async");
  auto model = tied_across_model();
  RoundPipe rp(model, RoundPipeOptions().devices(cpu_devices(3)).seed(4));
  ASSERT_EQ(rp.parameters().size(), 5u);  // the embedding weight once, two Linears
  auto optimizer = [&] {
    OptimizerCtx ctx;
    return torch::optim::Adam(rp.parameters(), torch::optim::AdamOptions(1e-2));
  }();
  // Reference: `compute` runs the iterations; `master` is what the optimizer updates. Sync: the
  // same model. Async: compute holds the values one step behind (staleness one).
  auto compute = tied_across_model();
  auto master = mode == StepMode::kSync ? compute : tied_across_model();
  auto compute_params = distinct(compute->parameters()), master_params = distinct(master->parameters());
  ASSERT_EQ(master_params.size(), 5u);
  torch::optim::Adam ref_optimizer(master_params, torch::optim::AdamOptions(1e-2));
  RunConfig cfg;
  cfg.num_microbatch = 4;
  // The two uses in different stages: the head in the fused tail, the embedding in the last one.
  cfg.execute_plan = scheduler::ExecutePlan({{0, 2}, {2, 3}}, {{3, 5}, {1, 3}, {0, 1}});
  for (int64_t step = 0; step < 4; ++step) {
    torch::manual_seed(500 + step);
    auto x = torch::randint(16, {8, 5}), y = torch::randint(16, {8, 5});
    rp.forward_backward({x}, y, token_loss(y.numel()), cfg);
    rp.step([&] {
      optimizer.step();
      optimizer.zero_grad();
    }, mode);
    token_loss(y.numel())(compute->forward(x), y).backward();
    {
      torch::NoGradGuard no_grad;
      for (size_t k = 0; k < compute_params.size() && mode == StepMode::kAsync; ++k) {
        compute_params[k].copy_(master_params[k]);  // publish the values after the previous step
        master_params[k].mutable_grad() = compute_params[k].grad().clone();
        compute_params[k].mutable_grad().reset();
      }
    }
    ref_optimizer.step();
    ref_optimizer.zero_grad();
  }
  rp.synchronize();
  EXPECT_TRUE(testing::tensor_lists_close(rp.optim_parameters(), master_params, 1e-6));
  EXPECT_TRUE(testing::tensor_lists_close(rp.parameters(), master_params, 1e-6));
  // Both layers of the wrapped model still hold the one shared tensor.
  EXPECT_TRUE(model[0]->parameters()[0].is_same(model[4]->parameters()[0]));
}

TEST(RoundPipeTest, TiedAcrossLayers_OneMasterSummedGradient_Sync) { tied_across_case(StepMode::kSync); }
TEST(RoundPipeTest, TiedAcrossLayers_OneMasterSummedGradient_Async) { tied_across_case(StepMode::kAsync); }

}  // namespace
}  // namespace roundpipe
