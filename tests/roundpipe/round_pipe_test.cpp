// RoundPipe engine vs plain LibTorch on CPU devices (the *_CUDA twins run on a GPU machine).
#include "roundpipe/round_pipe.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <chrono>
#include <fstream>
#include <memory>
#include <optional>
#include <thread>

#include "amp/autocast_guard.h"
#include "roundpipe/detail/layer_shells.h"
#include "roundpipe/devices.h"
#include "scheduler/planner.h"
#include "scheduler/simulator.h"
#include "tests/common/tensor_compare.h"
#include "tests/common/test_macros.h"
#include "tests/roundpipe/test_models.h"

namespace roundpipe {
namespace {

using testing::cpu_devices;
using testing::mse_over;

using testing::deep_copy;
using testing::make_mlp;
using testing::make_transformer;

enum class Opt { kSGD, kAdam };

std::unique_ptr<torch::optim::Optimizer> make_optimizer(Opt opt, std::vector<torch::Tensor> params) {
  if (opt == Opt::kSGD)
    return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.05).momentum(0.9));
  // eps 1e-4: some transformer parameters (the attention's key bias) have a mathematically zero
  // gradient, so their gradients are rounding noise (~1e-10) that Adam with a tiny eps would
  // amplify to full-size steps in either implementation.
  return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(1e-2).eps(1e-4));
}

struct Data {
  torch::Tensor x, y;
};

Data make_data(bool transformer, int64_t step, int64_t batch = 12) {
  torch::manual_seed(1000 + step);
  if (transformer) return {torch::randn({batch, 5, 16}), torch::randn({batch, 5, 4})};
  return {torch::randn({batch, 8}), torch::randn({batch, 4})};
}

// Plain full-batch loop vs RoundPipe (kSync): parameters after every step within 1e-6.
void check_equivalence(bool transformer, int num_devices, int64_t num_micro, RecomputeGrain grain, Opt opt,
                       std::optional<scheduler::ExecutePlan> plan = std::nullopt,
                       std::vector<c10::Device> devices = {}) {
  SCOPED_TRACE(::testing::Message() << (transformer ? "transformer" : "mlp") << " devices=" << num_devices << " M="
                                    << num_micro << " grain=" << (grain == RecomputeGrain::kStage ? "stage" : "layer")
                                    << " opt=" << (opt == Opt::kSGD ? "SGD" : "Adam") << (plan ? " hand plan" : ""));
  auto model = transformer ? make_transformer(7, 0.0) : make_mlp(7);
  auto reference = deep_copy(model);
  if (devices.empty()) devices = cpu_devices(num_devices);
  RoundPipe rp(model, RoundPipeOptions().devices(devices).seed(99));
  auto optimizer = [&] {
    OptimizerCtx ctx;
    return make_optimizer(opt, rp.parameters());
  }();
  auto ref_optimizer = make_optimizer(opt, reference->parameters());
  RunConfig cfg;
  cfg.num_microbatch = num_micro;
  cfg.recompute_grain = grain;
  cfg.execute_plan = plan;
  for (int64_t step = 0; step < 5; ++step) {
    auto data = make_data(transformer, step);
    auto loss_fn = mse_over(data.y.numel());
    auto loss = rp.forward_backward({data.x.to(devices[0])}, data.y.to(devices[0]), loss_fn, cfg);
    rp.step(
        [&] {
          optimizer->step();
          optimizer->zero_grad();
        },
        StepMode::kSync);

    ref_optimizer->zero_grad();
    auto ref_loss = loss_fn(reference->forward(data.x), data.y);
    ref_loss.backward();
    ref_optimizer->step();

    ASSERT_TRUE(testing::tensors_close(loss, ref_loss.detach(), 1e-6)) << "loss at step " << step;
    auto ours = rp.module()->parameters();
    auto theirs = reference->parameters();
    ASSERT_TRUE(testing::tensor_lists_close(ours, theirs, 1e-6)) << "parameters after step " << step;
    ASSERT_TRUE(testing::tensor_lists_close(rp.optim_parameters(), theirs, 1e-6)) << "masters after step " << step;
  }
}

TEST(RoundPipeTest, Equivalence_MlpAllCombinations) {
  for (int devices : {1, 2, 3}) {
    for (int64_t m : {1, 3, 4}) {
      for (auto grain : {RecomputeGrain::kStage, RecomputeGrain::kLayer}) {
        for (auto opt : {Opt::kSGD, Opt::kAdam}) check_equivalence(false, devices, m, grain, opt);
      }
    }
  }
}

TEST(RoundPipeTest, Equivalence_TransformerAllCombinations) {
  for (int devices : {1, 2, 3}) {
    for (int64_t m : {1, 3, 4}) {
      for (auto grain : {RecomputeGrain::kStage, RecomputeGrain::kLayer}) {
        check_equivalence(true, devices, m, grain, (devices + m) % 2 ? Opt::kAdam : Opt::kSGD);
      }
    }
  }
}

TEST(RoundPipeTest, Equivalence_HandWrittenAsymmetricPlan) {
  scheduler::ExecutePlan mlp_plan({{0, 1}, {1, 3}}, {{3, 5}, {2, 3}, {0, 2}});
  scheduler::ExecutePlan tf_plan({{0, 2}}, {{2, 4}, {1, 2}, {0, 1}});
  for (int devices : {1, 2, 3}) {
    for (auto grain : {RecomputeGrain::kStage, RecomputeGrain::kLayer}) {
      check_equivalence(false, devices, 3, grain, Opt::kAdam, mlp_plan);
      check_equivalence(true, devices, 4, grain, Opt::kSGD, tf_plan);
    }
  }
}

