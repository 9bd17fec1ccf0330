// The fused CPU Adam/AdamW element kernel: plain-pointer interface shared by the scalar, AVX2 and
// AVX-512 translation units and by optim::Adam, which dispatches to one of them at run time.
// Deliberately free of LibTorch headers: the ISA-specific TUs are compiled with their own flags
// and must not reuse the shared precompiled header.
#pragma once

#include <cstdint>

#include "optim/cpu_isa.h"
#include "optim/detail/quant_map.h"

namespace roundpipe::optim::detail {

// The ISA enum is public (optim/cpu_isa.h); the kernels name it unqualified.
using optim::best_cpu_isa;
using optim::cpu_supports;
using optim::CpuIsa;

/// Element type of an optional compute copy written in the same pass.
enum class CopyDtype { kNone, kFloat, kHalf, kBFloat16 };

/// Element type of the gradient the kernel reads; fp16/bf16 are widened to float exactly in the
/// same pass, so results equal those of an fp32 gradient holding the widened values.
enum class GradDtype { kFloat, kHalf, kBFloat16 };

/// Per-tensor scalars, precomputed in double and rounded to float the way PyTorch's
/// `_single_tensor_adam` hands Python floats to its float kernels.
struct AdamScalars {
  float lerp_weight = 0;            ///< (float)(1 - beta1), torch's lerp_ weight.
  float beta2 = 0;                  ///< exp_avg_sq *= beta2
  float one_minus_beta2 = 0;        ///< exp_avg_sq += (1 - beta2) * g * g
  float neg_step_size = 0;          ///< -(lr / (1 - beta1^step))
  float bias_correction2_sqrt = 1;  ///< sqrt(1 - beta2^step)
  float eps = 0;
  float weight_decay = 0;  ///< L2 term added to the gradient (used when !decoupled)
  float decay_factor = 1;  ///< 1 - lr * weight_decay (used when decoupled)
  float grad_factor = 1;   ///< g *= grad_factor right after loading (Adam::scale_next_gradients)
  bool has_weight_decay = false;
  bool decoupled = false;
  bool amsgrad = false;
  bool maximize = false;
};

/// Block-wise 8-bit moments (Note [8-bit Adam states] in adam_kernel_impl.h): codes of
/// `numel` elements, one absmax per kQuantBlock elements (the last block may be shorter).
struct QuantizedMoments {
  uint8_t* exp_avg_codes = nullptr;  ///< signed dynamic map
  float* exp_avg_absmax = nullptr;
  uint8_t* exp_avg_sq_codes = nullptr;  ///< unsigned dynamic map
  float* exp_avg_sq_absmax = nullptr;
  const QuantMapTable* exp_avg_map = nullptr;
  const QuantMapTable* exp_avg_sq_map = nullptr;
};

/// One parameter's buffers (all contiguous, `numel` elements). `max_exp_avg_sq` is null unless
/// amsgrad; `copy` is null unless a compute copy of dtype `copy_dtype` is to be written. With
/// 8-bit states `quantized.exp_avg_codes` is set and exp_avg / exp_avg_sq / max_exp_avg_sq are
/// null (no amsgrad). A bfloat16 master (Note [Kahan-compensated bf16 masters] in
/// adam_kernel_impl.h) sets `param_bf16` and, with AdamOptions::kahan_sum, `compensation` instead
/// of `param` (and no copy).
struct AdamTensor {
  float* param = nullptr;
  uint16_t* param_bf16 = nullptr;    ///< bf16 bits of the master; null for a float32 master
  uint16_t* compensation = nullptr;  ///< bf16 bits of the Kahan compensation; null: plain rounding
  const void* grad = nullptr;        ///< `numel` elements of `grad_dtype`
  GradDtype grad_dtype = GradDtype::kFloat;
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
  float* max_exp_avg_sq = nullptr;
  void* copy = nullptr;
  CopyDtype copy_dtype = CopyDtype::kNone;
  int64_t numel = 0;
  /// Write param / exp_avg / exp_avg_sq / max_exp_avg_sq with non-temporal stores where they
  /// are mutually aligned (see Note [Streaming stores] in adam_kernel_impl.h).
  bool streaming_stores = false;
  /// Internal to the kernel: write the update u of Note [Kahan-compensated bf16 masters] to
  /// `param` (which holds the widened master on entry) instead of the new parameter.
  bool write_update = false;
  AdamScalars scalars;
  QuantizedMoments quantized;
};

/// Updates elements [begin, end) of `t` in one pass. All ISAs give bitwise-identical results.
/// With 8-bit states it updates the blocks that start in [begin, end) (whole blocks, so that
/// ranges splitting [0, numel) update every block exactly once).
void adam_update_scalar(const AdamTensor& t, int64_t begin, int64_t end);
void adam_update_avx2(const AdamTensor& t, int64_t begin, int64_t end);
void adam_update_avx512(const AdamTensor& t, int64_t begin, int64_t end);

/// codes[j] = the code of x[j] under `map` by the AVX-512 kernel's lookup (Note [Decade code
/// lookup] in quant_map.h, with its gather for ambiguous lanes) for j < n: the kernel's quantize
/// with absmax 1, for tests (each must equal quantize_code(map, x[j])). Only on a CPU with
/// AVX-512 (cpu_supports(CpuIsa::kAvx512)) and on x86 builds.
void quantize_scaled_avx512(const float* x, int64_t n, const QuantMapTable& map, uint8_t* codes);

/// True when the CPU has AVX-512 VBMI and BW (the AVX-512 kernel's byte-plane dequantize of 8-bit
/// states, Note [Byte-plane dequantize] in adam_kernel_avx512.cpp).
bool cpu_has_avx512_vbmi();
/// Whether the AVX-512 kernel may use that dequantize where the CPU has it (default true). Tests
/// and benchmarks turn it off to run the AVX-512F dequantize on the same CPU; both give the same
/// bits. A relaxed atomic: change it only while no step runs.
void set_avx512_vbmi_allowed(bool allowed);
bool avx512_vbmi_allowed();

using AdamUpdateFn = void (*)(const AdamTensor&, int64_t, int64_t);
/// The kernel for `isa` (which must be supported).
AdamUpdateFn adam_update_fn(CpuIsa isa);

}  // namespace roundpipe::optim::detail
