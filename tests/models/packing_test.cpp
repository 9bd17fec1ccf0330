// Packed sequences (docs/models.md, "Packed sequences"): rows holding several conversations side by
// side, told apart by the side inputs models::kSegmentIds and kPositionIds, train exactly as the
// conversations would one by one. The reference is a plain loop over the unpacked conversations
// (the presets' unpacked path, itself checked against transformers in transformers_parity_test);
// the packed side runs through RoundPipe on CPU devices, with recompute, 1 and 3 devices.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "roundpipe/models/detail/rotary.h"
#include "roundpipe/models/layers.h"
#include "roundpipe/models/model_config.h"
#include "roundpipe/models/pretrained.h"
#include "roundpipe/round_pipe.h"
#include "roundpipe/side_inputs.h"
#include "tests/common/tensor_compare.h"

namespace roundpipe::testing {
namespace {

using models::ModelConfig;

constexpr int64_t kSeqLen = 16, kVocab = 64, kIgnore = -100;

// Three rows of kSeqLen tokens: [7, 5, 4], [9, 6] + 1 padding, [10, 3] + 3 padding.
const std::vector<std::vector<int64_t>> kRows = {{7, 5, 4}, {9, 6}, {10, 3}};

struct Packed {
  std::vector<at::Tensor> conversations;        // [1, n] token ids each, in row order
  at::Tensor ids, labels, positions, segments;  // [rows, kSeqLen]
};

// Labels are the ids, except -100 on each conversation's first token (no label across a boundary:
// the previous conversation's last logit would be scored against it) and on padding.
Packed make_packed() {
  torch::manual_seed(21);
  Packed p;
  const int64_t rows = static_cast<int64_t>(kRows.size());
  p.ids = torch::zeros({rows, kSeqLen}, torch::kLong);
  p.labels = torch::full({rows, kSeqLen}, kIgnore, torch::kLong);
  p.positions = torch::zeros({rows, kSeqLen}, torch::kLong);
  p.segments = torch::zeros({rows, kSeqLen}, torch::kLong);
  for (int64_t r = 0; r < rows; ++r) {
    int64_t at = 0, segment = 0;
    for (int64_t n : kRows[r]) {
      const at::Tensor conv = torch::randint(1, kVocab, {1, n}, torch::kLong);
      p.conversations.push_back(conv);
      p.ids[r].narrow(0, at, n).copy_(conv[0]);
      p.labels[r].narrow(0, at + 1, n - 1).copy_(conv[0].narrow(0, 1, n - 1));
      p.positions[r].narrow(0, at, n).copy_(torch::arange(n, torch::kLong));
      p.segments[r].narrow(0, at, n).fill_(segment++);
      at += n;
    }
    if (at < kSeqLen) {  // padding: a segment of its own, positions 0.., no labels
      p.positions[r].narrow(0, at, kSeqLen - at).copy_(torch::arange(kSeqLen - at, torch::kLong));
      p.segments[r].narrow(0, at, kSeqLen - at).fill_(segment);
    }
  }
  return p;
}

// Summed cross-entropy of logits [B, T, V] at t against labels [B, T] at t + 1.
at::Tensor summed_lm_loss(const at::Tensor& logits, const at::Tensor& labels) {
  const int64_t t = logits.size(1);
  return torch::nn::functional::cross_entropy(
      logits.narrow(1, 0, t - 1).reshape({-1, logits.size(2)}).to(torch::kFloat),
      labels.narrow(1, 1, t - 1).reshape({-1}),
      torch::nn::functional::CrossEntropyFuncOptions().ignore_index(kIgnore).reduction(torch::kSum));
}

torch::nn::Sequential seeded_model(const ModelConfig& config) {
  torch::manual_seed(4);
  models::Pretrained pre = models::build(config);
  torch::NoGradGuard no_grad;
  for (const auto& item : pre.model->named_parameters()) {
    const bool norm = item.key().find("norm") != std::string::npos;
    if (norm) {
      item.value().normal_(1.0, 0.2);
    } else {
      item.value().normal_(0.0, 0.3);
    }
  }
  return pre.model;
}

struct Result {
  at::Tensor loss;
  std::vector<at::Tensor> grads;  // per unique parameter, module order
};

// The reference: every conversation alone, no side inputs, summed.
Result unpacked_reference(const ModelConfig& config, const Packed& packed) {
  torch::nn::Sequential model = seeded_model(config);
  at::Tensor total = torch::zeros({}, torch::kFloat);
  for (const at::Tensor& conv : packed.conversations) {
    const at::Tensor loss = summed_lm_loss(models::forward(model, conv), conv);
    loss.backward();
    total += loss.detach();
  }
  Result r{total, {}};
  for (const at::Tensor& p : models::unique_parameters(*model)) r.grads.push_back(p.grad().clone());
  return r;
}

// The packed rows without RoundPipe, under a SideInputScope with `side`.
at::Tensor plain_packed_loss(const ModelConfig& config, const Packed& packed, const SideInputs& side) {
  torch::nn::Sequential model = seeded_model(config);
  torch::NoGradGuard no_grad;
  SideInputScope scope(side);
  return summed_lm_loss(models::forward(model, packed.ids), packed.labels);
}

Result roundpipe_packed(const ModelConfig& config, const Packed& packed, int64_t num_devices, RecomputeGrain grain) {
  RoundPipe model(seeded_model(config),
                  RoundPipeOptions().devices(std::vector<c10::Device>(num_devices, c10::kCPU)).seed(3));
  RunConfig cfg;
  cfg.num_microbatch = 3;
  cfg.recompute_grain = grain;
  // Two forward stages, two backward stages and the fused tail: every layer but the head's stage
  // is recomputed.
  const int64_t n = config.num_hidden_layers;  // layers: embedding, n decoder layers, head
  cfg.execute_plan = scheduler::ExecutePlan({{0, 2}, {2, n}}, {{n, n + 2}, {1, n}, {0, 1}});
  std::vector<at::Tensor> masters = model.optim_parameters();
  at::Tensor loss;
  {
    SideInputScope side({{models::kPositionIds, packed.positions}, {models::kSegmentIds, packed.segments}});
    loss = model.forward_backward({packed.ids}, packed.labels, summed_lm_loss, cfg);
  }
  Result r{loss, {}};
  model.step(
      [&] {
        for (const at::Tensor& p : masters) r.grads.push_back(p.grad().clone());
      },
      StepMode::kSync);
  return r;
}

ModelConfig config_of(const std::string& json) { return models::parse_model_config(json); }

const char* const kLlama =
    R"({"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2})";