TEST(RoundPipeTest, Equivalence_UnevenAndTooFewRows) {
  // 12 rows in 5 microbatches (3,3,2,2,2); and a batch of 2 rows with 4 microbatches requested.
  check_equivalence(false, 2, 5, RecomputeGrain::kStage, Opt::kSGD);
  auto model = make_mlp(3);
  auto reference = deep_copy(model);
  RoundPipe rp(model, RoundPipeOptions().devices(cpu_devices(2)));
  auto x = torch::randn({2, 8}), y = torch::randn({2, 4});
  RunConfig cfg;
  cfg.num_microbatch = 4;
  auto loss = rp.forward_backward({x}, y, mse_over(y.numel()), cfg);
  EXPECT_TRUE(testing::tensors_close(loss, mse_over(y.numel())(reference->forward(x), y).detach(), 1e-6));
}

// Steps [first, first + count) of make_data's training data through `rp`, each forward_backward
// followed by a kSync SGD step (lr 0.05) on the masters.
void sgd_steps(RoundPipe& rp, const RunConfig& cfg, int first, int count) {
  auto optimizer = [&] {
    OptimizerCtx ctx;
    return torch::optim::SGD(rp.parameters(), 0.05);
  }();
  for (int step = first; step < first + count; ++step) {
    auto data = make_data(true, step);
    rp.forward_backward({data.x}, data.y, mse_over(data.y.numel()), cfg);
    rp.step(
        [&] {
          optimizer.step();
          optimizer.zero_grad();
        },
        StepMode::kSync);
  }
}

// Plain microbatched loop with the documented RNG scheme (Note [Layer RNG]).
std::vector<torch::Tensor> dropout_reference(uint64_t seed, int64_t num_micro, int steps) {
  auto model = make_transformer(11, 0.2);
  torch::optim::SGD optimizer(model->parameters(), 0.05);
  int64_t iteration = 0;
  for (int step = 0; step < steps; ++step) {
    auto data = make_data(true, step);
    auto loss_fn = mse_over(data.y.numel());
    optimizer.zero_grad();
    auto xs = data.x.tensor_split(num_micro, 0);
    auto ys = data.y.tensor_split(num_micro, 0);
    for (int64_t j = 0; j < num_micro; ++j) {
      torch::Tensor act = xs[j];
      int64_t l = 0;
      for (auto& layer : *model) {
        torch::manual_seed(layer_seed(seed, iteration, j, l++));
        act = layer.forward(act);
      }
      loss_fn(act, ys[j]).backward();
    }
    ++iteration;
    optimizer.step();
  }
  return model->parameters();
}

TEST(RoundPipeTest, Dropout_MatchesSeededMicrobatchLoopOnAnyDeviceCount) {
  const uint64_t seed = 4242;
  const int64_t num_micro = 3;
  auto expected = dropout_reference(seed, num_micro, 3);
  std::vector<torch::Tensor> first;
  for (int devices : {1, 2, 3}) {
    for (auto grain : {RecomputeGrain::kStage, RecomputeGrain::kLayer}) {
      SCOPED_TRACE(::testing::Message() << "devices=" << devices << " grain=" << static_cast<int>(grain));
      RoundPipe rp(make_transformer(11, 0.2), RoundPipeOptions().devices(cpu_devices(devices)).seed(seed));
      RunConfig cfg;
      cfg.num_microbatch = num_micro;
      cfg.recompute_grain = grain;
      sgd_steps(rp, cfg, 0, 3);
      auto params = rp.module()->parameters();
      EXPECT_TRUE(testing::tensor_lists_close(params, expected, 1e-6));
      if (first.empty()) {
        first = params;
      } else {
        for (size_t k = 0; k < params.size(); ++k)
          EXPECT_TRUE(testing::tensors_equal(params[k], first[k])) << "param " << k;
      }
    }
  }
}

TEST(RoundPipeTest, Dropout_DoesNotDisturbCallersRandomStream) {
  RoundPipe rp(make_transformer(11, 0.5), RoundPipeOptions().devices(cpu_devices(2)).seed(1));
  auto data = make_data(true, 0);
  torch::manual_seed(5);
  rp.forward_backward({data.x}, data.y, mse_over(data.y.numel()));
  auto after = torch::rand({4});
  torch::manual_seed(5);
  EXPECT_TRUE(testing::tensors_equal(after, torch::rand({4})));
}

// A model resumed after 2 steps (its weights in a new RoundPipe) with set_iteration(2) takes step
// 3 bitwise as the uninterrupted model does: the same dropout masks. Without it, other masks.
TEST(RoundPipeTest, Dropout_SetIterationResumesTheLayerSeeds) {
  const uint64_t seed = 99;
  RunConfig cfg;
  cfg.num_microbatch = 2;
  RoundPipe straight(make_transformer(11, 0.3), RoundPipeOptions().devices(cpu_devices(2)).seed(seed));
  sgd_steps(straight, cfg, 0, 2);
  EXPECT_EQ(straight.iteration(), 2);
  auto at_two = deep_copy(straight.module());
  sgd_steps(straight, cfg, 2, 1);
  const auto expected = straight.module()->parameters();

  RoundPipe resumed(deep_copy(at_two), RoundPipeOptions().devices(cpu_devices(2)).seed(seed));
  resumed.set_iteration(2);
  sgd_steps(resumed, cfg, 2, 1);
  EXPECT_EQ(resumed.iteration(), 3);
  const auto got = resumed.module()->parameters();
  ASSERT_EQ(got.size(), expected.size());
  for (size_t k = 0; k < got.size(); ++k) EXPECT_TRUE(testing::tensors_equal(got[k], expected[k])) << "param " << k;

  RoundPipe restarted(deep_copy(at_two), RoundPipeOptions().devices(cpu_devices(2)).seed(seed));
  sgd_steps(restarted, cfg, 2, 1);  // iteration 0's masks
  EXPECT_FALSE(testing::tensor_lists_close(restarted.module()->parameters(), expected, 1e-6));

  EXPECT_THROW_WITH(resumed.set_iteration(-1), "must be >= 0");
}

