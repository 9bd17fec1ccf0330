// Layers that fail on command, for the fault-injection tests: an identity that throws in a
// no-grad forward, in a grad-mode forward (recompute) or in its backward; one that emits inf/NaN
// gradients; one that blocks until released (to hold a call open while another thread calls in).
#pragma once

#include <torch/torch.h>

#include <atomic>
#include <chrono>
#include <future>
#include <memory>

#include "tests/roundpipe/test_models.h"  // Poison

namespace roundpipe::testing {

/// Where an InjectImpl throws while armed.
enum class InjectAt : int { kNone = 0, kForward = 1, kRecompute = 2, kBackward = 3 };

struct InjectBackwardFn : torch::autograd::Function<InjectBackwardFn> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, torch::Tensor x, bool fail) {
    ctx->saved_data["fail"] = fail;
    return x.clone();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list g) {
    TORCH_CHECK(!ctx->saved_data["fail"].toBool(), "injected backward failure");
    return {g[0], torch::Tensor()};
  }
};

/// Identity that throws where `*mode` says: kForward in no-grad forwards (forward stages),
/// kRecompute in grad-mode forwards (recompute in backward stages), kBackward in its backward.
/// Clones share the mode.
struct InjectImpl : torch::nn::Cloneable<InjectImpl> {
  explicit InjectImpl(std::shared_ptr<std::atomic<int>> mode) : mode_(std::move(mode)) {}
  void reset() override {}
  torch::Tensor forward(const torch::Tensor& x) {
    const auto mode = static_cast<InjectAt>(mode_->load());
    const bool grad = torch::GradMode::is_enabled();
    TORCH_CHECK(!(mode == InjectAt::kForward && !grad), "injected forward failure");
    TORCH_CHECK(!(mode == InjectAt::kRecompute && grad), "injected recompute failure");
    return InjectBackwardFn::apply(x, mode == InjectAt::kBackward);
  }
  std::shared_ptr<std::atomic<int>> mode_;
};
TORCH_MODULE(Inject);

/// Shared by a GateImpl and its clones: the first no-grad forward announces itself on `entered`
/// and then waits (at most 60 s, then throws) for `release`.
struct GateState {
  std::promise<void> entered;
  std::promise<void> release;
  std::shared_future<void> released{release.get_future().share()};
  std::atomic<bool> armed{true};
};

struct GateImpl : torch::nn::Cloneable<GateImpl> {
  explicit GateImpl(std::shared_ptr<GateState> state) : state_(std::move(state)) {}
  void reset() override {}
  torch::Tensor forward(const torch::Tensor& x) {
    if (!torch::GradMode::is_enabled() && state_->armed.exchange(false)) {
      state_->entered.set_value();
      TORCH_CHECK(state_->released.wait_for(std::chrono::seconds(60)) == std::future_status::ready,
                  "gate never released");
    }
    return x;
  }
  std::shared_ptr<GateState> state_;
};
TORCH_MODULE(Gate);

}  // namespace roundpipe::testing
