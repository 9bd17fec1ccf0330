#include "roundpipe/models/model_config.h"

#include <gtest/gtest.h>

#include <fstream>
#include <optional>
#include <string>

#include "tests/common/python_oracle.h"
#include "tests/common/test_macros.h"
#include "tests/models/hf_oracle.h"

namespace roundpipe::testing {
namespace {

using models::ModelConfig;
using models::parse_model_config;

// A Llama 3.1-style config in the older form (rope_theta + rope_scaling + torch_dtype), as
// published before transformers 5.
constexpr const char* kOldForm = R"({
  "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1000, "hidden_size": 64,
  "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 2,
  "max_position_embeddings": 4096, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
  "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192, "rope_type": "llama3"},
  "torch_dtype": "bfloat16", "tie_word_embeddings": true, "bos_token_id": 128000,
  "eos_token_id": [128001, 128008, 128009], "use_cache": true, "hidden_act": "silu"})";

// The same model in transformers 5's form (rope_parameters + dtype).
constexpr const char* kNewForm = R"({
  "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1000, "hidden_size": 64,
  "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 2,
  "max_position_embeddings": 4096, "rms_norm_eps": 1e-05,
  "rope_parameters": {"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
  "dtype": "bfloat16", "tie_word_embeddings": true, "bos_token_id": 128000,
  "eos_token_id": [128001, 128008, 128009], "use_cache": true, "hidden_act": "silu"})";

TEST(ModelConfigTest, Parse_OldAndNewRopeFormsAgree) {
  const ModelConfig old_form = parse_model_config(kOldForm);
  const ModelConfig new_form = parse_model_config(kNewForm);
  EXPECT_TRUE(old_form == new_form) << models::to_json(old_form) << "\nvs\n" << models::to_json(new_form);
  // Closed-form expectations for the fields.
  EXPECT_EQ(old_form.rope.rope_type, "llama3");
  EXPECT_EQ(old_form.rope.rope_theta, 500000.0);
  EXPECT_EQ(old_form.rope.factor, 8.0);
  EXPECT_EQ(old_form.rope.original_max_position_embeddings, 8192);
  EXPECT_EQ(old_form.head_dim, 8);
  EXPECT_EQ(old_form.dtype, c10::kBFloat16);
  EXPECT_EQ(old_form.eos_token_id, (std::vector<int64_t>{128001, 128008, 128009}));
  EXPECT_EQ(old_form.bos_token_id, 128000);
  EXPECT_TRUE(old_form.tie_word_embeddings);
}

// gpt-oss's released rotary parameters (older form), on a Llama config.
constexpr const char* kYarnGptOssForm = R"({
  "model_type": "llama", "hidden_size": 2880, "num_attention_heads": 64, "head_dim": 64,
  "max_position_embeddings": 131072, "rope_theta": 150000,
  "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                   "rope_type": "yarn", "truncate": false}})";

TEST(ModelConfigTest, Parse_YarnGptOssForm) {
  const ModelConfig c = parse_model_config(kYarnGptOssForm);
  EXPECT_EQ(c.rope.rope_type, "yarn");
  EXPECT_EQ(c.rope.rope_theta, 150000.0);
  EXPECT_EQ(c.rope.factor, 32.0);
  EXPECT_EQ(c.rope.beta_fast, 32.0);
  EXPECT_EQ(c.rope.beta_slow, 1.0);
  EXPECT_FALSE(c.rope.truncate);
  EXPECT_EQ(c.rope.original_max_position_embeddings, 4096);
  EXPECT_FALSE(c.rope.attention_factor.has_value());
  EXPECT_FALSE(c.rope.mscale.has_value());
  EXPECT_FALSE(c.rope.mscale_all_dim.has_value());
  // The newer form of the same parameters is the same config.
  const ModelConfig new_form = parse_model_config(R"({
      "model_type": "llama", "hidden_size": 2880, "num_attention_heads": 64, "head_dim": 64,
      "max_position_embeddings": 131072, "rope_parameters": {"rope_theta": 150000.0, "rope_type": "yarn",
      "factor": 32, "beta_fast": 32, "beta_slow": 1, "truncate": false, "original_max_position_embeddings": 4096}})");
  EXPECT_TRUE(c == new_form) << models::to_json(c) << "\nvs\n" << models::to_json(new_form);
}

