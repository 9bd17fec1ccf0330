#include "roundpipe/detail/layer_shells.h"

#include <ATen/ATen.h>

#include <algorithm>

#include "roundpipe/detail/layer_rng.h"

namespace roundpipe::detail {
namespace {

// Swaps every parameter and buffer of `module` (recursively) for an empty CPU tensor of its dtype.
void empty_tensors(torch::nn::Module& module) {
  at::NoGradGuard no_grad;
  for (auto& p : module.parameters()) {
    if (p.grad().defined()) p.mutable_grad().reset();
    p.set_data(at::empty({0}, p.options().device(c10::kCPU).requires_grad(false)));
  }
  for (auto& b : module.buffers()) b.set_data(at::empty({0}, b.options().device(c10::kCPU).requires_grad(false)));
}

}  // namespace

void LayerShells::resize_locked() {
  if (free_.size() < layers_->size()) {
    free_.resize(layers_->size());
    out_.resize(layers_->size(), 0);
    waiting_.resize(layers_->size());
  }
}

// A new shell of layer l; out_[l] already counts it. On failure it is uncounted.
torch::nn::AnyModule LayerShells::clone(int64_t l) {
  const auto& layer = (*layers_)[l];
  torch::nn::AnyModule shell;
  try {
    run_rng_isolated([&] { shell = layer.clone(); });
    empty_tensors(*shell.ptr());
  } catch (...) {
    std::lock_guard<std::mutex> lock(mutex_);
    drop_lease_locked(l);
    throw;
  }
  return shell;
}

void LayerShells::drop_lease_locked(int64_t l) {
  --out_[l];
  auto& waiting = waiting_[l];
  while (static_cast<int64_t>(waiting.size()) > out_[l]) {
    waiting.back()->ready = true;  // with no shell: its taker clones
    waiting.pop_back();
    ++out_[l];
  }
  released_.notify_all();
}

torch::nn::AnyModule LayerShells::acquire(int64_t l) {
  torch::nn::AnyModule shell;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    resize_locked();
    ++out_[l];
    auto& free = free_[l];
    if (!free.empty()) {
      shell = std::move(free.back());
      free.pop_back();
    }
  }
  return ready(l, std::move(shell));
}

// `shell` (a new clone when empty, which out_[l] already counts) in the layer's training mode.
torch::nn::AnyModule LayerShells::ready(int64_t l, torch::nn::AnyModule shell) {
  if (shell.is_empty()) shell = clone(l);
  shell.ptr()->train((*layers_)[l].ptr()->is_training());
  return shell;
}

void LayerShells::release(int64_t l, torch::nn::AnyModule shell) noexcept {
  try {
    empty_tensors(*shell.ptr());
    std::lock_guard<std::mutex> lock(mutex_);
    auto& waiting = waiting_[l];
    if (!waiting.empty()) {  // still out: now the claim's
      waiting.front()->shell = std::move(shell);
      waiting.front()->ready = true;
      waiting.pop_front();
      released_.notify_all();
      return;
    }
    --out_[l];
    free_[l].push_back(std::move(shell));
  } catch (...) {
    // A shell that cannot be emptied is dropped (the next job clones a new one).
    std::lock_guard<std::mutex> lock(mutex_);
    drop_lease_locked(l);
  }
}

std::shared_ptr<LayerShells::ClaimState> LayerShells::claim(int64_t l) {
  auto state = std::make_shared<ClaimState>();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    resize_locked();
    // A shell that is out first: a free one is for this run's forward jobs, which come before the
    // claimant and would otherwise clone.
    if (out_[l] > static_cast<int64_t>(waiting_[l].size())) {
      waiting_[l].push_back(state);
      return state;
    }
    ++out_[l];
    auto& free = free_[l];
    if (!free.empty()) {
      state->shell = std::move(free.back());
      free.pop_back();
      state->ready = true;
      return state;
    }
  }
  state->shell = clone(l);
  state->ready = true;  // not shared with anyone yet
  return state;
}

torch::nn::AnyModule LayerShells::take(int64_t l, const std::shared_ptr<ClaimState>& claim) {
  torch::nn::AnyModule shell;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    released_.wait(lock, [&] { return claim->ready; });
    shell = std::move(claim->shell);
  }
  return ready(l, std::move(shell));  // empty: counted when the claim was made ready
}

void LayerShells::abandon(int64_t l, const std::shared_ptr<ClaimState>& claim) noexcept {
  torch::nn::AnyModule shell;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!claim->ready) {
      auto& waiting = waiting_[l];
      const auto it = std::find(waiting.begin(), waiting.end(), claim);
      if (it != waiting.end()) waiting.erase(it);
      return;
    }
    shell = std::move(claim->shell);
    if (shell.is_empty()) {
      drop_lease_locked(l);
      return;
    }
  }
  release(l, std::move(shell));
}

}  // namespace roundpipe::detail
