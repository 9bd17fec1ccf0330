#include "roundpipe/models/detail/rotary.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <string>
#include <vector>

#include "roundpipe/models/model_config.h"
#include "tests/common/python_oracle.h"
#include "tests/common/tensor_compare.h"
#include "tests/models/hf_oracle.h"

namespace roundpipe::testing {
namespace {

using models::ModelConfig;
using models::RopeParameters;

constexpr int64_t kSeqLen = 4200;  // past gpt-oss's original 4096 positions

// One YaRN configuration: a config.json that transformers loads, and our parameters for it (parsed
// from the same text, except gpt_oss, whose model type parse_model_config does not know yet).
struct YarnCase {
  std::string name;
  std::string json;
  RopeParameters rope;
  int64_t head_dim;
};

RopeParameters gpt_oss_rope() {
  RopeParameters rope;  // GptOssConfig's defaults (the released checkpoints' rope_scaling)
  rope.rope_type = "yarn";
  rope.rope_theta = 150000.0;
  rope.factor = 32.0;
  rope.beta_fast = 32.0;
  rope.beta_slow = 1.0;
  rope.truncate = false;
  rope.original_max_position_embeddings = 4096;
  return rope;
}

YarnCase parsed_case(const std::string& name, const std::string& json) {
  const ModelConfig config = models::parse_model_config(json, name);
  return {name, json, config.rope, config.head_dim};
}

std::vector<YarnCase> yarn_cases() {
  return {
      {"gpt_oss", R"({"model_type": "gpt_oss"})", gpt_oss_rope(), 64},
      // Qwen's documented long-context recipe: truncate left at its default (true).
      parsed_case("qwen3", R"({"model_type": "qwen3", "max_position_embeddings": 131072, "rope_parameters":
          {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, "rope_theta": 1000000.0}})"),
      // mscale / mscale_all_dim (DeepSeek style), other betas, the old `type` key.
      parsed_case("llama_mscale", R"({"model_type": "llama", "hidden_size": 512, "num_attention_heads": 8,
          "max_position_embeddings": 16384, "rope_scaling": {"type": "yarn", "factor": 8, "mscale": 1.0,
          "mscale_all_dim": 0.5, "beta_fast": 16, "beta_slow": 2, "original_max_position_embeddings": 2048}})"),
      // factor null (the context ratio), a top-level original_max_position_embeddings that wins,
      // truncate null (false in HF), an explicit attention_factor.
      parsed_case("llama_nulls", R"({"model_type": "llama", "hidden_size": 256, "num_attention_heads": 4,
          "max_position_embeddings": 8192, "original_max_position_embeddings": 1024, "rope_parameters":
          {"rope_type": "yarn", "factor": null, "original_max_position_embeddings": 4096, "truncate": null,
          "attention_factor": 1.25, "rope_theta": 50000.0}})"),
  };
}

// transformers' outputs for every case, computed once per process: ROPE_INIT_FUNCTIONS['yarn'] on
// the loaded config, and the model's rotary embedding module's (cos, sin) in fp32 and bf16. Each
// parsed case is also loaded from our to_json of it ("<name>.saved"), which must give the same.
const TensorMap& transformers_outputs() {
  static const TensorMap outputs = [] {
    ScratchDir dir;
    std::string names;
    for (const YarnCase& c : yarn_cases()) {
      ::mkdir(dir.file(c.name).c_str(), 0755);
      std::ofstream(dir.file(c.name + "/config.json")) << c.json;
      names += "'" + c.name + "', ";
      if (c.name != "gpt_oss") {
        ::mkdir(dir.file(c.name + ".saved").c_str(), 0755);
        std::ofstream(dir.file(c.name + ".saved/config.json")) << models::to_json(models::parse_model_config(c.json));
        names += "'" + c.name + ".saved', ";
      }
    }
    return run_python(
        "from transformers import AutoConfig\n"
        "from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS\n"
        "from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding\n"
        "from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding\n"
        "from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding\n"
        "modules = {'llama': LlamaRotaryEmbedding, 'qwen3': Qwen3RotaryEmbedding, 'gpt_oss': GptOssRotaryEmbedding}\n"
        "for name in [" + names + "]:\n"
        "    config = AutoConfig.from_pretrained('" + dir.path() + "/' + name)\n"
        "    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS['yarn'](config)\n"
        "    outputs[name + '.inv_freq'] = inv_freq\n"
        "    outputs[name + '.attention_factor'] = float(attention_factor)\n"
        "    embedding = modules[config.model_type](config)\n"
        "    positions = torch.arange(" + std::to_string(kSeqLen) + ")[None]\n"
        "    for dtype in (torch.float32, torch.bfloat16):\n"
        "        cos, sin = embedding(torch.zeros(1, dtype=dtype), positions)\n"
        "        outputs[name + '.cos.' + str(dtype)] = cos[0]\n"
        "        outputs[name + '.sin.' + str(dtype)] = sin[0]\n");
  }();
  return outputs;
}

