// linear_cross_entropy (the fused, chunked LM head + loss) against the full-logits computation in
// plain LibTorch autograd: loss and gradients of hidden and weight, for chunks that divide the
// tokens and chunks that do not, ignored targets, fp32 and bf16; the LmHead and RoundPipe paths
// that use it (training through the engine is compared with transformers in
// roundpipe_training_test.cpp).
#include "roundpipe/models/linear_cross_entropy.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <vector>

#include "roundpipe/models/layers.h"
#include "roundpipe/models/pretrained.h"
#include "roundpipe/round_pipe.h"
#include "tests/common/tensor_compare.h"
#include "tests/common/test_macros.h"

namespace roundpipe::testing {
namespace {

using models::linear_cross_entropy;
using models::LinearCrossEntropyOptions;

constexpr int64_t kVocab = 50, kHidden = 12;

struct Problem {
  at::Tensor hidden, weight, targets;
};

// hidden [2, 7, H], weight [V, H], targets with a few ignored positions.
Problem make_problem(at::ScalarType dtype) {
  torch::manual_seed(3);
  Problem p;
  p.hidden = torch::randn({2, 7, kHidden}).to(dtype).requires_grad_(true);
  p.weight = (torch::randn({kVocab, kHidden}) * 0.5).to(dtype).requires_grad_(true);
  p.targets = torch::randint(0, kVocab, {2, 7}, torch::kLong);
  p.targets.index_put_({0, 3}, models::kIgnoreIndex);
  p.targets.index_put_({1, 0}, models::kIgnoreIndex);
  p.targets.index_put_({1, 6}, models::kIgnoreIndex);
  return p;
}

// The reference: full logits in the model's dtype, upcast, summed cross-entropy (transformers').
at::Tensor full_logits_loss(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets) {
  const at::Tensor logits = torch::matmul(hidden, weight.t()).to(torch::kFloat);
  return torch::nn::functional::cross_entropy(
      logits.reshape({-1, weight.size(0)}), targets.reshape({-1}),
      torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum).ignore_index(models::kIgnoreIndex));
}

at::Tensor ce_of_logits(const at::Tensor& logits, const at::Tensor& targets) {
  return torch::nn::functional::cross_entropy(
      logits.reshape({-1, logits.size(-1)}).to(torch::kFloat), targets.reshape({-1}),
      torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum).ignore_index(models::kIgnoreIndex));
}

// Relative closeness: every element within `rel` of the reference's largest magnitude.
::testing::AssertionResult close_rel(const at::Tensor& actual, const at::Tensor& expected, double rel) {
  return tensors_close(actual.to(at::kFloat), expected.to(at::kFloat), rel * expected.abs().max().item<double>(), rel);
}

struct Result {
  at::Tensor loss, grad_hidden, grad_weight;
};

template <typename LossOf>
Result run(const Problem& p, LossOf loss_of, double grad_scale = 1.0) {
  const at::Tensor hidden = p.hidden.detach().clone().requires_grad_(true);
  const at::Tensor weight = p.weight.detach().clone().requires_grad_(true);
  const at::Tensor loss = loss_of(hidden, weight, p.targets);
  (loss * grad_scale).backward();
  return {loss.detach(), hidden.grad(), weight.grad()};
}

LinearCrossEntropyOptions chunk_of(int64_t tokens, at::ScalarType dtype) {
  const int64_t per_logit = dtype == at::kFloat ? 4 : 8;
  return LinearCrossEntropyOptions().chunk_bytes(tokens * kVocab * per_logit);
}

TEST(LinearCrossEntropyTest, Fp32_MatchesFullLogitsForDividingAndNonDividingChunks) {
  const Problem p = make_problem(at::kFloat);
  const Result ref = run(p, full_logits_loss, 0.37);
  for (int64_t tokens : {1, 2, 3, 5, 7, 14, 100}) {
    SCOPED_TRACE("chunk of " + std::to_string(tokens) + " tokens");
    ASSERT_EQ(models::loss_chunk_tokens(kVocab, at::kFloat, chunk_of(tokens, at::kFloat).chunk_bytes()), tokens);
    const Result got = run(
        p, [&](auto& h, auto& w, auto& t) { return linear_cross_entropy(h, w, t, chunk_of(tokens, at::kFloat)); },
        0.37);
    EXPECT_EQ(got.loss.scalar_type(), at::kFloat);
    EXPECT_EQ(got.loss.dim(), 0);
    EXPECT_TRUE(close_rel(got.loss, ref.loss, 1e-6));
    EXPECT_TRUE(close_rel(got.grad_hidden, ref.grad_hidden, 1e-5));
    EXPECT_TRUE(close_rel(got.grad_weight, ref.grad_weight, 1e-5));
  }
}

