// Helpers of the model tests that need transformers: the skip rule (skip locally, fail when
// CI=true), with the import checked once per process (importing transformers takes seconds).
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "tests/common/python_oracle.h"
#include "tests/common/test_config.h"
#include "tests/models/test_files.h"

namespace roundpipe::testing {

/// True when the oracle Python imports transformers and safetensors (checked once).
inline bool transformers_available() {
  static const bool available = python_oracle_available() && python_has_modules("transformers safetensors");
  return available;
}

}  // namespace roundpipe::testing

/// Skips the test when transformers is missing, except under CI=true where that is a failure.
#define ROUNDPIPE_REQUIRE_TRANSFORMERS()                                                            \
  do {                                                                                              \
    if (!::roundpipe::testing::transformers_available()) {                                          \
      if (::roundpipe::testing::running_in_ci()) FAIL() << "CI=true but Python lacks transformers"; \
      GTEST_SKIP() << "the oracle Python lacks transformers (pip install -r requirements.txt)";     \
    }                                                                                               \
  } while (false)