TEST(RoundPipeTest, BatchNorm_RunningStatsEvolveOnceLikeAPlainMicrobatchedForward) {
  torch::manual_seed(3);
  torch::nn::Sequential model(torch::nn::Linear(8, 8), torch::nn::BatchNorm1d(8), torch::nn::Tanh(),
                              torch::nn::Linear(8, 8), torch::nn::BatchNorm1d(8), torch::nn::Linear(8, 4));
  auto reference = deep_copy(model);
  RoundPipe rp(model, RoundPipeOptions().devices(cpu_devices(3)));
  for (auto grain : {RecomputeGrain::kStage, RecomputeGrain::kLayer}) {
    RunConfig cfg;
    cfg.num_microbatch = 3;
    cfg.recompute_grain = grain;
    cfg.execute_plan = scheduler::ExecutePlan({{0, 2}, {2, 4}}, {{4, 6}, {3, 4}, {0, 3}});
    auto data = make_data(false, 1);
    auto loss_fn = mse_over(data.y.numel());
    rp.forward_backward({data.x}, data.y, loss_fn, cfg);
    auto xs = data.x.tensor_split(3, 0), ys = data.y.tensor_split(3, 0);
    for (int j = 0; j < 3; ++j) loss_fn(reference->forward(xs[j]), ys[j]).backward();
    EXPECT_TRUE(testing::tensor_lists_close(rp.module()->buffers(), reference->buffers(), 1e-6));
    for (size_t k = 0; k < reference->parameters().size(); ++k) {
      EXPECT_TRUE(testing::tensors_close(rp.module()->parameters()[k].grad(), reference->parameters()[k].grad(), 1e-6));
    }
  }
}

TEST(RoundPipeTest, GradientAccumulation_TwoCallsEqualOneCallOnConcatenatedBatch) {
  auto model = make_mlp(5);
  auto twin = deep_copy(model);
  RoundPipe two_calls(model, RoundPipeOptions().devices(cpu_devices(2)));
  RoundPipe one_call(twin, RoundPipeOptions().devices(cpu_devices(3)));
  auto a = make_data(false, 0), b = make_data(false, 1);
  auto x = torch::cat({a.x, b.x}), y = torch::cat({a.y, b.y});
  auto loss_fn = mse_over(y.numel());  // normalized by the concatenated batch
  RunConfig cfg;
  cfg.num_microbatch = 3;
  auto l1 = two_calls.forward_backward({a.x}, a.y, loss_fn, cfg);
  auto l2 = two_calls.forward_backward({b.x}, b.y, loss_fn, cfg);
  RunConfig cfg6;
  cfg6.num_microbatch = 6;
  auto l = one_call.forward_backward({x}, y, loss_fn, cfg6);
  EXPECT_TRUE(testing::tensors_close(l1 + l2, l, 1e-6));
  auto p2 = two_calls.module()->parameters(), p1 = one_call.module()->parameters();
  for (size_t k = 0; k < p1.size(); ++k) EXPECT_TRUE(testing::tensors_close(p2[k].grad(), p1[k].grad(), 1e-6)) << k;
  // And the step applies the accumulated gradient once.
  auto o2 = [&] {
    OptimizerCtx ctx;
    return torch::optim::SGD(two_calls.parameters(), 0.1);
  }();
  auto o1 = [&] {
    OptimizerCtx ctx;
    return torch::optim::SGD(one_call.parameters(), 0.1);
  }();
  two_calls.step([&] { o2.step(); }, StepMode::kSync);
  one_call.step([&] { o1.step(); }, StepMode::kSync);
  EXPECT_TRUE(testing::tensor_lists_close(two_calls.module()->parameters(), one_call.module()->parameters(), 1e-6));
}

TEST(RoundPipeTest, DeviceCountInvariance_BitwiseForFixedMicrobatches) {
  std::vector<torch::Tensor> first;
  for (int devices : {1, 2, 3}) {
    RoundPipe rp(make_transformer(4, 0.0), RoundPipeOptions().devices(cpu_devices(devices)).seed(5));
    auto opt = [&] {
      OptimizerCtx ctx;
      return torch::optim::Adam(rp.parameters(), 1e-2);
    }();
    RunConfig cfg;
    cfg.num_microbatch = 4;
    for (int step = 0; step < 3; ++step) {
      auto data = make_data(true, step);
      rp.forward_backward({data.x}, data.y, mse_over(data.y.numel()), cfg);
      rp.step(
          [&] {
            opt.step();
            opt.zero_grad();
          },
          StepMode::kSync);
    }
    auto params = rp.module()->parameters();
    if (first.empty()) {
      first = params;
      continue;
    }
    for (size_t k = 0; k < params.size(); ++k) {
      EXPECT_TRUE(testing::tensors_equal(params[k], first[k])) << "devices=" << devices << " param " << k;
    }
  }
}

TEST(RoundPipeTest, Autocast_CallersStateAppliesOnWorkers) {
  auto model = make_mlp(6);
  auto reference = deep_copy(model);
  RoundPipe rp(model, RoundPipeOptions().devices(cpu_devices(3)));
  auto data = make_data(false, 0);
  auto loss_fn = [n = data.y.numel()](const torch::Tensor& out, const torch::Tensor& y) {
    return torch::mse_loss(out.to(torch::kFloat), y, torch::Reduction::Sum) / static_cast<double>(n);
  };
  RunConfig cfg;
  cfg.num_microbatch = 3;
  torch::Tensor loss, expected;
  {
    amp::AutocastGuard autocast(c10::DeviceType::CPU, torch::kBFloat16);
    loss = rp.forward_backward({data.x}, data.y, loss_fn, cfg);
    auto xs = data.x.tensor_split(3), ys = data.y.tensor_split(3);
    expected = torch::zeros({});
    for (int j = 0; j < 3; ++j) expected = expected + loss_fn(reference->forward(xs[j]), ys[j]).detach();
  }
  auto fp32 = loss_fn(reference->forward(data.x), data.y).detach();
  EXPECT_TRUE(testing::tensors_close(loss, expected, 1e-6));
  EXPECT_FALSE(testing::tensors_close(loss, fp32, 1e-6)) << "bf16 autocast had no effect on the workers";
}