// A frozen weight (LoRA's head) gets no gradient, and skipping it changes nothing else: loss and
// hidden gradient are bitwise those of the trainable case, fp32 and bf16.
TEST(LinearCrossEntropyTest, FrozenWeight_NoWeightGradientSameHiddenGradient) {
  for (const auto dtype : {at::kFloat, at::kBFloat16}) {
    SCOPED_TRACE(c10::toString(dtype));
    const Problem p = make_problem(dtype);
    const auto options = chunk_of(3, dtype);
    const Result trainable = run(p, [&](auto& h, auto& w, auto& t) { return linear_cross_entropy(h, w, t, options); });
    const at::Tensor hidden = p.hidden.detach().clone().requires_grad_(true);
    const at::Tensor frozen = p.weight.detach().clone();
    const at::Tensor loss = linear_cross_entropy(hidden, frozen, p.targets, options);
    (loss * 1.0).backward();
    EXPECT_FALSE(frozen.grad().defined());
    EXPECT_TENSOR_EQ(loss.detach(), trainable.loss);
    EXPECT_TENSOR_EQ(hidden.grad(), trainable.grad_hidden);
  }
}

TEST(LinearCrossEntropyTest, Bf16_WithinBf16ToleranceOfTheFp32Reference) {
  const Problem p = make_problem(at::kBFloat16);
  Problem p32{p.hidden.detach().to(at::kFloat), p.weight.detach().to(at::kFloat), p.targets};
  const Result ref = run(p32, full_logits_loss);
  const Result ref_bf16 = run(p, full_logits_loss);  // the full-logits path in bf16 itself
  for (int64_t tokens : {3, 14}) {
    SCOPED_TRACE("chunk of " + std::to_string(tokens) + " tokens");
    const Result got = run(
        p, [&](auto& h, auto& w, auto& t) { return linear_cross_entropy(h, w, t, chunk_of(tokens, at::kBFloat16)); });
    EXPECT_EQ(got.grad_hidden.scalar_type(), at::kBFloat16);
    EXPECT_EQ(got.grad_weight.scalar_type(), at::kBFloat16);
    // bf16 logits carry ~3 significant digits: the loss of 11 tokens agrees to 1e-2 relative.
    EXPECT_TRUE(close_rel(got.loss, ref.loss, 1e-2));
    EXPECT_TRUE(close_rel(got.grad_hidden, ref.grad_hidden, 3e-2));
    EXPECT_TRUE(close_rel(got.grad_weight, ref.grad_weight, 3e-2));
    // ... and no further from it than bf16 autograd over full logits is.
    const double err = (got.grad_weight.to(at::kFloat) - ref.grad_weight).abs().max().item<double>();
    const double err_bf16 = (ref_bf16.grad_weight.to(at::kFloat) - ref.grad_weight).abs().max().item<double>();
    EXPECT_LE(err, 2 * err_bf16 + 1e-3);
  }
}

TEST(LinearCrossEntropyTest, WithoutAutograd_LossOnlyEqualsTheTrainingLoss) {
  const Problem p = make_problem(at::kFloat);
  const at::Tensor ref = full_logits_loss(p.hidden.detach(), p.weight.detach(), p.targets);
  {
    at::NoGradGuard no_grad;
    const at::Tensor loss = linear_cross_entropy(p.hidden, p.weight, p.targets, chunk_of(4, at::kFloat));
    EXPECT_FALSE(loss.requires_grad());
    EXPECT_TRUE(close_rel(loss, ref, 1e-6));
  }
  const at::Tensor detached = linear_cross_entropy(p.hidden.detach(), p.weight.detach(), p.targets);
  EXPECT_FALSE(detached.requires_grad());
  EXPECT_TRUE(close_rel(detached, ref, 1e-6));
}

TEST(LinearCrossEntropyTest, AllTargetsIgnored_ZeroLossAndGradients) {
  Problem p = make_problem(at::kFloat);
  p.targets.fill_(models::kIgnoreIndex);
  const Result got = run(p, [](auto& h, auto& w, auto& t) { return linear_cross_entropy(h, w, t); });
  EXPECT_EQ(got.loss.item<float>(), 0.0f);
  EXPECT_EQ(got.grad_hidden.abs().max().item<float>(), 0.0f);
  EXPECT_EQ(got.grad_weight.abs().max().item<float>(), 0.0f);
}

