// Trains a small MLP on a synthetic regression task and prints the execution plan RoundPipe's
// scheduler chooses for it. Usage: train_mlp [iterations] [num_devices]
#include <torch/torch.h>

#include <cstdlib>
#include <iostream>

#include "roundpipe/roundpipe.h"

int main(int argc, char** argv) {
  const int iterations = argc > 1 ? std::atoi(argv[1]) : 200;
  const int64_t num_devices = argc > 2 ? std::atoll(argv[2]) : 3;
  torch::manual_seed(0);

  torch::nn::Sequential model(torch::nn::Linear(16, 64), torch::nn::GELU(), torch::nn::Linear(64, 64),
                              torch::nn::GELU(), torch::nn::Linear(64, 64), torch::nn::GELU(),
                              torch::nn::Linear(64, 1));

  // Plan: size-based estimates per layer, min_stages = number of devices.
  std::vector<int64_t> bytes, grad_bytes;
  for (const auto& layer : model->children()) {
    int64_t b = 0;
    for (const auto& p : layer->parameters()) b += p.numel() * static_cast<int64_t>(p.element_size());
    bytes.push_back(b);
    grad_bytes.push_back(b);
  }
  namespace rs = roundpipe::scheduler;
  auto plan = rs::partition(rs::size_based_costs(bytes, grad_bytes), rs::RunType::kFused,
                            rs::PartitionOptions().set_min_stages(num_devices));
  std::cout << "plan for " << bytes.size() << " layers on " << num_devices << " devices: " << plan.to_string()
            << "\n";
  for (const auto& job : rs::dispatch_order(plan, rs::RunType::kFused, num_devices)) {
    std::cout << "  " << rs::to_string(job.phase) << " layers " << job.layers.to_string() << " -> device "
              << job.device << "\n";
  }

  // Synthetic task: y = sin(sum(x)).
  auto x = torch::randn({512, 16});
  auto y = torch::sin(x.sum(1, true));
  torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(1e-3));
  double first = 0, last = 0;
  for (int it = 0; it < iterations; ++it) {
    optimizer.zero_grad();
    auto loss = torch::mse_loss(model->forward(x), y);
    loss.backward();
    optimizer.step();
    last = loss.item<double>();
    if (it == 0) first = last;
    if (it % 50 == 0 || it == iterations - 1) std::cout << "iter " << it << " loss " << last << "\n";
  }
  std::cout << "loss " << first << " -> " << last << (last < first ? " (trained)" : " (did not improve)") << "\n";
  return last < first ? 0 : 1;
}
