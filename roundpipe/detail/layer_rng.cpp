#include "roundpipe/detail/layer_rng.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/equal.h>

#include <map>
#include <mutex>
#include <optional>

#include "base/config.h"
#include "roundpipe/layer_seed.h"
#if ROUNDPIPE_WITH_CUDA
#include <ATen/cuda/CUDAGeneratorImpl.h>
#endif

namespace roundpipe {

// Note [Layer RNG]:
// Every layer's forward on a microbatch runs with its device's default generator seeded with
// layer_seed(base seed, iteration, microbatch index, layer index), and the generator's previous
// state is restored afterwards. Recompute seeds the same way, so it replays the forward's dropout
// masks, whichever device or thread runs it and whatever the grain: results are independent of
// the device count for a fixed num_microbatch. A plain loop reproduces it by calling
// torch::manual_seed(layer_seed(...)) before each layer. The cost on CPU devices: they share one
// generator, so seeded layer forwards are serialized by a mutex (set preserve_rng_state=false to
// run CPU workers fully in parallel, without deterministic dropout).

namespace {

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace

uint64_t layer_seed(uint64_t base_seed, int64_t iteration, int64_t microbatch, int64_t layer) {
  uint64_t h = splitmix64(base_seed);
  h = splitmix64(h ^ static_cast<uint64_t>(iteration));
  h = splitmix64(h ^ static_cast<uint64_t>(microbatch));
  h = splitmix64(h ^ static_cast<uint64_t>(layer));
  return h >> 1;  // keep it representable as a non-negative int64 (Python's manual_seed range)
}

}  // namespace roundpipe

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

// What a draw changes in a generator (the caller holds gen.mutex()). CPU: the engine and the
// cached normal samples, compared without serializing them (get_state() builds a 5 KB tensor,
// which per layer and microbatch showed in the dispatch overhead); other devices: get_state().
struct GeneratorMark {
  std::optional<at::mt19937_data_pod> engine;
  std::optional<float> next_float;
  std::optional<double> next_double;
  at::Tensor state;

  static GeneratorMark of(at::Generator& gen) {
    GeneratorMark m;
    if (gen.device().is_cpu()) {
      auto* cpu = gen.get<at::CPUGeneratorImpl>();
      m.engine = cpu->engine().data();
      m.next_float = cpu->next_float_normal_sample();
      m.next_double = cpu->next_double_normal_sample();
    } else {
      m.state = gen.get_state();
    }
    return m;
  }
  bool same_as(const GeneratorMark& o) const {
    if (engine) {
      return o.engine && engine->seed_ == o.engine->seed_ && engine->left_ == o.engine->left_ &&
             engine->seeded_ == o.engine->seeded_ && engine->next_ == o.engine->next_ &&
             engine->state_ == o.engine->state_ && next_float == o.next_float && next_double == o.next_double;
    }
    return state.defined() && o.state.defined() && at::equal(state, o.state);
  }
};

// Returns whether `fn` drew from the generator (its state after `fn` differs from before).
bool run_on_generator(const c10::Device& device, std::optional<uint64_t> seed, const std::function<void()>& fn) {
  std::lock_guard<std::mutex> hold(generator_mutex(device));
  at::Generator gen = default_generator(device);
  at::Tensor saved;
  GeneratorMark start;
  {
    std::lock_guard<std::mutex> lock(gen.mutex());
    saved = gen.get_state();
    if (seed) gen.set_current_seed(*seed);
    start = GeneratorMark::of(gen);
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
  std::lock_guard<std::mutex> lock(gen.mutex());
  return !GeneratorMark::of(gen).same_as(start);
}

}  // namespace

bool run_seeded(const c10::Device& device, uint64_t seed, const std::function<void()>& fn) {
  return run_on_generator(device, seed, fn);
}

bool run_noting_draws(const c10::Device& device, const std::function<void()>& fn) {
  at::Generator gen = default_generator(device);
  GeneratorMark before;
  {
    std::lock_guard<std::mutex> lock(gen.mutex());
    before = GeneratorMark::of(gen);
  }
  fn();
  std::lock_guard<std::mutex> lock(gen.mutex());
  return !GeneratorMark::of(gen).same_as(before);
}

void run_rng_isolated(const std::function<void()>& fn) { run_on_generator(c10::Device(c10::kCPU), std::nullopt, fn); }

}  // namespace roundpipe::detail
