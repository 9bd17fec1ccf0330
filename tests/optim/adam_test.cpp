// roundpipe::optim::Adam against PyTorch's torch.optim.Adam/AdamW (Python oracle), state-dict
// round trips (ours and torch::optim::Adam's archives), option validation, LR schedulers, and
// clip_grad_norm against torch::nn::utils::clip_grad_norm_.
#include "optim/adam.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "base/thread_budget.h"
#include "tests/common/python_oracle.h"
#include "tests/common/tensor_compare.h"

namespace roundpipe::optim {
namespace {

using roundpipe::testing::max_abs_diff;
using roundpipe::testing::TensorMap;

constexpr int kSteps = 10;
// The gradient of parameter kLateParam is absent for the first kLateSteps steps, so per-parameter
// step counts (bias corrections) differ between parameters.
constexpr int kLateParam = 2;
constexpr int kLateSteps = 3;
const std::vector<std::vector<int64_t>> kShapes = {{0}, {1}, {7}, {17}, {1000003}, {3, 5}, {33, 9}};
constexpr int64_t kBigParam = 4;

struct Combo {
  double lr, beta1, beta2, eps, weight_decay;
  bool amsgrad, maximize, decoupled;
};

std::vector<Combo> all_combos() {
  // Second hyper-parameter set: beta1 = 0.4 makes lerp's weight 0.6 >= 0.5 (ATen's other branch).
  const Combo bases[] = {{0.01, 0.9, 0.999, 1e-8, 0, false, false, false},
                         {0.001, 0.4, 0.95, 1e-4, 0, false, false, false}};
  std::vector<Combo> combos;
  for (const auto& base : bases) {
    for (double wd : {0.0, 0.01}) {
      for (bool amsgrad : {false, true}) {
        for (bool maximize : {false, true}) {
          for (bool decoupled : {false, true}) {
            Combo c = base;
            c.weight_decay = wd;
            c.amsgrad = amsgrad;
            c.maximize = maximize;
            c.decoupled = decoupled;
            combos.push_back(c);
          }
        }
      }
    }
  }
  return combos;
}

std::string key(const char* prefix, size_t a, size_t b) {
  return std::string(prefix) + std::to_string(a) + "_" + std::to_string(b);
}

// Elements compared at every step for the 1M-element parameter (all of it after the last step).
torch::Tensor sample_index(int64_t n) {
  return torch::cat({torch::arange(0, n, 61), torch::arange(n / 2 - 40, n / 2 + 40), torch::arange(n - 100, n)});
}

TEST(AdamTest, MatchesTorchAdamAndAdamW_AllOptionCombinations) {
  ROUNDPIPE_REQUIRE_ORACLE();
  torch::manual_seed(0);
  const auto combos = all_combos();
  TensorMap inputs;
  std::vector<torch::Tensor> init;
  for (size_t i = 0; i < kShapes.size(); ++i) {
    init.push_back(torch::randn(kShapes[i]));
    inputs[key("p", i, 0)] = init.back();
    for (int s = 0; s < kSteps; ++s) {
      inputs[key("g", i, s)] = torch::randn(kShapes[i]);
    }
  }
  torch::Tensor config = torch::empty({static_cast<int64_t>(combos.size()), 8}, torch::kDouble);
  for (size_t c = 0; c < combos.size(); ++c) {
    const auto& k = combos[c];
    double row[8] = {
        k.lr, k.beta1, k.beta2, k.eps, k.weight_decay, double(k.amsgrad), double(k.maximize), double(k.decoupled)};
    for (int j = 0; j < 8; ++j) {
      config[c][j] = row[j];
    }
  }
  inputs["config"] = config;
  inputs["sample"] = sample_index(kShapes[kBigParam][0]);
  const std::string snippet = R"PY(
n_params = )PY" + std::to_string(kShapes.size()) +
                              R"PY(
steps = )PY" + std::to_string(kSteps) +
                              R"PY(
late, late_steps, big = )PY" + std::to_string(kLateParam) +
                              ", " + std::to_string(kLateSteps) + ", " + std::to_string(kBigParam) + R"PY(
