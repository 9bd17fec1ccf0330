// The decoder architectures the models module builds (Llama, Mistral, Qwen3 and the mixtures of
// experts Qwen3-MoE, Mixtral, gpt-oss) as an enum, with one row of traits each: what differs
// between them as data. Strings (HF config.json `model_type`) only at the JSON edge.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace roundpipe::models {

/// A decoder architecture. To add one: an enumerator here, a row in kArchitectures
/// (architecture.cpp), and code where its layers differ (layers.cpp, moe.cpp).
enum class Architecture { kLlama, kMistral, kQwen3, kQwen3Moe, kMixtral, kGptOss };

/// How an architecture differs from the others where a value says it. HF's defaults are those of
/// transformers 5's XxxConfig, used when config.json omits the key.
struct ArchitectureTraits {
  Architecture architecture;
  const char* model_type;     ///< HF config.json "model_type"
  const char* hf_class;       ///< HF config.json "architectures" entry
  bool moe;                   ///< a mixture of experts (expert keys, MoeDecoderLayer)
  bool qk_norm;               ///< RMSNorm on each head's q and k (q_norm, k_norm)
  bool attention_sinks;       ///< a learned per-head sink logit in the softmax (sinks)
  bool norm_weight_fp32;      ///< RMSNorm multiplies by its weight in float32, then casts
  bool attention_bias_key;    ///< config.json's "attention_bias" is read (else: no biases, key kept)
  bool mlp_bias_key;          ///< config.json's "mlp_bias" is read (else: no biases, key kept)
  bool llama_special_tokens;  ///< bos_token_id 1, eos_token_id 2 when the file omits them
  // HF's defaults.
  int64_t vocab_size;
  int64_t hidden_size;
  int64_t intermediate_size;
  int64_t num_hidden_layers;
  int64_t num_attention_heads;
  int64_t num_key_value_heads;  ///< 0: num_attention_heads
  int64_t max_position_embeddings;
  int64_t head_dim;  ///< 0: hidden_size / num_attention_heads
  double rms_norm_eps;
  double rope_theta;
  bool attention_bias;
};

/// The row of `architecture`.
const ArchitectureTraits& architecture_traits(Architecture architecture);
/// Every row, in enum order.
const std::vector<ArchitectureTraits>& all_architectures();
/// The architecture of a config.json "model_type", or nullopt when none has it.
std::optional<Architecture> architecture_from_model_type(const std::string& model_type);
/// The config.json "model_type" of `architecture` ("llama", "qwen3_moe", ...).
const char* model_type_name(Architecture architecture);
/// The model types, "llama, mistral, ..." (`moe_only`: those of mixtures of experts), the last
/// two joined by `last_separator`.
std::string model_type_list(bool moe_only = false, const std::string& last_separator = ", ");

}  // namespace roundpipe::models
