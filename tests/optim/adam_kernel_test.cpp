// The Adam kernel paths: every ISA the CPU supports gives bitwise the same results as the scalar
// path (odd lengths exercise the vector tails), the thread count does not change results, the
// compute copy written in the same pass equals PyTorch's own dtype conversion, fp16/bf16
// gradients read directly equal their fp32 values, and bf16 masters with Kahan compensation
// (float32 and 8-bit moments) give the same bits on every ISA and thread count; a gradient factor
// (Adam::scale_next_gradients) equals a mul_ of the float32 gradients.
#include "optim/detail/adam_kernel.h"

#include <ATen/Parallel.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <optional>
#include <string>
#include <vector>

#include "optim/adam.h"
#include "tests/common/tensor_compare.h"

namespace roundpipe::optim {
namespace {

struct AdamRun {
  std::vector<torch::Tensor> params;
  std::vector<torch::Tensor> copies;  // compute copies: float16, bfloat16, float32 in rotation
};

// Lengths around the AVX2 (8) and AVX-512 (16) widths, one big enough to use several threads, and
// two past the streaming-store threshold (2^20): the last one is made misaligned (storage offset
// 1) so the kernel must peel / fall back to ordinary stores.
const std::vector<int64_t> kLengths = {
    0, 1, 3, 7, 8, 9, 15, 16, 17, 31, 33, 100, 200003, (1 << 20) + 13, (1 << 20) + 5};

// `grad_dtype`: the gradients are rounded to it; `widen` hands them to the optimizer widened back
// to float32 (the reference for the kernel's own widening of fp16/bf16 gradients).
// `factor`: every step's gradients are multiplied by it, by Adam::scale_next_gradients, or with
// `widen` by mul_ on the widened float32 gradients (the reference).
AdamRun run_adam(const AdamOptions& options, CpuIsa isa, int64_t threads, bool with_copies, bool streaming = false,
                 torch::Dtype grad_dtype = torch::kFloat, bool widen = false, std::optional<float> factor = {}) {
  torch::manual_seed(11);
  AdamRun run;
  for (size_t i = 0; i < kLengths.size(); ++i) {
    const int64_t n = kLengths[i];
    run.params.push_back(i + 1 == kLengths.size() ? torch::randn({n + 1}).narrow(0, 1, n) : torch::randn({n}));
  }
  std::vector<std::vector<torch::Tensor>> grads;
  for (int s = 0; s < 5; ++s) {
    grads.emplace_back();
    for (int64_t n : kLengths) {
      // Some large and tiny values so fp16 rounding covers overflow and subnormals.
      auto g = torch::randn({n}) * (s == 2 ? 1e4 : 1.0);
      if (grad_dtype != torch::kFloat) {
        g = g.to(grad_dtype);
        if (widen) g = g.to(torch::kFloat);
      }
      grads.back().push_back(g);
    }
  }
  Adam opt(run.params, options);
  opt.set_kernel_isa(isa);
  opt.set_num_threads(threads);
  opt.set_streaming_stores(streaming);
  if (with_copies) {
    const torch::Dtype dtypes[] = {torch::kHalf, torch::kBFloat16, torch::kFloat};
    for (size_t i = 0; i < run.params.size(); ++i) {
      run.copies.push_back(torch::zeros({kLengths[i]}, dtypes[i % 3]));
      opt.set_compute_copy(run.params[i], run.copies.back());
    }
  }
  for (const auto& step_grads : grads) {
    for (size_t i = 0; i < run.params.size(); ++i) {
      run.params[i].mutable_grad() = step_grads[i];
      if (factor && widen) run.params[i].mutable_grad().mul_(*factor);
    }
    if (factor && !widen) opt.scale_next_gradients(*factor);
    opt.step();
  }
  return run;
}

std::vector<AdamOptions> option_sets() {
  return {AdamOptions(1e-2), AdamOptions(1e-3).betas({0.4, 0.95}).weight_decay(0.01).amsgrad(true).maximize(true),
          AdamOptions(1e-2).weight_decay(0.1).decoupled_weight_decay(true).amsgrad(true).eps(1e-6)};
}

TEST(AdamKernelTest, EveryIsaMatchesScalarBitwise_OddLengths) {
  const auto isas = supported_cpu_isas();
  ASSERT_GE(isas.size(), 1u);
  if (isas.size() == 1) {
    GTEST_SKIP() << "only the scalar kernel is available on this CPU";
  }
  for (const auto& options : option_sets()) {
    const AdamRun reference = run_adam(options, CpuIsa::kScalar, 1, /*with_copies=*/true);
    for (size_t k = 1; k < isas.size(); ++k) {
      const AdamRun run = run_adam(options, isas[k], 1, /*with_copies=*/true, /*streaming=*/k % 2 == 0);
      for (size_t i = 0; i < kLengths.size(); ++i) {
        EXPECT_TENSOR_EQ(run.params[i], reference.params[i]) << cpu_isa_name(isas[k]) << ", length " << kLengths[i];
        EXPECT_TENSOR_EQ(run.copies[i], reference.copies[i]) << cpu_isa_name(isas[k]) << ", length " << kLengths[i];
      }
    }
  }
}

TEST(AdamKernelTest, ResultsIndependentOfThreadCount) {
  const int saved = at::get_num_threads();
  at::set_num_threads(2);
  for (const auto& isa : supported_cpu_isas()) {
    const auto options = option_sets()[2];
    const AdamRun one = run_adam(options, isa, 1, /*with_copies=*/false);
    const AdamRun two = run_adam(options, isa, 2, /*with_copies=*/false);
    const AdamRun streamed = run_adam(options, isa, 2, /*with_copies=*/false, /*streaming=*/true);
    for (size_t i = 0; i < kLengths.size(); ++i) {
      EXPECT_TENSOR_EQ(two.params[i], one.params[i]) << cpu_isa_name(isa) << ", length " << kLengths[i];
      EXPECT_TENSOR_EQ(streamed.params[i], one.params[i]) << cpu_isa_name(isa) << " streaming, length " << kLengths[i];
    }
  }
  at::set_num_threads(saved);
}

TEST(AdamKernelTest, ComputeCopyEqualsTorchConversion_EveryIsa) {
  for (const auto& isa : supported_cpu_isas()) {
    const AdamRun run = run_adam(option_sets()[1], isa, 2, /*with_copies=*/true);
    for (size_t i = 0; i < kLengths.size(); ++i) {
      EXPECT_TENSOR_EQ(run.copies[i], run.params[i].to(run.copies[i].scalar_type()))
          << cpu_isa_name(isa) << ", length " << kLengths[i] << ", dtype " << run.copies[i].scalar_type();
    }
  }
}

// fp16/bf16 gradients are widened in the kernel's pass: bitwise the same as a step on their fp32
// values, on every ISA (vector bodies and scalar tails), with and without compute copies.
TEST(AdamKernelTest, LowPrecisionGradsEqualTheirFp32Values_EveryIsa) {
  for (const auto& isa : supported_cpu_isas()) {
    for (auto dtype : {torch::kHalf, torch::kBFloat16}) {
      for (const auto& options : option_sets()) {
        const AdamRun low = run_adam(options, isa, 2, /*with_copies=*/true, /*streaming=*/false, dtype);
        const AdamRun ref = run_adam(options, isa, 2, /*with_copies=*/true, /*streaming=*/false, dtype, /*widen=*/true);
        for (size_t i = 0; i < kLengths.size(); ++i) {
          EXPECT_TENSOR_EQ(low.params[i], ref.params[i])
              << cpu_isa_name(isa) << ", " << dtype << ", length " << kLengths[i];
          EXPECT_TENSOR_EQ(low.copies[i], ref.copies[i])
              << cpu_isa_name(isa) << ", " << dtype << ", length " << kLengths[i];
        }
      }
    }
  }
}

// Adam::scale_next_gradients multiplies the widened gradient in the fused pass: bitwise a mul_ of
// the float32 gradients before the step, on every ISA, for float32 / fp16 / bf16 gradients, float32
// and 8-bit states (clip_grad_norm's coefficient, and a factor above 1 that makes fp16 values
// overflow float16 range if they were rounded back).
TEST(AdamKernelTest, GradientFactorEqualsMulOfFp32Grads_EveryIsa) {
  std::vector<AdamOptions> options = option_sets();
  options.push_back(
      AdamOptions(1e-2).weight_decay(0.01).decoupled_weight_decay(true).state_dtype(AdamStateDtype::kInt8));
  for (const auto& isa : supported_cpu_isas()) {
    for (auto dtype : {torch::kFloat, torch::kHalf, torch::kBFloat16}) {
      for (size_t o = 0; o < options.size(); ++o) {
        const float factor = o % 2 == 0 ? 0.3183099f : 7.5e4f;
        const AdamRun scaled = run_adam(options[o], isa, 2, /*with_copies=*/true, false, dtype, false, factor);
        const AdamRun ref = run_adam(options[o], isa, 2, /*with_copies=*/true, false, dtype, /*widen=*/true, factor);
        const AdamRun unscaled = run_adam(options[o], isa, 2, /*with_copies=*/true, false, dtype);
        for (size_t i = 0; i < kLengths.size(); ++i) {
          const std::string where = std::string(cpu_isa_name(isa)) + ", " + c10::toString(dtype) + ", options " +
                                    std::to_string(o) + ", length " + std::to_string(kLengths[i]);
          EXPECT_TENSOR_EQ(scaled.params[i], ref.params[i]) << where;
          EXPECT_TENSOR_EQ(scaled.copies[i], ref.copies[i]) << where;
          if (kLengths[i] > 100) {  // the factor is used at all
            EXPECT_FALSE(torch::equal(scaled.params[i], unscaled.params[i])) << where;
          }
        }
      }
    }
  }
}

struct KahanRun {
  std::vector<torch::Tensor> params;         // bfloat16
  std::vector<torch::Tensor> compensations;  // bfloat16, from the optimizer's state
};

// bf16 masters (kahan_sum) of kLengths, bf16 gradients on odd-indexed parameters, 5 steps. With
// int8 states the 200003 and 2^20 + x parameters get 8-bit moments (partial last blocks).
KahanRun run_kahan(AdamOptions options, CpuIsa isa, int64_t threads, bool int8) {
  torch::manual_seed(13);
  options.kahan_sum(true).state_dtype(int8 ? AdamStateDtype::kInt8 : AdamStateDtype::kFloat32);
  if (int8) {
    options.amsgrad(false);
  }
  KahanRun run;
  for (size_t i = 0; i < kLengths.size(); ++i) {
    const int64_t n = kLengths[i];
    auto p = torch::randn({n + 1}).to(torch::kBFloat16);
    run.params.push_back(i + 1 == kLengths.size() ? p.narrow(0, 1, n) : p.narrow(0, 0, n).clone());
  }
  Adam opt(run.params, options);
  opt.set_kernel_isa(isa);
  opt.set_num_threads(threads);
  for (int s = 0; s < 5; ++s) {
    for (size_t i = 0; i < run.params.size(); ++i) {
      // Gradients of 1e-3 scale make updates below half a bf16 ulp, where compensation matters.
      auto g = torch::randn({kLengths[i]}) * (s == 2 ? 1e-3 : 1.0);
      run.params[i].mutable_grad() = i % 2 == 1 ? g.to(torch::kBFloat16) : g;
    }
    opt.step();
  }
  for (const auto& p : run.params) {
    const auto it = opt.state().find(p.unsafeGetTensorImpl());
    run.compensations.push_back(it == opt.state().end()
                                    ? torch::Tensor()
                                    : static_cast<const AdamParamState&>(*it->second).kahan_compensation());
  }
  return run;
}

// Note [Kahan-compensated bf16 masters]: every ISA and thread count gives the scalar path's bits,
// for the master and the compensation, with float32 and 8-bit moments and every option set.
TEST(AdamKernelTest, Bf16KahanMasters_EveryIsaAndThreadCountMatchScalarBitwise) {
  const int saved = at::get_num_threads();
  at::set_num_threads(2);
  for (bool int8 : {false, true}) {
    for (const auto& options : option_sets()) {
      const KahanRun reference = run_kahan(options, CpuIsa::kScalar, 1, int8);
      for (const auto& isa : supported_cpu_isas()) {
        for (int64_t threads : {1, 2}) {
          if (isa == CpuIsa::kScalar && threads == 1) {
            continue;
          }
          const KahanRun run = run_kahan(options, isa, threads, int8);
          for (size_t i = 0; i < kLengths.size(); ++i) {
            const std::string what = cpu_isa_name(isa) + std::string(", ") + std::to_string(threads) +
                                     " thread(s), int8 " + std::to_string(int8) + ", length " +
                                     std::to_string(kLengths[i]);
            EXPECT_TENSOR_EQ(run.params[i], reference.params[i]) << what;
            if (kLengths[i] > 0) {
              EXPECT_TENSOR_EQ(run.compensations[i], reference.compensations[i]) << what;
            }
          }
        }
      }
      // The compensation is in use (not all zero) and the masters moved.
      EXPECT_GT(reference.compensations[12].abs().max().item<float>(), 0.0f);
    }
  }
  at::set_num_threads(saved);
}

TEST(AdamKernelTest, GradDtypeMustBeFloatingCpu) {
  auto p = torch::zeros({4});
  Adam opt({p});
  p.mutable_grad() = torch::zeros({4}, torch::kDouble);
  try {
    opt.step();
    FAIL() << "expected an error for a float64 gradient";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("must be a float32, float16 or bfloat16 CPU tensor"), std::string::npos)
        << e.what();
  }
}

TEST(AdamKernelTest, ComputeCopyRoundsSpecialValuesLikeTorch) {
  // Values that hit fp16 overflow, subnormals, ties and bf16 rounding; written by a zero-lr step.
  auto p = torch::tensor({0.0f, -0.0f, 1.0f, 65504.0f, 65520.0f, 1e6f, -1e6f, 6e-8f, 3e-5f, 1.00048828125f,
                          1.0009765625f, 3.14159265f, 1.00390625f, 1.005859375f, -2.7182818f, 1e-40f, 3.4e38f});
  for (const auto& isa : supported_cpu_isas()) {
    for (auto dtype : {torch::kHalf, torch::kBFloat16}) {
      auto param = p.clone();
      auto copy = torch::zeros(p.sizes(), dtype);
      Adam opt({param}, AdamOptions(0.0));
      opt.set_kernel_isa(isa);
      opt.set_compute_copy(param, copy);
      param.mutable_grad() = torch::ones_like(param);
      opt.step();
      EXPECT_TENSOR_EQ(param, p) << cpu_isa_name(isa);  // lr 0 leaves p unchanged
      EXPECT_TENSOR_EQ(copy, p.to(dtype)) << cpu_isa_name(isa) << ", " << dtype;
    }
  }
}

TEST(AdamKernelTest, KernelIsaSelection_DefaultsToBestSupported) {
  auto p = torch::zeros({2});
  Adam opt({p});
  EXPECT_EQ(opt.kernel_isa(), best_cpu_isa());
  opt.set_kernel_isa(CpuIsa::kScalar);
  EXPECT_EQ(opt.kernel_isa(), CpuIsa::kScalar);
  EXPECT_EQ(cpu_isa_name(opt.kernel_isa()), std::string("scalar"));
  opt.set_kernel_isa(best_cpu_isa());
  EXPECT_EQ(opt.kernel_isa(), best_cpu_isa());
  // The command-line edge: names round-trip, "auto" is the best, anything else is nullopt.
  for (const CpuIsa isa : {CpuIsa::kScalar, CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    EXPECT_EQ(parse_cpu_isa(cpu_isa_name(isa)), isa);
  }
  EXPECT_EQ(parse_cpu_isa("auto"), best_cpu_isa());
  EXPECT_EQ(parse_cpu_isa("sse9"), std::nullopt);
  EXPECT_EQ(supported_cpu_isas().front(), CpuIsa::kScalar);
  EXPECT_EQ(supported_cpu_isas().back(), best_cpu_isa());
}

}  // namespace
}  // namespace roundpipe::optim