cfg = inputs['config']
for c in range(cfg.shape[0]):
    lr, b1, b2, eps, wd, ams, mx, dec = cfg[c].tolist()
    params = [inputs[f'p{i}_0'].clone().requires_grad_() for i in range(n_params)]
    opt = torch.optim.Adam(params, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd,
                           amsgrad=bool(ams), maximize=bool(mx), foreach=False,
                           decoupled_weight_decay=bool(dec))
    for s in range(steps):
        for i, p in enumerate(params):
            p.grad = None if (i == late and s < late_steps) else inputs[f'g{i}_{s}'].clone()
        opt.step()
        for i, p in enumerate(params):
            t = p.detach()
            outputs[f'r{c}_{s}_{i}'] = t[inputs['sample']].clone() if i == big else t.clone()
    outputs[f'final{c}'] = params[big].detach().clone()
)PY";
  const TensorMap ref = roundpipe::testing::run_python(snippet, inputs);

  const auto sample = inputs["sample"];
  for (size_t c = 0; c < combos.size(); ++c) {
    const auto& k = combos[c];
    std::vector<torch::Tensor> params;
    for (const auto& t : init) {
      params.push_back(t.clone());
    }
    Adam opt(params, AdamOptions(k.lr)
                         .betas({k.beta1, k.beta2})
                         .eps(k.eps)
                         .weight_decay(k.weight_decay)
                         .amsgrad(k.amsgrad)
                         .maximize(k.maximize)
                         .decoupled_weight_decay(k.decoupled));
    const std::string what = "combo " + std::to_string(c) + " (lr " + std::to_string(k.lr) + ", beta1 " +
                             std::to_string(k.beta1) + ", wd " + std::to_string(k.weight_decay) + ", amsgrad " +
                             std::to_string(k.amsgrad) + ", maximize " + std::to_string(k.maximize) + ", decoupled " +
                             std::to_string(k.decoupled) + ")";
    for (int s = 0; s < kSteps; ++s) {
      for (size_t i = 0; i < params.size(); ++i) {
        params[i].mutable_grad() =
            (int(i) == kLateParam && s < kLateSteps) ? torch::Tensor() : inputs.at(key("g", i, s)).clone();
      }
      opt.step();
      for (size_t i = 0; i < params.size(); ++i) {
        const auto expected = ref.at("r" + std::to_string(c) + "_" + std::to_string(s) + "_" + std::to_string(i));
        const auto actual = int64_t(i) == kBigParam ? params[i].index({sample}) : params[i];
        ASSERT_LE(max_abs_diff(actual, expected), 1e-6)
            << what << ", step " << s << ", param " << i << " of shape " << params[i].sizes();
      }
    }
    ASSERT_LE(max_abs_diff(params[kBigParam], ref.at("final" + std::to_string(c))), 1e-6) << what;
    // Parameters did move (the comparison is not between two untouched copies).
    ASSERT_GT(max_abs_diff(params[kBigParam], init[kBigParam]), 1e-3) << what;
  }
}

// Runs `steps` steps of a two-group optimizer (group 2: amsgrad + AdamW) on fixed gradients.
struct TwoGroupRun {
  std::vector<torch::Tensor> a, b;
  std::vector<torch::Tensor> grads;

  explicit TwoGroupRun(uint64_t seed) {
    torch::manual_seed(seed);
    a = {torch::randn({5, 4}), torch::randn({257})};
    b = {torch::randn({33})};
    for (int s = 0; s < kSteps; ++s) {
      for (const auto& p : all()) {
        grads.push_back(torch::randn(p.sizes()));
      }
    }
  }
  std::vector<torch::Tensor> all() const { return {a[0], a[1], b[0]}; }
  std::unique_ptr<Adam> make() const {
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(a);
    groups.emplace_back(b, std::make_unique<AdamOptions>(
                               AdamOptions(3e-3).amsgrad(true).weight_decay(0.1).decoupled_weight_decay(true)));
    return std::make_unique<Adam>(groups, AdamOptions(1e-2).betas({0.8, 0.99}).weight_decay(0.01));
  }
  void run(Adam& opt, int from, int to) {
    const auto params = all();
    for (int s = from; s < to; ++s) {
      for (size_t i = 0; i < params.size(); ++i) {
        params[i].mutable_grad() = grads[s * params.size() + i];
      }
      opt.step();
    }
  }
};

