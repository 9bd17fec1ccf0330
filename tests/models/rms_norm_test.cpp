// RMSNorm with its own backward (Note [RMSNorm saved tensors], roundpipe/models/detail/rms_norm.h)
// against autograd over the HF expression it replaces: bitwise the same output and gradients of x
// and the weight, fp32, bf16 and fp16 inputs, weight in the input's dtype or float32, both scaling
// orders (LlamaRMSNorm, GptOssRMSNorm), 3-D and 4-D inputs (q/k norms), either input frozen; and it
// keeps fewer bytes for the backward.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <vector>

#include "roundpipe/models/layers.h"
#include "tests/common/sanitizer_memory.h"

namespace roundpipe::testing {
namespace {

// The HF expression under plain autograd (what RMSNormImpl::forward computed before).
at::Tensor reference(const at::Tensor& x, const at::Tensor& weight, double eps, bool weight_in_fp32) {
  const at::Tensor h = x.to(at::kFloat);
  const at::Tensor variance = h.pow(2).mean(-1, /*keepdim=*/true);
  if (weight_in_fp32) return (weight * (h * at::rsqrt(variance + eps))).to(x.scalar_type());
  return weight * (h * at::rsqrt(variance + eps)).to(x.scalar_type());
}

struct Result {
  at::Tensor y, grad_x, grad_weight;
};

Result run(bool ours, const at::Tensor& x0, const at::Tensor& w0, const at::Tensor& g, bool weight_in_fp32, bool x_grad,
           bool w_grad) {
  const at::Tensor x = x0.clone().requires_grad_(x_grad);
  const at::Tensor w = w0.clone().requires_grad_(w_grad);
  at::Tensor y;
  if (ours) {
    models::RMSNorm norm(w0.size(0), 1e-6, at::TensorOptions().dtype(w0.scalar_type()), weight_in_fp32);
    norm->weight = w;
    y = norm(x);
  } else {
    y = reference(x, w, 1e-6, weight_in_fp32);
  }
  (y * g).sum().backward();
  return {y.detach(), x_grad ? x.grad() : at::Tensor(), w_grad ? w.grad() : at::Tensor()};
}

bool same(const at::Tensor& a, const at::Tensor& b) {
  if (!a.defined() || !b.defined()) return a.defined() == b.defined();
  return a.scalar_type() == b.scalar_type() && a.sizes() == b.sizes() && a.equal(b);
}

TEST(RmsNormTest, BitwiseAutogradsGradients_EveryDtypeOrderShapeAndFrozenInput) {
  torch::manual_seed(5);
  for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    for (const at::ScalarType weight_dtype : {dtype, at::kFloat}) {
      for (const bool weight_in_fp32 : {false, true}) {
        for (const std::vector<int64_t>& shape : {std::vector<int64_t>{2, 7, 48}, std::vector<int64_t>{2, 5, 3, 16}}) {
          const int64_t width = shape.back();
          const at::Tensor x = (torch::randn(shape) * 3).to(dtype);
          const at::Tensor w = (torch::rand({width}) + 0.5).to(weight_dtype);
          at::Tensor g = torch::randn(shape);
          for (const auto& [x_grad, w_grad] : {std::pair{true, true}, std::pair{true, false}, std::pair{false, true}}) {
            SCOPED_TRACE(::testing::Message() << c10::toString(dtype) << " weight " << c10::toString(weight_dtype)
                                              << (weight_in_fp32 ? " GptOss" : " Llama") << " " << shape.size()
                                              << "-D x_grad " << x_grad << " w_grad " << w_grad);
            const Result ref = run(false, x, w, g, weight_in_fp32, x_grad, w_grad);
            const Result ours = run(true, x, w, g, weight_in_fp32, x_grad, w_grad);
            EXPECT_TRUE(same(ours.y, ref.y));
            EXPECT_TRUE(same(ours.grad_x, ref.grad_x));
            EXPECT_TRUE(same(ours.grad_weight, ref.grad_weight));
          }
        }
      }
    }
  }
}

// What a forward keeps for the backward (the heap's bytes in use with the output held, after a
// warm-up call): in bf16 the expression keeps x's float32 copy and the bf16 normalized product
// (6 bytes an element beyond x); ours keeps one float per row.
TEST(RmsNormTest, KeepsOnlyTheInputAndOneFloatPerRow) {
  const at::Tensor x = torch::randn({4, 512, 256}).to(at::kBFloat16).requires_grad_();
  models::RMSNorm norm(256, 1e-6, at::TensorOptions().dtype(at::kBFloat16));
  auto kept = [&](auto forward) {
    forward();
    const double before = heap_in_use();
    const at::Tensor y = forward();
    return heap_in_use() - before - static_cast<double>(y.nbytes());
  };
  const double elements = static_cast<double>(x.numel());
  const double ref = kept([&] { return reference(x, norm->weight, 1e-6, false); });
  const double ours = kept([&] { return norm(x); });
  EXPECT_GT(ref, 5.5 * elements) << "the expression's float32 copy and normalized product";
  EXPECT_LT(ours, 0.1 * elements) << "one float per row, " << 4 * 512 * 4 << " bytes, and bookkeeping";
}

}  // namespace
}  // namespace roundpipe::testing
