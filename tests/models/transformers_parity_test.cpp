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

TEST(Qwen3Test, MatchesTransformers_YarnRope) {
  // 48 positions past original_max_position_embeddings = 16; attention_factor 0.1 ln 4 + 1 on cos
  // and sin; truncate off as in gpt-oss.
  ROUNDPIPE_REQUIRE_TRANSFORMERS();
  expect_matches_transformers(
      {"Qwen3Config",
       "dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,"
       " num_key_value_heads=2, head_dim=32, max_position_embeddings=64, tie_word_embeddings=False,"
       " rope_parameters=dict(rope_type='yarn', rope_theta=10000.0, factor=4.0, beta_fast=8, beta_slow=1,"
       " truncate=False, original_max_position_embeddings=16))",
       /*tied=*/false, /*seq=*/48});
}

TEST(MistralTest, MatchesTransformers_WindowLongerThanSequence) {
  ROUNDPIPE_REQUIRE_TRANSFORMERS();
  expect_matches_transformers(
      {"MistralConfig",
       "dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,"
       " num_key_value_heads=1, sliding_window=32, max_position_embeddings=128)",
       /*tied=*/false});
}

TEST(MistralTest, MatchesTransformers_SequenceLongerThanWindow) {
  // 24 tokens through a window of 5: one query block with a band mask.
  ROUNDPIPE_REQUIRE_TRANSFORMERS();
  expect_matches_transformers(
      {"MistralConfig",
       "dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,"
       " num_key_value_heads=2, sliding_window=5, max_position_embeddings=128)",
       /*tied=*/false});
}

TEST(MistralTest, MatchesTransformers_SlidingWindowAcrossQueryBlocks) {
  // 1100 tokens through a window of 300: query blocks [0, 512), [512, 1024), [1024, 1100), the
  // later ones attending to keys from 299 positions before the block (Note [Sliding window in blocks]).
  ROUNDPIPE_REQUIRE_TRANSFORMERS();
  expect_matches_transformers(
      {"MistralConfig",
       "dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,"
       " num_key_value_heads=1, sliding_window=300, max_position_embeddings=2048)",
       /*tied=*/false, /*seq=*/1100});
}

TEST(Qwen3Test, MatchesTransformers_SlidingOnlyOnSlidingLayers) {
  // use_sliding_window with max_window_layers = 1: layer 0 is full attention, layer 1 slides over 7.
  ROUNDPIPE_REQUIRE_TRANSFORMERS();
  models::ModelConfig config = models::parse_model_config(
      R"({"model_type": "qwen3", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 32, "head_dim": 8,
          "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
          "use_sliding_window": true, "sliding_window": 4, "max_window_layers": 1})");
  EXPECT_FALSE(config.layer_uses_sliding_window(0));
  EXPECT_TRUE(config.layer_uses_sliding_window(1));
  expect_matches_transformers(
      {"Qwen3Config",
       "dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,"
       " num_key_value_heads=2, head_dim=16, tie_word_embeddings=True, use_sliding_window=True,"
       " sliding_window=7, max_window_layers=1, max_position_embeddings=128)",
       /*tied=*/true});
}

}  // namespace
}  // namespace roundpipe::testing
