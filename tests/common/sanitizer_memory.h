// Heap measurements that still mean something in sanitizer builds.
#pragma once

#include <malloc.h>

#include <cstdint>
#include <optional>

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define ROUNDPIPE_TEST_SANITIZER_BUILD 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define ROUNDPIPE_TEST_SANITIZER_BUILD 1
#endif
#endif
#ifdef ROUNDPIPE_TEST_SANITIZER_BUILD
#define ROUNDPIPE_TEST_SANITIZER_ALLOCATOR 1
#endif
// GCC ships the sanitizer runtimes but not this header (clang does): without it, std::nullopt.
#if defined(ROUNDPIPE_TEST_SANITIZER_ALLOCATOR) && !__has_include(<sanitizer/allocator_interface.h>)
#undef ROUNDPIPE_TEST_SANITIZER_ALLOCATOR
#endif
#ifdef ROUNDPIPE_TEST_SANITIZER_ALLOCATOR
#include <sanitizer/allocator_interface.h>
#endif

namespace roundpipe::testing {

/// True in an ASan or TSan build (GCC or clang): tests that sweep large inputs sample them there.
#ifdef ROUNDPIPE_TEST_SANITIZER_BUILD
inline constexpr bool kSanitizerBuild = true;
#else
inline constexpr bool kSanitizerBuild = false;
#endif

/// In an ASan or TSan build, the sanitizer allocator's bytes in use; std::nullopt otherwise (and
/// with GCC, which lacks the header declaring the count: the TSan phase builds with GCC). Its
/// allocator replaces glibc's, so mallinfo2 does not move there, and the RSS includes freed blocks
/// waiting in ASan's quarantine and the shadow memory: neither measures what a test holds.
inline std::optional<int64_t> sanitizer_allocated_bytes() {
#ifdef ROUNDPIPE_TEST_SANITIZER_ALLOCATOR
  return static_cast<int64_t>(__sanitizer_get_current_allocated_bytes());
#else
  return std::nullopt;
#endif
}

/// Bytes the process's heap has in use: the sanitizer allocator's count under ASan/TSan (where it
/// has one), else glibc's (mallinfo2: in-use chunks and mmapped blocks).
inline double heap_in_use() {
  if (const auto bytes = sanitizer_allocated_bytes()) return static_cast<double>(*bytes);
  const struct mallinfo2 m = ::mallinfo2();
  return static_cast<double>(m.uordblks + m.hblkhd);
}

}  // namespace roundpipe::testing