// Note [Optimizer thread budget]: a thread's budget caps the default thread count of a step, not an
// explicit one.
TEST(AdamTest, ThreadBudget_CapsTheDefaultThreadCountOnly) {
  auto p = torch::zeros({8 * 32 * 1024}, torch::requires_grad());  // 8 grains of work
  p.mutable_grad() = torch::ones_like(p);
  optim::Adam adam({p});
  std::thread([&] {
    const int64_t all = std::min<int64_t>(at::get_num_threads(), 8);
    adam.step();
    EXPECT_EQ(adam.last_step_threads(), all);
    base::set_thread_budget(1);
    adam.step();
    EXPECT_EQ(adam.last_step_threads(), 1);
    adam.set_num_threads(2);
    adam.step();
    EXPECT_EQ(adam.last_step_threads(), 2);
    adam.set_num_threads(0);
    base::set_thread_budget(0);
    adam.step();
    EXPECT_EQ(adam.last_step_threads(), all);
  }).join();
  EXPECT_EQ(base::thread_budget(), 0) << "the budget is the setting thread's own";
}

TEST(AdamTest, StateDictRoundTrip_ContinuesIdentically) {
  TwoGroupRun straight(7), resumed(7);
  auto opt = straight.make();
  straight.run(*opt, 0, kSteps);

  auto first = resumed.make();
  resumed.run(*first, 0, 4);
  std::stringstream buffer;
  {
    torch::serialize::OutputArchive archive;
    first->save(archive);
    archive.save_to(buffer);
  }
  // Fresh parameter tensors (other TensorImpls) holding the same values, fresh optimizer.
  for (auto* list : {&resumed.a, &resumed.b}) {
    for (auto& p : *list) {
      p = p.detach().clone();
    }
  }
  auto second = resumed.make();
  {
    torch::serialize::InputArchive archive;
    archive.load_from(buffer);
    second->load(archive);
  }
  ASSERT_EQ(second->state().size(), 3u);
  resumed.run(*second, 4, kSteps);
  const auto x = straight.all(), y = resumed.all();
  for (size_t i = 0; i < x.size(); ++i) {
    EXPECT_TENSOR_EQ(y[i], x[i]);
  }
  const auto& state = static_cast<const AdamParamState&>(*second->state().at(y[2].unsafeGetTensorImpl()));
  EXPECT_EQ(state.step(), kSteps);
  EXPECT_TRUE(state.max_exp_avg_sq().defined());
  const auto& group2 = static_cast<const AdamOptions&>(second->param_groups()[1].options());
  EXPECT_TRUE(group2.amsgrad() && group2.decoupled_weight_decay());
  EXPECT_DOUBLE_EQ(group2.weight_decay(), 0.1);
}

TEST(AdamTest, LoadsTorchAdamArchive_ContinuesLikeTorch) {
  torch::manual_seed(3);
  const auto init = torch::randn({1001});
  std::vector<torch::Tensor> grads;
  for (int s = 0; s < 6; ++s) {
    grads.push_back(torch::randn({1001}));
  }
  auto p_torch = init.clone();
  torch::optim::Adam torch_opt({p_torch}, torch::optim::AdamOptions(1e-2).weight_decay(0.01).amsgrad(true));
  for (int s = 0; s < 3; ++s) {
    p_torch.mutable_grad() = grads[s];
    torch_opt.step();
  }
  std::stringstream buffer;
  {
    torch::serialize::OutputArchive archive;
    torch_opt.save(archive);
    archive.save_to(buffer);
  }
  auto p_ours = p_torch.detach().clone();
  Adam ours({p_ours});
  {
    torch::serialize::InputArchive archive;
    archive.load_from(buffer);
    ours.load(archive);
  }
  const auto& options = static_cast<const AdamOptions&>(ours.param_groups()[0].options());
  EXPECT_TRUE(options.amsgrad());
  EXPECT_FALSE(options.decoupled_weight_decay());
  for (int s = 3; s < 6; ++s) {
    p_torch.mutable_grad() = grads[s];
    torch_opt.step();
    p_ours.mutable_grad() = grads[s];
    ours.step();
    ASSERT_LE(max_abs_diff(p_ours, p_torch), 1e-6) << "step " << s;
  }
}

