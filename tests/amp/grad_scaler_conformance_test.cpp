// GradScaler conformance against Python's torch.amp.GradScaler("cpu"): scripted runs of 50+
// iterations (inf/NaN injections, natural overflow, setters and update(new_scale) mid-run, separate
// unscale_) replayed on both sides with identical fp32 math; per-iteration scale, growth tracker,
// skipped steps and parameters must match bitwise.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "amp/grad_scaler.h"
#include "tests/common/python_oracle.h"
#include "tests/common/tensor_compare.h"

namespace roundpipe::amp {
namespace {

struct Injection {
  int64_t iteration;
  size_t param;
  int64_t flat_index;
  float value;
};

struct Scenario {
  GradScalerOptions options;
  int64_t iterations = 60;
  double grad_std = 1.0;
  std::vector<Injection> injections;
  std::map<int64_t, double> set_growth_factor;   // applied before that iteration's step
  std::map<int64_t, double> set_backoff_factor;
  std::map<int64_t, int64_t> set_growth_interval;
  std::map<int64_t, double> new_scale;           // update(new_scale) instead of update()
  std::set<int64_t> separate_unscale;            // unscale_, grads *= 0.5, then step
};

// Python replays exactly what run_cpp does (see the comments there).
constexpr const char* kPythonReplay = R"PY(
cfg = inputs['config'].tolist()
ev = inputs['events'].tolist()
num_params = int(cfg[5])
params = [inputs[f'p{i}'].clone().requires_grad_(True) for i in range(num_params)]
grads = [inputs[f'g{i}'] for i in range(num_params)]
opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
scaler = torch.amp.GradScaler('cpu', init_scale=cfg[0], growth_factor=cfg[1], backoff_factor=cfg[2],
                              growth_interval=int(cfg[3]))
used, scales, trackers, stepped = [], [], [], []
history = [[] for _ in params]
for k in range(int(cfg[4])):
    growth, backoff, interval, new_scale, separate = ev[k]
    if growth != 0: scaler.set_growth_factor(growth)
    if backoff != 0: scaler.set_backoff_factor(backoff)
    if interval != 0: scaler.set_growth_interval(int(interval))
    opt.zero_grad()
    for p, g in zip(params, grads):
        p.grad = scaler.scale(g[k])
    used.append(scaler._scale.clone())
    if separate != 0:
        scaler.unscale_(opt)
        with torch.no_grad():
            for p in params: p.grad.mul_(0.5)
    scaler.step(opt)
    found = sum(v.item() for v in scaler._per_optimizer_states[id(opt)]['found_inf_per_device'].values())
    stepped.append(found == 0)
    if new_scale != 0: scaler.update(new_scale)
    else: scaler.update()
    scales.append(scaler._scale.clone())
    trackers.append(scaler._growth_tracker.clone())
    for h, p in zip(history, params): h.append(p.detach().clone())
outputs['used'] = torch.stack(used)
outputs['scales'] = torch.stack(scales)
outputs['trackers'] = torch.stack(trackers)
outputs['stepped'] = torch.tensor(stepped)
for i, h in enumerate(history): outputs[f'p{i}'] = torch.stack(h)
sd = scaler.state_dict()
outputs['sd_scale'] = sd['scale']
outputs['sd_growth_factor'] = sd['growth_factor']
outputs['sd_backoff_factor'] = sd['backoff_factor']
outputs['sd_growth_interval'] = sd['growth_interval']
outputs['sd_growth_tracker'] = sd['_growth_tracker']
)PY";

struct Run {
  torch::Tensor used, scales, trackers, stepped;
  std::vector<torch::Tensor> params;
  GradScalerState final_state;
};

struct Inputs {
  std::vector<torch::Tensor> initial;  // parameters
  std::vector<torch::Tensor> grads;    // [iterations, param shape...], injections baked in
  torch::Tensor events;                // [iterations, 5] double
};

Inputs make_inputs(const Scenario& sc) {
  torch::manual_seed(1234);
  Inputs in;
  const std::vector<std::vector<int64_t>> shapes = {{4, 3}, {4}, {2, 4}, {2}};
  for (const auto& shape : shapes) {
    in.initial.push_back(torch::randn(shape));
    std::vector<int64_t> stacked = {sc.iterations};
    stacked.insert(stacked.end(), shape.begin(), shape.end());
    in.grads.push_back(torch::randn(stacked) * sc.grad_std);
  }
  for (const auto& inj : sc.injections) {
    in.grads[inj.param][inj.iteration].view({-1})[inj.flat_index] = inj.value;
  }
  in.events = torch::zeros({sc.iterations, 5}, torch::kDouble);
  auto e = in.events.accessor<double, 2>();
  for (const auto& [k, v] : sc.set_growth_factor) e[k][0] = v;
  for (const auto& [k, v] : sc.set_backoff_factor) e[k][1] = v;
  for (const auto& [k, v] : sc.set_growth_interval) e[k][2] = static_cast<double>(v);
  for (const auto& [k, v] : sc.new_scale) e[k][3] = v;
  for (int64_t k : sc.separate_unscale) e[k][4] = 1.0;
  return in;
}

Run run_cpp(const Scenario& sc, const Inputs& in) {
  std::vector<torch::Tensor> params;
  for (const auto& p : in.initial) params.push_back(p.clone().set_requires_grad(true));
  torch::optim::SGD opt(params, torch::optim::SGDOptions(0.05).momentum(0.9));
  GradScaler scaler(sc.options);
  std::vector<torch::Tensor> used, scales, trackers, stepped;
  std::vector<std::vector<torch::Tensor>> history(params.size());
  for (int64_t k = 0; k < sc.iterations; ++k) {
    if (auto it = sc.set_growth_factor.find(k); it != sc.set_growth_factor.end()) scaler.set_growth_factor(it->second);
    if (auto it = sc.set_backoff_factor.find(k); it != sc.set_backoff_factor.end()) {
      scaler.set_backoff_factor(it->second);
    }
    if (auto it = sc.set_growth_interval.find(k); it != sc.set_growth_interval.end()) {
      scaler.set_growth_interval(it->second);
    }
    opt.zero_grad();
    for (size_t i = 0; i < params.size(); ++i) params[i].mutable_grad() = scaler.scale(in.grads[i][k]);
    used.push_back(scaler.scale_tensor());
    if (sc.separate_unscale.count(k) != 0) {
      scaler.unscale_(opt);
      torch::NoGradGuard no_grad;
      for (auto& p : params) p.mutable_grad().mul_(0.5);
    }
    stepped.push_back(torch::tensor(scaler.step(opt)));
    if (auto it = sc.new_scale.find(k); it != sc.new_scale.end()) {
      scaler.update(it->second);
    } else {
      scaler.update();
    }
    scales.push_back(scaler.scale_tensor());
    trackers.push_back(torch::full({}, scaler.state_dict().growth_tracker, torch::kInt));
    for (size_t i = 0; i < params.size(); ++i) history[i].push_back(params[i].detach().clone());
  }
  Run run;
  run.used = torch::stack(used);
  run.scales = torch::stack(scales);
  run.trackers = torch::stack(trackers);
  run.stepped = torch::stack(stepped);
  for (auto& h : history) run.params.push_back(torch::stack(h));
  run.final_state = scaler.state_dict();
  return run;
}

void expect_conforms(const Scenario& sc, int64_t min_skipped) {
  ROUNDPIPE_REQUIRE_ORACLE();
  const Inputs in = make_inputs(sc);
  const Run cpp = run_cpp(sc, in);

  testing::TensorMap py_inputs;
  py_inputs["config"] = torch::tensor({sc.options.init_scale(), sc.options.growth_factor(), sc.options.backoff_factor(),
                                       static_cast<double>(sc.options.growth_interval()),
                                       static_cast<double>(sc.iterations), static_cast<double>(in.initial.size())},
                                      torch::kDouble);
  py_inputs["events"] = in.events;
  for (size_t i = 0; i < in.initial.size(); ++i) {
    py_inputs["p" + std::to_string(i)] = in.initial[i];
    py_inputs["g" + std::to_string(i)] = in.grads[i];
  }
  const auto py = testing::run_python(kPythonReplay, py_inputs);

  // The scenario must exercise what it claims to: some steps skipped, some taken.
  const int64_t skipped = (~cpp.stepped).sum().item<int64_t>();
  EXPECT_GE(skipped, min_skipped);
  EXPECT_LT(skipped, sc.iterations);

  EXPECT_TENSOR_EQ(cpp.used, py.at("used"));
  EXPECT_TENSOR_EQ(cpp.scales, py.at("scales"));
  EXPECT_TENSOR_EQ(cpp.trackers, py.at("trackers"));
  EXPECT_TENSOR_EQ(cpp.stepped, py.at("stepped"));
  for (size_t i = 0; i < cpp.params.size(); ++i) {
    EXPECT_TENSOR_EQ(cpp.params[i], py.at("p" + std::to_string(i))) << "parameter " << i;
  }
  // First iteration where the scale differs, for a readable failure.
  if (!torch::equal(cpp.scales, py.at("scales"))) {
    auto differ = (cpp.scales != py.at("scales")).nonzero();
    const int64_t k = differ[0][0].item<int64_t>();
    ADD_FAILURE() << "scale differs first at iteration " << k << ": C++ " << cpp.scales[k].item<float>()
                  << ", Python " << py.at("scales")[k].item<float>();
  }
  EXPECT_EQ(cpp.final_state.scale, py.at("sd_scale").item<double>());
  EXPECT_EQ(cpp.final_state.growth_factor, py.at("sd_growth_factor").item<double>());
  EXPECT_EQ(cpp.final_state.backoff_factor, py.at("sd_backoff_factor").item<double>());
  EXPECT_EQ(cpp.final_state.growth_interval, py.at("sd_growth_interval").item<int64_t>());
  EXPECT_EQ(cpp.final_state.growth_tracker, py.at("sd_growth_tracker").item<int64_t>());
}

constexpr float kInf = std::numeric_limits<float>::infinity();
const float kNaN = std::nanf("");

TEST(GradScalerConformanceTest, GrowthInterval1_InfNaNAndSeparateUnscale) {
  Scenario sc;
  sc.options = GradScalerOptions().init_scale(128.0).growth_interval(1);
  sc.iterations = 60;
  sc.injections = {{5, 0, 3, kInf}, {17, 2, 0, kNaN}, {18, 1, 2, -kInf}, {30, 3, 1, kNaN},
                   {41, 0, 11, kInf}, {41, 2, 7, kNaN}, {12, 1, 0, kInf}};
  sc.separate_unscale = {10, 11, 12, 13, 14, 15, 50};
  expect_conforms(sc, 6);
}

TEST(GradScalerConformanceTest, GrowthInterval2_SettersAndNewScaleMidRun) {
  Scenario sc;
  sc.options = GradScalerOptions().init_scale(1024.0).growth_factor(2.0).backoff_factor(0.5).growth_interval(2);
  sc.iterations = 64;
  sc.injections = {{3, 0, 0, kInf}, {9, 1, 3, kNaN}, {22, 2, 5, kInf}, {27, 3, 0, -kInf},
                   {40, 0, 6, kNaN}, {51, 1, 1, kInf}, {60, 2, 2, kInf}};
  sc.set_growth_factor = {{20, 4.0}, {44, 1.5}};
  sc.set_backoff_factor = {{25, 0.25}, {50, 0.9}};
  // 33: interval 3; 46: interval 1 while the tracker may be above it (growth stops until an inf).
  sc.set_growth_interval = {{33, 3}, {46, 1}, {55, 2}};
  sc.new_scale = {{48, 3000.0}, {57, 0.1}};
  sc.separate_unscale = {22, 23, 34};
  expect_conforms(sc, 7);
}

TEST(GradScalerConformanceTest, GrowthInterval2000_DefaultsThenShortInterval) {
  Scenario sc;  // torch's defaults: 65536, 2, 0.5, 2000
  sc.iterations = 58;
  sc.injections = {{7, 0, 1, kInf}, {8, 3, 0, kNaN}, {30, 2, 4, kInf}, {50, 1, 2, kNaN}};
  sc.new_scale = {{40, 1048576.0}};
  sc.set_growth_interval = {{44, 5}};
  expect_conforms(sc, 4);
}

TEST(GradScalerConformanceTest, HugeScale_NaturalOverflowAndGrowthOnlyToFinite) {
  Scenario sc;
  sc.options = GradScalerOptions().init_scale(3e38).growth_factor(16.0).growth_interval(1);
  sc.iterations = 52;
  sc.grad_std = 4.0;  // scaled grads overflow fp32 until the scale has backed off
  sc.set_growth_factor = {{30, 1e6}};
  sc.set_backoff_factor = {{35, 0.01}};
  expect_conforms(sc, 1);
}

}  // namespace
}  // namespace roundpipe::amp
