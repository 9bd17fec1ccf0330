#include "roundpipe/detail/layer_shells.h"

#include <ATen/ATen.h>

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

torch::nn::AnyModule LayerShells::acquire(int64_t l) {
  torch::nn::AnyModule shell;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (free_.size() < layers_->size()) free_.resize(layers_->size());
    auto& free = free_[l];
    if (!free.empty()) {
      shell = std::move(free.back());
      free.pop_back();
    }
  }
  const auto& layer = (*layers_)[l];
  if (shell.is_empty()) {
    run_rng_isolated([&] { shell = layer.clone(); });
    empty_tensors(*shell.ptr());
  }
  shell.ptr()->train(layer.ptr()->is_training());
  return shell;
}

void LayerShells::release(int64_t l, torch::nn::AnyModule shell) noexcept {
  try {
    empty_tensors(*shell.ptr());
    std::lock_guard<std::mutex> lock(mutex_);
    free_[l].push_back(std::move(shell));
  } catch (...) {
    // A shell that cannot be emptied is dropped (the next job clones a new one).
  }
}

}  // namespace roundpipe::detail
