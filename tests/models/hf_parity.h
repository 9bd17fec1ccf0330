// Parity of roundpipe::models with Hugging Face transformers on tiny random models: the shared
// body of LlamaTest, Qwen3Test and MistralTest.
#pragma once

#include <cstdint>
#include <string>

namespace roundpipe::testing {

/// One tiny model: `config_class(**kwargs)` from transformers (a Python expression for the kwargs).
struct TinyModelSpec {
  std::string config_class;  ///< "LlamaConfig", "Qwen3Config", "MistralConfig"
  std::string kwargs;        ///< Python dict literal
  bool tied = false;         ///< expected tie_word_embeddings
  int64_t seq = 24;          ///< tokens per row of the two-row batch
};

/// Builds the model in transformers with random weights (not the tiny init, so that every
/// parameter matters), saves it, and checks in fp32: load_pretrained logits (<= 1e-4 abs),
/// causal_lm_loss (<= 1e-5) and gradients of several parameters after backward (<= 1e-4 rel)
/// against transformers; in bf16: logits against transformers run in bf16 (<= 5e-2 of the
/// largest logit); save_pretrained read back by transformers: no missing/unexpected keys and the
/// same logits.
void expect_matches_transformers(const TinyModelSpec& spec);

}  // namespace roundpipe::testing
