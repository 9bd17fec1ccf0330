// Runtime selection of the kernel ISA (baseline flags; never calls into a TU the CPU lacks), and the
// public optim/cpu_isa.h functions.
#include <atomic>

#include "optim/cpu_isa.h"
#include "optim/detail/adam_kernel.h"
#include "optim/detail/lion_kernel.h"

#if ROUNDPIPE_OPTIM_X86
#include <cpuid.h>
#endif

namespace roundpipe::optim {
namespace {

#if ROUNDPIPE_OPTIM_X86
// F16C from CPUID leaf 1 (ECX bit 29): clang 14's __builtin_cpu_supports does not know "f16c".
bool cpu_has_f16c() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & bit_F16C) != 0;
}
#endif

std::atomic<bool> vbmi_allowed{true};

}  // namespace

namespace detail {

bool cpu_has_avx512_vbmi() {
#if ROUNDPIPE_OPTIM_X86
  return __builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("avx512bw");
#else
  return false;
#endif
}

void set_avx512_vbmi_allowed(bool allowed) { vbmi_allowed.store(allowed, std::memory_order_relaxed); }

bool avx512_vbmi_allowed() { return vbmi_allowed.load(std::memory_order_relaxed); }

}  // namespace detail

bool cpu_supports(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kScalar:
      return true;
    case CpuIsa::kAvx2:
#if ROUNDPIPE_OPTIM_X86
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && cpu_has_f16c();
#else
      return false;
#endif
    case CpuIsa::kAvx512:
#if ROUNDPIPE_OPTIM_X86
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma") && cpu_has_f16c();
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

const char* cpu_isa_name(CpuIsa isa) {
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

std::vector<CpuIsa> supported_cpu_isas() {
  std::vector<CpuIsa> isas;
  for (const CpuIsa isa : {CpuIsa::kScalar, CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    if (cpu_supports(isa)) {
      isas.push_back(isa);
    }
  }
  return isas;
}

std::optional<CpuIsa> parse_cpu_isa(const std::string& name) {
  if (name == "auto") {
    return best_cpu_isa();
  }
  for (const CpuIsa isa : {CpuIsa::kScalar, CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    if (name == cpu_isa_name(isa)) {
      return isa;
    }
  }
  return std::nullopt;
}

namespace detail {

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

LionUpdateFn lion_update_fn(CpuIsa isa) {
#if ROUNDPIPE_OPTIM_X86
  switch (isa) {
    case CpuIsa::kAvx512:
      return &lion_update_avx512;
    case CpuIsa::kAvx2:
      return &lion_update_avx2;
    case CpuIsa::kScalar:
      break;
  }
#else
  (void)isa;
#endif
  return &lion_update_scalar;
}

}  // namespace detail
}  // namespace roundpipe::optim
