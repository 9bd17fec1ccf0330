#include "roundpipe/models/model_config.h"

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <iterator>
#include <set>
#include <sys/stat.h>

namespace roundpipe::models {
namespace {

using nlohmann::json;

// Keys that make a model a mixture of experts; any of them set (not null, not 0) on a dense
// model_type is rejected.
constexpr const char* kMoeKeys[] = {"num_experts",          "num_local_experts",     "num_experts_per_tok",
                                    "n_routed_experts",     "n_shared_experts",      "moe_intermediate_size",
                                    "decoder_sparse_step",  "moe_layer_freq",        "first_k_dense_replace",
                                    "shared_expert_intermediate_size"};

// Mixture-of-experts model types of transformers that we do not implement, named in the error.
constexpr const char* kUnsupportedMoeTypes[] = {"qwen2_moe", "deepseek_v2", "deepseek_v3", "olmoe",
                                                "jamba",    "dbrx",      "granitemoe",  "phimoe",      "jetmoe",
                                                "minimax",  "qwen3_next", "glm4_moe",   "ernie4_5_moe", "dots1",
                                                "hunyuan_v1_moe", "llama4", "switch_transformers", "nllb_moe"};


// Reads keys of one JSON object, remembering which ones it interpreted (the rest go to
// ModelConfig::extra_json) and naming the file, key and value in every error.
class KeyReader {
 public:
  KeyReader(const json& object, std::string source) : object_(object), source_(std::move(source)) {}

  const std::string& source() const { return source_; }

  /// The value at `key`, or nullptr when absent or JSON null. Marks the key as interpreted.
  const json* find(const std::string& key) {
    used_.insert(key);
    auto it = object_.find(key);
    if (it == object_.end() || it->is_null()) return nullptr;
    return &*it;
  }
  bool has(const std::string& key) { return find(key) != nullptr; }
  /// True when the object has `key`, even with a null value.
  bool contains(const std::string& key) const { return object_.contains(key); }

  int64_t get_int(const std::string& key, int64_t fallback) {
    const json* v = find(key);
    if (v == nullptr) return fallback;
    return as_int(*v, key);
  }
  std::optional<int64_t> get_optional_int(const std::string& key) {
    const json* v = find(key);
    if (v == nullptr) return std::nullopt;
    return as_int(*v, key);
  }
  double get_double(const std::string& key, double fallback) {
    const json* v = find(key);
    if (v == nullptr) return fallback;
    TORCH_CHECK(v->is_number(), source_, ": key \"", key, "\" = ", v->dump(), " must be a number");
    return v->get<double>();
  }
  bool get_bool(const std::string& key, bool fallback) {
    const json* v = find(key);
    if (v == nullptr) return fallback;
    TORCH_CHECK(v->is_boolean(), source_, ": key \"", key, "\" = ", v->dump(), " must be true or false");
    return v->get<bool>();
  }
  std::string get_string(const std::string& key, const std::string& fallback) {
    const json* v = find(key);
    if (v == nullptr) return fallback;
    TORCH_CHECK(v->is_string(), source_, ": key \"", key, "\" = ", v->dump(), " must be a string");
    return v->get<std::string>();
  }

  int64_t as_int(const json& v, const std::string& key) const {
    TORCH_CHECK(v.is_number_integer() || (v.is_number_float() && std::floor(v.get<double>()) == v.get<double>()),
                source_, ": key \"", key, "\" = ", v.dump(), " must be an integer");
    return v.is_number_integer() ? v.get<int64_t>() : static_cast<int64_t>(v.get<double>());
  }

  /// The keys this reader did not interpret, as a JSON object.
  json rest() const {
    json out = json::object();
    for (auto it = object_.begin(); it != object_.end(); ++it) {
      if (used_.count(it.key()) == 0) out[it.key()] = it.value();
    }
    return out;
  }

