// Oracle tests: run a Python snippet with the project's venv (PyTorch's own implementation) and
// read its tensors back.
#pragma once

#include <ATen/core/Tensor.h>
#include <gtest/gtest.h>

#include <map>
#include <string>

#include "tests/common/oracle_rule.h"

namespace roundpipe::testing {

using TensorMap = std::map<std::string, at::Tensor>;

/// Runs `snippet` in the venv's Python (ROUNDPIPE_PYTHON) with `import torch` done, the dict
/// `inputs` holding `inputs` (CPU tensors, by name), and an empty dict `outputs` that the snippet
/// fills with tensors (or Python numbers / bools, returned as 0-dim float64 / bool tensors).
/// Exchange goes through torch.save / torch::pickle_load files in a temporary directory.
/// Throws std::runtime_error with Python's stderr if the snippet fails.
///
///   auto out = run_python("outputs['y'] = inputs['x'] * 2", {{"x", x}});
TensorMap run_python(const std::string& snippet, const TensorMap& inputs = {});

/// True when the oracle interpreter exists and imports torch (tests use ROUNDPIPE_REQUIRE_ORACLE).
bool python_oracle_available();

}  // namespace roundpipe::testing

/// ROUNDPIPE_ORACLE_OR_SKIP (tests/common/oracle_rule.h) for the Python oracle itself (the venv's Python with torch).
#define ROUNDPIPE_REQUIRE_ORACLE() \
  ROUNDPIPE_ORACLE_OR_SKIP(::roundpipe::testing::python_oracle_available(), "the Python oracle (venv with torch)")
