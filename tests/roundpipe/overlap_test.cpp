// Overlapping iterations (Note [Overlapping iterations] in round_pipe.cpp, Note [Run tails] in
// step_pipeline.cpp): forward_backward returns once the losses are known, the backward stages
// finish in the background, the next iteration's forward fills the previous one's drain, every
// reader waits for what it reads, a background error reaches the next call, and the results are
// bitwise those of a run without overlap.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "roundpipe/round_pipe.h"
#include "tests/common/tensor_compare.h"
#include "tests/roundpipe/test_models.h"

namespace roundpipe {
namespace {

using Clock = std::chrono::steady_clock;

// Lets a test hold a backward stage inside a layer's backward: counts the layer's no-grad
// forwards (forward stages), and the next backward through it after `hold` is set waits until
// `until()` is true (polling; at most 20 s, then `timed_out`). With `fail` set, backward then
// throws.
struct Rendezvous {
  std::atomic<int> forwards{0};
  std::atomic<bool> hold{false};
  std::atomic<bool> holding{false};
  std::atomic<bool> timed_out{false};
  std::atomic<bool> fail{false};
  std::function<bool()> until;  // set before `hold`, read by the held backward only
};

struct HoldFn : torch::autograd::Function<HoldFn> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, Rendezvous* r) {
    ctx->saved_data["r"] = reinterpret_cast<int64_t>(r);
    return x.clone();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list g) {
    auto* r = reinterpret_cast<Rendezvous*>(ctx->saved_data["r"].toInt());
    if (r->hold.exchange(false)) {
      r->holding = true;
      const auto deadline = Clock::now() + std::chrono::seconds(20);
      while (!r->until()) {
        if (Clock::now() > deadline) {
          r->timed_out = true;
          break;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      r->holding = false;
    }
    TORCH_CHECK(!r->fail.load(), "injected backward failure");
    return {g[0], torch::Tensor()};
  }
};

struct RendezvousLayerImpl : torch::nn::Cloneable<RendezvousLayerImpl> {
  explicit RendezvousLayerImpl(std::shared_ptr<Rendezvous> r) : r_(std::move(r)) {}
  void reset() override {}
  torch::Tensor forward(const torch::Tensor& x) {
    if (!torch::GradMode::is_enabled()) {
      r_->forwards.fetch_add(1);
      return x;
    }
    return HoldFn::apply(x, r_.get());
  }
  std::shared_ptr<Rendezvous> r_;
};
TORCH_MODULE(RendezvousLayer);

// Linear, Rendezvous, Tanh, Linear, Tanh, Linear: forward stage [0, 3), fused [3, 6), backward
// [0, 3) on two CPU workers, 3 microbatches. The Rendezvous layer sits in the backward stage.
struct Rig {
  std::shared_ptr<Rendezvous> r = std::make_shared<Rendezvous>();
  torch::nn::Sequential model;
  std::unique_ptr<RoundPipe> rp;
  std::unique_ptr<torch::optim::SGD> opt;
  RunConfig cfg;

  explicit Rig(bool overlap) {
    torch::manual_seed(11);
    model = torch::nn::Sequential(torch::nn::Linear(8, 16), RendezvousLayer(r), torch::nn::Tanh(),
                                  torch::nn::Linear(16, 16), torch::nn::Tanh(), torch::nn::Linear(16, 4));
    rp = std::make_unique<RoundPipe>(
        model, RoundPipeOptions().devices({c10::kCPU, c10::kCPU}).overlap_backward(overlap).name("overlap"));
    OptimizerCtx ctx;
    opt = std::make_unique<torch::optim::SGD>(rp->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    cfg.num_microbatch = 3;
    cfg.execute_plan = scheduler::ExecutePlan({{0, 3}}, {{3, 6}, {0, 3}});
  }
  torch::Tensor fb(int it) {
    torch::manual_seed(100 + it);
    auto x = torch::randn({6, 8}), y = torch::randn({6, 4});
    const double n = static_cast<double>(y.numel());
    return rp->forward_backward({x}, y,
                                [n](const torch::Tensor& out, const torch::Tensor& t) {
                                  return torch::mse_loss(out, t, torch::Reduction::Sum) / n;
                                },
                                cfg);
  }
  void step(StepMode mode = StepMode::kAsync) {
    rp->step(
        [this] {
          opt->step();
          opt->zero_grad();
        },
        mode);
  }
  // The compute copies' gradients (through parameters(), which waits for them).
  std::vector<torch::Tensor> grads() {
    std::vector<torch::Tensor> out;
    for (const auto& p : rp->parameters()) out.push_back(p.grad().defined() ? p.grad().clone() : torch::Tensor());
    return out;
  }
};

void expect_lists_equal(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b,
                        const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(a[i].defined(), b[i].defined()) << what << " " << i;
    if (a[i].defined()) {
      EXPECT_TENSOR_EQ(a[i], b[i]) << what << " " << i;
    }
  }
}

std::vector<torch::Tensor> values(const std::vector<torch::Tensor>& params) {
  std::vector<torch::Tensor> out;
  for (const auto& p : params) out.push_back(p.detach().clone());
  return out;
}

// Run 1's backward stage is held until run 2's forward stage has run all its microbatches: only
// possible if forward_backward returned before its backward finished, and if the next
// iteration's forward stage started while that backward still ran (its parameters published by
// the async step as soon as the held stage had its copy). Losses and parameters are bitwise those
// of the same loop without overlap.
TEST(OverlapTest, NextForwardRunsWhileTheTailIsHeld_BitwiseAsWithoutOverlap) {
  Rig overlap(true), plain(false);
  std::vector<torch::Tensor> losses_overlap, losses_plain;
  for (int it = 0; it < 5; ++it) {
    if (it == 1) {
      const int target = overlap.r->forwards.load() + 2 * 3;  // runs 1 and 2: 3 microbatches each
      overlap.r->until = [r = overlap.r.get(), target] { return r->forwards.load() >= target; };
      overlap.r->hold = true;
    }
    losses_overlap.push_back(overlap.fb(it));
    if (it == 1) {
      EXPECT_TRUE(overlap.r->hold.load() || overlap.r->holding.load());  // returned, backward not done
    }
    overlap.step();
    losses_plain.push_back(plain.fb(it));
    plain.step();
  }
  overlap.rp->synchronize();
  plain.rp->synchronize();
  EXPECT_FALSE(overlap.r->timed_out.load()) << "the next iteration's forward stage did not run while the previous "
                                               "backward stage was held";
  EXPECT_FALSE(overlap.r->hold.load());  // the hold happened
  expect_lists_equal(losses_overlap, losses_plain, "loss");
  expect_lists_equal(values(overlap.rp->parameters()), values(plain.rp->parameters()), "parameter");
  expect_lists_equal(values(overlap.rp->optim_parameters()), values(plain.rp->optim_parameters()), "master");
}

// Each reader of gradients or parameters waits for the held backward (released after 200 ms):
// parameters(), module(), a sync step, synchronize() and the next forward_backward's gradients
// equal those of the loop without overlap.
TEST(OverlapTest, EveryReaderWaitsForTheTail) {
  Rig overlap(true), plain(false);
  auto hold_for_200ms = [&] {
    const auto t0 = Clock::now();
    overlap.r->until = [t0] { return Clock::now() - t0 > std::chrono::milliseconds(200); };
    overlap.r->hold = true;
  };
  int it = 0;
  auto both_fb = [&] {
    overlap.fb(it);
    plain.fb(it);
    ++it;
  };
  // parameters(): the gradients of the held run.
  hold_for_200ms();
  both_fb();
  expect_lists_equal(overlap.grads(), plain.grads(), "parameters() grads");
  // module(): gradients accumulated over two calls, the second one held.
  both_fb();
  hold_for_200ms();
  both_fb();
  {
    std::vector<torch::Tensor> a, b;
    for (const auto& p : overlap.rp->module()->parameters()) a.push_back(p.grad().clone());
    for (const auto& p : plain.rp->module()->parameters()) b.push_back(p.grad().clone());
    expect_lists_equal(a, b, "module() grads");
  }
  // A sync step moves the held run's gradients.
  hold_for_200ms();
  both_fb();
  overlap.step(StepMode::kSync);
  plain.step(StepMode::kSync);
  expect_lists_equal(values(overlap.rp->parameters()), values(plain.rp->parameters()), "after a sync step");
  // An async step, then synchronize().
  hold_for_200ms();
  both_fb();
  overlap.step();
  plain.step();
  overlap.rp->synchronize();
  plain.rp->synchronize();
  EXPECT_FALSE(overlap.r->holding.load());
  expect_lists_equal(values(overlap.rp->parameters()), values(plain.rp->parameters()), "after synchronize");
  EXPECT_FALSE(overlap.r->timed_out.load());
}

// A backward stage that fails after forward_backward returned: the call returned the loss, the
// async step queued behind it skips its step function, the next sync point rethrows the error
// naming the stage (once), the failed run's gradients are dropped, and the model trains on.
TEST(OverlapTest, TailError_NextCallRethrows_StepSkipped_ModelUsable) {
  Rig rig(true);
  rig.fb(0);
  rig.step();
  rig.rp->synchronize();
  const auto before = values(rig.rp->optim_parameters());

  std::atomic<bool> queued{false};
  rig.r->until = [&queued] { return queued.load(); };
  rig.r->hold = true;  // the backward fails once the step is queued
  rig.r->fail = true;
  const torch::Tensor loss = rig.fb(1);  // the forward and fused stages succeed
  EXPECT_TRUE(torch::isfinite(loss).item<bool>());
  std::atomic<bool> ran{false};
  rig.rp->step([&] { ran = true; });
  queued = true;
  try {
    rig.rp->synchronize();  // a sync point: waits for the tail (an entry point only checks)
    ADD_FAILURE() << "expected the backward error at the next sync point";
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    EXPECT_NE(msg.find("RoundPipe 'overlap': backward stage [0, 3)"), std::string::npos) << msg;
    EXPECT_NE(msg.find("injected backward failure"), std::string::npos) << msg;
  }
  rig.r->fail = false;
  rig.rp->synchronize();  // the error was reported once
  EXPECT_FALSE(ran.load()) << "the step function of a failed run ran";
  for (const auto& p : rig.rp->module()->parameters()) EXPECT_FALSE(p.grad().defined());
  expect_lists_equal(values(rig.rp->optim_parameters()), before, "masters after the skipped step");

  const torch::Tensor next = rig.fb(3);
  rig.step();
  rig.rp->synchronize();
  EXPECT_TRUE(torch::isfinite(next).item<bool>());
  for (const auto& p : rig.rp->optim_parameters()) EXPECT_TRUE(torch::isfinite(p).all().item<bool>());
}

// Recompute ahead (Note [Recompute ahead] in stage_jobs.cpp): a backward stage recomputes a
// microbatch before its gradient arrives. The fused tail's backward through WaitForRecompute
// holds microbatch 0's gradient until the backward stage has recomputed microbatch 0 (its
// RecomputeCounter ran with grad enabled): only possible if the recompute did not wait for that
// gradient (else the two wait for each other until the 20 s deadline).
struct RecomputeCounterImpl : torch::nn::Cloneable<RecomputeCounterImpl> {
  explicit RecomputeCounterImpl(std::shared_ptr<std::atomic<int>> n) : n_(std::move(n)) {}
  void reset() override {}
  torch::Tensor forward(const torch::Tensor& x) {
    if (torch::GradMode::is_enabled()) n_->fetch_add(1);  // a recompute (forward stages run no-grad)
    return x;
  }
  std::shared_ptr<std::atomic<int>> n_;
};
TORCH_MODULE(RecomputeCounter);

TEST(OverlapTest, BackwardStageRecomputesBeforeItsGradientArrives) {
  auto run = [](RecomputeGrain grain, bool hold) {
    auto recomputes = std::make_shared<std::atomic<int>>(0);
    auto r = std::make_shared<Rendezvous>();
    r->until = [recomputes] { return recomputes->load() >= 1; };
    r->hold = hold;
    torch::manual_seed(12);
    torch::nn::Sequential model(torch::nn::Linear(8, 16), RecomputeCounter(recomputes), torch::nn::Tanh(),
                                torch::nn::Linear(16, 16), RendezvousLayer(r), torch::nn::Linear(16, 4));
    RoundPipe rp(model, RoundPipeOptions().devices({c10::kCPU, c10::kCPU}).name("ahead"));
    RunConfig cfg;
    cfg.num_microbatch = 3;
    cfg.recompute_grain = grain;
    cfg.execute_plan = scheduler::ExecutePlan({{0, 3}}, {{3, 6}, {0, 3}});  // F d0, fused d1, B [0, 3) d0
    torch::manual_seed(5);
    auto x = torch::randn({6, 8}), y = torch::randn({6, 4});
    auto loss = rp.forward_backward({x}, y, [](const torch::Tensor& o, const torch::Tensor& t) { return torch::mse_loss(o, t); },
                                    cfg);
    rp.synchronize();
    EXPECT_FALSE(r->timed_out.load()) << "the backward stage waited for microbatch 0's gradient before recomputing it";
    EXPECT_FALSE(r->hold.load());
    EXPECT_EQ(recomputes->load(), 3);  // one recompute per microbatch
    std::vector<torch::Tensor> out{loss};
    for (const auto& p : rp.parameters()) out.push_back(p.grad().clone());
    return out;
  };
  const auto ahead = run(RecomputeGrain::kStage, /*hold=*/true);
  // The layer grain awaits the gradient first; its results are bitwise the same.
  expect_lists_equal(ahead, run(RecomputeGrain::kLayer, /*hold=*/false), "loss and gradients");
}

}  // namespace
}  // namespace roundpipe
