// Small models for engine tests: an MLP and transformer blocks (attention + MLP + LayerNorm).
#pragma once

#include <torch/torch.h>

#include <atomic>
#include <functional>
#include <memory>
#include <random>
#include <vector>

namespace roundpipe::testing {

/// Pre-norm transformer block on [batch, seq, embed] activations, with optional dropout.
struct BlockImpl : torch::nn::Cloneable<BlockImpl> {
  BlockImpl(int64_t embed, int64_t heads, double dropout) : embed_(embed), heads_(heads), dropout_(dropout) { reset(); }
  void reset() override {
    ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({embed_})));
    attn = register_module("attn", torch::nn::MultiheadAttention(torch::nn::MultiheadAttentionOptions(embed_, heads_)));
    ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({embed_})));
    fc1 = register_module("fc1", torch::nn::Linear(embed_, 2 * embed_));
    fc2 = register_module("fc2", torch::nn::Linear(2 * embed_, embed_));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = ln1(x).transpose(0, 1);  // [seq, batch, embed]
    auto a = std::get<0>(attn(h, h, h)).transpose(0, 1);
    auto y = x + torch::dropout(a, dropout_, is_training());
    auto m = fc2(torch::gelu(fc1(ln2(y))));
    return y + torch::dropout(m, dropout_, is_training());
  }
  int64_t embed_, heads_;
  double dropout_;
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  torch::nn::MultiheadAttention attn{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Block);

/// A layer that, while `*fail` is true, throws in forward stages (no-grad forwards) on every `period`-th call starting
/// with call `fail_at` (0-based; e.g. period 3, fail_at 2: the third microbatch of each call). Clones share the flag
/// and the counter.
struct FaultyImpl : torch::nn::Cloneable<FaultyImpl> {
  explicit FaultyImpl(std::shared_ptr<std::atomic<bool>> fail, int64_t period = 1, int64_t fail_at = 0)
      : fail_(std::move(fail)), calls_(std::make_shared<std::atomic<int64_t>>(0)), period_(period), fail_at_(fail_at) {}
  void reset() override {}
  torch::Tensor forward(const torch::Tensor& x) {
    if (torch::GradMode::is_enabled()) return x;  // recompute / fused: never fails, not counted
    const int64_t call = calls_->fetch_add(1);
    TORCH_CHECK(!(fail_->load() && call % period_ == fail_at_), "injected failure");
    return x;
  }
  std::shared_ptr<std::atomic<bool>> fail_;
  std::shared_ptr<std::atomic<int64_t>> calls_;
  int64_t period_, fail_at_;
};
TORCH_MODULE(Faulty);

/// `n` CPU devices.
inline std::vector<c10::Device> cpu_devices(int n) { return std::vector<c10::Device>(n, c10::Device(c10::kCPU)); }

/// Sum-reduced MSE over a microbatch divided by the full batch's element count: the sum over
/// microbatches equals the full-batch mean loss.
inline std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&)> mse_over(int64_t full_numel) {
  return [full_numel](const torch::Tensor& out, const torch::Tensor& y) {
    return torch::mse_loss(out, y, torch::Reduction::Sum) / static_cast<double>(full_numel);
  };
}

inline torch::nn::Sequential make_mlp(int64_t seed) {
  torch::manual_seed(seed);
  return torch::nn::Sequential(torch::nn::Linear(8, 16), torch::nn::Tanh(), torch::nn::Linear(16, 16),
                               torch::nn::Tanh(), torch::nn::Linear(16, 4));
}

inline torch::nn::Sequential make_transformer(int64_t seed, double dropout) {
  torch::manual_seed(seed);
  return torch::nn::Sequential(Block(16, 2, dropout), Block(16, 2, dropout), Block(16, 2, dropout),
                               torch::nn::Linear(16, 4));
}

inline torch::nn::Sequential deep_copy(const torch::nn::Sequential& model) {
  torch::nn::Sequential copy(std::dynamic_pointer_cast<torch::nn::SequentialImpl>(model->clone()));
  // Cloneable::clone() leaves every parameter trainable (reset() makes them, set_data keeps it).
  auto from = model->parameters(), to = copy->parameters();
  for (size_t k = 0; k < from.size(); ++k) to[k].requires_grad_(from[k].requires_grad());
  return copy;
}

/// `layers` Linear layers from `in` to `out` features with random hidden widths in
/// [1, max_width] (drawn from `width_seed`) and Tanh between them; weights from `torch_seed`.
inline torch::nn::Sequential random_mlp(uint32_t width_seed, int64_t torch_seed, int64_t in, int64_t out, int layers,
                                        int64_t max_width) {
  std::mt19937 rng(width_seed);
  std::uniform_int_distribution<int64_t> width(1, max_width);
  torch::manual_seed(torch_seed);
  torch::nn::Sequential model;
  for (int l = 0; l < layers; ++l) {
    const int64_t next = l == layers - 1 ? out : width(rng);
    model->push_back(torch::nn::Linear(in, next));
    if (l != layers - 1) model->push_back(torch::nn::Tanh());
    in = next;
  }
  return model;
}

/// The staleness-one reference of DESIGN.md §3: compute model C (forward/backward) and master
/// model M (optimizer, made by `make_optimizer` over M's parameters). Step k: C <- M (values after
/// step k-1), M.grad <- grads of iteration k, optimizer step on M. At the end C <- M.
struct StaleReference {
  torch::nn::Sequential compute, master;
  std::unique_ptr<torch::optim::Optimizer> opt;
  StaleReference(
      const torch::nn::Sequential& initial,
      const std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<torch::Tensor>)>& make_optimizer)
      : compute(deep_copy(initial)), master(deep_copy(initial)), opt(make_optimizer(master->parameters())) {}
  /// One iteration with `loss_fn` over the whole batch; returns the loss.
  torch::Tensor iterate(const torch::Tensor& x, const torch::Tensor& y,
                        const std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&)>& loss_fn) {
    auto loss = loss_fn(compute->forward(x), y);
    loss.backward();
    torch::NoGradGuard no_grad;
    auto cp = compute->parameters();
    auto mp = master->parameters();
    for (size_t k = 0; k < cp.size(); ++k) {
      cp[k].copy_(mp[k]);
      if (!cp[k].grad().defined()) continue;  // frozen
      mp[k].mutable_grad() = cp[k].grad().clone();
      cp[k].mutable_grad().reset();
    }
    opt->step();
    opt->zero_grad();
    return loss.detach();
  }
  void synchronize() {
    torch::NoGradGuard no_grad;
    auto cp = compute->parameters();
    auto mp = master->parameters();
    for (size_t k = 0; k < cp.size(); ++k) cp[k].copy_(mp[k]);
  }
};

/// Identity whose backward multiplies the gradient by `*poison` (1, inf or nan), read at each
/// forward: tests switch a model's gradients to inf/NaN and back (GradScaler, fault injection).
struct PoisonFn : torch::autograd::Function<PoisonFn> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, torch::Tensor x, double poison) {
    ctx->saved_data["poison"] = poison;
    return x.clone();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list g) {
    return {g[0] * ctx->saved_data["poison"].toDouble(), torch::Tensor()};
  }
};

struct PoisonImpl : torch::nn::Cloneable<PoisonImpl> {
  explicit PoisonImpl(std::shared_ptr<std::atomic<double>> poison) : poison_(std::move(poison)) {}
  void reset() override {}
  torch::Tensor forward(const torch::Tensor& x) { return PoisonFn::apply(x, poison_->load()); }
  std::shared_ptr<std::atomic<double>> poison_;
};
TORCH_MODULE(Poison);

}  // namespace roundpipe::testing