TEST(LinearCrossEntropyTest, BadInput_ClearErrors) {
  const Problem p = make_problem(at::kFloat);
  EXPECT_THROW_WITH(linear_cross_entropy(p.hidden, p.weight, p.targets.to(at::kFloat)), "integer token ids");
  EXPECT_THROW_WITH(linear_cross_entropy(p.hidden, p.weight, p.targets.narrow(1, 0, 6)), "one target per position");
  EXPECT_THROW_WITH(linear_cross_entropy(p.hidden, p.weight.t(), p.targets), "hidden size");
  EXPECT_THROW_WITH(linear_cross_entropy(p.hidden, p.weight.to(at::kDouble), p.targets), "same floating-point dtype");
  at::Tensor out_of_range = p.targets.clone();
  out_of_range.index_put_({1, 2}, kVocab);
  EXPECT_THROW_WITH(linear_cross_entropy(p.hidden, p.weight, out_of_range), "targets must lie in [0, 50)");
  EXPECT_THROW_WITH(linear_cross_entropy(p.hidden, p.weight, p.targets, LinearCrossEntropyOptions().chunk_bytes(0)),
                    "chunk_bytes must be positive");
  const at::Tensor loss = linear_cross_entropy(p.hidden, p.weight, p.targets);
  loss.backward({}, /*retain_graph=*/true);
  EXPECT_THROW_WITH(loss.backward(), "backward ran twice");
}

TEST(LinearCrossEntropyTest, ShiftLabels_AsTransformers) {
  const at::Tensor labels = torch::tensor({{5, 6, 7}, {8, -100, 9}}, torch::kLong);
  const at::Tensor expected = torch::tensor({{6, 7, -100}, {-100, 9, -100}}, torch::kLong);
  EXPECT_TRUE(torch::equal(models::shift_labels(labels), expected));
}

models::ModelConfig tiny_config(bool tied) {
  models::ModelConfig c;
  c.vocab_size = kVocab;
  c.hidden_size = 16;
  c.intermediate_size = 24;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 4;
  c.tie_word_embeddings = tied;
  return c;
}

TEST(LinearCrossEntropyTest, LmHead_GivenTargetsEqualsCrossEntropyOfItsLogits_LoraFallbackToo) {
  for (bool lora : {false, true}) {
    SCOPED_TRACE(lora ? "LoRA on lm_head" : "plain head");
    torch::manual_seed(11);
    models::Pretrained pre = models::build(tiny_config(/*tied=*/false));
    auto head = pre.model->ptr<models::LmHeadImpl>(pre.model->size() - 1);
    if (lora) {  // apply_lora does not target lm_head; LinearImpl::enable_lora does
      head->lm_head->enable_lora(2, 4.0, 0.0);
      torch::NoGradGuard no_grad;
      for (const auto& p : head->parameters()) p.normal_(0, 0.1);  // uninitialised adapters
    }
    ASSERT_EQ(head->lm_head->has_lora(), lora);
    head->set_loss_chunk_bytes(3 * kVocab * 4);
    const at::Tensor hidden = torch::randn({2, 5, 16});
    const at::Tensor targets = models::shift_labels(torch::randint(0, kVocab, {2, 5}, torch::kLong));
    EXPECT_TRUE(close_rel(head->forward(hidden, targets), ce_of_logits(head->forward(hidden), targets), 1e-6));
  }
}

