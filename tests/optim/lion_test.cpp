// roundpipe::optim::Lion against the Lion paper's reference implementation run in PyTorch (Python
// oracle: the same per-tensor ops), bf16/fp16 gradients, missing gradients, state-dict round trip,
// thread-count independence and option validation.
#include "optim/lion.h"

#include "optim/detail/lion_kernel.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <iterator>
#include <limits>
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
const std::vector<std::vector<int64_t>> kShapes = {{1}, {7}, {1000}, {200003}, {33, 9}};

// Steps `kSteps` times with gradients grads[step][param] (parameter 1 has none at step 0).
std::vector<torch::Tensor> run_ours(const std::vector<torch::Tensor>& init,
                                    const std::vector<std::vector<torch::Tensor>>& grads, LionOptions options,
                                    int64_t threads = 0) {
  std::vector<torch::Tensor> params;
  for (const auto& t : init) params.push_back(t.clone());
  Lion opt(params, options);
  opt.set_num_threads(threads);
  for (int s = 0; s < kSteps; ++s) {
    for (size_t i = 0; i < params.size(); ++i) {
      params[i].mutable_grad() = s == 0 && i == 1 ? torch::Tensor() : grads[s][i].clone();
    }
    opt.step();
  }
  return params;
}

TEST(LionTest, MatchesThePapersReferenceInPyTorch) {
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
      // Some exact zeros and a spread of magnitudes: sign(0) and tiny updates are exercised.
      auto g = torch::randn(kShapes[i]) * std::pow(10.0, s % 3 - 1);
      g.masked_fill_(torch::rand(kShapes[i]) < 0.05, 0.0);
      grads[s].push_back(g);
      inputs["g" + std::to_string(s) + "_" + std::to_string(i)] = g;
    }
  }
  struct Case {
    double lr, beta1, beta2, wd;
    torch::ScalarType grad_dtype;
  };
  const Case cases[] = {{1e-3, 0.9, 0.99, 0.0, torch::kFloat},
                        {3e-4, 0.95, 0.98, 0.1, torch::kFloat},
                        {1e-3, 0.9, 0.99, 0.01, torch::kBFloat16},
                        {1e-3, 0.0, 1.0, 0.0, torch::kHalf}};
  // One Python run for every case (the reference: lucidrains/lion-pytorch's update_fn, op for op).
  std::ostringstream py;
  py.precision(17);
  py << "cases = [";
  for (const Case& c : cases) {
    py << "(" << c.lr << ", " << c.beta1 << ", " << c.beta2 << ", " << c.wd << ", torch."
       << (c.grad_dtype == torch::kFloat ? "float32" : c.grad_dtype == torch::kHalf ? "float16" : "bfloat16") << "), ";
  }
  py << "]\n"
     << "n = " << kShapes.size() << "\n"
     << "for k, (lr, b1, b2, wd, dt) in enumerate(cases):\n"
     << "    ps = [inputs[f'p{i}'].clone() for i in range(n)]\n"
     << "    ms = [torch.zeros_like(p) for p in ps]\n"
     << "    for s in range(" << kSteps << "):\n"
     << "        for i in range(n):\n"
     << "            if s == 0 and i == 1: continue\n"
     << "            g = inputs[f'g{s}_{i}'].to(dt).float()\n"
     << "            p, m = ps[i], ms[i]\n"
     << "            p.mul_(1 - lr * wd)\n"
     << "            update = m.clone().mul_(b1).add(g, alpha=1 - b1).sign_()\n"
     << "            p.add_(update, alpha=-lr)\n"
     << "            m.mul_(b2).add_(g, alpha=1 - b2)\n"
     << "    for i in range(n): outputs[f'c{k}_p{i}'] = ps[i]\n";
  const TensorMap ref = roundpipe::testing::run_python(py.str(), inputs);
  for (size_t k = 0; k < std::size(cases); ++k) {
    const Case& c = cases[k];
    SCOPED_TRACE(::testing::Message() << "lr " << c.lr << " betas " << c.beta1 << "," << c.beta2 << " wd " << c.wd
                                      << " grads " << c10::toString(c.grad_dtype));
    std::vector<std::vector<torch::Tensor>> typed = grads;
    for (auto& step : typed) {
      for (auto& g : step) g = g.to(c.grad_dtype);
    }
    const auto ours = run_ours(init, typed, LionOptions(c.lr).betas({c.beta1, c.beta2}).weight_decay(c.wd));
    for (size_t i = 0; i < kShapes.size(); ++i) {
      const auto& want = ref.at("c" + std::to_string(k) + "_p" + std::to_string(i));
      EXPECT_LE(max_abs_diff(ours[i], want), 1e-6 * (1 + want.abs().max().item<double>())) << "param " << i;
    }
  }
}

