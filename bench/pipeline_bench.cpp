// Pipeline engine benchmark (a dedicated executable printing tables):
//  1. Schedule quality: 12 equal layers that sleep (forward t, backward 3t incl. recompute; no CPU
//     burn) on 2-8 CPU device workers, devices + 1 microbatches, the automatic plan: the bubble of
//     isolated and of back-to-back async (overlapping) iterations, measured and simulated, against
//     GPipe's and 1F1B's for the same layers ((p-1)/(m+p-1), p = devices).
//  2. Dispatch overhead: parameter-free empty layers, one stage per layer; time per (stage, mb).
//  3. Async vs sync step: the sleeping model with 64M fp32 parameters and roundpipe::optim::Adam;
//     3b: the step() call with bf16 compute copies, fp32 masters and fp32 vs uncast bf16 master
//     gradients (RoundPipeOptions::master_grad_dtype).
//  4. Per-job layer copy on a CPU device: Cloneable::clone(device) (what stage jobs did before
//     Note [Layer shells]: reset() re-initializes every parameter, then the values are copied)
//     vs leasing a reused shell and uploading the values; the floor is one plain copy (clone()) of
//     the same parameters.
//  5. (`pipeline_bench paper` runs only this) The Python original's five workloads (issue 15): layers
//     that sleep the artifact's per-layer forward / backward times, scaled so an iteration takes
//     about two seconds, 8 CPU device workers, 16 microbatches. For the runtime's own automatic plan
//     (from measured forward times) and for the plan the simulation planner picks from the true
//     costs: simulated vs measured bubble, isolated and back-to-back async, next to the paper's.
//  6. (`pipeline_bench steady` runs only this) Issue 32: the same five workloads through the public
//     API exactly as a user would run back-to-back asynchronous iterations (4 warm-up + 10
//     measured, then synchronize), next to the simulator's prediction for the plan the runtime ran.
// Usage: pipeline_bench [sleep_ms=2] [layers=12] | pipeline_bench paper [iteration_ms=2000] [workload name part]
//        | pipeline_bench steady [iteration_ms=2000] [workload name part, "" for all] [rng: keep preserve_rng_state on]
#include <ATen/ops/_fused_adam.h>
#include <sys/resource.h>
#include <torch/torch.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <thread>

#include "optim/adam.h"
#include "roundpipe/detail/device_io.h"
#include "roundpipe/detail/layer_shells.h"
#include "roundpipe/round_pipe.h"
#include "roundpipe/stage_trace.h"
#include "scheduler/dispatch.h"
#include "scheduler/planner.h"
#include "scheduler/simulator.h"

namespace {

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

// y = x (identity) that sleeps `ms` in forward and 2*ms in backward.
struct SleepFn : torch::autograd::Function<SleepFn> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, torch::Tensor x, double ms) {
    ctx->saved_data["ms"] = ms;
    std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(ms));
    return x.clone();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(2 * ctx->saved_data["ms"].toDouble()));
    return {grads[0], torch::Tensor()};
  }
};

struct SleepLayerImpl : torch::nn::Cloneable<SleepLayerImpl> {
  SleepLayerImpl(double ms, int64_t numel) : ms_(ms), numel_(numel) { reset(); }
  void reset() override { weight = register_parameter("weight", torch::ones({numel_})); }
  torch::Tensor forward(const torch::Tensor& x) {
    if (ms_ == 0) return x;
    return SleepFn::apply(x * weight[0], ms_);
  }
  double ms_;
  int64_t numel_;
  torch::Tensor weight;
};
TORCH_MODULE(SleepLayer);

torch::nn::Sequential sleep_model(int layers, double ms, int64_t numel_per_layer) {
  torch::nn::Sequential model;
  for (int l = 0; l < layers; ++l) model->push_back(SleepLayer(ms, numel_per_layer));
  return model;
}

// Sections 3 and 3b: roundpipe::optim::Adam on the masters, and the run configuration.
roundpipe::optim::Adam master_adam(roundpipe::RoundPipe& model) {
  roundpipe::OptimizerCtx ctx;
  return roundpipe::optim::Adam(model.parameters(), roundpipe::optim::AdamOptions(1e-4));
}

roundpipe::RunConfig sleep_run_config() {
  roundpipe::RunConfig cfg;
  cfg.num_microbatch = 4;
  cfg.preserve_rng_state = false;
  return cfg;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

roundpipe::LossFn sum_loss() {
  return [](const torch::Tensor& out, const torch::Tensor&) { return out.sum(); };
}

// Section 5: the time the sleeping layers really slept (sleep_for overshoots by ~0.1 ms on this
// machine: 4-13% of a 0.5-3 ms sleep), summed over every thread.
std::atomic<int64_t> g_slept_ns{0};
std::atomic<int64_t> g_nominal_ns{0};  // what was asked for
void sleep_counted(double ms) {
  g_nominal_ns.fetch_add(static_cast<int64_t>(ms * 1e6));
  const auto t0 = Clock::now();
  std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(ms));
  g_slept_ns.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count());
}
double slept_ms() { return static_cast<double>(g_slept_ns.load()) / 1e6; }
double nominal_slept_ms() { return static_cast<double>(g_nominal_ns.load()) / 1e6; }