// Token accuracy without logits: the number of trained positions whose argmax is the target, per
// chunk, == that of the full logits; ignored positions count in neither. Through the LmHead in eval
// mode with report_correct (the LoRA fallback too) and in training mode (unchanged 0-dim loss).
TEST(LinearCrossEntropyTest, Correct_CountsArgmaxHitsLikeFullLogits) {
  Problem p = make_problem(at::kFloat);
  at::NoGradGuard no_grad;
  // Make some predictions right: targets = argmax at half of the positions.
  const at::Tensor logits = torch::matmul(p.hidden, p.weight.t());
  const at::Tensor argmax = logits.argmax(-1);
  at::Tensor targets = p.targets.clone();
  for (int64_t i = 0; i < 7; i += 2) targets.index_put_({0, i}, argmax.index({0, i}));
  targets.index_put_({0, 3}, models::kIgnoreIndex);
  const at::Tensor valid = targets.ne(models::kIgnoreIndex);
  const double expected = (argmax.eq(targets) & valid).sum().item<double>();
  ASSERT_GE(expected, 3.0);
  for (int64_t tokens : {3, 14}) {
    const at::Tensor got =
        models::linear_cross_entropy_and_correct(p.hidden, p.weight, targets, chunk_of(tokens, at::kFloat));
    ASSERT_EQ(got.sizes(), at::IntArrayRef({2}));
    EXPECT_TRUE(close_rel(got[0], full_logits_loss(p.hidden, p.weight, targets), 1e-6));
    EXPECT_EQ(got[1].item<double>(), expected) << tokens << " tokens a chunk";
  }
  for (bool lora : {false, true}) {
    SCOPED_TRACE(lora ? "LoRA on lm_head" : "plain head");
    torch::manual_seed(13);
    models::Pretrained pre = models::build(tiny_config(/*tied=*/false));
    auto head = pre.model->ptr<models::LmHeadImpl>(pre.model->size() - 1);
    if (lora) {
      head->lm_head->enable_lora(2, 4.0, 0.0);
      for (const auto& q : head->parameters()) q.normal_(0, 0.1);
    }
    head->set_loss_chunk_bytes(3 * kVocab * 4);
    head->set_report_correct(true);
    head->eval();
    const at::Tensor hidden = torch::randn({2, 5, 16});
    const at::Tensor head_logits = head->forward(hidden);
    at::Tensor t = models::shift_labels(torch::randint(0, kVocab, {2, 5}, torch::kLong));
    t.index_put_({0, 1}, head_logits.argmax(-1).index({0, 1}));
    const at::Tensor got = head->forward(hidden, t);
    ASSERT_EQ(got.sizes(), at::IntArrayRef({1, 2}));
    EXPECT_TRUE(close_rel(got[0][0], ce_of_logits(head_logits, t), 1e-6));
    EXPECT_EQ(got[0][1].item<double>(),
              (head_logits.argmax(-1).eq(t) & t.ne(models::kIgnoreIndex)).sum().item<double>());
    head->train();
    EXPECT_EQ(head->forward(hidden, t).dim(), 0);
  }
}

// RoundPipe evaluation without logits: forward(inputs, label) with the head given the label
// returns each microbatch's summed loss, equal to the loss of the full logits of forward(inputs).
TEST(LinearCrossEntropyTest, RoundPipeForwardWithLabel_PerMicrobatchSummedLossOfTheLogits) {
  torch::manual_seed(12);
  models::Pretrained pre = models::build(tiny_config(/*tied=*/true));
  pre.model->ptr<models::LmHeadImpl>(pre.model->size() - 1)->set_loss_chunk_bytes(4 * kVocab * 4);
  RoundPipe model(pre.model, RoundPipeOptions().devices({c10::kCPU, c10::kCPU}).label_to_last_layer(true));
  const at::Tensor ids = torch::randint(0, kVocab, {4, 9}, torch::kLong);
  const at::Tensor targets = models::shift_labels(ids);
  RunConfig cfg;
  cfg.num_microbatch = 2;
  at::NoGradGuard no_grad;
  const at::Tensor logits = model.forward({ids}, cfg);  // the head called without the label
  const at::Tensor losses = model.forward({ids}, targets, cfg);
  ASSERT_EQ(losses.sizes(), at::IntArrayRef({2}));
  for (int64_t j = 0; j < 2; ++j) {
    const at::Tensor rows = torch::arange(2 * j, 2 * j + 2);
    EXPECT_TRUE(close_rel(losses[j], ce_of_logits(logits.index({rows}), targets.index({rows})), 1e-6));
  }
  RoundPipe plain(models::build(tiny_config(true)).model, RoundPipeOptions().devices({c10::kCPU}));
  EXPECT_THROW_WITH(plain.forward({ids}, targets, cfg), "forward was given a label, but only a last layer");
  at::GradMode::set_enabled(true);
  const LossFn loss_fn = [](const at::Tensor& summed, const at::Tensor&) { return summed; };
  EXPECT_THROW_WITH(model.forward_backward({ids}, at::Tensor(), loss_fn, cfg),
                    "forward_backward needs a label: RoundPipeOptions::label_to_last_layer");
}

}  // namespace
}  // namespace roundpipe::testing
