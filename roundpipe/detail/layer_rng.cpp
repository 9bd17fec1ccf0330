#include "roundpipe/detail/layer_rng.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

#include <map>
#include <mutex>
#include <optional>

#include "roundpipe/config.h"
#if ROUNDPIPE_WITH_CUDA
#include <ATen/cuda/CUDAGeneratorImpl.h>
#endif

namespace roundpipe::detail {
namespace {

// One mutex per generator: held while a seeded layer runs (the generator's own mutex cannot be
// held that long, since sampling kernels lock it).
std::mutex& generator_mutex(const c10::Device& device) {
  static std::mutex cpu_mutex;
  static std::mutex map_mutex;
  static std::map<int, std::mutex> cuda_mutexes;
  if (device.is_cpu()) return cpu_mutex;
  std::lock_guard<std::mutex> lock(map_mutex);
  return cuda_mutexes[device.index()];
}

at::Generator default_generator(const c10::Device& device) {
#if ROUNDPIPE_WITH_CUDA
  if (device.is_cuda()) return at::cuda::detail::getDefaultCUDAGenerator(device.index());
#endif
  TORCH_CHECK(device.is_cpu(), "no default generator for device ", device);
  return at::detail::getDefaultCPUGenerator();
}

void run_on_generator(const c10::Device& device, std::optional<uint64_t> seed, const std::function<void()>& fn) {
  std::lock_guard<std::mutex> hold(generator_mutex(device));
  at::Generator gen = default_generator(device);
  at::Tensor saved;
  {
    std::lock_guard<std::mutex> lock(gen.mutex());
    saved = gen.get_state();
    if (seed) gen.set_current_seed(*seed);
  }
  struct Restore {
    at::Generator& gen;
    at::Tensor& saved;
    ~Restore() {
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(saved);
    }
  } restore{gen, saved};
  fn();
}

}  // namespace

void run_seeded(const c10::Device& device, uint64_t seed, const std::function<void()>& fn) {
  run_on_generator(device, seed, fn);
}

void run_rng_isolated(const std::function<void()>& fn) { run_on_generator(c10::Device(c10::kCPU), std::nullopt, fn); }

}  // namespace roundpipe::detail
