#include "tests/common/tensor_compare.h"

#include <ATen/ATen.h>

#include <sstream>

namespace roundpipe::testing {
namespace {

std::string describe(const at::Tensor& t) {
  std::ostringstream out;
  out << t.scalar_type() << t.sizes() << " on " << t.device();
  return out.str();
}

}  // namespace

double max_abs_diff(const at::Tensor& a, const at::Tensor& b) {
  if (a.numel() == 0) return 0;
  auto da = a.detach().to(at::kCPU, at::kDouble);
  auto db = b.detach().to(at::kCPU, at::kDouble);
  return (da - db).abs().max().item<double>();
}

::testing::AssertionResult tensors_close(const at::Tensor& actual, const at::Tensor& expected, double atol,
                                         double rtol) {
  if (!actual.defined() || !expected.defined()) {
    if (actual.defined() == expected.defined()) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << "one tensor is undefined: actual "
                                         << (actual.defined() ? describe(actual) : "undefined") << ", expected "
                                         << (expected.defined() ? describe(expected) : "undefined");
  }
  if (actual.sizes() != expected.sizes()) {
    return ::testing::AssertionFailure() << "shape mismatch: actual " << describe(actual) << ", expected "
                                         << describe(expected);
  }
  if (actual.numel() == 0) return ::testing::AssertionSuccess();
  auto a = actual.detach().to(at::kCPU, at::kDouble).contiguous().flatten();
  auto e = expected.detach().to(at::kCPU, at::kDouble).contiguous().flatten();
  auto both_nan = a.isnan() & e.isnan();
  auto same_inf = a.isinf() & e.isinf() & (a == e);
  auto diff = (a - e).abs();
  auto ok = (diff <= atol + rtol * e.abs()) | both_nan | same_inf;
  if (ok.all().item<bool>()) return ::testing::AssertionSuccess();
  auto bad = (~ok).nonzero().flatten();
  auto finite_diff = at::where(ok, at::zeros_like(diff), at::nan_to_num(diff, 0, 1e300, 1e300));
  std::ostringstream msg;
  msg << bad.numel() << " of " << a.numel() << " elements differ (atol " << atol << ", rtol " << rtol
      << "), max abs diff " << finite_diff.max().item<double>() << "; actual " << describe(actual)
      << ", expected " << describe(expected) << "\n";
  const int64_t show = std::min<int64_t>(bad.numel(), 8);
  for (int64_t k = 0; k < show; ++k) {
    const int64_t flat = bad[k].item<int64_t>();
    msg << "  at flat index " << flat << ": actual " << a[flat].item<double>() << ", expected "
        << e[flat].item<double>() << "\n";
  }
  return ::testing::AssertionFailure() << msg.str();
}

::testing::AssertionResult tensors_equal(const at::Tensor& actual, const at::Tensor& expected) {
  if (actual.scalar_type() != expected.scalar_type()) {
    return ::testing::AssertionFailure() << "dtype mismatch: actual " << describe(actual) << ", expected "
                                         << describe(expected);
  }
  if (actual.sizes() != expected.sizes()) {
    return ::testing::AssertionFailure() << "shape mismatch: actual " << describe(actual) << ", expected "
                                         << describe(expected);
  }
  if (actual.numel() == 0) return ::testing::AssertionSuccess();
  auto a = actual.detach().cpu().contiguous();
  auto e = expected.detach().cpu().contiguous();
  if (std::memcmp(a.data_ptr(), e.data_ptr(), a.nbytes()) == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "not bitwise equal: " << tensors_close(actual, expected).message();
}

::testing::AssertionResult tensor_lists_close(const std::vector<at::Tensor>& actual,
                                              const std::vector<at::Tensor>& expected, double atol, double rtol) {
  if (actual.size() != expected.size()) {
    return ::testing::AssertionFailure() << "list length mismatch: actual " << actual.size() << ", expected "
                                         << expected.size();
  }
  for (size_t i = 0; i < actual.size(); ++i) {
    auto r = tensors_close(actual[i], expected[i], atol, rtol);
    if (!r) return ::testing::AssertionFailure() << "element " << i << ": " << r.message();
  }
  return ::testing::AssertionSuccess();
}

}  // namespace roundpipe::testing
