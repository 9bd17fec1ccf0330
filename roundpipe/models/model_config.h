// The configuration of a Llama-family decoder (Llama, Mistral, Qwen3, and the mixtures of experts
// Qwen3-MoE and Mixtral), read from and written to a Hugging Face `config.json`. The architecture (layers.h) and the checkpoint loader
// (pretrained.h) are built from it.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "roundpipe/models/architecture.h"

namespace roundpipe::models {

/// Rotary position embedding parameters (HF `rope_parameters`, formerly `rope_theta` +
/// `rope_scaling`).
struct RopeParameters {
  /// "default", "linear", "llama3" or "yarn" (HF `rope_type`, formerly `type`). Others are rejected.
  std::string rope_type = "default";
  /// Base wavelength (HF `rope_theta`).
  double rope_theta = 10000.0;
  /// "linear", "llama3" and "yarn": positions (inverse frequencies) are divided by this. "yarn" with
  /// `factor: null` takes max_position_embeddings / original_max_position_embeddings, as HF does.
  double factor = 1.0;
  /// "llama3" only.
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  /// "llama3" and "yarn"; defaults to max_position_embeddings when the file omits it. A top-level
  /// `original_max_position_embeddings` key wins over the one in rope_parameters, as in HF.
  int64_t original_max_position_embeddings = 8192;
  /// "yarn" only: the rotation counts bounding the linear ramp between extrapolated (fast) and
  /// interpolated (slow) frequencies. HF reads `beta_fast or 32`, `beta_slow or 1`: null and 0 give
  /// the default, and are stored as it.
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  /// "yarn" only: floor/ceil the correction range (HF default true; gpt-oss writes false). A null
  /// value in the file means false, as HF's `rope_parameters.get("truncate", True)` does.
  bool truncate = true;
  /// "yarn" only: the factor multiplying both cos and sin. nullopt: derived from factor, mscale and
  /// mscale_all_dim (detail::rotary_attention_factor).
  std::optional<double> attention_factor;
  /// "yarn" only (DeepSeek-style): used for the derived attention_factor only when both are set and
  /// non-zero (HF's `if mscale and mscale_all_dim`); kept as in the file so a save round-trips them.
  std::optional<double> mscale;
  std::optional<double> mscale_all_dim;