 private:
  const json& object_;
  std::string source_;
  std::set<std::string> used_;
};

std::optional<c10::ScalarType> parse_dtype(const json& v, const std::string& key, const std::string& source) {
  TORCH_CHECK(v.is_string(), source, ": key \"", key, "\" = ", v.dump(), " must be a string such as \"bfloat16\"");
  const std::string name = v.get<std::string>();
  if (name == "float32" || name == "float") return c10::kFloat;
  if (name == "bfloat16") return c10::kBFloat16;
  if (name == "float16" || name == "half") return c10::kHalf;
  if (name == "auto") return std::nullopt;
  TORCH_CHECK(false, source, ": key \"", key, "\" = \"", name,
              "\" is not a supported dtype (use float32, bfloat16 or float16)");
}

// The "yarn" keys of `rope` (named `params_key` in messages) into `config.rope`, with the defaults
// and null/0 meanings of HF's _compute_yarn_parameters. original_max_position_embeddings is read.
void parse_yarn(KeyReader& rope, const std::string& params_key, ModelConfig& config) {
  const std::string& source = rope.source();
  RopeParameters& out = config.rope;
  TORCH_CHECK(rope.contains("factor"), source, ": key \"", params_key, ".factor\" is required for rope type yarn");
  if (rope.has("factor")) {
    out.factor = rope.get_double("factor", 1.0);
  } else {  // null: the context extension ratio (DeepSeek-V3 configs), a true division as in Python
    out.factor = static_cast<double>(config.max_position_embeddings) /
                 static_cast<double>(out.original_max_position_embeddings);
  }
  TORCH_CHECK(out.factor > 0, source, ": key \"", params_key, ".factor\" = ", out.factor, " must be positive");
  // HF reads `beta_fast or 32` and `beta_slow or 1`: null and 0 both mean the default.
  out.beta_fast = rope.get_double("beta_fast", 0.0);
  if (out.beta_fast == 0.0) out.beta_fast = 32.0;
  out.beta_slow = rope.get_double("beta_slow", 0.0);
  if (out.beta_slow == 0.0) out.beta_slow = 1.0;
  // HF reads `rope_parameters.get("truncate", True)`: absent is true, null is false.
  const bool truncate_null = rope.contains("truncate") && !rope.has("truncate");
  out.truncate = truncate_null ? false : rope.get_bool("truncate", true);
  if (rope.has("attention_factor")) {
    out.attention_factor = rope.get_double("attention_factor", 1.0);
    TORCH_CHECK(*out.attention_factor > 0, source, ": key \"", params_key, ".attention_factor\" = ",
                *out.attention_factor, " must be positive (it multiplies cos and sin)");
  }
  if (rope.has("mscale")) out.mscale = rope.get_double("mscale", 0.0);
  if (rope.has("mscale_all_dim")) out.mscale_all_dim = rope.get_double("mscale_all_dim", 0.0);
}

// Reads the rotary parameters from either form into `config.rope`.
void parse_rope(KeyReader& top, ModelConfig& config) {
  const std::string& source = top.source();
  // HF's default_theta: 10000, except GptOssConfig's 150000.
  const double top_theta = top.get_double("rope_theta", config.traits().rope_theta);
  const json* params = top.find("rope_parameters");
  const char* params_key = "rope_parameters";
  if (params == nullptr) {
    params = top.find("rope_scaling");
    params_key = "rope_scaling";
  } else {
    top.find("rope_scaling");  // the newer form wins, as in transformers
  }
  config.rope = RopeParameters{};
  config.rope.rope_theta = top_theta;
  config.rope.original_max_position_embeddings = config.max_position_embeddings;
  if (const json* partial = top.find("partial_rotary_factor")) {
    TORCH_CHECK(partial->is_number() && partial->get<double>() == 1.0, source, ": key \"partial_rotary_factor\" = ",
                partial->dump(), " is not supported (only 1.0: rotary embedding over the whole head)");
  }
  if (params == nullptr) {
    if (config.architecture == Architecture::kGptOss) {
      // GptOssConfig's default rope_parameters: YaRN, factor 32 over 4096 positions.
      config.rope.rope_type = "yarn";
      config.rope.factor = 32.0;
      config.rope.beta_fast = 32.0;
      config.rope.beta_slow = 1.0;
      config.rope.truncate = false;
      config.rope.original_max_position_embeddings = 4096;
    }
    return;
  }
  TORCH_CHECK(params->is_object(), source, ": key \"", params_key, "\" = ", params->dump(), " must be an object");
  for (auto it = params->begin(); it != params->end(); ++it) {
    TORCH_CHECK(!it.value().is_object(), source, ": key \"", params_key, ".", it.key(),
                "\" holds per-layer-type rotary parameters, which Llama/Mistral/Qwen3 do not use");
  }
  KeyReader rope(*params, source);
  const std::string type_key = rope.has("rope_type") ? "rope_type" : "type";
  config.rope.rope_type = rope.get_string(type_key, "default");
  config.rope.rope_theta = rope.get_double("rope_theta", top_theta);
  const std::string& type = config.rope.rope_type;
  TORCH_CHECK(type == "default" || type == "linear" || type == "llama3" || type == "yarn", source, ": key \"",
              params_key, ".", type_key, "\" = \"", type,
              "\" is not supported (supported: default, linear, llama3, yarn)");
  if (const json* partial = rope.find("partial_rotary_factor")) {
    TORCH_CHECK(partial->is_number() && partial->get<double>() == 1.0, source, ": key \"", params_key,
                ".partial_rotary_factor\" = ", partial->dump(), " is not supported (only 1.0)");
  }
  if (type == "llama3" || type == "yarn") {
    // HF (standardize_rope_params) lets a top-level original_max_position_embeddings (Phi-3 style)
    // win over the one in the rotary parameters.
    const std::string top_key = "original_max_position_embeddings";
    config.rope.original_max_position_embeddings =
        top.has(top_key) ? top.get_int(top_key, 0)
                         : rope.get_int("original_max_position_embeddings", config.max_position_embeddings);
    rope.find("original_max_position_embeddings");
    TORCH_CHECK(config.rope.original_max_position_embeddings > 0, source, ": key \"", params_key,
                ".original_max_position_embeddings\" = ", config.rope.original_max_position_embeddings,
                " must be positive");
  }
  if (type == "linear" || type == "llama3") {
    TORCH_CHECK(rope.has("factor"), source, ": key \"", params_key, ".factor\" is required for rope type ", type);
    config.rope.factor = rope.get_double("factor", 1.0);
    TORCH_CHECK(config.rope.factor > 0, source, ": key \"", params_key, ".factor\" = ", config.rope.factor,
                " must be positive");
  }
  if (type == "llama3") {
    for (const char* key : {"low_freq_factor", "high_freq_factor"}) {
      TORCH_CHECK(rope.has(key), source, ": key \"", params_key, ".", key, "\" is required for rope type llama3");
    }
    config.rope.low_freq_factor = rope.get_double("low_freq_factor", 1.0);
    config.rope.high_freq_factor = rope.get_double("high_freq_factor", 4.0);
    TORCH_CHECK(config.rope.high_freq_factor != config.rope.low_freq_factor, source, ": keys \"", params_key,
                ".low_freq_factor\" and \"high_freq_factor\" are both ", config.rope.low_freq_factor,
                "; they must differ");
  }
  if (type == "yarn") parse_yarn(rope, params_key, config);
  TORCH_CHECK(config.rope.rope_theta > 0, source, ": key \"rope_theta\" = ", config.rope.rope_theta,
              " must be positive");
}

void parse_sliding_window(KeyReader& top, ModelConfig& config) {
  const std::string& source = top.source();
  const Architecture arch = config.architecture;
  if (arch == Architecture::kMistral || arch == Architecture::kMixtral) {
    // MistralConfig's default window is 4096, MixtralConfig's none; configs state null to turn it
    // off. Every layer uses the window.
    const bool stated = top.contains("sliding_window");
    const json* v = top.find("sliding_window");
    config.sliding_window = std::nullopt;
    if (v != nullptr) config.sliding_window = top.as_int(*v, "sliding_window");
    if (!stated && arch == Architecture::kMistral) config.sliding_window = 4096;
    return;
  }
  if (arch == Architecture::kQwen3Moe) {
    // Qwen3MoeConfig: the window (default 4096) applies to every layer iff use_sliding_window.
    config.use_sliding_window = top.get_bool("use_sliding_window", false);
    const bool stated = top.contains("sliding_window");
    const std::optional<int64_t> window = top.get_optional_int("sliding_window");
    config.sliding_window = config.use_sliding_window ? (stated ? window : std::optional<int64_t>(4096)) : std::nullopt;
    return;
  }
  if (arch == Architecture::kQwen3 || arch == Architecture::kGptOss) {
    const bool gpt_oss = arch == Architecture::kGptOss;
    // GptOssConfig: window 128, even layers sliding unless layer_types says otherwise.
    config.use_sliding_window = gpt_oss || top.get_bool("use_sliding_window", false);
    config.max_window_layers = gpt_oss ? 0 : top.get_int("max_window_layers", 28);
    const bool stated = top.contains("sliding_window");
    const std::optional<int64_t> window = top.get_optional_int("sliding_window");
    config.sliding_window = config.use_sliding_window ? (gpt_oss && !stated ? std::optional<int64_t>(128) : window)
                                                      : std::nullopt;
    config.layer_types.clear();
    if (const json* types = top.find("layer_types")) {
      TORCH_CHECK(types->is_array() && static_cast<int64_t>(types->size()) == config.num_hidden_layers, source,
                  ": key \"layer_types\" = ", types->dump(), " must list one type per layer (num_hidden_layers = ",
                  config.num_hidden_layers, ")");
      for (const auto& t : *types) {
        TORCH_CHECK(t.is_string() && (t == "full_attention" || t == "sliding_attention"), source,
                    ": key \"layer_types\" holds ", t.dump(), "; supported: \"full_attention\", \"sliding_attention\"");
        config.layer_types.push_back(t.get<std::string>());
      }
    } else {
      for (int64_t i = 0; i < config.num_hidden_layers; ++i) {
        const bool sliding = gpt_oss ? i % 2 == 0 : config.sliding_window && i >= config.max_window_layers;
        config.layer_types.push_back(sliding ? "sliding_attention" : "full_attention");
      }
    }
    bool any_sliding = false;
    for (const auto& t : config.layer_types) any_sliding |= t == "sliding_attention";
    TORCH_CHECK(!any_sliding || config.sliding_window, source,
                ": key \"layer_types\" has sliding_attention layers but \"sliding_window\" is null or "
                "\"use_sliding_window\" is false");
    if (!any_sliding) config.sliding_window = std::nullopt;
    return;
  }
  // Llama has no sliding window; a stray key is kept in extra_json.
  config.sliding_window = std::nullopt;
}

// The expert keys of qwen3_moe and mixtral into `config` (after the sizes).
void parse_experts(KeyReader& top, ModelConfig& config) {
  const std::string& source = top.source();
  const bool qwen3_moe = config.architecture == Architecture::kQwen3Moe;
  const bool gpt_oss = config.architecture == Architecture::kGptOss;
  // Qwen3MoeConfig and GptOssConfig map num_experts to num_local_experts (released configs use the first,
  // transformers 5 writes the second); MixtralConfig has num_local_experts.
  const char* count_key = top.has("num_local_experts") ? "num_local_experts" : "num_experts";
  if ((qwen3_moe || gpt_oss) && top.has("num_local_experts") && top.has("num_experts")) {
    TORCH_CHECK(top.get_int("num_experts", 0) == top.get_int("num_local_experts", 0), source,
                ": keys \"num_experts\" and \"num_local_experts\" disagree (", top.get_int("num_experts", 0), " vs ",
                top.get_int("num_local_experts", 0), "); they name the same count");
  }
  if (!qwen3_moe && !gpt_oss) {
    const json* v = top.find("num_experts");
    TORCH_CHECK(v == nullptr, source, ": key \"num_experts\" = ", v == nullptr ? "" : v->dump(),
                " is not a Mixtral key; Mixtral's expert count is \"num_local_experts\"");
  }
  config.num_experts = top.get_int(count_key, qwen3_moe || gpt_oss ? 128 : 8);
  config.num_experts_per_tok = top.get_int("num_experts_per_tok", qwen3_moe ? 8 : gpt_oss ? 4 : 2);
  config.moe_intermediate_size =
      qwen3_moe ? top.get_int("moe_intermediate_size", 768) : config.intermediate_size;
  // gpt_oss softmaxes the k chosen logits (its weights sum to one by construction).
  config.norm_topk_prob = qwen3_moe ? top.get_bool("norm_topk_prob", false) : !gpt_oss;
  config.router_aux_loss_coef = top.get_double("router_aux_loss_coef", 0.001);
  top.find("output_router_logits");  // kept in extra_json: see docs/models.md, "Mixture of experts"
  config.decoder_sparse_step = 1;
  config.mlp_only_layers.clear();
  if (qwen3_moe) {
    config.decoder_sparse_step = top.get_int("decoder_sparse_step", 1);
    TORCH_CHECK(config.decoder_sparse_step > 0, source, ": key \"decoder_sparse_step\" = ",
                config.decoder_sparse_step, " must be positive");
    if (const json* only = top.find("mlp_only_layers")) {
      TORCH_CHECK(only->is_array(), source, ": key \"mlp_only_layers\" = ", only->dump(),
                  " must be a list of layer indices");
      for (const auto& v : *only) {
        const int64_t layer = top.as_int(v, "mlp_only_layers");
        TORCH_CHECK(layer >= 0 && layer < config.num_hidden_layers, source, ": key \"mlp_only_layers\" holds ",
                    layer, ", outside [0, num_hidden_layers = ", config.num_hidden_layers, ")");
        config.mlp_only_layers.push_back(layer);
      }
    }
  } else if (gpt_oss) {
    config.swiglu_alpha = top.get_double("swiglu_alpha", 1.702);
    config.swiglu_limit = top.get_double("swiglu_limit", 7.0);
    TORCH_CHECK(std::isfinite(config.swiglu_alpha) && config.swiglu_limit > 0 && std::isfinite(config.swiglu_limit),
                source, ": keys \"swiglu_alpha\" = ", config.swiglu_alpha, " and \"swiglu_limit\" = ",
                config.swiglu_limit, " must be finite, the limit positive");
  } else {
    const double jitter = top.get_double("router_jitter_noise", 0.0);
    TORCH_CHECK(jitter == 0.0, source, ": key \"router_jitter_noise\" = ", jitter,
                " is not supported (it multiplies the layer input by random noise in training); set it to 0");
  }
  TORCH_CHECK(config.num_experts > 0, source, ": key \"", count_key, "\" = ", config.num_experts,
              " must be positive");
  TORCH_CHECK(config.num_experts_per_tok > 0 && config.num_experts_per_tok <= config.num_experts, source,
              ": key \"num_experts_per_tok\" = ", config.num_experts_per_tok, " must be in [1, ", count_key, " = ",
              config.num_experts, "]");
  TORCH_CHECK(config.moe_intermediate_size > 0, source, ": key \"moe_intermediate_size\" = ",
              config.moe_intermediate_size, " must be positive");
  TORCH_CHECK(config.router_aux_loss_coef >= 0 && std::isfinite(config.router_aux_loss_coef), source,
              ": key \"router_aux_loss_coef\" = ", config.router_aux_loss_coef, " must be finite and >= 0");
}

// config.json's "model_type" as an Architecture; anything else fails naming the supported types.
Architecture parse_architecture(KeyReader& top) {
  const std::string& source = top.source();
  TORCH_CHECK(top.has("model_type"), source, " has no \"model_type\" (expected one of ", model_type_list(), ")");
  const std::string model_type = top.get_string("model_type", "");
  for (const char* moe_type : kUnsupportedMoeTypes) {
    TORCH_CHECK(model_type != moe_type, source, ": key \"model_type\" = \"", model_type,
                "\" is a mixture-of-experts architecture that is not supported (supported: ", model_type_list(),
                "; the mixtures of experts among them: ", model_type_list(/*moe_only=*/true), ")");
  }
  const std::optional<Architecture> architecture = architecture_from_model_type(model_type);
  TORCH_CHECK(architecture.has_value(), source, ": key \"model_type\" = \"", model_type,
              "\" is not supported (supported: ", model_type_list(), ")");
  return *architecture;
}

// The sizes, norms and biases, with the architecture's HF defaults (its traits row: LlamaConfig,
// MistralConfig, Qwen3Config, Qwen3MoeConfig, MixtralConfig, GptOssConfig in transformers 5).
void parse_sizes(KeyReader& top, ModelConfig& c) {
  const std::string& source_name = top.source();
  const ArchitectureTraits& traits = c.traits();
  c.vocab_size = top.get_int("vocab_size", traits.vocab_size);
  c.hidden_size = top.get_int("hidden_size", traits.hidden_size);
  c.intermediate_size = top.get_int("intermediate_size", traits.intermediate_size);
  c.num_hidden_layers = top.get_int("num_hidden_layers", traits.num_hidden_layers);
  c.num_attention_heads = top.get_int("num_attention_heads", traits.num_attention_heads);
  c.num_key_value_heads = top.get_int(
      "num_key_value_heads", traits.num_key_value_heads > 0 ? traits.num_key_value_heads : c.num_attention_heads);
  c.max_position_embeddings = top.get_int("max_position_embeddings", traits.max_position_embeddings);
  c.rms_norm_eps = top.get_double("rms_norm_eps", traits.rms_norm_eps);
  c.initializer_range = top.get_double("initializer_range", 0.02);
  c.attention_dropout = top.get_double("attention_dropout", 0.0);
  c.tie_word_embeddings = top.get_bool("tie_word_embeddings", false);
  c.attention_bias = traits.attention_bias_key ? top.get_bool("attention_bias", traits.attention_bias) : false;
  c.mlp_bias = traits.mlp_bias_key ? top.get_bool("mlp_bias", false) : false;

  for (const auto& [key, value] : std::vector<std::pair<const char*, int64_t>>{
           {"vocab_size", c.vocab_size},
           {"hidden_size", c.hidden_size},
           {"intermediate_size", c.intermediate_size},
           {"num_hidden_layers", c.num_hidden_layers},
           {"num_attention_heads", c.num_attention_heads},
           {"num_key_value_heads", c.num_key_value_heads},
           {"max_position_embeddings", c.max_position_embeddings}}) {
    TORCH_CHECK(value > 0, source_name, ": key \"", key, "\" = ", value, " must be positive");
  }
  if (top.has("head_dim")) {
    c.head_dim = top.get_int("head_dim", 0);
  } else if (traits.head_dim > 0) {
    c.head_dim = traits.head_dim;
  } else {
    TORCH_CHECK(c.hidden_size % c.num_attention_heads == 0, source_name, ": key \"hidden_size\" = ", c.hidden_size,
                " is not divisible by \"num_attention_heads\" = ", c.num_attention_heads,
                " and \"head_dim\" is not given");
    c.head_dim = c.hidden_size / c.num_attention_heads;
  }
  TORCH_CHECK(c.head_dim > 0 && c.head_dim % 2 == 0, source_name, ": key \"head_dim\" = ", c.head_dim,
              " must be positive and even (rotary embeddings pair the dimensions)");
  TORCH_CHECK(c.num_attention_heads % c.num_key_value_heads == 0, source_name, ": key \"num_attention_heads\" = ",
              c.num_attention_heads, " must be a multiple of \"num_key_value_heads\" = ", c.num_key_value_heads);
  TORCH_CHECK(c.rms_norm_eps > 0, source_name, ": key \"rms_norm_eps\" = ", c.rms_norm_eps, " must be positive");
  TORCH_CHECK(c.attention_dropout >= 0 && c.attention_dropout < 1, source_name, ": key \"attention_dropout\" = ",
              c.attention_dropout, " must be in [0, 1)");
}

// bos, eos (one id or a list) and pad.
void parse_special_tokens(KeyReader& top, ModelConfig& c) {
  const std::string& source_name = top.source();
  const std::optional<int64_t> default_special =
      c.traits().llama_special_tokens ? std::optional<int64_t>(1) : std::nullopt;  // bos 1, eos 2
  c.bos_token_id = top.contains("bos_token_id") ? top.get_optional_int("bos_token_id") : default_special;
  c.eos_token_id.clear();
  if (const json* eos = top.find("eos_token_id")) {
    if (eos->is_array()) {
      for (const auto& id : *eos) c.eos_token_id.push_back(top.as_int(id, "eos_token_id"));
    } else {
      c.eos_token_id.push_back(top.as_int(*eos, "eos_token_id"));
    }
  } else if (!top.contains("eos_token_id") && c.traits().llama_special_tokens) {
    c.eos_token_id.push_back(2);
  }
  c.pad_token_id = top.get_optional_int("pad_token_id");
  if (c.pad_token_id) {
    TORCH_CHECK(*c.pad_token_id >= 0 && *c.pad_token_id < c.vocab_size, source_name, ": key \"pad_token_id\" = ",
                *c.pad_token_id, " is outside the vocabulary [0, ", c.vocab_size, ")");
  }
}

std::string read_text_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in.good(), "cannot open model config ", path, ": check that the file exists and is readable");
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// The expert keys of a mixture of experts, in the names of its architecture's HF config.
void experts_to_json(const ModelConfig& c, json& j) {
  const bool qwen3_moe = c.architecture == Architecture::kQwen3Moe;
  const bool gpt_oss = c.architecture == Architecture::kGptOss;
  j.erase("num_local_experts");
  j.erase("num_experts");
  j[qwen3_moe ? "num_experts" : "num_local_experts"] = c.num_experts;
  // The weights are written in the compute dtype, never quantized (docs/models.md).
  j.erase("quantization_config");
  j["num_experts_per_tok"] = c.num_experts_per_tok;
  j["router_aux_loss_coef"] = c.router_aux_loss_coef;
  if (qwen3_moe) {
    j["moe_intermediate_size"] = c.moe_intermediate_size;
    j["norm_topk_prob"] = c.norm_topk_prob;
    j["decoder_sparse_step"] = c.decoder_sparse_step;
    j["mlp_only_layers"] = c.mlp_only_layers;
  } else if (gpt_oss) {
    j["swiglu_alpha"] = c.swiglu_alpha;
    j["swiglu_limit"] = c.swiglu_limit;
    j["sliding_window"] = c.sliding_window ? json(*c.sliding_window) : json(nullptr);
    j["layer_types"] = c.layer_types;
  } else {
    j["router_jitter_noise"] = 0.0;
  }
}

json eos_to_json(const std::vector<int64_t>& ids) {
  if (ids.empty()) return nullptr;
  if (ids.size() == 1) return ids[0];
  return ids;
}

}  // namespace

