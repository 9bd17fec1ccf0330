#pragma once
// How the `roundpipe` executable asks glibc's allocator to give freed host memory back to the OS
// (issue 31: host bytes per parameter). Called once at the top of main(); the RoundPipe library
// itself never changes process-wide allocator settings (docs/launcher.md, "Host memory").

#include <string>

namespace roundpipe::launcher {

/// Note [Host allocator policy] in host_allocator.cpp. Applies ROUNDPIPE_MALLOC ("return", the
/// default, or "retain") unless the user tuned glibc's thresholds themselves (MALLOC_MMAP_THRESHOLD_)
/// or preloaded another allocator. Returns a one-line description for the log. Throws ConfigError
/// (exit 2) naming the variable and its values for any other ROUNDPIPE_MALLOC.
std::string apply_host_allocator_policy();

}  // namespace roundpipe::launcher