TEST(RoundPipeTest, Forward_InferenceMatchesPlainForward) {
  auto model = make_transformer(8, 0.3);
  auto reference = deep_copy(model);
  model->eval();
  reference->eval();
  RoundPipe rp(model, RoundPipeOptions().devices(cpu_devices(3)));
  auto data = make_data(true, 0, 10);
  RunConfig cfg;
  cfg.num_microbatch = 4;
  auto out = rp.forward({data.x}, cfg);
  torch::NoGradGuard no_grad;
  EXPECT_TRUE(testing::tensors_close(out, reference->forward(data.x), 1e-6));
}

// Linear whose reset() (run by construction and by every clone) is counted.
struct CountingLinearImpl : torch::nn::Cloneable<CountingLinearImpl> {
  CountingLinearImpl(int64_t in, int64_t out, std::shared_ptr<std::atomic<int>> resets)
      : in_(in), out_(out), resets_(std::move(resets)) {
    reset();
  }
  void reset() override {
    resets_->fetch_add(1);
    linear = register_module("linear", torch::nn::Linear(in_, out_));
  }
  torch::Tensor forward(const torch::Tensor& x) { return linear(x); }
  int64_t in_, out_;
  std::shared_ptr<std::atomic<int>> resets_;
  torch::nn::Linear linear{nullptr};
};
TORCH_MODULE(CountingLinear);

// Note [Layer shells]: stage jobs reuse module copies instead of cloning (and re-initializing)
// every layer in every job, and still follow the model's current values and training mode.
TEST(RoundPipeTest, LayerShells_ReusedAcrossIterationsAndFollowTrainingMode) {
  auto resets = std::make_shared<std::atomic<int>>(0);
  torch::manual_seed(3);
  torch::nn::Sequential model(CountingLinear(8, 16, resets), torch::nn::Dropout(0.5), torch::nn::Tanh(),
                              CountingLinear(16, 4, resets));
  const int after_construction = resets->load();
  RoundPipe rp(model, RoundPipeOptions().devices(cpu_devices(2)));
  auto opt = [&] {
    OptimizerCtx ctx;
    return torch::optim::SGD(rp.parameters(), 0.1);
  }();
  RunConfig cfg;
  cfg.num_microbatch = 3;
  cfg.execute_plan = scheduler::ExecutePlan({{0, 2}}, {{2, 4}, {0, 2}});
  cfg.preserve_rng_state = false;
  model->eval();  // dropout off: the shells must follow the model's mode
  for (int it = 0; it < 10; ++it) {
    auto data = make_data(false, it);
    rp.forward_backward({data.x}, data.y, mse_over(data.y.numel()), cfg);
    rp.step(
        [&] {
          opt.step();
          opt.zero_grad();
        },
        StepMode::kSync);
  }
  // Layer 0 runs in a forward and a backward job, layer 3 in the fused job: at most 2 + 1 shells.
  EXPECT_LE(resets->load() - after_construction, 3) << "layers re-cloned per job";
  EXPECT_GE(resets->load() - after_construction, 2);
  // Values follow the steps: the eval-mode outputs equal a plain forward of the trained model.
  torch::NoGradGuard no_grad;
  auto x = torch::randn({5, 8});
  auto eval_out = rp.forward({x});
  EXPECT_TRUE(testing::tensors_close(eval_out, model->forward(x), 1e-6));
  model->train();  // training mode again: the jobs' dropout must be active
  EXPECT_FALSE(testing::tensors_close(rp.forward({x}), eval_out, 1e-3)) << "the shells did not follow train()";
}

// Identity whose forward sleeps `ms` (recompute too), with no parameters: size-based estimates
// see it as free.
struct SlowIdentityImpl : torch::nn::Cloneable<SlowIdentityImpl> {
  explicit SlowIdentityImpl(double ms) : ms_(ms) {}
  void reset() override {}
  torch::Tensor forward(const torch::Tensor& x) {
    std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(ms_));
    return x.clone();
  }
  double ms_;
};
TORCH_MODULE(SlowIdentity);

// The rules the runtime simulates its plans under (the default grain; iterations overlap).
scheduler::SimulateOptions runtime_rules() { return engine_simulate_options(kDefaultRecomputeGrain, true); }

// `rp`'s automatic plan is the simulation planner's plan for `costs` on 2 devices with 3
// microbatches, as the runtime models itself (iterations overlap, backward stages recompute
// ahead); with 6 layers the planner
// enumerates every plan, so that is the optimum for `objective`.
void expect_simulation_optimum(const RoundPipe& rp, const std::vector<scheduler::LayerCost>& costs,
                               scheduler::PlanObjective objective = scheduler::PlanObjective::kIsolated) {
  const auto planned = scheduler::plan_by_simulation(
      costs, scheduler::RunType::kFused,
      scheduler::PlannerOptions().set_num_devices(2).set_num_microbatch(3).set_objective(objective).set_simulate(
          runtime_rules()));
  ASSERT_TRUE(planned.exhaustive);
  EXPECT_EQ(rp.plan().to_string(), planned.plan.to_string());
}

