// roundpipe::optim::Adafactor against torch.optim.Adafactor (Python oracle, foreach=False: the
// per-tensor reference) for matrices, batched matrices, vectors and scalars, every option, bf16/fp16
// gradients and missing gradients; thread-count independence, state-dict round trip (bitwise
// resume) and option / parameter / state validation.
#include "optim/adafactor.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <iterator>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "tests/common/python_oracle.h"
#include "tests/common/tensor_compare.h"
#include "tests/common/test_macros.h"

namespace roundpipe::optim {
namespace {

using roundpipe::testing::max_abs_diff;
using roundpipe::testing::TensorMap;

constexpr int kSteps = 6;
// A scalar, vectors (one over several blocks of Note [Adafactor blocks]), matrices with several row
// blocks and several column blocks, and a batch of matrices (3 dimensions: factored per matrix).
const std::vector<std::vector<int64_t>> kShapes = {{}, {1}, {7}, {33000}, {33, 9}, {300, 70}, {2, 600}, {5, 3, 4}};

// Steps `kSteps` times with gradients grads[step][param] (parameter 1 has none at step 0).
std::vector<torch::Tensor> run_ours(const std::vector<torch::Tensor>& init,
                                    const std::vector<std::vector<torch::Tensor>>& grads, AdafactorOptions options,
                                    int64_t threads = 0) {
  std::vector<torch::Tensor> params;
  for (const auto& t : init) params.push_back(t.clone());
  Adafactor opt(params, options);
  opt.set_num_threads(threads);
  for (int s = 0; s < kSteps; ++s) {
    for (size_t i = 0; i < params.size(); ++i) {
      params[i].mutable_grad() = s == 0 && i == 1 ? torch::Tensor() : grads[s][i].clone();
    }
    opt.step();
  }
  return params;
}

struct Case {
  double lr, beta2_decay;
  std::optional<double> eps1;
  double eps2, d, wd;
  bool maximize;
  torch::ScalarType grad_dtype;
};

std::string python_case(const Case& c) {
  std::ostringstream py;
  py.precision(17);
  py << "(" << c.lr << ", " << c.beta2_decay << ", " << (c.eps1 ? std::to_string(*c.eps1) : std::string("None")) << ", "
     << c.eps2 << ", " << c.d << ", " << c.wd << ", " << (c.maximize ? "True" : "False") << ", torch."
     << (c.grad_dtype == torch::kFloat  ? "float32"
         : c.grad_dtype == torch::kHalf ? "float16"
                                        : "bfloat16")
     << ")";
  return py.str();
}

TEST(AdafactorTest, MatchesTorchOptimAdafactor) {
  ROUNDPIPE_REQUIRE_ORACLE();
  torch::manual_seed(11);
  std::vector<torch::Tensor> init;
  std::vector<std::vector<torch::Tensor>> grads(kSteps);
  TensorMap inputs;
  for (size_t i = 0; i < kShapes.size(); ++i) {
    init.push_back(torch::randn(kShapes[i]));
    inputs["p" + std::to_string(i)] = init.back();
  }
  for (int s = 0; s < kSteps; ++s) {
    for (size_t i = 0; i < kShapes.size(); ++i) {
      // A spread of magnitudes between steps (the update clipping engages) and some exact zeros.
      auto g = torch::randn(kShapes[i]) * std::pow(10.0, s % 3 - 1);
      g.masked_fill_(torch::rand(kShapes[i]) < 0.05, 0.0);
      grads[s].push_back(g);
      inputs["g" + std::to_string(s) + "_" + std::to_string(i)] = g;
    }
  }
  const Case cases[] = {
      {1e-2, -0.8, std::nullopt, 1e-3, 1.0, 0.0, false, torch::kFloat},  // torch's defaults
      {3e-3, -0.5, 1e-5, 1e-2, 2.0, 0.1, false, torch::kFloat},
      {0.5, -0.8, std::nullopt, 1e-3, 1.0, 0.01, false, torch::kFloat},  // rho = 1/sqrt(t) from step 5
      {1e-2, -0.8, std::nullopt, 1e-3, 1.0, 0.0, true, torch::kFloat},   // maximize
      {1e-2, -0.8, std::nullopt, 1e-3, 1.0, 0.05, false, torch::kBFloat16},
      {1e-2, 0.0, 1e-3, 0.0, 1.0, 0.0, false, torch::kHalf},  // beta2 weight 1 at every step, no eps2
  };
  std::ostringstream py;
  py << "cases = [";
  for (const Case& c : cases) py << python_case(c) << ", ";
  py << "]\n"
     << "n = " << kShapes.size() << "\n"
     << "for k, (lr, b2d, e1, e2, d, wd, mx, dt) in enumerate(cases):\n"
     << "    ps = [torch.nn.Parameter(inputs[f'p{i}'].clone()) for i in range(n)]\n"
     << "    opt = torch.optim.Adafactor(ps, lr=lr, beta2_decay=b2d, eps=(e1, e2), d=d, weight_decay=wd,\n"
     << "                                maximize=mx, foreach=False)\n"
     << "    for s in range(" << kSteps << "):\n"
     << "        for i in range(n):\n"
     << "            ps[i].grad = None if s == 0 and i == 1 else inputs[f'g{s}_{i}'].to(dt).float()\n"
     << "        opt.step()\n"
     << "    for i in range(n): outputs[f'c{k}_p{i}'] = ps[i].detach()\n";
  const TensorMap ref = roundpipe::testing::run_python(py.str(), inputs);
  for (size_t k = 0; k < std::size(cases); ++k) {
    const Case& c = cases[k];
    SCOPED_TRACE(::testing::Message() << "case " << python_case(c));
    std::vector<std::vector<torch::Tensor>> typed = grads;
    for (auto& step : typed) {
      for (auto& g : step) g = g.to(c.grad_dtype);
    }
    const auto options = AdafactorOptions(c.lr)
                             .beta2_decay(c.beta2_decay)
                             .eps1(c.eps1)
                             .eps2(c.eps2)
                             .d(c.d)
                             .weight_decay(c.wd)
                             .maximize(c.maximize);
    const auto ours = run_ours(init, typed, options);
    for (size_t i = 0; i < kShapes.size(); ++i) {
      const auto& want = ref.at("c" + std::to_string(k) + "_p" + std::to_string(i));
      ASSERT_EQ(ours[i].sizes(), want.sizes());
      EXPECT_LE(max_abs_diff(ours[i], want), 1e-6 * (1 + want.abs().max().item<double>())) << "param " << i;
      // The parameters moved: the comparison is not between two untouched copies.
      EXPECT_FALSE(torch::equal(ours[i], init[i])) << "param " << i;
    }
  }
}

TEST(AdafactorTest, ResultsIndependentOfThreadCount_AndStateRoundTripsBitwise) {
  torch::manual_seed(3);
  std::vector<torch::Tensor> init = {torch::randn({70001}), torch::randn({300, 200}), torch::randn({4, 5, 7}),
                                     torch::randn({})};
  std::vector<std::vector<torch::Tensor>> grads(kSteps);
  for (auto& step : grads) {
    for (const auto& p : init) step.push_back(torch::randn(p.sizes()));
  }
  const auto options = AdafactorOptions(1e-2).weight_decay(0.05);
  const auto one = run_ours(init, grads, options, 1);
  const auto four = run_ours(init, grads, options, 4);
  for (size_t i = 0; i < init.size(); ++i) EXPECT_TRUE(torch::equal(one[i], four[i])) << "param " << i;

  // Save after 3 steps, load into a fresh optimizer, continue: bitwise as without the round trip.
  auto continued = [&](bool round_trip) {
    std::vector<torch::Tensor> params;
    for (const auto& t : init) params.push_back(t.clone());
    auto opt = std::make_unique<Adafactor>(params, options);
    for (int s = 0; s < kSteps; ++s) {
      if (s == 3 && round_trip) {
        std::ostringstream saved;
        torch::save(*opt, saved);
        // Options (eps1 unset included) come from the archive.
        opt = std::make_unique<Adafactor>(params, AdafactorOptions(0.5).eps1(0.25).maximize(true));
        std::istringstream in(saved.str());
        torch::load(*opt, in);
        const auto& loaded = static_cast<const AdafactorOptions&>(opt->param_groups()[0].options());
        EXPECT_TRUE(loaded == options);
        const auto& state = static_cast<const AdafactorParamState&>(*opt->state().begin()->second);
        EXPECT_EQ(state.step(), 3);
      }
      for (size_t i = 0; i < params.size(); ++i) params[i].mutable_grad() = grads[s][i].clone();
      opt->step();
    }
    return params;
  };
  const auto plain = continued(false), resumed = continued(true);
  for (size_t i = 0; i < init.size(); ++i) EXPECT_TRUE(torch::equal(plain[i], resumed[i])) << "param " << i;
}

TEST(AdafactorTest, StateHasTorchsShapes_FactoredForMatrices) {
  auto m = torch::zeros({4, 6}), b = torch::zeros({2, 4, 6}), v = torch::zeros({6});
  Adafactor opt({m, b, v});
  for (auto* p : {&m, &b, &v}) p->mutable_grad() = torch::ones(p->sizes());
  opt.step();
  auto state = [&](const torch::Tensor& p) -> const AdafactorParamState& {
    return static_cast<const AdafactorParamState&>(*opt.state().at(p.unsafeGetTensorImpl()));
  };
  EXPECT_EQ(state(m).row_var().sizes(), torch::IntArrayRef({4, 1}));
  EXPECT_EQ(state(m).col_var().sizes(), torch::IntArrayRef({1, 6}));
  EXPECT_FALSE(state(m).variance().defined());
  EXPECT_EQ(state(b).row_var().sizes(), torch::IntArrayRef({2, 4, 1}));
  EXPECT_EQ(state(b).col_var().sizes(), torch::IntArrayRef({2, 1, 6}));
  EXPECT_EQ(state(v).variance().sizes(), torch::IntArrayRef({6}));
  EXPECT_FALSE(state(v).row_var().defined());
  // Step 1: beta2 weight 1, so the second moments are the means of g^2 = 1.
  EXPECT_TRUE(torch::equal(state(m).row_var(), torch::ones({4, 1})));
  EXPECT_TRUE(torch::equal(state(b).col_var(), torch::ones({2, 1, 6})));
}

TEST(AdafactorTest, RejectsInvalidOptionsParamsAndState_WithClearMessages) {
  auto p = torch::zeros({3});
  EXPECT_THROW_WITH(Adafactor({p}, AdafactorOptions(-1.0)), "invalid learning rate");
  EXPECT_THROW_WITH(Adafactor({p}, AdafactorOptions().beta2_decay(0.5)), "use beta2_decay <= 0");
  EXPECT_THROW_WITH(Adafactor({p}, AdafactorOptions().eps1(-1.0)), "use eps1 >= 0");
  EXPECT_THROW_WITH(Adafactor({p}, AdafactorOptions().eps2(-1.0)), "use eps2 >= 0");
  EXPECT_THROW_WITH(Adafactor({p}, AdafactorOptions().d(0.5)), "use d >= 1");
  EXPECT_THROW_WITH(Adafactor({p}, AdafactorOptions().weight_decay(-1)), "weight_decay >= 0");
  EXPECT_THROW_WITH(Adafactor({torch::zeros({3}, torch::kBFloat16)}), "dense float32 CPU");
  EXPECT_THROW_WITH(Adafactor({torch::zeros({3}, torch::kDouble)}), "dense float32 CPU");
  {
    Adafactor opt({p});
    p.mutable_grad() = torch::zeros({4});
    EXPECT_THROW_WITH(opt.step(), "of the same shape");
  }
  // A state dict saved for other shapes.
  auto small = torch::zeros({2, 3});
  Adafactor saved_opt({small});
  small.mutable_grad() = torch::ones({2, 3});
  saved_opt.step();
  std::ostringstream saved;
  torch::save(saved_opt, saved);
  auto big = torch::zeros({2, 4});
  Adafactor opt({big});
  std::istringstream in(saved.str());
  torch::load(opt, in);
  big.mutable_grad() = torch::ones({2, 4});
  EXPECT_THROW_WITH(opt.step(), "state 'col_var' has shape");
}

}  // namespace
}  // namespace roundpipe::optim
