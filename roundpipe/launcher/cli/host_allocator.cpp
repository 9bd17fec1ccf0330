#include "roundpipe/launcher/cli/host_allocator.h"

#include <malloc.h>

#include <cstdlib>

#include "roundpipe/launcher/config.h"

namespace roundpipe::launcher {

// Note [Host allocator policy]:
// glibc's malloc serves blocks under its mmap threshold from arenas and keeps what is freed there
// for reuse; the threshold starts at 128 KiB and rises to the largest block freed so far (up to
// 32 MiB), so after the first tensors are freed, every later tensor of a few MiB comes from an
// arena and stays in the process after it is freed. A training run frees many such tensors (layer
// clones, activations, gradients, checkpoint buffers), and measured on a 194M-parameter model
// (bench/host_memory_bench.py, docs/benchmarks.md "Host memory") the retained memory was ~7.5 B/param
// of the run's peak. A fixed threshold of 1 MiB (mallopt(M_MMAP_THRESHOLD), which also stops the
// dynamic rise) maps every block of 1 MiB or more on its own and unmaps it when freed: the peak
// falls to within ~2 B/param of the live tensors, the same as jemalloc or mimalloc preloaded,
// with no dependency. The cost is page faults when such memory is touched again (system CPU time,
// measured there); ROUNDPIPE_MALLOC=retain keeps glibc's default for a host with memory to spare.
// A user who set MALLOC_MMAP_THRESHOLD_ (glibc reads it at start) or preloaded another allocator
// has chosen already: nothing is changed then.
std::string apply_host_allocator_policy() {
  const char* policy = std::getenv("ROUNDPIPE_MALLOC");
  const std::string value = policy != nullptr ? policy : "return";
  if (value != "return" && value != "retain") {
    throw ConfigError("ROUNDPIPE_MALLOC='" + value +
                      "' is not a host allocator policy; use 'return' (the default: freed blocks of 1 MiB or "
                      "more go back to the OS) or 'retain' (glibc's default)");
  }
  if (std::getenv("MALLOC_MMAP_THRESHOLD_") != nullptr) {
    return "host allocator: glibc with MALLOC_MMAP_THRESHOLD_ from the environment (ROUNDPIPE_MALLOC ignored)";
  }
  const char* preload = std::getenv("LD_PRELOAD");
  if (preload != nullptr && *preload != '\0') {
    return std::string("host allocator: LD_PRELOAD=") + preload + " (ROUNDPIPE_MALLOC ignored)";
  }
  if (value == "retain") {
    return "host allocator: glibc's default (ROUNDPIPE_MALLOC=retain: freed memory stays in the process)";
  }
  constexpr int kThresholdBytes = 1 << 20;
  if (mallopt(M_MMAP_THRESHOLD, kThresholdBytes) != 1) {
    return "host allocator: glibc's default (mallopt(M_MMAP_THRESHOLD) refused)";
  }
  return "host allocator: glibc, blocks of 1 MiB or more returned to the OS when freed (ROUNDPIPE_MALLOC=return)";
}

}  // namespace roundpipe::launcher
