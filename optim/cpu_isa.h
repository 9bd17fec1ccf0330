// The CPU instruction sets the fused optimizer kernels (Adam, Lion) are compiled for, picked at run
// time. An enum at the API edge; the names ("scalar", "avx2", "avx512") only for people and
// command lines. Free of LibTorch headers: the per-ISA kernel TUs include it.
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace roundpipe::optim {

/// The instruction sets the kernels are compiled for, best last.
enum class CpuIsa { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

/// True when the running CPU supports `isa` and the library was built with it.
bool cpu_supports(CpuIsa isa);
/// The best ISA the running CPU supports.
CpuIsa best_cpu_isa();
/// "scalar", "avx2" or "avx512".
const char* cpu_isa_name(CpuIsa isa);
/// Every ISA the running CPU supports, kScalar first.
std::vector<CpuIsa> supported_cpu_isas();
/// The ISA named `name` ("scalar", "avx2", "avx512"; "auto" = best_cpu_isa()), or nullopt for any
/// other name. For command lines; whether the CPU supports it is a separate question (cpu_supports).
std::optional<CpuIsa> parse_cpu_isa(const std::string& name);

}  // namespace roundpipe::optim