TEST(RoundPipeTest, MeasuredLayerTimes_ReplanAfterFirstCall) {
  const double slow_ms = 20;
  auto make = [&] {
    torch::manual_seed(6);
    return torch::nn::Sequential(torch::nn::Linear(32, 32), torch::nn::Linear(32, 32), SlowIdentity(slow_ms),
                                 torch::nn::Linear(32, 32), torch::nn::Linear(32, 32), torch::nn::Linear(32, 32));
  };
  RoundPipe rp(make(), RoundPipeOptions().devices(cpu_devices(2)));
  RoundPipe fixed(make(), RoundPipeOptions().devices(cpu_devices(2)).measure_layer_times(false));
  const auto size_based = rp.layer_costs();
  EXPECT_LT(size_based[2].forward, size_based[0].forward);  // no bytes: "cheap" by size
  const auto plan_before = rp.plan();
  RunConfig cfg;
  cfg.num_microbatch = 3;
  auto loss_fn = [](const torch::Tensor& out, const torch::Tensor& y) { return torch::mse_loss(out, y); };
  auto x = torch::randn({6, 32}), y = torch::randn({6, 32});
  auto loss = rp.forward_backward({x}, y, loss_fn, cfg);
  auto fixed_loss = fixed.forward_backward({x}, y, loss_fn, cfg);

  const auto costs = rp.layer_costs();
  ASSERT_EQ(costs.size(), 6u);
  // Only lower bounds are certain for wall-clock times: the layer sleeps slow_ms per microbatch.
  EXPECT_GE(costs[2].forward, slow_ms);  // per microbatch, milliseconds (size-based: 0 bytes)
  for (size_t l = 0; l < costs.size(); ++l) EXPECT_EQ(costs[l].bytes, size_based[l].bytes) << "layer " << l;
  // The slow layer's backward stage recomputes it: the stage's backward time includes the sleep.
  for (const auto& r : plan_before.backward_stages()) {
    if (!r.contains(2)) continue;
    double stage_backward = 0;
    for (int64_t l = r.begin; l < r.end; ++l) stage_backward += costs[l].backward;
    EXPECT_GE(stage_backward, slow_ms) << r.to_string();
  }
  // The plan minimises the simulated makespan for the measured costs, whatever they are.
  expect_simulation_optimum(rp, costs);
  auto simulated = [&](const scheduler::ExecutePlan& plan) {
    return scheduler::simulate(plan, scheduler::RunType::kFused, costs, 2, 3, runtime_rules()).makespan;
  };
  const auto partitioned =
      scheduler::partition(costs, scheduler::RunType::kFused, scheduler::PartitionOptions().set_min_stages(2));
  EXPECT_LE(simulated(rp.plan()), simulated(partitioned) + 1e-9);
  EXPECT_LE(simulated(rp.plan()), simulated(plan_before) + 1e-9);
  // Measuring changes the schedule, never the numbers; without it the costs stay size-based.
  EXPECT_TRUE(torch::equal(loss, fixed_loss));
  EXPECT_TRUE(testing::tensor_lists_close(rp.module()->parameters(), fixed.module()->parameters(), 0));
  EXPECT_EQ(fixed.layer_costs()[2].forward, size_based[2].forward);
  EXPECT_EQ(fixed.plan().to_string(), plan_before.to_string());
  // The plan follows the mode of the last step: asynchronous steps get the plan with the shortest
  // mean time per back-to-back iteration, synchronous ones the shortest isolated iteration again.
  rp.step(nullptr, StepMode::kAsync);
  expect_simulation_optimum(rp, costs, scheduler::PlanObjective::kSteadyState);
  rp.forward_backward({x}, y, loss_fn, cfg);
  rp.step(nullptr, StepMode::kSync);
  expect_simulation_optimum(rp, costs);
  // Without overlapping iterations a back-to-back iteration is an isolated one: no switch.
  RoundPipe serial(make(), RoundPipeOptions().devices(cpu_devices(2)).overlap_backward(false));
  serial.forward_backward({x}, y, loss_fn, cfg);
  const auto serial_plan = serial.plan().to_string();
  serial.step(nullptr, StepMode::kAsync);
  EXPECT_EQ(serial.plan().to_string(), serial_plan);
}

// One automatic forward_backward of `model` (32 features in and out, 2 rows per microbatch) on 2
// CPU devices, which measures its layers: the measured costs.
std::vector<scheduler::LayerCost> measured_costs(torch::nn::Sequential model, int64_t num_microbatch) {
  RoundPipe rp(model, RoundPipeOptions().devices(cpu_devices(2)));
  RunConfig cfg;
  cfg.num_microbatch = num_microbatch;
  auto loss_fn = [](const torch::Tensor& out, const torch::Tensor& y) { return torch::mse_loss(out, y); };
  rp.forward_backward({torch::randn({2 * num_microbatch, 32})}, torch::randn({2 * num_microbatch, 32}), loss_fn, cfg);
  return rp.layer_costs();
}

// Layers of one kind and size share the median of their measured times when they are within 15%
// of it (Note [Smoothing measured times]); a layer of the same kind that costs 3x keeps its own.
TEST(RoundPipeTest, MeasuredLayerTimes_EqualLayersShareTheirMedian) {
  const double ms = 30;
  torch::nn::Sequential model;
  for (int l = 0; l < 5; ++l) model->push_back(SlowIdentity(ms));
  model->push_back(SlowIdentity(3 * ms));
  model->push_back(torch::nn::Linear(32, 32));
  const auto costs = measured_costs(model, 2);
  ASSERT_EQ(costs.size(), 7u);
  // The five equal layers share one time (most of them at least: a preempted wake-up on a loaded
  // machine may put one beyond 15%; PlanSelectorTest checks the rule with synthetic times).
  int most = 0;
  double shared = 0;
  for (int a = 0; a < 5; ++a) {
    int same = 0;
    for (int b = 0; b < 5; ++b) same += costs[b].forward == costs[a].forward ? 1 : 0;
    if (same > most) most = same, shared = costs[a].forward;
  }
  EXPECT_GE(most, 3);
  EXPECT_GE(shared, ms);  // per microbatch
  EXPECT_GE(costs[5].forward, 3 * ms);
  EXPECT_NE(costs[5].forward, shared);
}