// CPU time of the whole process (every thread), ms: sleeping layers use none, so this is the
// engine's and the layers' own tensor work plus the optimizer's.
double process_cpu_ms() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  auto ms = [](const timeval& t) { return static_cast<double>(t.tv_sec) * 1e3 + static_cast<double>(t.tv_usec) / 1e3; };
  return ms(u.ru_utime) + ms(u.ru_stime);
}

// Section 5: y = x that sleeps `fwd_ms` in forward and `bwd_ms` in backward (per microbatch).
struct SleepPairFn : torch::autograd::Function<SleepPairFn> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, torch::Tensor x, double fwd_ms, double bwd_ms) {
    ctx->saved_data["bwd"] = bwd_ms;
    sleep_counted(fwd_ms);
    return x.clone();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    sleep_counted(ctx->saved_data["bwd"].toDouble());
    return {grads[0], torch::Tensor(), torch::Tensor()};
  }
};

struct SleepPairLayerImpl : torch::nn::Cloneable<SleepPairLayerImpl> {
  SleepPairLayerImpl(double fwd_ms, double bwd_ms) : fwd_ms_(fwd_ms), bwd_ms_(bwd_ms) { reset(); }
  void reset() override { weight = register_parameter("weight", torch::ones({1})); }
  torch::Tensor forward(const torch::Tensor& x) { return SleepPairFn::apply(x * weight[0], fwd_ms_, bwd_ms_); }
  double fwd_ms_, bwd_ms_;
  torch::Tensor weight;
};
TORCH_MODULE(SleepPairLayer);

struct PaperWorkload {
  const char* name;
  int layers;
  double fwd, bwd, head_fwd, head_bwd;             // ms per microbatch (bwd without recompute), the artifact's
  double paper_isolated, paper_async, paper_1f1b;  // % bubble, the artifact's simulator
};

const std::vector<PaperWorkload>& paper_workload_list() {
  static const std::vector<PaperWorkload> workloads = {
      {"Qwen3-1.7B", 28, 7.429, 15.831, 22.0655, 43.707, 19.1, 4.0, 35.2},
      {"Llama3-8B", 32, 18.50370313, 41.20659375, 37.2255, 74.501, 14.3, 1.3, 42.1},
      {"GPT-OSS-20B", 24, 21.6445625, 81.780875, 44.2925, 86.264, 14.0, 3.3, 41.7},
      {"Qwen3-32B", 64, 40.5610625, 91.17429688, 54.928, 108.294, 6.7, 2.6, 34.9},
      {"Qwen3-235B", 94, 43.016, 58.376, 42.444, 43.294, 3.3, 1.0, 31.2},
  };
  return workloads;
}

