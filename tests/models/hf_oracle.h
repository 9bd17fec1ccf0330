// Helpers of the model tests that need transformers: the skip rule (skip locally, fail when
// CI=true; the import is checked once per process by python_has_modules).
#pragma once

#include "tests/models/test_files.h"

/// Skips the test when the oracle Python lacks transformers, except under CI=true (a failure).
#define ROUNDPIPE_REQUIRE_TRANSFORMERS() ROUNDPIPE_REQUIRE_PYTHON("transformers safetensors")
