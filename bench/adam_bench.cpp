// Adam step throughput on the CPU: roundpipe::optim::Adam vs torch::optim::Adam / AdamW, ATen's
// fused CPU Adam (at::_fused_adam_) and a STREAM-style triad on the same buffers; and, for
// gradients that arrive in bf16 (RoundPipe's bf16 compute copies), our kernel reading them
// directly vs casting them to fp32 first (what at::_fused_adam_ requires).
//
//   build/bench/adam_bench [--sizes 16,128] [--threads 1,2] [--reps N] [--isa auto|avx2|...]
//
// Bytes counted (no write-allocate, like STREAM): Adam 28 B/param (read p, g, m, v; write p, m, v);
// triad a[i] = b[i] + s*c[i] 12 B/element (16 B really move: the store's line is read first; Adam
// reads every line it writes anyway, so its 28 B are all real). GB/s = bytes / seconds / 1e9.
// 8-bit states (AdamStateDtype::kInt8): read p, g, the two code bytes and two absmax per 256;
// write p, codes, absmax: 16 + 16/256 B/param (14 + 16/256 with bf16 gradients). On an AVX-512
// CPU with VBMI the 8-bit step is also timed with the AVX-512F dequantize ("without VBMI").
// bf16 masters with Kahan compensation (AdamOptions::kahan_sum, bf16 gradients): read p, g, c, m,
// v; write p, c, m, v: 26 B/param.
// Adafactor (not a single pass: torch's two norms need the sums first): a matrix [n / 4096, 4096]
// reads p (its norm), g three times (row sums, column sums, the update's norm), then p and g and
// writes p: 28 B/param; torch.optim.Adafactor on the same shape is timed in Python
// (docs/optimizer.md, "Adafactor").
// The time per implementation is the median of --reps steps after one warm-up step; elements/s
// (G elem/s) = parameters updated per second.
#include <ATen/Parallel.h>
#include <ATen/ops/_fused_adam.h>
#include <torch/torch.h>

#include "optim/adafactor.h"
#include "optim/adam.h"
#include "optim/detail/adam_kernel.h"
#include "optim/detail/parallel_tasks.h"
#include "optim/lion.h"

#if defined(__SSE2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

namespace {

std::vector<int64_t> parse_list(const char* text) {
  std::vector<int64_t> out;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    out.push_back(std::stoll(item));
  }
  return out;
}

