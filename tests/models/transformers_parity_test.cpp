// roundpipe::models against Hugging Face transformers on tiny random models (see hf_parity.h).
#include <torch/torch.h>

#include <gtest/gtest.h>

#include "roundpipe/models/layers.h"
#include "roundpipe/models/pretrained.h"
#include "tests/common/test_macros.h"
#include "tests/models/hf_oracle.h"
#include "tests/models/hf_parity.h"

namespace roundpipe::testing {
namespace {

TEST(LlamaTest, MatchesTransformers_GqaUntiedLlama3Rope) {
  ROUNDPIPE_REQUIRE_TRANSFORMERS();
  expect_matches_transformers(
      {"LlamaConfig",
       "dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,"
       " num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False,"
       " rope_parameters=dict(rope_type='llama3', rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,"
       " high_freq_factor=4.0, original_max_position_embeddings=32))",
       /*tied=*/false});
}

TEST(LlamaTest, MatchesTransformers_BiasesLinearRopeHeadDimPadding) {
  ROUNDPIPE_REQUIRE_TRANSFORMERS();
  expect_matches_transformers(
      {"LlamaConfig",
       "dict(vocab_size=128, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,"
       " num_key_value_heads=4, head_dim=16, attention_bias=True, mlp_bias=True, pad_token_id=0,"
       " rope_parameters=dict(rope_type='linear', rope_theta=10000.0, factor=2.0))",
       /*tied=*/false});
}

TEST(Qwen3Test, MatchesTransformers_TiedQkNorm) {
  ROUNDPIPE_REQUIRE_TRANSFORMERS();
  expect_matches_transformers(
      {"Qwen3Config",
       "dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,"
       " num_key_value_heads=2, head_dim=32, max_position_embeddings=128, tie_word_embeddings=True,"
       " rope_parameters=dict(rope_type='default', rope_theta=1000000.0))",
       /*tied=*/true});
}

TEST(MistralTest, MatchesTransformers_WindowLongerThanSequence) {
  ROUNDPIPE_REQUIRE_TRANSFORMERS();
  expect_matches_transformers(
      {"MistralConfig",
       "dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,"
       " num_key_value_heads=1, sliding_window=32, max_position_embeddings=128)",
       /*tied=*/false});
}

TEST(MistralTest, Forward_FailsPastSlidingWindow) {
  models::ModelConfig config = models::parse_model_config(
      R"({"model_type": "mistral", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 32,
          "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "sliding_window": 8})");
  auto pre = models::build(config);
  EXPECT_NO_THROW(pre.model->forward(torch::zeros({1, 8}, torch::kLong)));
  EXPECT_THROW_WITH(pre.model->forward(torch::zeros({1, 9}, torch::kLong)), "sliding_window = 8");
}

TEST(Qwen3Test, Forward_SlidingOnlyOnSlidingLayers) {
  // use_sliding_window with max_window_layers = 1: layer 0 is full attention, layer 1 slides.
  models::ModelConfig config = models::parse_model_config(
      R"({"model_type": "qwen3", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 32, "head_dim": 8,
          "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
          "use_sliding_window": true, "sliding_window": 4, "max_window_layers": 1})");
  EXPECT_FALSE(config.layer_uses_sliding_window(0));
  EXPECT_TRUE(config.layer_uses_sliding_window(1));
  auto pre = models::build(config);
  const auto x = torch::randn({1, 6, 16});
  EXPECT_NO_THROW(pre.model->ptr(1)->as<models::DecoderLayerImpl>()->forward(x));
  EXPECT_THROW_WITH(pre.model->ptr(2)->as<models::DecoderLayerImpl>()->forward(x), "layer 1: sequence length 6");
}

}  // namespace
}  // namespace roundpipe::testing