TEST(LionTest, ResultsIndependentOfThreadCount_AndStateRoundTripsBitwise) {
  torch::manual_seed(3);
  std::vector<torch::Tensor> init = {torch::randn({300001}), torch::randn({5, 7}), torch::randn({70000})};
  std::vector<std::vector<torch::Tensor>> grads(kSteps);
  for (auto& step : grads) {
    for (const auto& p : init) step.push_back(torch::randn(p.sizes()));
  }
  const auto options = LionOptions(1e-3).weight_decay(0.05);
  const auto one = run_ours(init, grads, options, 1);
  const auto four = run_ours(init, grads, options, 4);
  for (size_t i = 0; i < init.size(); ++i) EXPECT_TRUE(torch::equal(one[i], four[i])) << "param " << i;

  // Save after 3 steps, load into a fresh optimizer, continue: bitwise as without the round trip.
  auto continued = [&](bool round_trip) {
    std::vector<torch::Tensor> params;
    for (const auto& t : init) params.push_back(t.clone());
    auto opt = std::make_unique<Lion>(params, options);
    for (int s = 0; s < kSteps; ++s) {
      if (s == 3 && round_trip) {
        std::ostringstream saved;
        torch::save(*opt, saved);
        opt = std::make_unique<Lion>(params, LionOptions(0.5));  // options come from the archive
        std::istringstream in(saved.str());
        torch::load(*opt, in);
      }
      for (size_t i = 0; i < params.size(); ++i) params[i].mutable_grad() = grads[s][i].clone();
      opt->step();
    }
    return params;
  };
  const auto plain = continued(false), resumed = continued(true);
  for (size_t i = 0; i < init.size(); ++i) EXPECT_TRUE(torch::equal(plain[i], resumed[i])) << "param " << i;
}

// Note [Lion element order]: every ISA's kernel gives the scalar kernel's bits, for odd lengths
// (vector loops plus tails), every gradient dtype, special values (0, NaN gradients, denormals).
TEST(LionTest, EveryIsaMatchesScalarBitwise) {
  using detail::CpuIsa;
  torch::manual_seed(5);
  const int64_t n = 1037;
  auto g = torch::randn({n});
  g.index_put_({torch::arange(0, n, 97)}, 0.0);
  g[5] = std::numeric_limits<float>::quiet_NaN();
  g[6] = 1e-40f;  // denormal
  for (const auto dtype : {torch::kFloat, torch::kBFloat16, torch::kHalf}) {
    const torch::Tensor grad = g.to(dtype).contiguous();
    std::vector<torch::Tensor> results;
    for (const CpuIsa isa : {CpuIsa::kScalar, CpuIsa::kAvx2, CpuIsa::kAvx512}) {
      if (!detail::cpu_supports(isa)) continue;
      torch::manual_seed(6);
      auto p = torch::randn({n}), m = torch::randn({n}) * 0.1;
      detail::LionTensor t;
      t.param = p.data_ptr<float>();
      t.grad = grad.const_data_ptr();
      t.grad_dtype = dtype == torch::kFloat  ? detail::GradDtype::kFloat
                     : dtype == torch::kHalf ? detail::GradDtype::kHalf
                                             : detail::GradDtype::kBFloat16;
      t.exp_avg = m.data_ptr<float>();
      t.numel = n;
      t.scalars = {0.999f, 0.9f, 0.1f, -1e-3f, 0.99f, 0.01f};
      for (int step = 0; step < 3; ++step) {
        detail::lion_update_fn(isa)(t, 0, 500);
        detail::lion_update_fn(isa)(t, 500, n);  // a split mid-vector, as between threads
      }
      results.push_back(torch::cat({p, m}));
    }
    for (size_t i = 1; i < results.size(); ++i) {
      // NaN where NaN (the poisoned element's momentum), the same bits everywhere else.
      EXPECT_TRUE(torch::equal(torch::isnan(results[0]), torch::isnan(results[i])) &&
                  torch::equal(results[0].nan_to_num(0), results[i].nan_to_num(0)))
          << c10::toString(dtype) << ": ISA " << i << " differs from scalar";
    }
  }
}

TEST(LionTest, RejectsInvalidOptionsAndParams_WithClearMessages) {
  auto p = torch::zeros({3});
  EXPECT_THROW_WITH(Lion({p}, LionOptions(-1.0)), "invalid learning rate");
  EXPECT_THROW_WITH(Lion({p}, LionOptions(1e-3).betas({1.5, 0.99})), "betas must lie in [0, 1]");
  EXPECT_THROW_WITH(Lion({p}, LionOptions(1e-3).weight_decay(-1)), "weight_decay >= 0");
  EXPECT_THROW_WITH(Lion({torch::zeros({3}, torch::kDouble)}), "dense float32 CPU");
  Lion opt({p});
  p.mutable_grad() = torch::zeros({4});
  EXPECT_THROW_WITH(opt.step(), "of the same shape");
}

}  // namespace
}  // namespace roundpipe::optim