void paper_workloads(double target_ms, const std::string& only) {
  namespace rs = roundpipe::scheduler;
  using roundpipe::RoundPipe;
  using roundpipe::RoundPipeOptions;
  using roundpipe::RunConfig;
  constexpr int kDevices = 8, kMicro = 16, kIsolatedRuns = 3, kAsyncRuns = 10, kAsyncWarmup = 2;
  const std::vector<PaperWorkload>& workloads = paper_workload_list();
  std::printf(
      "== 5. paper workloads: %d CPU device workers, %d microbatches, sleeping layers scaled to ~%.0f ms "
      "per iteration\n",
      kDevices, kMicro, target_ms);
  std::printf(
      "bubble = 1 - work / (%d x time); work = the layers' sleep (blocks recomputed, the fused tail not). "
      "sim = scheduler::simulate with the true costs and no overheads; async = back-to-back kAsync "
      "iterations, mean of the last %d; sim_async = simulate_steady_state of the async plan.\n",
      kDevices, kAsyncRuns - 1 - kAsyncWarmup);
  std::printf(
      "hop_fit = the per-hop latency (SimulateOptions::hop_latency, ms) that makes the simulated isolated "
      "makespan equal the measured one. Plans: isolated | async (the runtime plans for the mode of the "
      "last step; 'planned' = plan_by_simulation with the true costs, kIsolated | kSteadyState).\n");
  std::printf(
      "real_* = the bubble against the time the layers really slept (sleep_for overshoots), meas_* "
      "against the nominal sleep.\n");
  std::printf(
      "cpu iso/asy/layers = the process's CPU time (all threads: the engine, the layers' tensor work, the "
      "optimizer) as a share of %d x wall time, isolated and async; sleeps use none. layers = the CPU time "
      "of a plain loop running the same layers without sleeps (no engine), against the isolated time.\n",
      kDevices);
  std::printf("%-12s %-20s %6s %8s %8s %8s %8s %8s %8s %8s %8s %7s %10s  %s\n", "workload", "plan", "scale", "sim_iso",
              "meas_iso", "real_iso", "sim_async", "meas_asy", "real_asy", "paper", "1F1B", "hop_fit",
              "cpu iso/asy/layers", "isolated plan  |  async plan");
  for (const auto& w : workloads) {
    if (!only.empty() && std::string(w.name).find(only) == std::string::npos) continue;
    // True costs: LayerCost::backward = recompute + backward (the fused tail's forward + backward).
    std::vector<rs::LayerCost> costs(w.layers, rs::LayerCost{w.fwd, w.fwd + w.bwd, 0, 0});
    costs.push_back(rs::LayerCost{w.head_fwd, w.head_fwd + w.head_bwd, 0, 0});
    double work_per_mb = 0;
    for (const auto& c : costs) work_per_mb += c.forward + c.backward;
    const double scale = target_ms * kDevices * 0.85 / (kMicro * work_per_mb);
    for (auto& c : costs) c.forward *= scale, c.backward *= scale;
    // The runtime's model of itself (Note [Engine self-model]), isolated iterations.
    auto sim_options = roundpipe::engine_simulate_options(roundpipe::kDefaultRecomputeGrain, false);
    const auto steady_options = rs::SimulateOptions(sim_options).set_overlap_backward_tail(true);
    auto plan_true = [&](rs::PlanObjective objective, const rs::SimulateOptions& model) {
      return rs::plan_by_simulation(costs, rs::RunType::kFused,
                                    rs::PlannerOptions()
                                        .set_num_devices(kDevices)
                                        .set_num_microbatch(kMicro)
                                        .set_objective(objective)
                                        .set_simulate(model))
          .plan;
    };

    auto make = [&](double sleep_scale) {
      torch::nn::Sequential model;
      for (int l = 0; l < w.layers; ++l) model->push_back(SleepPairLayer(w.fwd * sleep_scale, w.bwd * sleep_scale));
      model->push_back(SleepPairLayer(w.head_fwd * sleep_scale, w.head_bwd * sleep_scale));
      return model;
    };
    // The layers' own CPU work per iteration, without the engine: a plain loop over the
    // microbatches with the sleeps off (forward without grad, then recompute + backward, as the
    // stage jobs run them), process CPU time per iteration.
    const double layer_cpu_ms = [&] {
      auto plain = make(0);
      auto x = torch::ones({kMicro, 1});
      auto xs = x.tensor_split(kMicro, 0);
      double best = 1e300;
      for (int rep = 0; rep < 3; ++rep) {
        const double c0 = process_cpu_ms();
        for (const auto& xj : xs) {
          {
            torch::NoGradGuard no_grad;
            plain->forward(xj);
          }
          plain->forward(xj).sum().backward();
        }
        best = std::min(best, process_cpu_ms() - c0);
      }
      return best;
    }();
    // Runs isolated iterations with `iso_plan` and back-to-back async ones with `async_plan` (the
    // runtime's automatic plans when not given: it plans for the mode of the last step).
    auto run = [&](const char* what, std::optional<rs::ExecutePlan> iso_plan,
                   std::optional<rs::ExecutePlan> async_plan) {
      RoundPipe model(make(scale), RoundPipeOptions().devices(std::vector<c10::Device>(kDevices, c10::kCPU)));
      RunConfig cfg;
      cfg.num_microbatch = kMicro;
      cfg.preserve_rng_state = false;
      cfg.execute_plan = iso_plan;
      auto x = torch::ones({kMicro, 1});
      // A real (negligible) optimizer step: sleeping layers only multiply by a weight of ~1.
      torch::optim::SGD sgd(model.optim_parameters(), 1e-9);
      auto step = [&sgd] {
        sgd.step();
        sgd.zero_grad();
      };
      model.forward_backward({x}, torch::Tensor(), sum_loss(), cfg);  // measures the layers (automatic plan)
      model.step(step, roundpipe::StepMode::kSync);
      const rs::ExecutePlan plan = model.plan(cfg);
      // The work the sleeps add up to for this plan: forward stages, the fused tail, recompute + backward.
      const auto sim = rs::simulate(plan, rs::RunType::kFused, costs, kDevices, kMicro, sim_options);
      std::vector<double> isolated;
      const double slept_before_iso = slept_ms();
      const double cpu_before_iso = process_cpu_ms();
      for (int r = 0; r < kIsolatedRuns; ++r) {
        const auto t0 = Clock::now();
        model.forward_backward({x}, torch::Tensor(), sum_loss(), cfg);
        model.step(step, roundpipe::StepMode::kSync);
        isolated.push_back(ms_since(t0));
      }
      model.synchronize();
      const double slept_iso = slept_ms() - slept_before_iso;
      const double cpu_iso = process_cpu_ms() - cpu_before_iso;
      double iso_total = 0;
      for (double t : isolated) iso_total += t;
      // Async: the first step(kAsync) switches the automatic plan to the back-to-back one.
      cfg.execute_plan = async_plan;
      std::vector<Clock::time_point> ends;
      double slept_async_from = 0, slept_async_to = 0, cpu_async_from = 0, cpu_async_to = 0;
      for (int r = 0; r < kAsyncRuns; ++r) {
        model.forward_backward({x}, torch::Tensor(), sum_loss(), cfg);
        model.step(step, roundpipe::StepMode::kAsync);
        ends.push_back(Clock::now());
        // forward_backward returns before its backward ends (overlap_backward): in steady state
        // the same work is in flight at both marks, so the difference is the sleeps of the
        // iterations in between.
        if (r == kAsyncWarmup) slept_async_from = slept_ms(), cpu_async_from = process_cpu_ms();
        if (r == kAsyncRuns - 1) slept_async_to = slept_ms(), cpu_async_to = process_cpu_ms();
      }
      model.synchronize();
      const rs::ExecutePlan aplan = model.plan(cfg);
      const auto asim = rs::simulate(aplan, rs::RunType::kFused, costs, kDevices, kMicro, sim_options);
      const auto steady =
          rs::simulate_steady_state(aplan, rs::RunType::kFused, costs, kDevices, kMicro, steady_options);
      const int measured = kAsyncRuns - 1 - kAsyncWarmup;
      const double async_ms =
          std::chrono::duration<double, std::milli>(ends.back() - ends[kAsyncWarmup]).count() / measured;
      const double iso_ms = median(isolated);
      const double capacity_iso = kDevices * iso_ms, capacity_async = kDevices * async_ms;
      // Bisection: the simulated makespan does not decrease with the hop latency.
      auto makespan_at = [&](double hop) {
        return rs::simulate(plan, rs::RunType::kFused, costs, kDevices, kMicro,
                            rs::SimulateOptions(sim_options).set_hop_latency(hop))
            .makespan;
      };
      double lo = 0, hi = 1;
      while (makespan_at(hi) < iso_ms && hi < 1000) hi *= 2;
      for (int i = 0; i < 40 && makespan_at(lo) < iso_ms; ++i) {
        const double mid = (lo + hi) / 2;
        (makespan_at(mid) < iso_ms ? lo : hi) = mid;
      }
      const double real_iso = 1 - slept_iso / (kDevices * iso_total);
      const double real_async = 1 - (slept_async_to - slept_async_from) / (kDevices * async_ms * measured);
      // The CPU the process used, as a share of the devices' capacity (8 x wall time).
      const double cpu_share_iso = cpu_iso / (kDevices * iso_total);
      const double cpu_share_async = (cpu_async_to - cpu_async_from) / (kDevices * async_ms * measured);
      std::printf(
          "%-12s %-20s %6.3f %7.1f%% %7.1f%% %7.1f%% %7.1f%% %7.1f%% %7.1f%% %3.1f/%3.1f %7.1f%% %7.3f "
          "%4.1f/%4.1f/%4.1f%%  %s  |  %s\n",
          w.name, what, scale, 100 * sim.bubble_ratio(), 100 * (1 - sim.work / capacity_iso), 100 * real_iso,
          100 * steady.bubble_ratio(), 100 * (1 - asim.work / capacity_async), 100 * real_async, w.paper_isolated,
          w.paper_async, w.paper_1f1b, lo, 100 * cpu_share_iso, 100 * cpu_share_async,
          100 * layer_cpu_ms / capacity_iso, plan.to_string().c_str(), aplan.to_string().c_str());
      std::fflush(stdout);
    };
    run("runtime (auto)", std::nullopt, std::nullopt);
    run("planned, true costs", plan_true(rs::PlanObjective::kIsolated, sim_options),
        plan_true(rs::PlanObjective::kSteadyState, steady_options));
  }
}