// Our [T, head_dim] against HF's [T, head_dim] bitwise, or gpt-oss's [T, head_dim / 2] (both
// halves) within 1e-6: there cos/sin run over a tensor of another length, so which elements take
// ATen's vectorised or scalar cos may differ (bitwise equal on the x86 CPU this was written on).
::testing::AssertionResult matches(const at::Tensor& ours, const at::Tensor& hf) {
  if (hf.size(-1) == ours.size(-1)) return tensors_equal(ours, hf);
  const int64_t half = ours.size(-1) / 2;
  ::testing::AssertionResult first = tensors_close(ours.narrow(-1, 0, half), hf, 1e-6);
  if (!first) return first << " (first half)";
  ::testing::AssertionResult second = tensors_close(ours.narrow(-1, half, half), hf, 1e-6);
  if (!second) return second << " (second half)";
  return ::testing::AssertionSuccess();
}

std::vector<std::string> hf_names(const YarnCase& c) {
  if (c.name == "gpt_oss") return {c.name};
  return {c.name, c.name + ".saved"};
}

TEST(RotaryTest, Yarn_InvFreqAndAttentionFactorMatchTransformers) {
  ROUNDPIPE_REQUIRE_TRANSFORMERS();
  const TensorMap& hf = transformers_outputs();
  for (const YarnCase& c : yarn_cases()) {
    const at::Tensor inv_freq = models::detail::rotary_inv_freq(c.rope, c.head_dim, at::kCPU);
    for (const std::string& name : hf_names(c)) {
      EXPECT_TRUE(tensors_equal(inv_freq, hf.at(name + ".inv_freq"))) << name;
      EXPECT_EQ(models::detail::rotary_attention_factor(c.rope), hf.at(name + ".attention_factor").item<double>())
          << name;
    }
  }
}

TEST(RotaryTest, Yarn_CosSinMatchTransformers) {
  ROUNDPIPE_REQUIRE_TRANSFORMERS();
  const TensorMap& hf = transformers_outputs();
  for (const YarnCase& c : yarn_cases()) {
    for (const auto& [dtype, suffix] : {std::pair{at::kFloat, "torch.float32"}, {at::kBFloat16, "torch.bfloat16"}}) {
      const auto [cos, sin] = models::detail::rotary_cos_sin(c.rope, c.head_dim, kSeqLen, at::kCPU, dtype);
      for (const std::string& name : hf_names(c)) {
        EXPECT_TRUE(matches(cos, hf.at(name + ".cos." + suffix))) << name << " " << suffix;
        EXPECT_TRUE(matches(sin, hf.at(name + ".sin." + suffix))) << name << " " << suffix;
      }
    }
  }
}

// Closed forms of the gpt-oss release: attention_factor = 0.1 ln 32 + 1 on both cos and sin, and
// the highest frequency (ramp 0: pure extrapolation) and lowest (pure interpolation) untouched
// by the blend.
TEST(RotaryTest, Yarn_GptOssClosedForm) {
  const RopeParameters rope = gpt_oss_rope();
  const double factor = models::detail::rotary_attention_factor(rope);
  EXPECT_DOUBLE_EQ(factor, 0.1 * std::log(32.0) + 1.0);
  EXPECT_NEAR(factor, 1.3466, 1e-4);
  const at::Tensor inv_freq = models::detail::rotary_inv_freq(rope, 64, at::kCPU);
  EXPECT_FLOAT_EQ(inv_freq[0].item<float>(), 1.0f);
  EXPECT_NEAR(inv_freq[31].item<double>(), std::pow(150000.0, -62.0 / 64.0) / 32.0, 1e-12);
  const auto [cos, sin] = models::detail::rotary_cos_sin(rope, 64, 3, at::kCPU, at::kFloat);
  EXPECT_FLOAT_EQ(cos[0][0].item<float>(), static_cast<float>(factor));  // cos(0) * factor
  EXPECT_FLOAT_EQ(sin[0][0].item<float>(), 0.0f);
  const at::Tensor norm = (cos * cos + sin * sin).sqrt();  // |rotation| = factor everywhere
  EXPECT_TRUE(tensors_close(norm, at::full_like(norm, factor), 1e-6));
  // The other rope types keep factor 1.
  EXPECT_EQ(models::detail::rotary_attention_factor(RopeParameters{}), 1.0);
}

}  // namespace
}  // namespace roundpipe::testing