bool RopeParameters::operator==(const RopeParameters& o) const {
  return rope_type == o.rope_type && rope_theta == o.rope_theta && factor == o.factor &&
         low_freq_factor == o.low_freq_factor && high_freq_factor == o.high_freq_factor &&
         original_max_position_embeddings == o.original_max_position_embeddings && beta_fast == o.beta_fast &&
         beta_slow == o.beta_slow && truncate == o.truncate && attention_factor == o.attention_factor &&
         mscale == o.mscale && mscale_all_dim == o.mscale_all_dim;
}

bool ModelConfig::is_moe() const { return traits().moe; }

bool ModelConfig::layer_is_sparse(int64_t layer) const {
  if (!is_moe() || num_experts <= 0) return false;
  if (std::find(mlp_only_layers.begin(), mlp_only_layers.end(), layer) != mlp_only_layers.end()) return false;
  return (layer + 1) % decoder_sparse_step == 0;
}

int64_t ModelConfig::num_sparse_layers() const {
  int64_t n = 0;
  for (int64_t i = 0; i < num_hidden_layers; ++i) n += layer_is_sparse(i) ? 1 : 0;
  return n;
}

bool ModelConfig::layer_uses_sliding_window(int64_t layer) const {
  if (!sliding_window) return false;
  if (architecture == Architecture::kQwen3 || architecture == Architecture::kGptOss) {
    return layer >= 0 && layer < static_cast<int64_t>(layer_types.size()) && layer_types[layer] == "sliding_attention";
  }
  return true;
}

