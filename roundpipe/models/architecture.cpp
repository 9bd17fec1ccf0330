#include "roundpipe/models/architecture.h"

#include <c10/util/Exception.h>

namespace roundpipe::models {
namespace {

using A = Architecture;

// One row per architecture, in enum order. Columns: model_type, hf_class, moe, qk_norm,
// attention_sinks, norm_weight_fp32, attention_bias_key, mlp_bias_key, llama_special_tokens; HF
// defaults: vocab_size, hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
// num_key_value_heads (0: heads), max_position_embeddings, head_dim (0: hidden / heads),
// rms_norm_eps, rope_theta, attention_bias.
const std::vector<ArchitectureTraits>& table() {
  // One row per architecture, each on its own lines: not reflowed.
  // clang-format off
  static const std::vector<ArchitectureTraits> kRows = {
      {A::kLlama, "llama", "LlamaForCausalLM", false, false, false, false, true, true, true,
       32000, 4096, 11008, 32, 32, 0, 2048, 0, 1e-6, 10000.0, false},
      {A::kMistral, "mistral", "MistralForCausalLM", false, false, false, false, false, false, true,
       32000, 4096, 14336, 32, 32, 8, 131072, 0, 1e-6, 10000.0, false},
      {A::kQwen3, "qwen3", "Qwen3ForCausalLM", false, true, false, false, true, false, false,
       151936, 4096, 22016, 32, 32, 0, 32768, 128, 1e-6, 10000.0, false},
      {A::kQwen3Moe, "qwen3_moe", "Qwen3MoeForCausalLM", true, true, false, false, true, false, false,
       151936, 2048, 6144, 24, 32, 4, 32768, 0, 1e-6, 10000.0, false},
      {A::kMixtral, "mixtral", "MixtralForCausalLM", true, false, false, false, false, false, true,
       32000, 4096, 14336, 32, 32, 8, 131072, 0, 1e-5, 10000.0, false},
      {A::kGptOss, "gpt_oss", "GptOssForCausalLM", true, false, true, true, true, false, false,
       201088, 2880, 2880, 36, 64, 8, 131072, 64, 1e-5, 150000.0, true},
  };
  // clang-format on
  return kRows;
}

}  // namespace

const std::vector<ArchitectureTraits>& all_architectures() { return table(); }

const ArchitectureTraits& architecture_traits(Architecture architecture) {
  const auto index = static_cast<size_t>(architecture);
  TORCH_INTERNAL_ASSERT(index < table().size() && table()[index].architecture == architecture,
                        "architecture table out of enum order at ", index);
  return table()[index];
}

std::optional<Architecture> architecture_from_model_type(const std::string& model_type) {
  for (const ArchitectureTraits& row : table()) {
    if (model_type == row.model_type) return row.architecture;
  }
  return std::nullopt;
}

const char* model_type_name(Architecture architecture) { return architecture_traits(architecture).model_type; }

std::string model_type_list(bool moe_only, const std::string& last_separator) {
  std::vector<const char*> names;
  for (const ArchitectureTraits& row : table()) {
    if (!moe_only || row.moe) names.push_back(row.model_type);
  }
  std::string list;
  for (size_t i = 0; i < names.size(); ++i) {
    if (i > 0) list += i + 1 == names.size() ? last_separator : ", ";
    list += names[i];
  }
  return list;
}

}  // namespace roundpipe::models
