// Tests of the test harness itself: tensor comparisons and the Python oracle.
#include <ATen/ATen.h>
#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <optional>
#include <string>

#include "tests/common/python_oracle.h"
#include "tests/common/tensor_compare.h"

namespace roundpipe::testing {
namespace {

TEST(TensorCompareTest, Close_ReportsDifferences) {
  auto a = at::arange(6, at::kFloat).reshape({2, 3});
  auto b = a.clone();
  EXPECT_TRUE(tensors_close(a, b));
  b[1][2] = 100;
  auto r = tensors_close(a, b, 1e-6);
  ASSERT_FALSE(r);
  const std::string msg = r.message();
  EXPECT_NE(msg.find("1 of 6 elements differ"), std::string::npos) << msg;
  EXPECT_NE(msg.find("flat index 5: actual 5, expected 100"), std::string::npos) << msg;
  EXPECT_FALSE(tensors_close(a, a.reshape({3, 2})));
  EXPECT_TRUE(tensors_close(a + 1e-7, a, 1e-6));
}

TEST(TensorCompareTest, Equal_IsBitwise) {
  auto a = at::tensor({1.0f, std::nanf(""), INFINITY});
  EXPECT_TRUE(tensors_equal(a, a.clone()));
  EXPECT_FALSE(tensors_equal(a, a.to(at::kDouble)));
  EXPECT_FALSE(tensors_equal(a, a + at::tensor({1e-7f, 0.f, 0.f})));
}

TEST(PythonOracleTest, RoundTripsTensors) {
  ROUNDPIPE_REQUIRE_ORACLE();
  auto x = at::randn({3, 4}, at::kDouble);
  auto out = run_python("outputs['y'] = inputs['x'].matmul(inputs['x'].T)\noutputs['n'] = 7\n", {{"x", x}});
  EXPECT_TRUE(tensors_equal(out.at("y"), x.matmul(x.t())));
  EXPECT_EQ(out.at("n").item<double>(), 7.0);
}

TEST(PythonOracleTest, FailuresCarryPythonsError) {
  ROUNDPIPE_REQUIRE_ORACLE();
  try {
    run_python("raise ValueError('oracle says no')");
    FAIL() << "expected an exception";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("oracle says no"), std::string::npos) << e.what();
  }
}

// Sets (or unsets, with nullopt) an environment variable for one scope.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, std::optional<std::string> value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value) {
      ::setenv(name, value->c_str(), 1);
    } else {
      ::unsetenv(name);
    }
  }
  ~ScopedEnv() {
    if (old_) {
      ::setenv(name_, old_->c_str(), 1);
    } else {
      ::unsetenv(name_);
    }
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

void require_a_missing_oracle() { ROUNDPIPE_ORACLE_OR_SKIP(false, "the test oracle"); }

TEST(PythonOracleTest, OracleRequired_OnlyWhenCiIsTrue) {
  {
    ScopedEnv ci("CI", "true");
    EXPECT_TRUE(oracle_required());
  }
  for (const char* value : {"false", "1", ""}) {
    ScopedEnv ci("CI", std::string(value));
    EXPECT_FALSE(oracle_required()) << "CI=" << value;
  }
  ScopedEnv ci("CI", std::nullopt);
  EXPECT_FALSE(oracle_required());
}

// Issue 17: on CI a missing oracle is a failure, never a skip.
TEST(PythonOracleTest, MissingOracle_FailsWhenCiIsTrue) {
  ScopedEnv ci("CI", "true");
  EXPECT_FATAL_FAILURE(require_a_missing_oracle(), "CI=true but the test oracle is missing");
}

}  // namespace
}  // namespace roundpipe::testing