bool ModelConfig::operator==(const ModelConfig& o) const {
  return architecture == o.architecture && vocab_size == o.vocab_size && hidden_size == o.hidden_size &&
         intermediate_size == o.intermediate_size && num_hidden_layers == o.num_hidden_layers &&
         num_attention_heads == o.num_attention_heads && num_key_value_heads == o.num_key_value_heads &&
         head_dim == o.head_dim && rms_norm_eps == o.rms_norm_eps && rope == o.rope &&
         max_position_embeddings == o.max_position_embeddings && attention_bias == o.attention_bias &&
         mlp_bias == o.mlp_bias && tie_word_embeddings == o.tie_word_embeddings && dtype == o.dtype &&
         hidden_act == o.hidden_act && initializer_range == o.initializer_range &&
         attention_dropout == o.attention_dropout && sliding_window == o.sliding_window &&
         layer_types == o.layer_types && use_sliding_window == o.use_sliding_window &&
         max_window_layers == o.max_window_layers && bos_token_id == o.bos_token_id &&
         eos_token_id == o.eos_token_id && pad_token_id == o.pad_token_id && num_experts == o.num_experts &&
         num_experts_per_tok == o.num_experts_per_tok && moe_intermediate_size == o.moe_intermediate_size &&
         norm_topk_prob == o.norm_topk_prob && decoder_sparse_step == o.decoder_sparse_step &&
         mlp_only_layers == o.mlp_only_layers && router_aux_loss_coef == o.router_aux_loss_coef &&
         swiglu_alpha == o.swiglu_alpha && swiglu_limit == o.swiglu_limit &&
         json::parse(extra_json) == json::parse(o.extra_json);
}

