// Note [Recompute data] (roundpipe/recompute_data.h): a layer's forward-stage pass saves data that
// its recompute in backward gets back, so a decision made in the forward (here: a value drawn from
// a call counter, which a fresh decision would change) is replayed, with either recompute grain
// and any device count; inference neither saves nor replays, nor does the fused tail with the
// stage grain (with the layer grain it recomputes too: Note [Fused tail recompute]).
#include "roundpipe/recompute_data.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <cmath>
#include <vector>

#include "roundpipe/round_pipe.h"
#include "tests/common/tensor_compare.h"
#include "tests/roundpipe/test_models.h"

namespace roundpipe {
namespace {

std::atomic<int64_t> g_calls{0};
std::atomic<int64_t> g_replays{0};
std::atomic<int64_t> g_recomputes_without_data{0};

// y = w * x * c, where c is the number of this layer's first passes so far (a "decision" that
// differs on every call) unless the pass is a recompute, which must get the forward's c back.
class DecidingImpl : public torch::nn::Cloneable<DecidingImpl> {
 public:
  DecidingImpl() { reset(); }
  void reset() override { w = register_parameter("w", torch::ones({1})); }
  torch::Tensor forward(const torch::Tensor& x) {
    double c = 0;
    if (auto saved = recompute_data("c")) {
      c = saved->at(0).item<double>();
      ++g_replays;
    } else {
      if (in_recompute()) ++g_recomputes_without_data;
      c = static_cast<double>(++g_calls);
      save_for_recompute("c", {torch::full({1}, c)});
    }
    return w * x * c;
  }
  torch::Tensor w;
};
TORCH_MODULE(Deciding);

torch::nn::Sequential make_model() {
  torch::nn::Sequential model;
  for (int i = 0; i < 4; ++i) model->push_back(Deciding());
  return model;
}

// One training call of make_model() on 2 microbatches of a fixed batch with `plan`, the counters
// reset first; returns the loss (the sum of the outputs).
torch::Tensor train_once(RoundPipe& rp, RecomputeGrain grain, const scheduler::ExecutePlan& plan) {
  g_calls = 0;
  g_replays = 0;
  g_recomputes_without_data = 0;
  RunConfig cfg;
  cfg.num_microbatch = 2;
  cfg.recompute_grain = grain;
  cfg.execute_plan = plan;
  torch::manual_seed(3);
  const auto x = torch::rand({4, 3}) + 0.5;
  const auto loss = rp.forward_backward(
      {x}, torch::Tensor(), [](const torch::Tensor& y, const torch::Tensor&) { return y.sum(); }, cfg);
  rp.synchronize();
  return loss;
}

TEST(RecomputeDataTest, RecomputeGetsTheForwardsData) {
  for (const RecomputeGrain grain : {RecomputeGrain::kStage, RecomputeGrain::kLayer}) {
    for (const int devices : {1, 3}) {
      RoundPipe rp(make_model(), RoundPipeOptions().devices(testing::cpu_devices(devices)));
      // Layers 0-2 in forward stages (recomputed), layer 3 in the fused tail.
      train_once(rp, grain, scheduler::ExecutePlan({{0, 2}, {2, 3}}, {{3, 4}, {2, 3}, {0, 2}}));
      // First passes: 2 microbatches x 4 layers; replays: 2 x 3 recomputed layers.
      EXPECT_EQ(g_calls.load(), 8);
      EXPECT_EQ(g_replays.load(), 6);
      EXPECT_EQ(g_recomputes_without_data.load(), 0);
      // d(sum y)/d w_l = sum(y) / w_l with w = 1: the product of the first passes' c per
      // microbatch, summed. Microbatch j's c for layer l is its first-pass count; with the
      // forward's c replayed the gradient of every layer is the same sum.
      const auto params = rp.module()->parameters();
      // (Equal up to float32 rounding: each layer's gradient multiplies the same factors in
      // another order. A c that was not replayed changes a product by a whole factor.)
      const double g0 = params[0].grad().item<double>();
      for (const auto& p : params) EXPECT_NEAR(p.grad().item<double>(), g0, 1e-6 * std::abs(g0));
      // Inference neither saves nor replays.
      g_replays = 0;
      rp.forward({torch::rand({4, 3}) + 0.5});
      EXPECT_EQ(g_replays.load(), 0);
    }
  }
}

// Note [Fused tail recompute]: with the layer grain the fused tail recomputes every layer but its
// last from the layer's kept input, replaying what the first pass saved; with the stage grain it
// runs each layer once.
TEST(RecomputeDataTest, FusedTailRecomputesItsLayersButTheLastWithTheLayerGrain) {
  for (const RecomputeGrain grain : {RecomputeGrain::kStage, RecomputeGrain::kLayer}) {
    for (const int devices : {1, 2}) {
      RoundPipe rp(make_model(), RoundPipeOptions().devices(testing::cpu_devices(devices)));
      // Layer 0 in a forward stage, layers 1-3 in the fused tail.
      const auto loss = train_once(rp, grain, scheduler::ExecutePlan({{0, 1}}, {{1, 4}, {0, 1}}));
      EXPECT_EQ(g_calls.load(), 8);
      // Replays per microbatch: layer 0 (its backward stage), plus layers 1 and 2 of the tail with
      // the layer grain.
      EXPECT_EQ(g_replays.load(), grain == RecomputeGrain::kLayer ? 6 : 2) << "devices " << devices;
      EXPECT_EQ(g_recomputes_without_data.load(), 0);
      const auto params = rp.module()->parameters();
      const double sum = loss.item<double>();
      for (const auto& p : params) EXPECT_NEAR(p.grad().item<double>(), sum, 1e-6 * std::abs(sum));
    }
  }
}

// The tail's recompute replays its draws (dropout) and its layers' gradients are the same bits as
// the tail that keeps its autograd graph: both run the same kernels on the same values.
TEST(RecomputeDataTest, FusedTailWithTheLayerGrainIsBitwiseTheStageGrain) {
  std::vector<std::vector<torch::Tensor>> grads;
  std::vector<torch::Tensor> losses;
  for (const RecomputeGrain grain : {RecomputeGrain::kStage, RecomputeGrain::kLayer}) {
    RoundPipe rp(testing::make_transformer(5, /*dropout=*/0.2), RoundPipeOptions().devices(testing::cpu_devices(1)));
    RunConfig cfg;
    cfg.num_microbatch = 3;
    cfg.recompute_grain = grain;
    cfg.execute_plan = scheduler::ExecutePlan({}, {{0, 4}});
    torch::manual_seed(7);
    const auto x = torch::randn({6, 5, 16});
    const auto y = torch::randn({6, 5, 4});
    losses.push_back(rp.forward_backward({x}, y, testing::mse_over(y.numel()), cfg));
    rp.synchronize();
    std::vector<torch::Tensor> g;
    for (const auto& p : rp.module()->parameters()) g.push_back(p.grad().clone());
    grads.push_back(std::move(g));
  }
  EXPECT_TENSOR_EQ(losses[1], losses[0]);
  ASSERT_EQ(grads[1].size(), grads[0].size());
  for (size_t k = 0; k < grads[0].size(); ++k) EXPECT_TENSOR_EQ(grads[1][k], grads[0][k]) << "parameter " << k;
}

TEST(RecomputeDataTest, OutsideRoundPipeNothingIsKept) {
  auto layer = Deciding();
  g_replays = 0;
  layer->forward(torch::ones({1}));
  EXPECT_FALSE(recompute_data("c").has_value());
  EXPECT_FALSE(in_recompute());
  EXPECT_EQ(g_replays.load(), 0);
}

}  // namespace
}  // namespace roundpipe
