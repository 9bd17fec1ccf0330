// DESIGN.md's typical loop, compiled and run: fp16 compute copies, fp32 master weights,
// roundpipe::optim::Adam on the CPU, the asynchronous step, and an amp::GradScaler whose scale()
// runs on the device workers, step() on the optimizer thread and update() here. On a GPU machine
// leave devices() unset (every visible GPU); here it uses CPU device workers. Prints the loss and
// the scale, and returns non-zero unless the loss went down.
// Usage: train_fp16 [iterations=150] [num_devices=3]
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>

#include "roundpipe/roundpipe.h"

int main(int argc, char** argv) {
  namespace rp = roundpipe;
  const int iterations = argc > 1 ? std::atoi(argv[1]) : 150;
  const int num_devices = argc > 2 ? std::atoi(argv[2]) : 3;
  torch::manual_seed(0);
  const int64_t batch = 256, num_microbatch = num_devices + 1;

  torch::nn::Sequential net(torch::nn::Linear(16, 64), torch::nn::GELU(), torch::nn::Linear(64, 64),
                            torch::nn::GELU(), torch::nn::Linear(64, 1));
  net->to(torch::kHalf);  // compute copies in fp16
  rp::RoundPipe model(net, rp::RoundPipeOptions()
                               .optim_dtype(torch::kFloat)  // fp32 masters
                               .devices(std::vector<c10::Device>(num_devices, c10::kCPU)));
  auto optimizer = [&] {
    rp::OptimizerCtx ctx;
    return rp::optim::Adam(model.parameters(), rp::optim::AdamOptions(1e-3));
  }();
  rp::amp::GradScaler scaler;
  rp::RunConfig cfg;
  cfg.num_microbatch = num_microbatch;

  // Synthetic task: y = sin(sum(x)).
  auto x = torch::randn({batch, 16});
  auto y = torch::sin(x.sum(1, true));
  double first = 0, last = 0;
  for (int it = 0; it < iterations; ++it) {
    auto loss = model.forward_backward({x.to(torch::kHalf)}, y,
        [&](const torch::Tensor& out, const torch::Tensor& target) {
          // mean over the microbatch's rows / num_microbatch: the sum over microbatches is the mean
          return scaler.scale(torch::mse_loss(out.to(torch::kFloat), target)) / static_cast<double>(num_microbatch);
        }, cfg);
    const double loss_value = loss.item<double>() / scaler.get_scale();  // read before update()
    model.step([&] {
      scaler.step(optimizer);
      optimizer.zero_grad();
    });
    scaler.update();
    if (it == 0) first = loss_value;
    last = loss_value;
    if (it % 50 == 0 || it == iterations - 1) {
      std::printf("iter %d loss %.5f scale %.0f\n", it, loss_value, scaler.get_scale());
    }
  }
  model.synchronize();
  std::printf("loss %.5f -> %.5f (%s)\n", first, last, last < first ? "trained" : "did not improve");
  return last < first ? 0 : 1;
}