// Section 6 (`pipeline_bench steady`): issue 32's end-to-end protocol, as a user would run it: a
// fresh RoundPipe on 8 CPU devices, RunConfig{num_microbatch = 16, preserve_rng_state = false}, the
// runtime's own automatic plan, forward_backward + step(kAsync) with a minimal real step
// function from the first iteration on, 4 warm-up and 10 measured back-to-back iterations, then
// synchronize(). The clock runs from the 5th call to the end of synchronize(). Next to it: the
// same run's period between returns (the steady state, without the one final drain), the
// simulator on the plan the runtime ran (its steady state, and the same 14-iteration protocol),
// and the jobs per iteration from the stage trace.
void steady_workloads(double target_ms, const std::string& only, bool keep_rng) {
  namespace rs = roundpipe::scheduler;
  using roundpipe::RoundPipe;
  using roundpipe::RoundPipeOptions;
  using roundpipe::RunConfig;
  constexpr int kDevices = 8, kMicro = 16, kWarmup = 4, kMeasured = 10, kRuns = kWarmup + kMeasured;
  std::printf(
      "== 6. steady state, end to end (issue 32): %d CPU device workers, %d microbatches, sleeping layers "
      "scaled to ~%.0f ms per iteration; fresh RoundPipe, automatic plan, forward_backward + step(kAsync) "
      "(SGD step + zero_grad), %d warm-up + %d measured iterations, then synchronize(); preserve_rng_state %s\n",
      kDevices, kMicro, target_ms, kWarmup, kMeasured, keep_rng ? "on (default)" : "off");
  std::printf(
      "W = the plan's layer work per iteration (nominal sleeps; recompute counted); ideal = W / %d. "
      "e2e = (end of synchronize - start of call %d) / %d (the issue's figure); period = mean time between "
      "returns of calls %d..%d (steady state, no final drain); drain = last return to end of synchronize. "
      "bubble = 1 - ideal / time: nominal, and real (W x the run's measured sleep overshoot).\n",
      kDevices, kWarmup + 1, kMeasured, kWarmup, kRuns);
  std::printf(
      "sim = simulate_steady_state of the plan the runtime ran (true costs, the runtime's model): its "
      "period, and the same protocol (iterations 1..13 after the measuring call, from return 3 to end 13); "
      "pdef = the paper's 'async' bubble: the intra share of one isolated simulated iteration (idle "
      "that is not fill or drain), of this async plan / of the plan planned for one isolated iteration. per min/max: "
      "the shortest and longest return-to-return interval (ms).\n");
  std::printf("%-12s %-9s %8s %8s %8s %8s | %6s %6s | %6s %6s | %8s %6s %8s %6s | %9s %6s | %5s %13s  %s\n", "workload",
              "iter0,1", "ideal", "e2e", "period", "drain", "e2e_n", "e2e_r", "per_n", "per_r", "sim_per", "sim_b",
              "sim_e2e", "sim_eb", "pdef", "paper", "cpu", "per min/max", "async plan");
  for (const auto& w : paper_workload_list()) {
    if (!only.empty() && std::string(w.name).find(only) == std::string::npos) continue;
    std::vector<rs::LayerCost> costs(w.layers, rs::LayerCost{w.fwd, w.fwd + w.bwd, 0, 0});
    costs.push_back(rs::LayerCost{w.head_fwd, w.head_fwd + w.head_bwd, 0, 0});
    double work_per_mb = 0;
    for (const auto& c : costs) work_per_mb += c.forward + c.backward;
    const double scale = target_ms * kDevices * 0.85 / (kMicro * work_per_mb);
    for (auto& c : costs) c.forward *= scale, c.backward *= scale;
    torch::nn::Sequential net;
    for (int l = 0; l < w.layers; ++l) net->push_back(SleepPairLayer(w.fwd * scale, w.bwd * scale));
    net->push_back(SleepPairLayer(w.head_fwd * scale, w.head_bwd * scale));
    RoundPipe model(net, RoundPipeOptions().devices(std::vector<c10::Device>(kDevices, c10::kCPU)));
    RunConfig cfg;
    cfg.num_microbatch = kMicro;
    // Note [Layer RNG]: with preserve_rng_state on, CPU devices share one generator and every
    // first-pass layer forward (the sleep included) holds its mutex, so forward work is serialized
    // across the 8 workers; off unless asked for (`rng`), as in section 5.
    if (!keep_rng) cfg.preserve_rng_state = false;
    auto x = torch::ones({kMicro, 1});
    torch::optim::SGD sgd(model.optim_parameters(), 1e-9);
    auto step = [&sgd] {
      sgd.step();
      sgd.zero_grad();
    };
    roundpipe::trace::enable(true);
    const auto origin = Clock::now();
    auto at_ms = [&](Clock::time_point t) { return std::chrono::duration<double, std::milli>(t - origin).count(); };
    std::vector<Clock::time_point> begin(kRuns), ret(kRuns);
    double slept0 = 0, nominal0 = 0, cpu0 = 0;
    for (int i = 0; i < kRuns; ++i) {
      if (i == kWarmup) slept0 = slept_ms(), nominal0 = nominal_slept_ms(), cpu0 = process_cpu_ms();
      begin[i] = Clock::now();
      model.forward_backward({x}, torch::Tensor(), sum_loss(), cfg);
      model.step(step, roundpipe::StepMode::kAsync);
      ret[i] = Clock::now();
    }
    model.synchronize();
    const auto end = Clock::now();
    const double overshoot = (slept_ms() - slept0) / (nominal_slept_ms() - nominal0);
    const double cpu_ms = process_cpu_ms() - cpu0;
    const auto spans = roundpipe::trace::collect();
    roundpipe::trace::enable(false);

    const rs::ExecutePlan plan = model.plan(cfg);
    const auto model_options = roundpipe::engine_simulate_options(roundpipe::kDefaultRecomputeGrain, true);
    const auto iso = rs::simulate(plan, rs::RunType::kFused, costs, kDevices, kMicro, model_options);
    const double W = iso.work;
    const double ideal = W / kDevices;
    const auto steady = rs::simulate_steady_state(plan, rs::RunType::kFused, costs, kDevices, kMicro, model_options);
    // The paper's definition on the plan that minimizes one isolated iteration (true costs).
    const auto iso_plan =
        rs::plan_by_simulation(costs, rs::RunType::kFused,
                               rs::PlannerOptions().set_num_devices(kDevices).set_num_microbatch(kMicro).set_simulate(
                                   rs::SimulateOptions(model_options).set_overlap_backward_tail(false)))
            .plan;
    const auto iso_of_iso = rs::simulate(iso_plan, rs::RunType::kFused, costs, kDevices, kMicro, model_options);
    // The protocol in the simulator: iteration 0 (the measuring call, another plan) ran alone, so
    // calls 1..13 are simulated iterations 0..12; the clock runs from return 2 to end 12.
    const auto proto = rs::simulate_steady_state(plan, rs::RunType::kFused, costs, kDevices, kMicro,
                                                 rs::SimulateOptions(model_options).set_num_iterations(kRuns - 1));
    const double sim_e2e = proto.mean_iteration_time(kWarmup - 1, kRuns - 2);  // Note [Measured windows]

    const double e2e = std::chrono::duration<double, std::milli>(end - begin[kWarmup]).count() / kMeasured;
    const double period =
        std::chrono::duration<double, std::milli>(ret[kRuns - 1] - ret[kWarmup - 1]).count() / kMeasured;
    const double drain = std::chrono::duration<double, std::milli>(end - ret[kRuns - 1]).count();
    auto bubble = [&](double work, double t) { return 100 * (1 - work / (kDevices * t)); };
    double per_min = 1e300, per_max = 0;
    for (int i = kWarmup; i < kRuns; ++i) {
      const double dt = std::chrono::duration<double, std::milli>(ret[i] - ret[i - 1]).count();
      per_min = std::min(per_min, dt);
      per_max = std::max(per_max, dt);
    }
    const double w0 = at_ms(begin[kWarmup]), w1 = at_ms(end);
    int jobs = 0;
    for (const auto& s : spans) jobs += s.upload_begin_ms >= w0 && s.compute_end_ms <= w1 ? 1 : 0;
    const double jobs_per_iter = static_cast<double>(jobs) / kMeasured;
    std::printf(
        "%-12s %4.0f,%-4.0f %8.1f %8.1f %8.1f %8.1f | %5.1f%% %5.1f%% | %5.1f%% %5.1f%% | %8.1f %5.1f%% %8.1f "
        "%5.1f%% | %4.1f/%3.1f%% %5.1f%% | %4.1f%% %6.0f/%-6.0f  %s\n",
        w.name, std::chrono::duration<double, std::milli>(ret[0] - begin[0]).count(),
        std::chrono::duration<double, std::milli>(ret[1] - begin[1]).count(), ideal, e2e, period, drain, bubble(W, e2e),
        bubble(W * overshoot, e2e), bubble(W, period), bubble(W * overshoot, period), steady.period,
        100 * steady.bubble_ratio(), sim_e2e, bubble(W, sim_e2e), 100 * (iso.steady_ratio() + iso.overhead_ratio()),
        100 * (iso_of_iso.steady_ratio() + iso_of_iso.overhead_ratio()), w.paper_async,
        100 * cpu_ms / (kDevices * e2e * kMeasured), per_min, per_max, plan.to_string().c_str());
    std::printf(
        "%-12s   overshoot %.3f, %.1f jobs per iteration, sim drain %.1f ms (measured %.1f), sim iso makespan "
        "%.1f ms\n",
        "", overshoot, jobs_per_iter, proto.iteration_end[kRuns - 2] - proto.iteration_return[kRuns - 2], drain,
        iso.makespan);
    // What planning could do for this protocol (simulated, true costs): the runtime's objective
    // (kSteadyState over 100 iterations), the same over 10, and the protocol's own
    // (kMeasuredWindow over 10: period + drain / 10), rated on the steady state and on the protocol.
    const std::pair<rs::PlanObjective, int64_t> objectives[] = {{rs::PlanObjective::kSteadyState, 100},
                                                                {rs::PlanObjective::kSteadyState, kMeasured},
                                                                {rs::PlanObjective::kMeasuredWindow, kMeasured}};
    for (const auto& [objective, horizon] : objectives) {
      const auto what_if = rs::plan_by_simulation(costs, rs::RunType::kFused,
                                                  rs::PlannerOptions()
                                                      .set_num_devices(kDevices)
                                                      .set_num_microbatch(kMicro)
                                                      .set_objective(objective)
                                                      .set_run_iterations(horizon)
                                                      .set_simulate(model_options))
                               .plan;
      const auto r = rs::simulate_steady_state(what_if, rs::RunType::kFused, costs, kDevices, kMicro,
                                               rs::SimulateOptions(model_options).set_num_iterations(kRuns - 1));
      const auto exact =
          rs::simulate_steady_state(what_if, rs::RunType::kFused, costs, kDevices, kMicro, model_options);
      std::printf(
          "%-12s   what-if, true costs, %s over %3lld iterations: %lldF+%lldB, simulated period "
          "bubble %.1f%%, protocol %.1f%%\n",
          "", objective == rs::PlanObjective::kSteadyState ? "kSteadyState  " : "kMeasuredWindow",
          static_cast<long long>(horizon), static_cast<long long>(what_if.forward_stages().size()),
          static_cast<long long>(what_if.backward_stages().size()), 100 * exact.bubble_ratio(),
          100 * r.window_bubble_ratio(kWarmup - 1, kRuns - 2));
    }
    std::fflush(stdout);
  }
}

}  // namespace

