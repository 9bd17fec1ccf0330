// Mixed-precision training in a plain LibTorch loop with roundpipe::amp: autocast (bf16 on CPU,
// fp16 on a GPU when one is visible) plus dynamic loss scaling with GradScaler.
// Usage: amp_train [iterations]   (exits 0 only if the loss went down)
#include <torch/torch.h>

#include <cstdlib>
#include <iostream>

#include "amp/autocast_guard.h"
#include "amp/grad_scaler.h"

int main(int argc, char** argv) {
  const int iterations = argc > 1 ? std::atoi(argv[1]) : 200;
  if (iterations < 2) {
    std::cerr << "amp_train: iterations must be >= 2, got " << iterations << "\n";
    return 2;
  }
  torch::manual_seed(0);
  const bool cuda = torch::cuda::is_available();
  const torch::Device device = cuda ? torch::Device(torch::kCUDA, 0) : torch::Device(torch::kCPU);
  const auto autocast_dtype = cuda ? torch::kHalf : torch::kBFloat16;

  // Synthetic regression: y = tanh(x W) v + noise.
  auto w_true = torch::randn({16, 8});
  auto v_true = torch::randn({8, 1});
  auto x = torch::randn({512, 16});
  auto y = torch::tanh(x.matmul(w_true)).matmul(v_true) + 0.01 * torch::randn({512, 1});
  x = x.to(device);
  y = y.to(device);

  torch::nn::Sequential model(torch::nn::Linear(16, 64), torch::nn::Tanh(), torch::nn::Linear(64, 1));
  model->to(device);
  torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(1e-2));
  roundpipe::amp::GradScaler scaler;

  std::cout << "amp_train on " << device << " with " << (cuda ? "fp16" : "bf16") << " autocast, " << iterations
            << " iterations\n";
  double first_loss = 0, last_loss = 0;
  int skipped = 0;
  for (int it = 0; it < iterations; ++it) {
    optimizer.zero_grad();
    torch::Tensor loss;
    {
      roundpipe::amp::AutocastGuard autocast(device.type(), autocast_dtype);
      auto out = model->forward(x);
      loss = torch::mse_loss(out, y);  // autocast runs mse_loss in fp32
    }
    scaler.scale(loss).backward();
    if (!scaler.step(optimizer)) ++skipped;
    const double scale = scaler.get_scale();
    scaler.update();
    const double value = loss.item<double>();
    if (it == 0) first_loss = value;
    last_loss = value;
    if (it % 10 == 0 || it == iterations - 1) {
      std::cout << "iter " << it << "  loss " << value << "  scale " << scale << "\n";
    }
  }
  std::cout << "first loss " << first_loss << ", last loss " << last_loss << ", skipped steps " << skipped << "\n";
  if (!(last_loss < first_loss)) {
    std::cerr << "amp_train: the loss did not decrease\n";
    return 1;
  }
  return 0;
}