// Qwen3: q/k norms; a sliding window (4, shorter than most conversations) on the first layers.
const char* const kQwen3Window =
    R"({"model_type": "qwen3", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
        "use_sliding_window": true, "sliding_window": 4, "max_window_layers": 2})";
// gpt-oss: attention sinks, alternating sliding window, YaRN rope, mixture of experts.
const char* const kGptOss =
    R"({"model_type": "gpt_oss", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 24,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
        "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 5, "swiglu_limit": 1.0})";

class PackingTest : public ::testing::TestWithParam<const char*> {};

TEST_P(PackingTest, RoundPipe_PackedRowsEqualConversationsAlone) {
  const ModelConfig config = config_of(GetParam());
  const Packed packed = make_packed();
  const Result ref = unpacked_reference(config, packed);
  const Result one = roundpipe_packed(config, packed, 1, RecomputeGrain::kStage);
  const Result three = roundpipe_packed(config, packed, 3, RecomputeGrain::kStage);
  const Result layer_grain = roundpipe_packed(config, packed, 3, RecomputeGrain::kLayer);
  ASSERT_EQ(ref.grads.size(), three.grads.size());
  EXPECT_LT(max_abs_diff(three.loss, ref.loss), 1e-5 * std::max(1.0, ref.loss.item<double>())) << "loss";
  for (size_t i = 0; i < ref.grads.size(); ++i) {
    // fp32, relative to the gradient's largest entry (they reach ~10 with these weights).
    const double scale = std::max(1.0, ref.grads[i].abs().max().item<double>());
    EXPECT_LT(max_abs_diff(three.grads[i], ref.grads[i]), 1e-5 * scale) << "gradient of parameter " << i;
    EXPECT_TRUE(three.grads[i].equal(one.grads[i])) << "1 vs 3 devices, parameter " << i;
    EXPECT_TRUE(three.grads[i].equal(layer_grain.grads[i])) << "stage vs layer grain, parameter " << i;
  }
  EXPECT_TRUE(three.loss.equal(one.loss));
}

