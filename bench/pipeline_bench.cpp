// Pipeline engine benchmark (a dedicated executable printing tables):
//  1. Schedule quality: layers that sleep (forward t, backward 3t incl. recompute; no CPU burn) on
//     2, 3, 4 CPU device workers; measured iteration time vs the ideal makespan of the same plan
//     (event simulation of the dispatch order with zero overhead), our bubble fraction, and the
//     bubble fraction GPipe and 1F1B have for the same layers ((p-1)/(m+p-1), p = devices).
//  2. Dispatch overhead: parameter-free empty layers, one stage per layer; time per (stage, mb).
//  3. Async vs sync step: the sleeping model with 64M fp32 parameters and roundpipe::optim::Adam;
//     3b: the step() call with bf16 compute copies, fp32 masters and fp32 vs uncast bf16 master
//     gradients (RoundPipeOptions::master_grad_dtype).
//  4. Per-job layer copy on a CPU device: Cloneable::clone(device) (what stage jobs did before
//     Note [Layer shells]: reset() re-initializes every parameter, then the values are copied)
//     vs leasing a reused shell and uploading the values; the floor is one plain copy (clone()) of
//     the same parameters.
// Usage: pipeline_bench [sleep_ms=2] [layers=12]
#include <ATen/ops/_fused_adam.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <thread>

#include "optim/adam.h"
#include "roundpipe/detail/device_io.h"
#include "roundpipe/detail/layer_shells.h"
#include "roundpipe/round_pipe.h"
#include "scheduler/dispatch.h"

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

// Zero-overhead event simulation of `plan` dispatched round-robin: stage jobs run their
// microbatches in order; a microbatch starts when its input is ready and the previous one is done;
// a stage starts when its device finished its previous stage.
double ideal_makespan(const roundpipe::scheduler::ExecutePlan& plan, int devices, int micro, double t) {
  using namespace roundpipe::scheduler;
  auto order = dispatch_order(plan, RunType::kFused, devices);
  std::vector<double> device_free(devices, 0);
  std::vector<double> prev_ready(micro, 0);  // producer's finish per microbatch (chain)
  double makespan = 0;
  for (const auto& job : order) {
    const double per_mb = job.layers.size() * (job.phase == StagePhase::kForward ? t : 3 * t);
    double clock = device_free[job.device];
    std::vector<double> ready(micro);
    for (int j = 0; j < micro; ++j) {
      clock = std::max(clock, prev_ready[j]) + per_mb;
      ready[j] = clock;
    }
    device_free[job.device] = clock;
    prev_ready = ready;
    makespan = std::max(makespan, clock);
  }
  return makespan;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

roundpipe::LossFn sum_loss() {
  return [](const torch::Tensor& out, const torch::Tensor&) { return out.sum(); };
}

}  // namespace

int main(int argc, char** argv) {
  using namespace roundpipe;
  const double t = argc > 1 ? std::atof(argv[1]) : 2.0;
  const int layers = argc > 2 ? std::atoi(argv[2]) : 12;
  torch::set_num_threads(1);

  std::printf("== 1. schedule quality: %d sleeping layers, forward %.1f ms, backward %.1f ms per layer and microbatch\n",
              layers, t, 3 * t);
  std::printf("%-8s %-6s %-7s %-12s %-12s %-8s %-10s %-12s\n", "devices", "micro", "stages", "measured_ms", "ideal_ms",
              "ratio", "our_bubble", "gpipe/1f1b");
  for (int devices : {2, 3, 4}) {
    const int micro = devices + 1;
    RoundPipe model(sleep_model(layers, t, 1), RoundPipeOptions().devices(std::vector<c10::Device>(devices, c10::kCPU)));
    RunConfig cfg;
    cfg.num_microbatch = micro;
    cfg.preserve_rng_state = false;  // no dropout: skip the CPU generator lock (Note [Layer RNG])
    auto x = torch::ones({micro, 4});
    std::vector<double> times;
    for (int rep = 0; rep < 12; ++rep) {  // the first is a warm-up (masters, state, plan)
      auto t0 = Clock::now();
      model.forward_backward({x}, torch::Tensor(), sum_loss(), cfg);
      if (rep > 0) times.push_back(ms_since(t0));
    }
    const double measured = median(times);
    const auto plan = model.plan(cfg);
    const double ideal = ideal_makespan(plan, devices, micro, t);
    const double work = micro * layers * 4 * t;  // forward t + backward 3t per layer and microbatch
    const double bubble = 1 - work / (devices * measured);
    const double gpipe = static_cast<double>(devices - 1) / (micro + devices - 1);
    std::printf("%-8d %-6d %-7lld %-12.1f %-12.1f %-8.3f %-10.3f %-12.3f\n", devices, micro,
                static_cast<long long>(plan.num_stages()), measured, ideal, measured / ideal, bubble, gpipe);
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
      model.step([&] {
        optimizer.step();
        optimizer.zero_grad();
      }, mode);
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

  std::printf("\n== 3b. step() with bf16 compute copies and fp32 masters: %d sleeping layers, 64M parameters, "
              "roundpipe::optim::Adam, kSync\n", layers);
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
      model.step([&] {
        if (variant == 0) {
          aten_step();
        } else {
          optimizer.step();
          optimizer.zero_grad();
        }
      }, StepMode::kSync);
      if (rep > 0) steps.push_back(ms_since(t1));
    }
    const char* names[] = {"fp32, at::_fused_adam_", "fp32, roundpipe Adam", "bf16 uncast, roundpipe Adam"};
    std::printf("%-34s %-14.1f %-10.1f\n", names[variant], median(steps), *std::min_element(steps.begin(), steps.end()));
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
      roundpipe::detail::DeviceIo io(c10::Device(c10::kCPU));
      roundpipe::detail::ShellLease lease(shells, 0);
      io.upload_layer(*lease.module().ptr(), *layers[0].ptr());
    });
    std::printf("%-34s %-10.2f %-10.2f\n", "plain copy of the values (floor)", floor_ms, 1.0);
    std::printf("%-34s %-10.2f %-10.2f\n", "clone(device) per job (before)", clone_ms, clone_ms / floor_ms);
    std::printf("%-34s %-10.2f %-10.2f\n", "shell lease + upload (now)", shell_ms, shell_ms / floor_ms);
  }
  return 0;
}
