// The main example (scripts/train.sh): trains a small MLP with RoundPipe on CPU device workers,
// printing the execution plan, then checks the loss went down.
// Usage: train_mlp [iterations] [num_devices]
#include <torch/torch.h>

#include <cstdlib>
#include <iostream>

#include "roundpipe/roundpipe.h"

int main(int argc, char** argv) {
  using namespace roundpipe;
  const int iterations = argc > 1 ? std::atoi(argv[1]) : 200;
  const int num_devices = argc > 2 ? std::atoi(argv[2]) : 3;
  torch::manual_seed(0);

  torch::nn::Sequential net(torch::nn::Linear(16, 64), torch::nn::GELU(), torch::nn::Linear(64, 64),
                            torch::nn::GELU(), torch::nn::Linear(64, 64), torch::nn::GELU(),
                            torch::nn::Linear(64, 1));
  // CPU devices are real workers (one thread each); on a GPU machine leave devices() unset to use
  // every visible GPU.
  RoundPipe model(net, RoundPipeOptions().devices(std::vector<c10::Device>(num_devices, c10::kCPU)).name("mlp"));
  std::cout << "plan for " << model.num_layers() << " layers on " << num_devices
            << " devices: " << model.plan().to_string() << "\n";
  for (const auto& job : scheduler::dispatch_order(model.plan(), scheduler::RunType::kFused, num_devices)) {
    std::cout << "  " << scheduler::to_string(job.phase) << " layers " << job.layers.to_string() << " -> device "
              << job.device << "\n";
  }
  auto optimizer = [&] {
    OptimizerCtx ctx;
    return optim::Adam(model.parameters(), optim::AdamOptions(1e-3));
  }();

  // Synthetic task: y = sin(sum(x)).
  auto x = torch::randn({512, 16});
  auto y = torch::sin(x.sum(1, true));
  const auto loss_fn = [n = y.numel()](const torch::Tensor& out, const torch::Tensor& target) {
    return torch::mse_loss(out, target, torch::Reduction::Sum) / static_cast<double>(n);
  };
  double first = 0, last = 0;
  for (int it = 0; it < iterations; ++it) {
    last = model.forward_backward({x}, y, loss_fn).item<double>();
    model.step([&] {
      optimizer.step();
      optimizer.zero_grad();
    });
    if (it == 0) first = last;
    if (it % 50 == 0 || it == iterations - 1) std::cout << "iter " << it << " loss " << last << "\n";
  }
  model.synchronize();
  std::cout << "loss " << first << " -> " << last << (last < first ? " (trained)" : " (did not improve)") << "\n";
  return last < first ? 0 : 1;
}