// The test above can tell: without the block-diagonal mask, or with positions that are not each
// conversation's own (scaled), the packed loss differs from the reference (the plain model under a
// SideInputScope). Positions that do not restart but count on through the row leave the loss
// unchanged up to rounding: rotary attention depends only on the distance between a query and
// a key, which a per-conversation offset keeps (the restart is checked on the rotary values in
// Rotary_RestartingPositionsAreTheUnpackedValues).
TEST_P(PackingTest, Ablations_MaskAndPositionsEachMatter) {
  const ModelConfig config = config_of(GetParam());
  const Packed packed = make_packed();
  const double ref = unpacked_reference(config, packed).loss.item<double>();
  const SideInputs both = {{models::kPositionIds, packed.positions}, {models::kSegmentIds, packed.segments}};
  const SideInputs no_mask = {{models::kPositionIds, packed.positions}};
  const SideInputs scaled = {{models::kPositionIds, packed.positions * 3}, {models::kSegmentIds, packed.segments}};
  const SideInputs no_restart = {{models::kSegmentIds, packed.segments}};
  EXPECT_NEAR(plain_packed_loss(config, packed, both).item<double>(), ref, 1e-5 * ref);
  EXPECT_GT(std::abs(plain_packed_loss(config, packed, no_mask).item<double>() - ref), 1e-2) << "mask";
  EXPECT_GT(std::abs(plain_packed_loss(config, packed, scaled).item<double>() - ref), 1e-2) << "positions";
  EXPECT_NEAR(plain_packed_loss(config, packed, no_restart).item<double>(), ref, 1e-4 * ref) << "rotary is relative";
}

std::string preset_name(const ::testing::TestParamInfo<const char*>& info) {
  static const char* const kNames[] = {"Llama", "Qwen3Window", "GptOss"};
  return kNames[info.index];
}

INSTANTIATE_TEST_SUITE_P(Presets, PackingTest, ::testing::Values(kLlama, kQwen3Window, kGptOss), preset_name);

// A packed row's restarting positions give each conversation bitwise the rotary values of the
// unpacked path (positions 0..n-1), and a row that did not restart would not.
TEST(PackingTest, Rotary_RestartingPositionsAreTheUnpackedValues) {
  const ModelConfig config = config_of(kGptOss);  // YaRN: the attention factor too
  const Packed packed = make_packed();
  const auto [cos, sin] = models::detail::rotary_cos_sin_at(config.rope, 8, packed.positions, at::kFloat);
  ASSERT_EQ(cos.sizes(), (std::vector<int64_t>{3, 1, kSeqLen, 8}));
  int64_t start = 0;
  for (int64_t n : kRows[1]) {  // row 1: conversations of 9 and 6 tokens
    const auto [c, s] = models::detail::rotary_cos_sin(config.rope, 8, n, c10::kCPU, at::kFloat);
    EXPECT_TRUE(cos[1][0].narrow(0, start, n).equal(c));
    EXPECT_TRUE(sin[1][0].narrow(0, start, n).equal(s));
    start += n;
  }
  const auto [c_on, s_on] = models::detail::rotary_cos_sin(config.rope, 8, 6, c10::kCPU, at::kFloat, /*start=*/9);
  EXPECT_FALSE(cos[1][0].narrow(0, 9, 6).equal(c_on));
}

TEST(PackingTest, CachedGeneration_RefusesPackedSideInputs) {
  const ModelConfig config = config_of(kLlama);
  torch::nn::Sequential model = seeded_model(config);
  const Packed packed = make_packed();
  auto layer = model->ptr<models::DecoderLayerImpl>(1);
  models::LayerKvCache cache;
  SideInputScope scope({{models::kSegmentIds, packed.segments}});
  torch::NoGradGuard no_grad;
  EXPECT_THROW(layer->forward_cached(torch::zeros({3, kSeqLen, 32}), cache), c10::Error);
}

TEST(PackingTest, SideInputShape_IsChecked) {
  const ModelConfig config = config_of(kLlama);
  torch::nn::Sequential model = seeded_model(config);
  const Packed packed = make_packed();
  SideInputScope scope({{models::kSegmentIds, packed.segments.narrow(1, 0, 8)}});
  torch::NoGradGuard no_grad;
  EXPECT_THROW(models::forward(model, packed.ids), c10::Error);
}

}  // namespace
}  // namespace roundpipe::testing