// HF's defaults and null/0 meanings: `beta_fast or 32`, `beta_slow or 1`, truncate absent -> true
// and null -> false, factor null -> max_position_embeddings / original, original absent ->
// max_position_embeddings, and a top-level original_max_position_embeddings wins.
TEST(ModelConfigTest, Parse_YarnDefaultsAndNulls) {
  const ModelConfig d = parse_model_config(
      R"({"model_type": "llama", "max_position_embeddings": 8192, "rope_scaling": {"type": "yarn", "factor": 4}})");
  EXPECT_EQ(d.rope.rope_type, "yarn");
  EXPECT_EQ(d.rope.factor, 4.0);
  EXPECT_EQ(d.rope.beta_fast, 32.0);
  EXPECT_EQ(d.rope.beta_slow, 1.0);
  EXPECT_TRUE(d.rope.truncate);
  EXPECT_EQ(d.rope.original_max_position_embeddings, 8192);
  EXPECT_FALSE(d.rope.attention_factor.has_value());

  const ModelConfig n = parse_model_config(R"({"model_type": "llama", "max_position_embeddings": 8192,
      "rope_parameters": {"rope_type": "yarn", "factor": null, "beta_fast": 0, "beta_slow": null, "truncate": null,
      "original_max_position_embeddings": 3000, "mscale": 0, "mscale_all_dim": 1.5, "attention_factor": null}})");
  EXPECT_EQ(n.rope.factor, 8192.0 / 3000.0);
  EXPECT_EQ(n.rope.beta_fast, 32.0);
  EXPECT_EQ(n.rope.beta_slow, 1.0);
  EXPECT_FALSE(n.rope.truncate);
  EXPECT_EQ(n.rope.mscale, 0.0);  // kept (HF then ignores the pair: `if mscale and mscale_all_dim`)
  EXPECT_EQ(n.rope.mscale_all_dim, 1.5);
  EXPECT_FALSE(n.rope.attention_factor.has_value());

  const ModelConfig top = parse_model_config(R"({"model_type": "qwen3", "max_position_embeddings": 8192,
      "original_max_position_embeddings": 1024,
      "rope_parameters": {"rope_type": "yarn", "factor": null, "original_max_position_embeddings": 4096}})");
  EXPECT_EQ(top.rope.original_max_position_embeddings, 1024);
  EXPECT_EQ(top.rope.factor, 8.0);
  EXPECT_EQ(top.extra_json, "{}");  // read into rope, written back inside rope_parameters
}

TEST(ModelConfigTest, Parse_YarnErrorsNameKey) {
  EXPECT_THROW_WITH(parse_model_config(R"({"model_type": "llama", "rope_scaling": {"rope_type": "yarn"}})"),
                    "key \"rope_scaling.factor\" is required for rope type yarn");
  EXPECT_THROW_WITH(
      parse_model_config(R"({"model_type": "llama", "rope_parameters": {"rope_type": "yarn", "factor": -2}})"),
      "key \"rope_parameters.factor\" = -2 must be positive");
  EXPECT_THROW_WITH(parse_model_config(R"({"model_type": "llama", "rope_parameters": {"rope_type": "yarn",
                        "factor": 4, "attention_factor": 0}})"),
                    "key \"rope_parameters.attention_factor\" = 0 must be positive (it multiplies cos and sin)");
  EXPECT_THROW_WITH(parse_model_config(R"({"model_type": "llama", "rope_parameters": {"rope_type": "yarn",
                        "factor": 4, "truncate": "no"}})"),
                    "key \"truncate\" = \"no\" must be true or false");
  EXPECT_THROW_WITH(parse_model_config(R"({"model_type": "llama", "rope_parameters": {"rope_type": "yarn",
                        "factor": 4, "beta_fast": "fast"}})"),
                    "key \"beta_fast\" = \"fast\" must be a number");
  EXPECT_THROW_WITH(parse_model_config(R"({"model_type": "llama", "rope_parameters": {"rope_type": "yarn",
                        "factor": 4, "original_max_position_embeddings": 0}})"),
                    "key \"rope_parameters.original_max_position_embeddings\" = 0 must be positive");
}

