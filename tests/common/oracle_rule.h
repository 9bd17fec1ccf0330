// The one skip-or-fail rule of tests that compare against something outside the build (the venv's
// Python and its packages, torchrun, Debian's fortunes): locally a missing oracle skips the test;
// with CI=true it fails, so that CI cannot pass by skipping the comparisons it exists to run.
// Header-only and LibTorch-free: the NO_TORCH test binaries use it too.
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <string>

namespace roundpipe::testing {

/// True when the environment variable CI is "true": a missing oracle then fails the test.
inline bool oracle_required() {
  const char* ci = std::getenv("CI");
  return ci != nullptr && std::strcmp(ci, "true") == 0;
}

}  // namespace roundpipe::testing

/// Ends the calling test (or returns from the calling helper) because what it compares against is
/// missing: GTEST_SKIP() << reason, or with CI=true FAIL() << "CI=true but " << reason. `reason`
/// is a streamable expression (parenthesized by the macro), e.g. what + " is missing".
#define ROUNDPIPE_ORACLE_MISSING(reason)                                   \
  do {                                                                     \
    if (::roundpipe::testing::oracle_required()) {                         \
      FAIL() << "CI=true but " << (reason);                                \
    }                                                                      \
    GTEST_SKIP() << (reason);                                              \
  } while (false)

/// ROUNDPIPE_ORACLE_MISSING(what + " is missing (run scripts/setup.sh)") when `available` is false.
#define ROUNDPIPE_ORACLE_OR_SKIP(available, what)                                                 \
  do {                                                                                            \
    if (!(available)) {                                                                           \
      ROUNDPIPE_ORACLE_MISSING(std::string(what) + " is missing (run scripts/setup.sh)");         \
    }                                                                                             \
  } while (false)