int main(int argc, char** argv) {
  using namespace roundpipe;
  if (argc > 1 && std::strcmp(argv[1], "steady") == 0) {
    torch::set_num_threads(1);
    steady_workloads(argc > 2 ? std::atof(argv[2]) : 2000.0, argc > 3 ? argv[3] : "",
                     argc > 4 && std::strcmp(argv[4], "rng") == 0);
    return 0;
  }
  if (argc > 1 && std::strcmp(argv[1], "paper") == 0) {
    torch::set_num_threads(1);
    paper_workloads(argc > 2 ? std::atof(argv[2]) : 2000.0, argc > 3 ? argv[3] : "");
    return 0;
  }
  const double t = argc > 1 ? std::atof(argv[1]) : 2.0;
  const int layers = argc > 2 ? std::atoi(argv[2]) : 12;
  torch::set_num_threads(1);

  namespace rs = roundpipe::scheduler;
  std::printf(
      "== 1. schedule quality: %d sleeping layers, forward %.1f ms, recompute + backward %.1f ms per layer "
      "and microbatch (the fused tail: forward + backward %.1f ms)\n",
      layers, t, 3 * t, 3 * t);
  std::printf(
      "isolated = forward_backward + kSync step (median of 6); async = back-to-back kAsync iterations "
      "(mean of the last 8, overlapping; the runtime plans for the last step's mode: stages iso|async); sim = "
      "scheduler::simulate, steady = simulate_steady_state\n");
  std::printf("%-8s %-6s %-7s %-9s %-9s %-8s %-9s %-8s %-9s %-8s\n", "devices", "micro", "stages", "iso_ms", "async_ms",
              "sim_iso", "meas_iso", "steady", "meas_asy", "gpipe");
  for (int devices = 2; devices <= 8; ++devices) {
    const int micro = devices + 1;
    RoundPipe model(sleep_model(layers, t, 1),
                    RoundPipeOptions().devices(std::vector<c10::Device>(devices, c10::kCPU)));
    RunConfig cfg;
    cfg.num_microbatch = micro;
    cfg.preserve_rng_state = false;  // no dropout: skip the CPU generator lock (Note [Layer RNG])
    auto x = torch::ones({micro, 4});
    torch::optim::SGD sgd(model.optim_parameters(), 1e-9);  // a real, negligible step
    auto step = [&sgd] {
      sgd.step();
      sgd.zero_grad();
    };
    model.forward_backward({x}, torch::Tensor(), sum_loss(), cfg);  // warm-up: measures, plans
    model.step(step, StepMode::kSync);
    std::vector<double> times;
    for (int rep = 0; rep < 6; ++rep) {
      auto t0 = Clock::now();
      model.forward_backward({x}, torch::Tensor(), sum_loss(), cfg);
      model.step(step, StepMode::kSync);
      times.push_back(ms_since(t0));
    }
    const auto iso_plan = model.plan(cfg);
    std::vector<Clock::time_point> ends;
    for (int rep = 0; rep < 11; ++rep) {  // the first kAsync step switches the automatic plan
      model.forward_backward({x}, torch::Tensor(), sum_loss(), cfg);
      model.step(step, StepMode::kAsync);
      ends.push_back(Clock::now());
    }
    model.synchronize();
    const double iso = median(times);
    const double period = std::chrono::duration<double, std::milli>(ends.back() - ends[2]).count() / 8;
    const auto async_plan = model.plan(cfg);
    // Work: forward t + recompute and backward 3t per layer before the fused tail, 3t in it.
    auto work = [&](const rs::ExecutePlan& plan) {
      const int64_t fused_begin = plan.backward_stages().front().begin;
      return micro * t * static_cast<double>(4 * fused_begin + 3 * (layers - fused_begin));
    };
    const std::vector<rs::LayerCost> costs(layers, rs::LayerCost{t, 3 * t, 0, 0});
    const auto sim = rs::simulate(iso_plan, rs::RunType::kFused, costs, devices, micro,
                                  roundpipe::engine_simulate_options(roundpipe::kDefaultRecomputeGrain, false));
    const auto steady =
        rs::simulate_steady_state(async_plan, rs::RunType::kFused, costs, devices, micro,
                                  roundpipe::engine_simulate_options(roundpipe::kDefaultRecomputeGrain, true));
    const double gpipe = static_cast<double>(devices - 1) / (micro + devices - 1);
    std::printf("%-8d %-6d %3lld|%-3lld %-9.1f %-9.1f %-8.3f %-9.3f %-8.3f %-9.3f %-8.3f\n", devices, micro,
                static_cast<long long>(iso_plan.num_stages()), static_cast<long long>(async_plan.num_stages()), iso,
                period, sim.bubble_ratio(), 1 - work(iso_plan) / (devices * iso), steady.bubble_ratio(),
                1 - work(async_plan) / (devices * period), gpipe);
    std::fflush(stdout);
  }

  std::printf("\n== 2. dispatch overhead: 32 empty layers, one stage per layer, 8 microbatches\n");
  std::printf("%-8s %-14s %-16s\n", "devices", "iteration_ms", "us_per_stage_mb");
  for (int devices : {1, 3}) {
    RoundPipe model(sleep_model(32, 0, 1), RoundPipeOptions().devices(std::vector<c10::Device>(devices, c10::kCPU)));
    RunConfig cfg;
    cfg.num_microbatch = 8;
    cfg.preserve_rng_state = false;
    cfg.execute_plan = scheduler::ExecutePlan::per_layer(32, scheduler::RunType::kFused);
    auto x = torch::ones({8, 4});
    auto loss = sum_loss();
    std::vector<double> times;
    for (int rep = 0; rep < 20; ++rep) {
      auto t0 = Clock::now();
      model.forward_backward({x}, torch::Tensor(), loss, cfg);
      times.push_back(ms_since(t0));
    }
    const double it = median(times);
    const double per = it * 1000 / (cfg.execute_plan->num_stages() * 8);
    std::printf("%-8d %-14.3f %-16.1f\n", devices, it, per);
  }

  std::printf("\n== 3. async vs sync step: %d sleeping layers, 64M fp32 parameters, roundpipe::optim::Adam\n", layers);
  std::printf("%-7s %-16s %-10s %-10s %-14s\n", "mode", "iteration_ms", "min_ms", "max_ms", "step_call_ms");
  double sync_ms = 0, sync_min = 0, sync_step = 0;
  for (StepMode mode : {StepMode::kSync, StepMode::kAsync}) {
    torch::set_num_threads(2);
    RoundPipe model(sleep_model(layers, t, (int64_t{64} << 20) / layers),
                    RoundPipeOptions().devices({c10::kCPU, c10::kCPU, c10::kCPU}));
    auto optimizer = master_adam(model);
    const RunConfig cfg = sleep_run_config();
    auto x = torch::ones({4, 4});
    std::vector<double> iters, steps;
    for (int rep = 0; rep < 12; ++rep) {  // the first is a warm-up (masters, state, plan)
      auto t0 = Clock::now();
      model.forward_backward({x}, torch::Tensor(), sum_loss(), cfg);
      auto t1 = Clock::now();
      model.step(
          [&] {
            optimizer.step();
            optimizer.zero_grad();
          },
          mode);
      steps.push_back(ms_since(t1));
      if (rep > 0) iters.push_back(ms_since(t0));
    }
    model.synchronize();
    const double it = median(iters);
    const double best = *std::min_element(iters.begin(), iters.end());
    std::printf("%-7s %-16.1f %-10.1f %-10.1f %-14.1f\n", mode == StepMode::kSync ? "sync" : "async", it, best,
                *std::max_element(iters.begin(), iters.end()), median(steps));
    if (mode == StepMode::kSync) {
      sync_ms = it;
      sync_min = best;
      sync_step = median(steps);
    } else {
      // Perfect overlap hides the whole step: iteration = sync iteration - sync step call.
      std::printf("async speed-up: %.2fx (medians), %.2fx (best iterations); perfect overlap: %.2fx\n", sync_ms / it,
                  sync_min / best, sync_min / (sync_min - sync_step));
    }
  }

  std::printf(
      "\n== 3b. step() with bf16 compute copies and fp32 masters: %d sleeping layers, 64M parameters, "
      "roundpipe::optim::Adam, kSync\n",
      layers);
  std::printf("%-34s %-14s %-10s\n", "master gradients, optimizer", "step_call_ms", "best_ms");
  for (int variant : {0, 1, 2}) {  // 0: ATen's fused Adam (fp32 grads), 1: ours (fp32 grads), 2: ours (bf16 grads)
    const bool uncast = variant == 2;
    torch::set_num_threads(2);
    auto net = sleep_model(layers, t, (int64_t{64} << 20) / layers);
    net->to(torch::kBFloat16);
    auto options = RoundPipeOptions().devices({c10::kCPU, c10::kCPU, c10::kCPU}).optim_dtype(torch::kFloat);
    if (uncast) options.master_grad_dtype(torch::kBFloat16);
    RoundPipe model(net, options);
    auto optimizer = master_adam(model);
    const RunConfig cfg = sleep_run_config();
    auto x = torch::ones({4, 4}, torch::kBFloat16);
    // ATen's fused kernel on the same masters, as a step function would call it.
    const auto masters = model.optim_parameters();
    std::vector<torch::Tensor> exp_avgs, exp_avg_sqs, state_steps;
    for (const auto& p : masters) {
      exp_avgs.push_back(torch::zeros_like(p));
      exp_avg_sqs.push_back(torch::zeros_like(p));
      state_steps.push_back(torch::zeros({}, torch::kFloat));
    }
    const auto aten_step = [&] {
      std::vector<torch::Tensor> params, grads;
      for (const auto& p : masters) {
        params.push_back(p.detach());
        grads.push_back(p.grad());
      }
      at::_fused_adam_(params, grads, exp_avgs, exp_avg_sqs, {}, state_steps, 1e-4, 0.9, 0.999, 0, 1e-8, false, false);
      for (const auto& p : masters) p.mutable_grad().reset();
    };
    std::vector<double> steps;
    for (int rep = 0; rep < 8; ++rep) {
      model.forward_backward({x}, torch::Tensor(), sum_loss(), cfg);
      auto t1 = Clock::now();
      model.step(
          [&] {
            if (variant == 0) {
              aten_step();
            } else {
              optimizer.step();
              optimizer.zero_grad();
            }
          },
          StepMode::kSync);
      if (rep > 0) steps.push_back(ms_since(t1));
    }
    const char* names[] = {"fp32, at::_fused_adam_", "fp32, roundpipe Adam", "bf16 uncast, roundpipe Adam"};
    std::printf("%-34s %-14.1f %-10.1f\n", names[variant], median(steps),
                *std::min_element(steps.begin(), steps.end()));
  }

  std::printf("\n== 4. per-job layer copy on a CPU device: Linear(2048, 2048), 4.2M fp32 parameters\n");
  std::printf("%-34s %-10s %-10s\n", "method", "ms", "vs floor");
  {
    torch::set_num_threads(1);
    std::vector<torch::nn::AnyModule> layers{torch::nn::AnyModule(torch::nn::Linear(2048, 2048))};
    roundpipe::detail::LayerShells shells(&layers);
    const auto& weight = layers[0].ptr()->parameters();
    auto time_ms = [](const std::function<void()>& fn) {
      std::vector<double> v;
      for (int rep = 0; rep < 7; ++rep) {
        auto t0 = Clock::now();
        fn();
        v.push_back(ms_since(t0));
      }
      return median(v);
    };
    const double floor_ms = time_ms([&] {
      for (const auto& p : weight) p.clone();
    });
    const double clone_ms = time_ms([&] { layers[0].clone(c10::Device(c10::kCPU)); });
    const double shell_ms = time_ms([&] {
      roundpipe::detail::DeviceIo io{c10::Device(c10::kCPU)};
      roundpipe::detail::ShellLease lease(shells, 0);
      io.upload_layer(*lease.module().ptr(), *layers[0].ptr());
    });
    std::printf("%-34s %-10.2f %-10.2f\n", "plain copy of the values (floor)", floor_ms, 1.0);
    std::printf("%-34s %-10.2f %-10.2f\n", "clone(device) per job (before)", clone_ms, clone_ms / floor_ms);
    std::printf("%-34s %-10.2f %-10.2f\n", "shell lease + upload (now)", shell_ms, shell_ms / floor_ms);
  }
  return 0;
}