// Identity whose forward (and recompute) sleeps `*ms`, changeable between calls.
struct AdjustableSleepImpl : torch::nn::Cloneable<AdjustableSleepImpl> {
  explicit AdjustableSleepImpl(std::shared_ptr<std::atomic<double>> ms) : ms_(std::move(ms)) {}
  void reset() override {}
  torch::Tensor forward(const torch::Tensor& x) {
    std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(ms_->load()));
    return x.clone();
  }
  std::shared_ptr<std::atomic<double>> ms_;
};
TORCH_MODULE(AdjustableSleep);

// remeasure_layer_times: the next call times the layers again, and a layer that became 4x slower
// changes the costs and the plan (the simulation optimum for them); without a request no call
// measures. (That unchanged times keep the plan is tested on the PlanSelector with synthetic times:
// wall-clock times on a loaded machine are not stable enough.)
TEST(RoundPipeTest, MeasuredLayerTimes_RemeasureOnRequest) {
  auto slow = std::make_shared<std::atomic<double>>(30.0);
  torch::nn::Sequential model(torch::nn::Linear(32, 32), AdjustableSleep(slow), torch::nn::Linear(32, 32),
                              SlowIdentity(30), torch::nn::Tanh(), torch::nn::Linear(32, 32));
  RoundPipe rp(model, RoundPipeOptions().devices(cpu_devices(2)));
  RunConfig cfg;
  cfg.num_microbatch = 3;
  auto loss_fn = [](const torch::Tensor& out, const torch::Tensor& y) { return torch::mse_loss(out, y); };
  auto x = torch::randn({6, 32}), y = torch::randn({6, 32});
  rp.forward_backward({x}, y, loss_fn, cfg);
  const auto first = rp.layer_costs();
  EXPECT_LT(first[1].forward, 120.0);
  // Layer 1 becomes 4x slower: not seen until a re-measurement is requested.
  slow->store(120.0);
  rp.forward_backward({x}, y, loss_fn, cfg);
  EXPECT_EQ(rp.layer_costs()[1].forward, first[1].forward);
  rp.remeasure_layer_times();
  rp.forward_backward({x}, y, loss_fn, cfg);
  const auto changed = rp.layer_costs();
  EXPECT_GE(changed[1].forward, 120.0);
  expect_simulation_optimum(rp, changed);
}

// Identity whose backward sleeps `ms` (forward is free): only a timed backward can see it.
struct SlowBackwardFn : torch::autograd::Function<SlowBackwardFn> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, double ms) {
    ctx->saved_data["ms"] = ms;
    return x.clone();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(ctx->saved_data["ms"].toDouble()));
    return {grads[0], torch::Tensor()};
  }
};
struct SlowBackwardImpl : torch::nn::Cloneable<SlowBackwardImpl> {
  explicit SlowBackwardImpl(double ms) : ms_(ms) {}
  void reset() override {}
  torch::Tensor forward(const torch::Tensor& x) { return SlowBackwardFn::apply(x, ms_); }
  double ms_;
};
TORCH_MODULE(SlowBackward);