  bool operator==(const RopeParameters& other) const;
  bool operator!=(const RopeParameters& other) const { return !(*this == other); }
};

/// The fields of a HF Llama/Mistral/Qwen3/Qwen3-MoE/Mixtral `config.json` that define the model,
/// with HF's defaults for the model type applied. A plain value type (copyable, no shared state).
///
/// Supported: the architectures of architecture.h (model_type "llama", "mistral", "qwen3",
/// "qwen3_moe", "mixtral", "gpt_oss"); hidden_act "silu";
/// causal attention, full or sliding-window; rope types "default", "linear", "llama3", "yarn". Anything
/// else fails in parse_model_config with the key (other mixture-of-experts types name the
/// supported ones).
struct ModelConfig {
  /// HF `model_type` (architecture.h; model_type_name() gives the string back).
  Architecture architecture = Architecture::kLlama;
  int64_t vocab_size = 32000;
  int64_t hidden_size = 4096;
  int64_t intermediate_size = 11008;
  int64_t num_hidden_layers = 32;
  int64_t num_attention_heads = 32;
  int64_t num_key_value_heads = 32;
  /// Per-head width; HF's default when the file omits it: hidden_size / num_attention_heads.
  int64_t head_dim = 128;
  double rms_norm_eps = 1e-6;
  RopeParameters rope;
  int64_t max_position_embeddings = 2048;
  /// Biases on q/k/v/o (Llama, Qwen3; always false for Mistral).
  bool attention_bias = false;
  /// Biases on gate/up/down (Llama only).
  bool mlp_bias = false;
  bool tie_word_embeddings = false;
  /// HF `dtype` (formerly `torch_dtype`): the weights' dtype in the checkpoint, if stated.
  std::optional<c10::ScalarType> dtype;
  /// Only "silu" is supported.
  std::string hidden_act = "silu";
  /// Standard deviation of the random init (build()).
  double initializer_range = 0.02;
  /// Dropout on attention probabilities in training mode.
  double attention_dropout = 0.0;
  /// Sliding-window attention: the window when some layer uses it (Mistral: `sliding_window` not
  /// null; Qwen3: `use_sliding_window` true and the layer at or past `max_window_layers`).
  std::optional<int64_t> sliding_window;
  /// Qwen3 and gpt_oss: per-layer "full_attention" / "sliding_attention" (HF `layer_types`).
  std::vector<std::string> layer_types;
  /// Qwen3 only.
  bool use_sliding_window = false;
  int64_t max_window_layers = 28;
  std::optional<int64_t> bos_token_id;
  /// HF allows one id or a list; empty when null.
  std::vector<int64_t> eos_token_id;
  /// The embedding's padding row (its gradient is always zero, as in torch.nn.Embedding).
  std::optional<int64_t> pad_token_id;
  // Mixture of experts (qwen3_moe, mixtral, gpt_oss; docs/models.md "Mixture of experts"). num_experts 0:
  // every layer is dense.
  /// Experts per sparse layer (HF `num_experts` or `num_local_experts`).
  int64_t num_experts = 0;
  /// Experts each token is routed to (HF `num_experts_per_tok`).
  int64_t num_experts_per_tok = 0;
  /// Width of one expert's MLP: HF `moe_intermediate_size` (qwen3_moe), `intermediate_size`
  /// (mixtral, gpt_oss). Dense layers of qwen3_moe use intermediate_size.
  int64_t moe_intermediate_size = 0;
  /// qwen3_moe: renormalize the k routing weights to sum to one (mixtral always does).
  bool norm_topk_prob = false;
  /// qwen3_moe: layer i is sparse iff i is not in mlp_only_layers and (i + 1) % decoder_sparse_step
  /// == 0.
  int64_t decoder_sparse_step = 1;
  std::vector<int64_t> mlp_only_layers;
  /// Weight of the load-balancing loss added in training (HF `router_aux_loss_coef`).
  double router_aux_loss_coef = 0.001;
  /// gpt_oss: the clamped SwiGLU of its experts, (clamp(up, -limit, limit) + 1) *
  /// g * sigmoid(alpha * g) with g = clamp(gate, max = limit).
  double swiglu_alpha = 1.702;
  double swiglu_limit = 7.0;
  /// Keys of the file this struct does not interpret (e.g. "use_cache", "transformers_version"),
  /// as a JSON object; to_json writes them back so a save round-trips them.
  std::string extra_json = "{}";

  /// The traits row of `architecture`.
  const ArchitectureTraits& traits() const { return architecture_traits(architecture); }
  /// True when layer `layer` attends within `sliding_window` only.
  bool layer_uses_sliding_window(int64_t layer) const;
  /// True for a mixture-of-experts architecture (qwen3_moe, mixtral, gpt_oss), whatever its layers.
  bool is_moe() const;
  /// True when layer `layer` has a sparse (routed experts) MLP.
  bool layer_is_sparse(int64_t layer) const;
  /// How many layers are sparse.
  int64_t num_sparse_layers() const;
  /// Equality of every field (extra_json compared as parsed JSON).
  bool operator==(const ModelConfig& other) const;
  bool operator!=(const ModelConfig& other) const { return !(*this == other); }
};

/// Parses a HF `config.json` text. Accepts both the older form (`rope_theta`, `rope_scaling`
/// {type|rope_type, ...}, `torch_dtype`) and the newer (`rope_parameters` {rope_theta, rope_type,
/// ...}, `dtype`). Throws c10::Error naming `source_name`, the key and its value for an unknown
/// model_type, an unsupported option (MoE keys on a dense type, a mixture-of-experts type other
/// than qwen3_moe/mixtral/gpt_oss, hidden_act other than silu, rope types other than default/linear/llama3/yarn,
/// partial rotary, Mixtral's router_jitter_noise) or inconsistent sizes.
ModelConfig parse_model_config(const std::string& json_text, const std::string& source_name = "config.json");

/// Reads and parses the file at `path` (a config.json, or a directory holding one).
ModelConfig load_model_config(const std::string& path);

/// The config as HF `config.json` text (newer form: rope_parameters, dtype), with
/// "architectures" set from model_type; transformers loads it.
std::string to_json(const ModelConfig& config);

/// "float32", "bfloat16", "float16" for the HF dtype names; throws for other dtypes.
std::string dtype_name(c10::ScalarType dtype);

}  // namespace roundpipe::models
