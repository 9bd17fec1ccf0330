// Side inputs (roundpipe/side_inputs.h, docs/architecture.md "Side inputs"): the caller's named
// per-row tensors reach every layer pass of RoundPipe -- forward stages, the fused tail and the
// recompute, with either grain and any device count -- as the rows of the pass's microbatch, so
// training equals a plain loop over the whole batch under the same SideInputScope.
#include "roundpipe/side_inputs.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <string>
#include <vector>

#include "roundpipe/recompute_data.h"
#include "roundpipe/round_pipe.h"
#include "tests/roundpipe/test_models.h"

namespace roundpipe {
namespace {

std::atomic<int64_t> g_passes_without_shift{0};

// y = w * x + shift, with `shift` the side input [rows, 3] (counted when absent).
class ShiftedImpl : public torch::nn::Cloneable<ShiftedImpl> {
 public:
  ShiftedImpl() { reset(); }
  void reset() override { w = register_parameter("w", torch::full({3}, 1.5)); }
  torch::Tensor forward(const torch::Tensor& x) {
    std::optional<torch::Tensor> shift = side_input("shift");
    if (!shift) {
      ++g_passes_without_shift;
      return w * x;
    }
    EXPECT_EQ(shift->device(), x.device());
    return w * x + *shift;
  }
  torch::Tensor w;
};
TORCH_MODULE(Shifted);

torch::nn::Sequential make_model() {
  torch::nn::Sequential model;
  for (int i = 0; i < 4; ++i) model->push_back(Shifted());
  return model;
}

torch::Tensor loss_of(const torch::Tensor& y, const torch::Tensor&) { return y.pow(2).sum(); }

TEST(SideInputsTest, EveryPassSeesItsMicrobatchsRows) {
  torch::manual_seed(3);
  const torch::Tensor x = torch::rand({5, 3});
  const torch::Tensor shift = torch::rand({5, 3});
  // The reference: the plain model on the whole batch under the scope.
  torch::nn::Sequential plain = make_model();
  torch::Tensor ref_loss;
  {
    SideInputScope side({{"shift", shift}});
    ref_loss = loss_of(plain->forward(x), {});
  }
  ref_loss.backward();
  for (const RecomputeGrain grain : {RecomputeGrain::kStage, RecomputeGrain::kLayer}) {
    for (const int devices : {1, 3}) {
      SCOPED_TRACE(std::to_string(devices) + " devices, grain " + std::to_string(static_cast<int>(grain)));
      g_passes_without_shift = 0;
      RoundPipe rp(make_model(), RoundPipeOptions().devices(testing::cpu_devices(devices)));
      RunConfig cfg;
      cfg.num_microbatch = 3;  // 2 + 2 + 1 rows
      cfg.recompute_grain = grain;
      // Layers 0-2 in forward stages (recomputed), layer 3 in the fused tail.
      cfg.execute_plan = scheduler::ExecutePlan({{0, 2}, {2, 3}}, {{3, 4}, {2, 3}, {0, 2}});
      torch::Tensor loss, out;
      {
        SideInputScope side({{"shift", shift}});
        loss = rp.forward_backward({x}, torch::Tensor(), loss_of, cfg);
        out = rp.forward({x});
      }
      rp.synchronize();
      EXPECT_EQ(g_passes_without_shift.load(), 0);
      EXPECT_NEAR(loss.item<double>(), ref_loss.item<double>(), 1e-5 * ref_loss.item<double>());
      const auto params = rp.module()->parameters();
      for (size_t l = 0; l < params.size(); ++l) {
        EXPECT_TRUE(torch::allclose(params[l].grad(), plain->ptr(l)->parameters()[0].grad(), 1e-5, 1e-6))
            << "layer " << l;
      }
      SideInputScope side({{"shift", shift}});
      EXPECT_TRUE(torch::allclose(out, plain->forward(x), 1e-6, 1e-6));
    }
  }
}

TEST(SideInputsTest, WithoutAScope_LayersSeeNone) {
  RoundPipe rp(make_model(), RoundPipeOptions().devices(testing::cpu_devices(2)));
  g_passes_without_shift = 0;
  RunConfig cfg;
  cfg.num_microbatch = 2;
  rp.forward({torch::ones({2, 3})}, cfg);
  EXPECT_EQ(g_passes_without_shift.load(), 4 * 2);
  EXPECT_FALSE(side_input("shift").has_value());
}

TEST(SideInputsTest, RowsDifferFromTheInputs_Refused) {
  RoundPipe rp(make_model(), RoundPipeOptions().devices(testing::cpu_devices(2)).name("m"));
  SideInputScope side({{"shift", torch::zeros({4, 3})}});
  try {
    rp.forward_backward({torch::ones({5, 3})}, torch::Tensor(), loss_of);
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("RoundPipe 'm': side input 'shift' has 4 rows but the inputs have 5"),
              std::string::npos)
        << e.what();
  }
}

TEST(SideInputsTest, Scopes_NestAndRestore) {
  EXPECT_FALSE(side_input("a").has_value());
  {
    SideInputScope outer({{"a", torch::ones({1})}});
    EXPECT_EQ(side_input("a")->item<float>(), 1.0f);
    {
      SideInputScope inner({{"b", torch::ones({1})}});
      EXPECT_FALSE(side_input("a").has_value());  // the innermost scope only
      EXPECT_TRUE(side_input("b").has_value());
    }
    EXPECT_EQ(side_input("a")->item<float>(), 1.0f);
    EXPECT_EQ(SideInputScope::current().size(), 1u);
  }
  EXPECT_FALSE(side_input("a").has_value());
  EXPECT_TRUE(SideInputScope::current().empty());
}

}  // namespace
}  // namespace roundpipe