std::string dtype_name(c10::ScalarType dtype) {
  switch (dtype) {
    case c10::kFloat:
      return "float32";
    case c10::kBFloat16:
      return "bfloat16";
    case c10::kHalf:
      return "float16";
    default:
      TORCH_CHECK(false, "dtype ", dtype, " has no Hugging Face config name: use float32, bfloat16 or float16");
  }
}

ModelConfig parse_model_config(const std::string& json_text, const std::string& source_name) {
  json root;
  try {
    root = json::parse(json_text);
  } catch (const json::exception& e) {
    TORCH_CHECK(false, source_name, " is not valid JSON: ", e.what());
  }
  TORCH_CHECK(root.is_object(), source_name, " must hold a JSON object, got ", root.type_name());
  KeyReader top(root, source_name);
  ModelConfig c;

  c.architecture = parse_architecture(top);

  if (!c.is_moe()) {
    for (const char* key : kMoeKeys) {
      const json* v = top.find(key);
      if (v == nullptr || (v->is_number() && v->get<double>() == 0)) continue;
      TORCH_CHECK(false, source_name, ": key \"", key, "\" = ", v->dump(), " describes a mixture of experts, which ",
                  c.traits().model_type, " has not (the mixture-of-experts types are ",
                  model_type_list(/*moe_only=*/true, " and "), ")");
    }
  }
  c.hidden_act = top.get_string("hidden_act", "silu");
  TORCH_CHECK(c.hidden_act == "silu", source_name, ": key \"hidden_act\" = \"", c.hidden_act,
              "\" is not supported (only \"silu\", the SwiGLU MLP of Llama/Mistral/Qwen3)");

  parse_sizes(top, c);

  if (c.is_moe()) parse_experts(top, c);
  parse_rope(top, c);
  parse_sliding_window(top, c);
  if (c.sliding_window) {
    TORCH_CHECK(*c.sliding_window > 0, source_name, ": key \"sliding_window\" = ", *c.sliding_window,
                " must be positive or null");
  }

  const json* dtype = top.find("dtype");
  const char* dtype_key = "dtype";
  if (dtype == nullptr) {
    dtype = top.find("torch_dtype");
    dtype_key = "torch_dtype";
  } else {
    top.find("torch_dtype");
  }
  if (dtype != nullptr) c.dtype = parse_dtype(*dtype, dtype_key, source_name);

  parse_special_tokens(top, c);
  top.find("architectures");  // regenerated from model_type by to_json
  c.extra_json = top.rest().dump();
  return c;
}

