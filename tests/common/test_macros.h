// Assertion and registration macros shared by the test suites.
#pragma once

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <string>

/// Registers `fn(device)` twice: `Suite.Name` on the CPU and `Suite.Name_CUDA` on GPU 0 (skipped
/// by the shared test main when no GPU is visible).
#define ROUNDPIPE_DEVICE_TEST(Suite, Name, fn)      \
  TEST(Suite, Name) { fn(c10::Device(c10::kCPU)); } \
  TEST(Suite, Name##_CUDA) { fn(c10::Device(c10::kCUDA, 0)); }

/// Expects `statement` to throw c10::Error whose message contains `text`.
#define EXPECT_THROW_WITH(statement, text)                                        \
  do {                                                                            \
    try {                                                                         \
      statement;                                                                  \
      ADD_FAILURE() << "expected an exception containing: " << (text);            \
    } catch (const c10::Error& e) {                                               \
      EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what(); \
    }                                                                             \
  } while (false)