double median_seconds(int reps, const std::function<void()>& fn) {
  fn();  // warm-up: first touch, state allocation
  std::vector<double> times;
  for (int r = 0; r < reps; ++r) {
    const auto start = std::chrono::steady_clock::now();
    fn();
    times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

// On as many threads as the optimizer uses (at::get_num_threads()), split the same way.
void triad(float* a, const float* b, const float* c, float s, int64_t n) {
  const int64_t tasks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n >> 20));
  roundpipe::optim::detail::run_tasks(tasks, [&](int64_t task) {
    const int64_t begin = n * task / tasks, end = n * (task + 1) / tasks;
    int64_t i = begin;
#if defined(__SSE2__)
    // Explicit SSE: GCC's -O2 (very cheap cost model) leaves the plain loop scalar, which made
    // the baseline compute-bound (18 GB/s on one core vs 50 GB/s for Adam's vector kernel).
    const __m128 vs = _mm_set1_ps(s);
    for (; i + 4 <= end; i += 4) {
      _mm_storeu_ps(a + i, _mm_add_ps(_mm_loadu_ps(b + i), _mm_mul_ps(vs, _mm_loadu_ps(c + i))));
    }
#endif
    for (; i < end; ++i) {
      a[i] = b[i] + s * c[i];
    }
  });
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int64_t> sizes_m = {16, 128};
  std::vector<int64_t> threads = {1, 2};
  int reps = 5;
  roundpipe::optim::CpuIsa isa = roundpipe::optim::best_cpu_isa();
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--sizes")) {
      sizes_m = parse_list(argv[i + 1]);
    } else if (!std::strcmp(argv[i], "--threads")) {
      threads = parse_list(argv[i + 1]);
    } else if (!std::strcmp(argv[i], "--reps")) {
      reps = std::atoi(argv[i + 1]);
    } else if (!std::strcmp(argv[i], "--isa")) {
      const auto parsed = roundpipe::optim::parse_cpu_isa(argv[i + 1]);
      if (!parsed || !roundpipe::optim::cpu_supports(*parsed)) {
        std::fprintf(stderr, "--isa %s: not an ISA this CPU supports; use auto, scalar, avx2 or avx512\n", argv[i + 1]);
        return 2;
      }
      isa = *parsed;
    } else {
      std::fprintf(stderr, "unknown argument %s\n", argv[i]);
      return 2;
    }
  }
  torch::NoGradGuard no_grad;
  std::printf("%-8s %-7s %-32s %10s %9s %10s %12s\n", "params", "threads", "implementation", "ms/step", "GB/s",
              "G elem/s", "t / t_ours");
  for (int64_t size_m : sizes_m) {
    const int64_t n = size_m << 20;
    torch::manual_seed(0);
    auto p = torch::randn({n});
    auto g = torch::randn({n});
    for (int64_t t : threads) {
      at::set_num_threads(static_cast<int>(t));
      struct Row {
        std::string name;
        double seconds, bytes;
      };
      std::vector<Row> rows;
      const double adam_bytes = 28.0 * n;

      {
        auto m = torch::zeros({n}), v = torch::zeros({n});
        float* a = p.data_ptr<float>();
        const float* b = m.data_ptr<float>();
        const float* c = v.data_ptr<float>();
        rows.push_back(
            {"triad a=b+s*c (12 B/elem)", median_seconds(reps, [&] { triad(a, b, c, 1e-9f, n); }), 12.0 * n});
      }
      {
        auto param = p.clone();
        param.mutable_grad() = g;
        roundpipe::optim::Adam opt({param}, roundpipe::optim::AdamOptions(1e-3));
        opt.set_kernel_isa(isa);
        rows.push_back({std::string("roundpipe Adam (") + roundpipe::optim::cpu_isa_name(opt.kernel_isa()) + ")",
                        median_seconds(reps, [&] { opt.step(); }), adam_bytes});
      }
      {
        auto param = p.clone();
        param.mutable_grad() = g;
        roundpipe::optim::Adam opt({param}, roundpipe::optim::AdamOptions(1e-3));
        opt.set_kernel_isa(isa);
        opt.set_streaming_stores(true);
        rows.push_back({"roundpipe Adam, streaming stores", median_seconds(reps, [&] { opt.step(); }), adam_bytes});
      }
      {
        auto param = p.clone();
        param.mutable_grad() = g;
        roundpipe::optim::Adam opt({param},
                                   roundpipe::optim::AdamOptions(1e-3).weight_decay(0.01).decoupled_weight_decay(true));
        opt.set_kernel_isa(isa);
        rows.push_back({"roundpipe AdamW", median_seconds(reps, [&] { opt.step(); }), adam_bytes});
      }
      {  // bf16 master + bf16 Kahan compensation, float32 moments.
        auto param = p.to(torch::kBFloat16);
        param.mutable_grad() = g.to(torch::kBFloat16);
        roundpipe::optim::Adam opt({param}, roundpipe::optim::AdamOptions(1e-3).kahan_sum(true));
        opt.set_kernel_isa(isa);
        rows.push_back({"bf16 p, g: roundpipe Adam, Kahan", median_seconds(reps, [&] { opt.step(); }), 26.0 * n});
      }
      // 8-bit states: the same update, moments dequantized and re-quantized per 256-element block.
      const double int8_bytes = (16.0 + 16.0 / 256) * n;
      {
        auto param = p.clone();
        param.mutable_grad() = g;
        roundpipe::optim::Adam opt(
            {param}, roundpipe::optim::AdamOptions(1e-3).state_dtype(roundpipe::optim::AdamStateDtype::kInt8));
        opt.set_kernel_isa(isa);
        rows.push_back({"roundpipe Adam, 8-bit states", median_seconds(reps, [&] { opt.step(); }), int8_bytes});
        if (isa == roundpipe::optim::CpuIsa::kAvx512 && roundpipe::optim::detail::cpu_has_avx512_vbmi()) {
          // The same kernel with the AVX-512F dequantize instead of the VBMI byte planes.
          roundpipe::optim::detail::set_avx512_vbmi_allowed(false);
          rows.push_back({"8-bit states, without VBMI", median_seconds(reps, [&] { opt.step(); }), int8_bytes});
          roundpipe::optim::detail::set_avx512_vbmi_allowed(true);
        }
        param.mutable_grad() = g.to(torch::kBFloat16);
        rows.push_back(
            {"bf16 g: roundpipe Adam, 8-bit", median_seconds(reps, [&] { opt.step(); }), int8_bytes - 2.0 * n});
      }
      {
        auto param = p.clone();
        param.mutable_grad() = g;
        roundpipe::optim::Adam opt(
            {param}, roundpipe::optim::AdamOptions(1e-3).weight_decay(0.01).decoupled_weight_decay(true).state_dtype(
                         roundpipe::optim::AdamStateDtype::kInt8));
        opt.set_kernel_isa(isa);
        rows.push_back({"roundpipe AdamW, 8-bit states", median_seconds(reps, [&] { opt.step(); }), int8_bytes});
      }
      {  // Lion (one state): reads p, g, m and writes p, m: 20 B/param (18 with bf16 gradients).
        auto param = p.clone();
        param.mutable_grad() = g;
        roundpipe::optim::Lion opt({param}, roundpipe::optim::LionOptions(1e-4).weight_decay(0.1));
        rows.push_back({"roundpipe Lion", median_seconds(reps, [&] { opt.step(); }), 20.0 * n});
        param.mutable_grad() = g.to(torch::kBFloat16);
        rows.push_back({"bf16 g: roundpipe Lion", median_seconds(reps, [&] { opt.step(); }), 18.0 * n});
      }
      if (n % 4096 == 0) {  // Adafactor, factored (a matrix of rows of 4096)
        auto param = p.clone().view({n / 4096, 4096});
        param.mutable_grad() = g.view({n / 4096, 4096});
        roundpipe::optim::Adafactor opt({param}, roundpipe::optim::AdafactorOptions(1e-2).weight_decay(0.01));
        rows.push_back({"roundpipe Adafactor (matrix)", median_seconds(reps, [&] { opt.step(); }), 28.0 * n});
      }
      {
        auto param = p.clone();
        auto m = torch::zeros({n}), v = torch::zeros({n});
        auto step = torch::zeros({}, torch::kFloat);
        rows.push_back({"at::_fused_adam_",
                        median_seconds(reps,
                                       [&] {
                                         at::_fused_adam_({param}, {g}, {m}, {v}, {}, {step}, 1e-3, 0.9, 0.999, 0, 1e-8,
                                                          false, false);
                                       }),
                        adam_bytes});
      }
      // Gradients arriving in bf16 (RoundPipe's bf16 compute copies): read directly by our kernel
      // (26 B/param), or cast into a reused fp32 buffer first (+6 B/param, STREAM counting), which
      // at::_fused_adam_ needs (it takes gradients of the parameters' dtype only).
      const auto g16 = g.to(torch::kBFloat16);
      {
        auto param = p.clone();
        param.mutable_grad() = g16;
        roundpipe::optim::Adam opt({param}, roundpipe::optim::AdamOptions(1e-3));
        opt.set_kernel_isa(isa);
        rows.push_back({"bf16 g: roundpipe Adam", median_seconds(reps, [&] { opt.step(); }), 26.0 * n});
      }
      {
        auto param = p.clone();
        auto buffer = torch::empty({n});
        param.mutable_grad() = buffer;
        roundpipe::optim::Adam opt({param}, roundpipe::optim::AdamOptions(1e-3));
        opt.set_kernel_isa(isa);
        rows.push_back({"bf16 g: cast + roundpipe",
                        median_seconds(reps,
                                       [&] {
                                         buffer.copy_(g16);
                                         opt.step();
                                       }),
                        34.0 * n});
      }
      {
        auto param = p.clone();
        auto m = torch::zeros({n}), v = torch::zeros({n});
        auto step = torch::zeros({}, torch::kFloat);
        auto buffer = torch::empty({n});
        rows.push_back({"bf16 g: cast + fused_adam_",
                        median_seconds(reps,
                                       [&] {
                                         buffer.copy_(g16);
                                         at::_fused_adam_({param}, {buffer}, {m}, {v}, {}, {step}, 1e-3, 0.9, 0.999, 0,
                                                          1e-8, false, false);
                                       }),
                        34.0 * n});
      }
      {
        auto param = p.clone();
        param.mutable_grad() = g;
        torch::optim::Adam opt({param}, torch::optim::AdamOptions(1e-3));
        rows.push_back({"torch::optim::Adam", median_seconds(reps, [&] { opt.step(); }), adam_bytes});
      }
      {
        auto param = p.clone();
        param.mutable_grad() = g;
        torch::optim::AdamW opt({param}, torch::optim::AdamWOptions(1e-3));
        rows.push_back({"torch::optim::AdamW", median_seconds(reps, [&] { opt.step(); }), adam_bytes});
      }
      const double ours = rows[1].seconds;
      for (const auto& row : rows) {
        std::printf("%-8s %-7lld %-32s %10.2f %9.2f %10.3f %11.2fx\n", (std::to_string(size_m) + "M").c_str(),
                    static_cast<long long>(t), row.name.c_str(), row.seconds * 1e3, row.bytes / row.seconds / 1e9,
                    n / row.seconds / 1e9, row.seconds / ours);
      }
      const auto time_of = [&](const std::string& name) {
        for (const auto& row : rows) {
          if (row.name == name) return row.seconds;
        }
        return 0.0;
      };
      std::printf("%-8s %-7lld bf16 gradients: cast + at::_fused_adam_ takes %.2fx the time of our direct read\n", "",
                  static_cast<long long>(t), time_of("bf16 g: cast + fused_adam_") / time_of("bf16 g: roundpipe Adam"));
      const double triad_gbs = rows[0].bytes / rows[0].seconds;
      std::printf(
          "%-8s %-7lld ours / triad bandwidth: %.0f%% (%.0f%% counting the triad's write-allocate, 16 B/elem)\n", "",
          static_cast<long long>(t), 100.0 * (adam_bytes / ours) / triad_gbs,
          100.0 * (adam_bytes / ours) / (triad_gbs * 16.0 / 12.0));
      std::fflush(stdout);
    }
  }
  return 0;
}