template <typename Fn>
void expect_error(Fn fn, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "expected an error containing '" << needle << "'";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(AdamTest, RejectsInvalidOptionsAndParams_WithClearMessages) {
  auto p = torch::zeros({3});
  expect_error([&] { Adam({p}, AdamOptions(-1)); }, "invalid learning rate lr=-1");
  expect_error([&] { Adam({p}, AdamOptions().betas({1.0, 0.9})); }, "beta parameter at index 0");
  expect_error([&] { Adam({p}, AdamOptions().betas({0.9, -0.1})); }, "beta parameter at index 1");
  expect_error([&] { Adam({p}, AdamOptions().eps(-1e-8)); }, "invalid epsilon");
  expect_error([&] { Adam({p}, AdamOptions().weight_decay(-0.1)); }, "invalid weight_decay");
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<torch::Tensor>{p}, std::make_unique<AdamOptions>(AdamOptions(-2)));
  expect_error([&] { Adam opt(groups); }, "param group 0");
  expect_error([&] { Adam({torch::zeros({3}, torch::kHalf)}); }, "dense float32 CPU");
  expect_error([&] { Adam({torch::zeros({3}, torch::kDouble)}); }, "dense float32 CPU");
  expect_error([&] { Adam({torch::zeros({4, 4}).t()}); }, "not contiguous");

  Adam opt({p});
  p.mutable_grad() = torch::zeros({3}, torch::kDouble);
  expect_error([&] { opt.step(); }, "gradient of a parameter of shape [3]");
  p.mutable_grad() = torch::zeros({4});
  expect_error([&] { opt.step(); }, "same shape");
  for (const CpuIsa isa : {CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    if (!cpu_supports(isa)) {
      expect_error([&] { opt.set_kernel_isa(isa); }, "does not support");
    }
  }
  expect_error([&] { opt.set_num_threads(-1); }, "set_num_threads");
  expect_error([&] { opt.set_compute_copy(torch::zeros({3}), torch::zeros({3})); },
               "not one of this optimizer's parameters");
  expect_error([&] { opt.set_compute_copy(p, torch::zeros({3}, torch::kDouble)); }, "float16 or bfloat16");
  expect_error([&] { opt.set_compute_copy(p, torch::zeros({4})); }, "has shape [4]");
}

// clip_grad_norm(Adam&) == torch::nn::utils::clip_grad_norm_ followed by step(): the same total
// norm and bitwise the same parameters, for float32 gradients and for bf16 ones (against clipping
// their float32 values; a bf16 gradient of more than kClipNormPiece elements given to torch as its
// pieces, Note [Clip norms in pieces]), clipping (a small max_norm) or not (a large one), over 4
// steps with two param groups and a parameter without a gradient.
TEST(AdamTest, ClipGradNorm_EqualsTorchClipGradNormThenStep) {
  for (const auto grad_dtype : {torch::kFloat, torch::kBFloat16}) {
    for (const double max_norm : {0.5, 1e6}) {
      torch::manual_seed(3);
      const std::vector<std::vector<int64_t>> shapes = {{300, 7}, {1000003}, {2, kClipNormPiece + 5}, {17}, {5}};
      std::vector<torch::Tensor> ours, ref;
      for (const auto& shape : shapes) {
        ours.push_back(torch::randn(shape));
        ref.push_back(ours.back().clone());
      }
      const auto make = [&](std::vector<torch::Tensor>& p) {
        std::vector<torch::optim::OptimizerParamGroup> groups;
        groups.emplace_back(std::vector<torch::Tensor>{p[0], p[1]},
                            std::make_unique<AdamOptions>(AdamOptions(1e-2).weight_decay(0.1)));
        groups.emplace_back(std::vector<torch::Tensor>{p[2], p[3]});
        return std::make_unique<Adam>(groups, AdamOptions(3e-3).decoupled_weight_decay(true).weight_decay(0.01));
      };
      auto our_opt = make(ours);
      auto ref_opt = make(ref);
      for (int step = 0; step < 4; ++step) {
        for (size_t i = 0; i + 1 < shapes.size(); ++i) {  // the last parameter never gets a gradient
          const torch::Tensor g = (torch::randn(shapes[i]) * (i + 1)).to(grad_dtype);
          ours[i].mutable_grad() = g;
          ref[i].mutable_grad() = g.to(torch::kFloat, /*non_blocking=*/false, /*copy=*/true);  // torch's clip writes it
        }
        // torch's clip_grad_norm_ takes the pieces as parameters of their own, each with a view
        // of the float32 gradient as its gradient (its coefficient is written into the views)
        std::vector<torch::Tensor> ref_pieces;
        for (const auto& p : ref) {
          if (!p.grad().defined() || grad_dtype == torch::kFloat || p.numel() <= kClipNormPiece) {
            ref_pieces.push_back(p);
            continue;
          }
          const torch::Tensor flat = p.grad().view({-1});
          for (int64_t lo = 0; lo < flat.numel(); lo += kClipNormPiece) {
            ref_pieces.push_back(torch::zeros({std::min(kClipNormPiece, flat.numel() - lo)}));
            ref_pieces.back().mutable_grad() = flat.slice(0, lo, lo + ref_pieces.back().numel());
          }
        }
        ASSERT_EQ(ref_pieces.size(), grad_dtype == torch::kFloat ? shapes.size() : shapes.size() + 2);
        const double our_norm = clip_grad_norm(*our_opt, max_norm);
        const double ref_norm = torch::nn::utils::clip_grad_norm_(ref_pieces, max_norm);
        EXPECT_EQ(our_norm, ref_norm) << grad_dtype << ", max_norm " << max_norm << ", step " << step;
        ASSERT_TRUE(our_opt->next_gradient_factor().has_value());
        EXPECT_EQ(*our_opt->next_gradient_factor() == 1.0f, max_norm > 1e5);
        our_opt->step();
        ref_opt->step();
        EXPECT_FALSE(our_opt->next_gradient_factor().has_value());
        for (size_t i = 0; i < shapes.size(); ++i) {
          EXPECT_TENSOR_EQ(ours[i], ref[i])
              << grad_dtype << ", max_norm " << max_norm << ", step " << step << ", parameter " << i;
        }
      }
    }
  }
  Adam empty({torch::zeros({3})});
  EXPECT_EQ(clip_grad_norm(empty, 1.0), 0.0);  // no gradient: nothing to clip, as torch's
}

// The factor belongs to the gradients it was set for: a replaced, modified, added or removed
// gradient makes the next step() refuse (and update nothing); the factor is gone afterwards.
TEST(AdamTest, ScaleNextGradients_RefusesOtherGradients) {
  auto a = torch::ones({8});
  auto b = torch::ones({4});
  Adam opt({a, b}, AdamOptions(0.1));
  const std::vector<std::function<void()>> changes = {
      [&] { a.mutable_grad() = torch::ones({8}); },  // replaced
      [&] { a.mutable_grad().mul_(2); },             // modified in place
      [&] { b.mutable_grad() = torch::ones({4}); },  // added
  };
  for (size_t c = 0; c < changes.size(); ++c) {
    a.mutable_grad() = torch::ones({8});
    b.mutable_grad() = torch::Tensor();
    opt.scale_next_gradients(0.5f);
    changes[c]();
    const auto before = a.clone();
    expect_error([&] { opt.step(); }, "scale_next_gradients(0.5) was called for other gradients");
    EXPECT_TENSOR_EQ(a, before) << "change " << c;
    EXPECT_FALSE(opt.next_gradient_factor().has_value()) << "change " << c;
  }
  a.mutable_grad() = torch::ones({8});
  b.mutable_grad() = torch::ones({4});
  opt.scale_next_gradients(0.5f);
  b.mutable_grad() = torch::Tensor();  // removed
  expect_error([&] { opt.step(); }, "other gradients");
  opt.step();  // without a factor: a normal step
  EXPECT_TENSOR_CLOSE(a, torch::full({8}, 0.9), 1e-6);
}

TEST(AdamTest, LrSchedulerAndClosure_WorkThroughOptimizerInterface) {
  auto p = torch::ones({4}, torch::requires_grad());
  Adam opt({p}, AdamOptions(0.1));
  torch::optim::StepLR scheduler(opt, /*step_size=*/1, /*gamma=*/0.5);
  int calls = 0;
  auto loss = opt.step([&] {
    ++calls;
    opt.zero_grad();
    auto l = (p * p).sum();
    l.backward();
    return l;
  });
  EXPECT_EQ(calls, 1);
  EXPECT_DOUBLE_EQ(loss.item<double>(), 4.0);
  // First Adam step moves every element by lr (m/sqrt(v) = 1 after bias correction).
  EXPECT_TENSOR_CLOSE(p.detach(), torch::full({4}, 0.9), 1e-6);
  // torch::optim::StepLR leaves the first step() alone, then decays every step_size steps.
  scheduler.step();
  scheduler.step();
  EXPECT_DOUBLE_EQ(opt.param_groups()[0].options().get_lr(), 0.05);
  EXPECT_DOUBLE_EQ(static_cast<const AdamOptions&>(opt.param_groups()[0].options()).lr(), 0.05);
}

}  // namespace
}  // namespace roundpipe::optim