ModelConfig load_model_config(const std::string& path) {
  struct stat st {};
  std::string file = path;
  if (::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) file = path + "/config.json";
  return parse_model_config(read_text_file(file), file);
}

std::string to_json(const ModelConfig& c) {
  json j = json::parse(c.extra_json);
  TORCH_CHECK(j.is_object(), "ModelConfig::extra_json must be a JSON object, got ", c.extra_json);
  const bool qwen3 = c.architecture == Architecture::kQwen3;
  const bool mistral = c.architecture == Architecture::kMistral;
  const bool qwen3_moe = c.architecture == Architecture::kQwen3Moe;
  const bool mixtral = c.architecture == Architecture::kMixtral;
  j["architectures"] = json::array({c.traits().hf_class});
  j["model_type"] = c.traits().model_type;
  j["vocab_size"] = c.vocab_size;
  j["hidden_size"] = c.hidden_size;
  j["intermediate_size"] = c.intermediate_size;
  j["num_hidden_layers"] = c.num_hidden_layers;
  j["num_attention_heads"] = c.num_attention_heads;
  j["num_key_value_heads"] = c.num_key_value_heads;
  j["head_dim"] = c.head_dim;
  j["hidden_act"] = c.hidden_act;
  j["max_position_embeddings"] = c.max_position_embeddings;
  j["initializer_range"] = c.initializer_range;
  j["rms_norm_eps"] = c.rms_norm_eps;
  j["attention_dropout"] = c.attention_dropout;
  j["tie_word_embeddings"] = c.tie_word_embeddings;
  if (c.traits().attention_bias_key) j["attention_bias"] = c.attention_bias;
  if (c.traits().mlp_bias_key) j["mlp_bias"] = c.mlp_bias;
  json rope = {{"rope_type", c.rope.rope_type}, {"rope_theta", c.rope.rope_theta}};
  const std::string& rope_type = c.rope.rope_type;
  if (rope_type == "linear" || rope_type == "llama3" || rope_type == "yarn") rope["factor"] = c.rope.factor;
  if (rope_type == "llama3" || rope_type == "yarn") {
    rope["original_max_position_embeddings"] = c.rope.original_max_position_embeddings;
  }
  if (rope_type == "llama3") {
    rope["low_freq_factor"] = c.rope.low_freq_factor;
    rope["high_freq_factor"] = c.rope.high_freq_factor;
  }
  if (rope_type == "yarn") {
    rope["beta_fast"] = c.rope.beta_fast;
    rope["beta_slow"] = c.rope.beta_slow;
    rope["truncate"] = c.rope.truncate;
    if (c.rope.attention_factor) rope["attention_factor"] = *c.rope.attention_factor;
    if (c.rope.mscale) rope["mscale"] = *c.rope.mscale;
    if (c.rope.mscale_all_dim) rope["mscale_all_dim"] = *c.rope.mscale_all_dim;
  }
  j["rope_parameters"] = rope;
  j.erase("rope_scaling");
  j.erase("rope_theta");
  j.erase("torch_dtype");
  if (mistral || mixtral) j["sliding_window"] = c.sliding_window ? json(*c.sliding_window) : json(nullptr);
  if (qwen3_moe) {
    j["use_sliding_window"] = c.use_sliding_window;
    j["sliding_window"] = c.sliding_window ? json(*c.sliding_window) : json(nullptr);
  }
  if (c.is_moe()) experts_to_json(c, j);
  if (qwen3) {
    j["use_sliding_window"] = c.use_sliding_window;
    j["sliding_window"] = c.sliding_window ? json(*c.sliding_window) : json(nullptr);
    j["max_window_layers"] = c.max_window_layers;
    j["layer_types"] = c.layer_types;
  }
  if (c.dtype) {
    j["dtype"] = dtype_name(*c.dtype);
  } else {
    j.erase("dtype");
  }
  j["bos_token_id"] = c.bos_token_id ? json(*c.bos_token_id) : json(nullptr);
  j["eos_token_id"] = eos_to_json(c.eos_token_id);
  j["pad_token_id"] = c.pad_token_id ? json(*c.pad_token_id) : json(nullptr);
  return j.dump(2) + "\n";
}

}  // namespace roundpipe::models