TEST(ModelConfigTest, ToJson_RoundTrips) {
  for (const char* text : {kOldForm, kNewForm,
                           R"({"model_type": "qwen3", "num_hidden_layers": 4, "use_sliding_window": true,
                               "sliding_window": 64, "max_window_layers": 2, "pad_token_id": 3})",
                           R"({"model_type": "mistral", "sliding_window": null, "head_dim": 96})",
                           R"({"model_type": "llama", "rope_scaling": {"type": "linear", "factor": 4}})",
                           kYarnGptOssForm,
                           R"({"model_type": "llama", "rope_parameters": {"rope_type": "yarn", "factor": 8,
                               "attention_factor": 1.5, "mscale": 0.5, "mscale_all_dim": 0}})",
                           R"({"model_type": "qwen3", "max_position_embeddings": 131072, "rope_parameters":
                               {"rope_type": "yarn", "factor": null, "original_max_position_embeddings": 32768}})"}) {
    const ModelConfig config = parse_model_config(text);
    const ModelConfig again = parse_model_config(models::to_json(config));
    EXPECT_TRUE(config == again) << text << "\n->\n" << models::to_json(config);
  }
}

TEST(ModelConfigTest, Parse_LinearRopeOldTypeKey) {
  const ModelConfig c = parse_model_config(R"({"model_type": "llama", "rope_scaling": {"type": "linear", "factor": 4}})");
  EXPECT_EQ(c.rope.rope_type, "linear");
  EXPECT_EQ(c.rope.factor, 4.0);
  EXPECT_EQ(c.rope.rope_theta, 10000.0);
}

TEST(ModelConfigTest, Parse_Qwen3SlidingLayers) {
  const ModelConfig c = parse_model_config(R"({"model_type": "qwen3", "num_hidden_layers": 4,
      "use_sliding_window": true, "sliding_window": 64, "max_window_layers": 2})");
  EXPECT_EQ(c.layer_types, (std::vector<std::string>{"full_attention", "full_attention", "sliding_attention",
                                                      "sliding_attention"}));
  EXPECT_EQ(c.sliding_window, 64);
  const ModelConfig off = parse_model_config(R"({"model_type": "qwen3", "sliding_window": 64})");
  EXPECT_FALSE(off.sliding_window.has_value());  // use_sliding_window defaults to false
  EXPECT_FALSE(off.layer_uses_sliding_window(0));
}

TEST(ModelConfigTest, Parse_UnknownModelTypeNamesKey) {
  EXPECT_THROW_WITH(parse_model_config(R"({"model_type": "gpt2"})", "my/config.json"),
                    "my/config.json: key \"model_type\" = \"gpt2\"");
  EXPECT_THROW_WITH(parse_model_config(R"({"hidden_size": 8})"), "no \"model_type\"");
}

TEST(ArchitectureTest, Table_OneRowPerArchitectureRoundTripsTheModelType) {
  EXPECT_EQ(models::all_architectures().size(), 6u);
  for (const models::ArchitectureTraits& row : models::all_architectures()) {
    const std::optional<models::Architecture> parsed = models::architecture_from_model_type(row.model_type);
    ASSERT_TRUE(parsed.has_value()) << row.model_type;
    EXPECT_TRUE(*parsed == row.architecture) << row.model_type;
    EXPECT_EQ(&models::architecture_traits(row.architecture), &row) << row.model_type;
    const ModelConfig config = parse_model_config(std::string(R"({"model_type": ")") + row.model_type + "\"}");
    EXPECT_TRUE(config.architecture == row.architecture) << row.model_type;
    EXPECT_EQ(config.is_moe(), row.moe) << row.model_type;
    const std::string json = models::to_json(config);
    EXPECT_NE(json.find(std::string("\"") + row.hf_class + "\""), std::string::npos) << json;
    EXPECT_TRUE(parse_model_config(json) == config) << json;
  }
  EXPECT_FALSE(models::architecture_from_model_type("gpt2").has_value());
  EXPECT_EQ(models::model_type_list(), "llama, mistral, qwen3, qwen3_moe, mixtral, gpt_oss");
  EXPECT_EQ(models::model_type_list(/*moe_only=*/true, " and "), "qwen3_moe, mixtral and gpt_oss");
}

TEST(ModelConfigTest, Parse_MoeKeysNameKey) {
  EXPECT_THROW_WITH(parse_model_config(R"({"model_type": "llama", "num_experts": 8})"), "key \"num_experts\" = 8");
  EXPECT_THROW_WITH(parse_model_config(R"({"model_type": "mistral", "num_local_experts": 8})"),
                    "key \"num_local_experts\" = 8");
  EXPECT_THROW_WITH(parse_model_config(R"({"model_type": "qwen3", "moe_intermediate_size": 768})"),
                    "key \"moe_intermediate_size\" = 768");
  // Zero or null means dense, as HF configs sometimes write.
  EXPECT_NO_THROW(parse_model_config(R"({"model_type": "llama", "num_experts": 0, "num_experts_per_tok": null})"));
}

