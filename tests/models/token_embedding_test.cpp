// TokenEmbedding's gradient (Note [Embedding gradient in place], roundpipe/models/detail/
// token_embedding.cpp) against at::embedding's autograd: bitwise the same .grad over several
// backward passes (microbatches) with repeated tokens, a padding row, int32 and int64 ids, fp32,
// bf16 and fp16; the later passes add into the existing .grad in place (no dense gradient reaches
// the weight's hook); create_graph and a non-leaf weight take the dense gradient.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <optional>
#include <vector>

#include "roundpipe/models/layers.h"
#include "tests/common/tensor_compare.h"

namespace roundpipe::testing {
namespace {

constexpr int64_t kVocab = 40, kWidth = 24;

struct Pass {
  at::Tensor ids, grad;
};

std::vector<Pass> passes(at::ScalarType dtype, at::ScalarType id_dtype) {
  torch::manual_seed(11);
  std::vector<Pass> out;
  for (int i = 0; i < 3; ++i) {  // tokens 0..11 only: many repeats within and across passes
    out.push_back({torch::randint(0, 12, {3, 29}).to(id_dtype), torch::randn({3, 29, kWidth}).to(dtype)});
  }
  return out;
}

TEST(TokenEmbeddingTest, GradientOverPasses_BitwiseAtEmbeddingsAndInPlace) {
  for (const auto dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    for (const auto id_dtype : {at::kLong, at::kInt}) {
      for (const std::optional<int64_t> padding : {std::optional<int64_t>(), std::optional<int64_t>(5)}) {
        SCOPED_TRACE(::testing::Message() << c10::toString(dtype) << " ids " << c10::toString(id_dtype) << " padding "
                                          << padding.value_or(-1));
        models::TokenEmbedding embedding(kVocab, kWidth, padding, at::TensorOptions().dtype(dtype));
        {
          torch::NoGradGuard init;
          embedding->weight.normal_();
        }
        const at::Tensor reference = embedding->weight.detach().clone().requires_grad_(true);
        int dense_gradients = 0;  // the weight's gradient hook sees only gradients autograd hands over
        embedding->weight.register_hook([&](const at::Tensor& g) { dense_gradients += g.defined() ? 1 : 0; });
        const void* first_grad = nullptr;
        for (const Pass& p : passes(dtype, id_dtype)) {
          embedding(p.ids).backward(p.grad);
          at::embedding(reference, p.ids, padding.value_or(-1)).backward(p.grad);
          if (first_grad == nullptr) first_grad = embedding->weight.grad().const_data_ptr();
          EXPECT_EQ(embedding->weight.grad().const_data_ptr(), first_grad) << "the .grad was replaced";
        }
        EXPECT_TENSOR_EQ(embedding->weight.grad(), reference.grad());
        EXPECT_EQ(dense_gradients, 1) << "passes 2 and 3 should add into the .grad in place";
      }
    }
  }
}

TEST(TokenEmbeddingTest, CreateGraphAndNonLeafWeight_DenseGradientAsAtEmbedding) {
  models::TokenEmbedding embedding(kVocab, kWidth, std::nullopt);
  const at::Tensor reference = embedding->weight.detach().clone().requires_grad_(true);
  for (const Pass& p : passes(at::kFloat, at::kLong)) {
    auto got = torch::autograd::grad({embedding(p.ids).mul(p.grad).sum()}, {embedding->weight}, {}, true, true);
    auto want = torch::autograd::grad({at::embedding(reference, p.ids).mul(p.grad).sum()}, {reference}, {}, true, true);
    EXPECT_TENSOR_EQ(got[0], want[0]);
  }
  // A weight computed from a leaf (scaled): the leaf's gradient through the dense path.
  const at::Tensor leaf = torch::randn({kVocab, kWidth}, torch::requires_grad());
  const at::Tensor reference_leaf = leaf.detach().clone().requires_grad_(true);
  for (const Pass& p : passes(at::kFloat, at::kLong)) {
    models::TokenEmbedding scaled(kVocab, kWidth, std::nullopt);
    scaled->weight = leaf * 2.0;  // the module's own tensor replaced by a non-leaf
    scaled(p.ids).backward(p.grad);
    at::embedding(reference_leaf * 2.0, p.ids).backward(p.grad);
  }
  EXPECT_TENSOR_EQ(leaf.grad(), reference_leaf.grad());
}

}  // namespace
}  // namespace roundpipe::testing
