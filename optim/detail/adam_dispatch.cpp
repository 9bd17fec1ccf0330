// Runtime selection of the Adam kernel ISA (baseline flags; never calls into a TU the CPU lacks).
#include "optim/detail/adam_kernel.h"

namespace roundpipe::optim::detail {

bool cpu_supports(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kScalar:
      return true;
    case CpuIsa::kAvx2:
#if ROUNDPIPE_OPTIM_X86
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("f16c");
#else
      return false;
#endif
    case CpuIsa::kAvx512:
#if ROUNDPIPE_OPTIM_X86
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("f16c");
#else
      return false;
#endif
  }
  return false;
}

CpuIsa best_cpu_isa() {
  if (cpu_supports(CpuIsa::kAvx512)) {
    return CpuIsa::kAvx512;
  }
  if (cpu_supports(CpuIsa::kAvx2)) {
    return CpuIsa::kAvx2;
  }
  return CpuIsa::kScalar;
}

const char* isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kScalar:
      return "scalar";
    case CpuIsa::kAvx2:
      return "avx2";
    case CpuIsa::kAvx512:
      return "avx512";
  }
  return "unknown";
}

AdamUpdateFn adam_update_fn(CpuIsa isa) {
#if ROUNDPIPE_OPTIM_X86
  switch (isa) {
    case CpuIsa::kAvx512:
      return &adam_update_avx512;
    case CpuIsa::kAvx2:
      return &adam_update_avx2;
    case CpuIsa::kScalar:
      break;
  }
#else
  (void)isa;
#endif
  return &adam_update_scalar;
}

}  // namespace roundpipe::optim::detail