// Note [Shell claims]: with asynchronous steps the next iteration starts while this one's backward
// jobs still hold their shells; its backward claims those instead of taking the free shells its
// forward jobs need, so two shells per layer serve the overlapping iterations and every clone
// happens in the first one (a later clone would land on the peak host memory). The results are
// bitwise those of iterations that do not overlap.
TEST(RoundPipeTest, LayerShells_OverlappingAsyncIterationsCloneOnlyInTheFirst) {
  auto train = [](bool overlap, int* clones_after_first) {
    auto resets = std::make_shared<std::atomic<int>>(0);
    torch::manual_seed(11);
    // Layer 1's backward sleeps: the backward job of layers [0, 2) still holds its shells when
    // the next forward_backward starts.
    torch::nn::Sequential model(CountingLinear(8, 16, resets), SlowBackward(20), torch::nn::Tanh(),
                                CountingLinear(16, 4, resets));
    RoundPipe rp(model, RoundPipeOptions().devices(cpu_devices(2)).overlap_backward(overlap));
    auto opt = [&] {
      OptimizerCtx ctx;
      return torch::optim::SGD(rp.parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    }();
    RunConfig cfg;
    cfg.num_microbatch = 3;
    cfg.execute_plan = scheduler::ExecutePlan({{0, 2}}, {{2, 4}, {0, 2}});
    cfg.preserve_rng_state = false;
    int after_first = 0;
    for (int it = 0; it < 8; ++it) {
      auto data = make_data(false, it);
      rp.forward_backward({data.x}, data.y, mse_over(data.y.numel()), cfg);
      if (it == 0) after_first = resets->load();
      rp.step(
          [&] {
            opt.step();
            opt.zero_grad();
          },
          StepMode::kAsync);
    }
    rp.synchronize();
    *clones_after_first = resets->load() - after_first;
    std::vector<torch::Tensor> params;
    for (const auto& p : model->parameters()) params.push_back(p.detach().clone());
    return params;
  };
  int overlapped_clones = -1, plain_clones = -1;
  const auto overlapped = train(true, &overlapped_clones);
  const auto plain = train(false, &plain_clones);
  EXPECT_EQ(overlapped_clones, 0) << "a layer was cloned after the first iteration (a third shell)";
  EXPECT_EQ(plain_clones, 0);
  ASSERT_EQ(overlapped.size(), plain.size());
  for (size_t i = 0; i < plain.size(); ++i) EXPECT_TRUE(overlapped[i].equal(plain[i])) << "parameter " << i;
}

// Note [Shell claims], the pool alone: a claim made while a shell is out waits for its release
// (served before the free list), a claim with nothing out takes a free shell, a withdrawn claim
// leaves the pool as it was.
TEST(RoundPipeTest, LayerShells_ClaimsWaitForReleasedShells) {
  auto resets = std::make_shared<std::atomic<int>>(0);
  std::vector<torch::nn::AnyModule> layers{torch::nn::AnyModule(CountingLinear(4, 4, resets))};
  const int made = resets->load();
  detail::LayerShells pool(&layers);
  auto first = std::make_unique<detail::ShellLease>(pool, 0);  // clones
  EXPECT_EQ(resets->load() - made, 1);
  detail::ShellClaim claim(pool, 0);  // waits for `first`
  std::atomic<bool> taken{false};
  std::optional<detail::ShellLease> lease;
  std::thread taker([&] {
    lease.emplace(std::move(claim).take());
    taken = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_FALSE(taken.load()) << "the claim took a shell before one was released";
  {
    detail::ShellLease second(pool, 0);  // no free shell: clones, the claim still waits
    EXPECT_EQ(resets->load() - made, 2);
  }  // released: goes to the claim
  taker.join();
  EXPECT_TRUE(taken.load());
  first.reset();  // back to the free list
  {
    detail::ShellLease again(pool, 0);  // reuses it
    EXPECT_EQ(resets->load() - made, 2);
    detail::ShellClaim withdrawn(pool, 0);  // two out: waits, then withdrawn unserved
  }
  lease.reset();
  {
    // Nothing out, two free: a claim takes a free one; a second and a third lease reuse and clone.
    detail::ShellClaim free_claim(pool, 0);
    auto taken_free = std::move(free_claim).take();
    detail::ShellLease other(pool, 0);
    EXPECT_EQ(resets->load() - made, 2);
    detail::ShellLease third(pool, 0);
    EXPECT_EQ(resets->load() - made, 3);
  }
}

TEST(RoundPipeTest, MeasuredLayerTimes_BackwardStagesAreTimedAndSharedByForwardTime) {
  const double slow_ms = 25;
  torch::manual_seed(7);
  // At most two layers of one kind and size, so no times are smoothed (Note [Smoothing measured
  // times]): the shares below are exact.
  auto no_bias = [] { return torch::nn::Linear(torch::nn::LinearOptions(32, 32).bias(false)); };
  torch::nn::Sequential model(torch::nn::Linear(32, 32), no_bias(), SlowBackward(slow_ms), torch::nn::Linear(32, 32),
                              no_bias(), torch::nn::Tanh());
  RoundPipe rp(model, RoundPipeOptions().devices(cpu_devices(2)));
  const auto plan_before = rp.plan();
  RunConfig cfg;
  cfg.num_microbatch = 3;
  auto loss_fn = [](const torch::Tensor& out, const torch::Tensor& y) { return torch::mse_loss(out, y); };
  rp.forward_backward({torch::randn({6, 32})}, torch::randn({6, 32}), loss_fn, cfg);
  const auto costs = rp.layer_costs();
  ASSERT_EQ(costs.size(), 6u);
  for (const auto& r : plan_before.backward_stages()) {
    double forward = 0, backward = 0;
    for (int64_t l = r.begin; l < r.end; ++l) {
      forward += costs[l].forward;
      backward += costs[l].backward;
    }
    // The sleep is in the backward of layer 2 only (its forward is a copy): per microbatch.
    if (r.contains(2)) {
      EXPECT_GE(backward, slow_ms) << r.to_string();
    }
    // A stage's time is shared in proportion to the forward times (evenly when they are zero).
    for (int64_t l = r.begin; l < r.end; ++l) {
      const double expected = forward > 0 ? backward * costs[l].forward / forward : backward / double(r.size());
      EXPECT_NEAR(costs[l].backward, expected, 1e-9 * backward) << "layer " << l << " in " << r.to_string();
    }
  }
  // The plan is the simulation planner's optimum for these costs.
  expect_simulation_optimum(rp, costs);
}

TEST(RoundPipeTest, MemoryBudget_StagesFitAndOversizedLayerFailsAtConstruction) {
  auto make = [] {
    torch::manual_seed(8);
    torch::nn::Sequential model;
    for (int l = 0; l < 6; ++l) model->push_back(torch::nn::Linear(32, 32));
    return model;
  };
  const int64_t layer_bytes = (32 * 32 + 32) * 4;
  const int64_t budget = 2 * layer_bytes;  // two layers forward; one layer with its gradients
  auto options = RoundPipeOptions().devices(cpu_devices(2)).measure_layer_times(false);
  RoundPipe capped(make(), RoundPipeOptions(options).device_memory_budget_bytes(budget));
  RoundPipe free(make(), options);
  const auto costs = capped.layer_costs();
  auto stage_bytes = [&](const scheduler::LayerRange& r, bool backward) {
    int64_t b = 0;
    for (int64_t l = r.begin; l < r.end; ++l) b += backward ? costs[l].backward_bytes : costs[l].bytes;
    return b;
  };
  auto max_stage_bytes = [&](const scheduler::ExecutePlan& plan) {
    int64_t most = 0;
    for (const auto& r : plan.forward_stages()) most = std::max(most, stage_bytes(r, false));
    for (const auto& r : plan.backward_stages()) most = std::max(most, stage_bytes(r, true));
    return most;
  };
  EXPECT_LE(max_stage_bytes(capped.plan()), budget) << capped.plan().to_string();
  EXPECT_GT(max_stage_bytes(free.plan()), budget) << "the budget should have mattered: " << free.plan().to_string();
  // The plan changes the schedule, not the results.
  auto x = torch::randn({6, 32}), y = torch::randn({6, 32});
  auto loss_fn = [](const torch::Tensor& out, const torch::Tensor& t) { return torch::mse_loss(out, t); };
  RunConfig cfg;
  cfg.num_microbatch = 3;
  EXPECT_TRUE(torch::equal(capped.forward_backward({x}, y, loss_fn, cfg), free.forward_backward({x}, y, loss_fn, cfg)));
  try {
    RoundPipe(make(), RoundPipeOptions(options).device_memory_budget_bytes(layer_bytes));
    ADD_FAILURE() << "a layer over the budget (with its gradients) must fail at construction";
  } catch (const c10::Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("device_memory_budget_bytes = " + std::to_string(layer_bytes)), std::string::npos) << what;
    EXPECT_NE(what.find("layer 0 needs"), std::string::npos) << what;
  }
  EXPECT_THROW(RoundPipe(make(), RoundPipeOptions(options).device_memory_budget_bytes(0)), c10::Error);
}

int64_t process_threads() {
  std::ifstream status("/proc/self/status");
  std::string key;
  while (status >> key) {
    if (key == "Threads:") {
      int64_t n = 0;
      status >> n;
      return n;
    }
  }
  return -1;
}

TEST(RoundPipeTest, Errors_ReachCallerNamingLayerAndPhase_ModelStaysUsable) {
  auto fail = std::make_shared<std::atomic<bool>>(true);
  torch::manual_seed(1);
  // Layer 2 sits in forward stage 1 and throws on microbatch 2 of 3.
  torch::nn::Sequential model(torch::nn::Linear(8, 8), torch::nn::Tanh(), testing::Faulty(fail, 3, 2),
                              torch::nn::Linear(8, 4));
  auto reference = deep_copy(model);
  RoundPipe rp(model, RoundPipeOptions().devices(cpu_devices(3)).name("faulty"));
  auto data = make_data(false, 0);
  auto loss_fn = mse_over(data.y.numel());
  RunConfig cfg;
  cfg.num_microbatch = 3;
  cfg.execute_plan = scheduler::ExecutePlan({{0, 1}, {1, 3}}, {{3, 4}, {2, 3}, {0, 2}});
  int64_t threads_after_first = -1;
  for (int rep = 0; rep < 100; ++rep) {
    try {
      rp.forward_backward({data.x}, data.y, loss_fn, cfg);
      FAIL() << "expected an error at repetition " << rep;
    } catch (const c10::Error& e) {
      const std::string msg = e.what_without_backtrace();
      ASSERT_NE(msg.find("RoundPipe 'faulty': forward stage [1, 3)"), std::string::npos) << msg;
      ASSERT_NE(msg.find("layer 2 (roundpipe::testing::FaultyImpl)"), std::string::npos) << msg;
      ASSERT_NE(msg.find("microbatch 2"), std::string::npos) << msg;
      ASSERT_NE(msg.find("injected failure"), std::string::npos) << msg;
    }
    if (rep == 0) threads_after_first = process_threads();
  }
  // No thread leaked, no gradient left behind by the failed calls.
  EXPECT_EQ(process_threads(), threads_after_first);
  for (const auto& p : rp.module()->parameters()) EXPECT_FALSE(p.grad().defined());
  // The next call works and matches plain LibTorch.
  fail->store(false);
  auto loss = rp.forward_backward({data.x}, data.y, loss_fn, cfg);
  auto ref_loss = loss_fn(reference->forward(data.x), data.y);
  ref_loss.backward();
  EXPECT_TRUE(testing::tensors_close(loss, ref_loss.detach(), 1e-6));
  for (size_t k = 0; k < reference->parameters().size(); ++k) {
    EXPECT_TRUE(testing::tensors_close(rp.module()->parameters()[k].grad(), reference->parameters()[k].grad(), 1e-6));
  }
}

TEST(RoundPipeTest, Errors_LossFnAndShapeMismatch) {
  RoundPipe rp(make_mlp(1), RoundPipeOptions().devices(cpu_devices(2)));
  auto data = make_data(false, 0);
  try {
    rp.forward_backward({data.x}, data.y, [](const torch::Tensor&, const torch::Tensor&) -> torch::Tensor {
      throw std::runtime_error("bad loss");
    });
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    EXPECT_NE(msg.find("fused stage"), std::string::npos) << msg;
    EXPECT_NE(msg.find("(loss_fn): bad loss"), std::string::npos) << msg;
  }
  try {
    rp.forward_backward({torch::randn({12, 5})}, data.y, mse_over(data.y.numel()));
    FAIL() << "expected a shape error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("layer 0 (torch::nn::Linear"), std::string::npos)
        << e.what_without_backtrace();
  }
  EXPECT_THROW(rp.forward_backward({data.x}, data.y.narrow(0, 0, 5), mse_over(1)), c10::Error);
  EXPECT_NO_THROW(rp.forward_backward({data.x}, data.y, mse_over(data.y.numel())));
}

TEST(RoundPipeTest, Construction_RejectsBadModelsAndOptions) {
  EXPECT_THROW(RoundPipe(torch::nn::Sequential(), RoundPipeOptions().devices(cpu_devices(1))), c10::Error);
  // An empty device list means the default devices (here: the CPU).
  EXPECT_NO_THROW(RoundPipe(make_mlp(1), RoundPipeOptions().devices({})).forward({torch::randn({2, 8})}));
  // A module held by two layers is one parameter set with two uses (shared_params_test.cpp).
  torch::nn::Linear shared(4, 4);
  EXPECT_EQ(
      RoundPipe(torch::nn::Sequential(shared, shared), RoundPipeOptions().devices(cpu_devices(1))).parameters().size(),
      2u);
  RunConfig bad;
  bad.execute_plan = scheduler::ExecutePlan({{0, 2}}, {{2, 3}, {0, 2}});
  RoundPipe rp(make_mlp(1), RoundPipeOptions().devices(cpu_devices(1)));
  EXPECT_THROW(rp.plan(bad), c10::Error);
  EXPECT_NO_THROW(rp.plan().validate(rp.num_layers(), scheduler::RunType::kFused));
}

TEST(RoundPipeTest, Equivalence_MlpOnGpus_CUDA) {
  std::vector<c10::Device> gpus;
  for (int64_t i = 0; i < cuda_device_count(); ++i) gpus.emplace_back(c10::kCUDA, i);
  for (auto grain : {RecomputeGrain::kStage, RecomputeGrain::kLayer}) {
    check_equivalence(false, static_cast<int>(gpus.size()), 3, grain, Opt::kAdam, std::nullopt, gpus);
  }
}

}  // namespace
}  // namespace roundpipe
