// Helpers of the reliability tests (docs/reliability.md): a watchdog that turns a hang into a
// failure, and the resource counters a fault must leave unchanged (threads, file descriptors,
// live CPU tensor memory).
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <string>

namespace roundpipe::testing {

/// While alive, a hang fails the test binary: after `seconds` a SIGALRM handler writes
/// "watchdog: <test> still running after N s (hang)" to stderr and _exit(124)s (a blocked thread
/// cannot be cancelled, so the process ends; ctest reports the failure). One at a time.
class Watchdog {
 public:
  explicit Watchdog(unsigned seconds);
  ~Watchdog();
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;
};

/// Threads of this process (entries of /proc/self/task).
int64_t thread_count();
/// Open file descriptors of this process (entries of /proc/self/fd, less the one listing them).
int64_t fd_count();
/// Bytes and (non-empty) blocks of CPU memory currently allocated through c10's CPU allocator
/// (every CPU tensor's storage), counted by a wrapper installed before main (CountingCpuAllocator
/// in reliability_util.cpp). Memory allocated before it was installed is not counted, nor are
/// zero-byte storages (LibTorch keeps a few in thread-local state).
struct CpuMemory {
  int64_t bytes = 0;
  int64_t blocks = 0;
};
CpuMemory live_cpu_memory();
/// Resident set size of the process in bytes (/proc/self/statm).
int64_t rss_bytes();
/// The process's memory for growth bounds: rss_bytes(), or in an ASan/TSan build the sanitizer
/// allocator's bytes in use (__sanitizer_get_current_allocated_bytes). There RSS is no leak signal:
/// freed blocks wait in ASan's quarantine (256 MiB by default) and the shadow memory grows with
/// what was ever touched, so the RSS of a steady loop creeps up by thread timing (+24 MB over a
/// 2,000-iteration soak, once in CI-local).
int64_t process_memory_bytes();

/// Runs a small forward/backward and a matrix product big enough for LibTorch to start its lazy
/// threads (the intra-op pool), so they are not mistaken for leaks by a later count.
void warm_up_torch();

/// The counters, taken together.
struct Resources {
  int64_t threads = 0;
  int64_t fds = 0;
  CpuMemory cpu;
  static Resources now();
};
/// Expects `after` to hold no more threads, file descriptors and CPU tensor blocks/bytes than
/// `before` (`what` names the situation in the failure message).
void expect_no_leak(const Resources& before, const Resources& after, const std::string& what);

}  // namespace roundpipe::testing
