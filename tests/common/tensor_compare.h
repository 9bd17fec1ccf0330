// Tensor assertions with readable diffs for GoogleTest.
#pragma once

#include <ATen/core/Tensor.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace roundpipe::testing {

/// Success when `actual` and `expected` have the same shape and every element differs by at
/// most atol + rtol * |expected| (NaNs equal NaNs, infs must match exactly). On failure the
/// message gives shapes, dtypes, the max abs difference, how many elements differ, and the
/// first few differing indices with both values.
::testing::AssertionResult tensors_close(const at::Tensor& actual, const at::Tensor& expected,
                                         double atol = 0, double rtol = 0);

/// Bitwise equality (same dtype, shape and bytes; NaN payloads included).
::testing::AssertionResult tensors_equal(const at::Tensor& actual, const at::Tensor& expected);

/// Element-wise close for lists (e.g. parameter lists), naming the first index that differs.
::testing::AssertionResult tensor_lists_close(const std::vector<at::Tensor>& actual,
                                              const std::vector<at::Tensor>& expected, double atol = 0,
                                              double rtol = 0);

/// Max |a - b| over all elements (as doubles); shapes must match.
double max_abs_diff(const at::Tensor& a, const at::Tensor& b);

}  // namespace roundpipe::testing

#define EXPECT_TENSOR_CLOSE(actual, expected, atol) \
  EXPECT_TRUE(::roundpipe::testing::tensors_close((actual), (expected), (atol)))
#define ASSERT_TENSOR_CLOSE(actual, expected, atol) \
  ASSERT_TRUE(::roundpipe::testing::tensors_close((actual), (expected), (atol)))
#define EXPECT_TENSOR_EQ(actual, expected) EXPECT_TRUE(::roundpipe::testing::tensors_equal((actual), (expected)))