TEST(ModelConfigTest, Parse_BadHiddenActNamesKey) {
  EXPECT_THROW_WITH(parse_model_config(R"({"model_type": "llama", "hidden_act": "gelu"})"),
                    "key \"hidden_act\" = \"gelu\"");
}

TEST(ModelConfigTest, Parse_UnsupportedRopeNamesKey) {
  EXPECT_THROW_WITH(
      parse_model_config(R"({"model_type": "llama", "rope_scaling": {"type": "longrope", "factor": 4}})"),
      "key \"rope_scaling.type\" = \"longrope\" is not supported (supported: default, linear, llama3, yarn)");
  EXPECT_THROW_WITH(
      parse_model_config(R"({"model_type": "llama", "rope_parameters": {"rope_type": "dynamic", "factor": 2}})"),
      "key \"rope_parameters.rope_type\" = \"dynamic\"");
  EXPECT_THROW_WITH(parse_model_config(R"({"model_type": "llama", "partial_rotary_factor": 0.5})"),
                    "key \"partial_rotary_factor\" = 0.5");
  EXPECT_THROW_WITH(parse_model_config(R"({"model_type": "llama", "rope_scaling": {"rope_type": "linear"}})"),
                    "rope_scaling.factor\" is required");
}

TEST(ModelConfigTest, Parse_InconsistentSizesNameKeys) {
  EXPECT_THROW_WITH(parse_model_config(R"({"model_type": "llama", "num_attention_heads": 6, "num_key_value_heads": 4, "head_dim": 64})"),
                    "\"num_attention_heads\" = 6 must be a multiple of \"num_key_value_heads\" = 4");
  EXPECT_THROW_WITH(parse_model_config(R"({"model_type": "llama", "hidden_size": 100, "num_attention_heads": 8})"),
                    "\"hidden_size\" = 100 is not divisible");
  EXPECT_THROW_WITH(parse_model_config(R"({"model_type": "llama", "vocab_size": "big"})"),
                    "key \"vocab_size\" = \"big\" must be an integer");
  EXPECT_THROW_WITH(parse_model_config(R"({"model_type": "llama", "torch_dtype": "int8"})"),
                    "key \"torch_dtype\" = \"int8\"");
  EXPECT_THROW_WITH(parse_model_config("{not json"), "is not valid JSON");
}

TEST(ModelConfigTest, Load_ReadsDirectoryOrFile) {
  ScratchDir dir;
  std::ofstream(dir.file("config.json")) << kNewForm;
  EXPECT_TRUE(models::load_model_config(dir.path()) == parse_model_config(kNewForm));
  EXPECT_TRUE(models::load_model_config(dir.file("config.json")) == parse_model_config(kNewForm));
  EXPECT_THROW_WITH(models::load_model_config(dir.file("missing.json")), "cannot open model config");
}

// Our defaults for keys a file omits are transformers' defaults: parse transformers' own
// serialisation of LlamaConfig(), Qwen3Config(), MistralConfig() and compare with a minimal file.
TEST(ModelConfigTest, Defaults_MatchTransformers) {
  ROUNDPIPE_REQUIRE_TRANSFORMERS();
  ScratchDir dir;
  run_python(
      "from transformers import LlamaConfig, Qwen3Config, MistralConfig\n"
      "for cls, name in [(LlamaConfig, 'llama'), (Qwen3Config, 'qwen3'), (MistralConfig, 'mistral')]:\n"
      "    open('" + dir.path() + "/' + name + '.json', 'w').write(cls().to_json_string())\n");
  for (const std::string type : {"llama", "qwen3", "mistral"}) {
    std::ifstream in(dir.file(type + ".json"));
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    ModelConfig from_hf = parse_model_config(text, type + ".json");
    ModelConfig minimal = parse_model_config(R"({"model_type": ")" + type + "\"}");
    from_hf.extra_json = minimal.extra_json = "{}";  // use_cache, transformers_version, ...
    EXPECT_TRUE(from_hf == minimal) << type << ":\n" << models::to_json(from_hf) << "\nvs\n"
                                    << models::to_json(minimal);
  }
}

}  // namespace
}  // namespace roundpipe::testing
