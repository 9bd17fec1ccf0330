#include "roundpipe/models/pretrained.h"

#include <torch/torch.h>

#include <gtest/gtest.h>

#include <sys/stat.h>

#include <cmath>
#include <map>

#include "roundpipe/models/layers.h"
#include "roundpipe/models/safetensors.h"
#include "tests/common/tensor_compare.h"
#include "tests/common/test_macros.h"
#include "tests/models/hf_oracle.h"

namespace roundpipe::testing {
namespace {

using namespace roundpipe::models;

ModelConfig tiny_config(const std::string& model_type, bool tied) {
  return parse_model_config(R"({"model_type": ")" + model_type +
                            R"(", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
      "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
      "pad_token_id": 5, "tie_word_embeddings": )" + (tied ? "true" : "false") + "}");
}

bool file_exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

TEST(PretrainedTest, HfParameterName_MapsEveryLayer) {
  EXPECT_EQ(hf_parameter_name("0.embed_tokens.weight", 4), "model.embed_tokens.weight");
  EXPECT_EQ(hf_parameter_name("1.self_attn.q_proj.weight", 4), "model.layers.0.self_attn.q_proj.weight");
  EXPECT_EQ(hf_parameter_name("4.input_layernorm.weight", 4), "model.layers.3.input_layernorm.weight");
  EXPECT_EQ(hf_parameter_name("5.norm.weight", 4), "model.norm.weight");
  EXPECT_EQ(hf_parameter_name("5.lm_head.weight", 4), "lm_head.weight");
  EXPECT_THROW_WITH(hf_parameter_name("6.norm.weight", 4), "outside [0, 5]");
  EXPECT_THROW_WITH(hf_parameter_name("x.norm.weight", 4), "does not start with a layer index");
}

TEST(PretrainedTest, HfStateDict_NamesAndShapes) {
  const ModelConfig config = tiny_config("qwen3", /*tied=*/false);
  const auto state = hf_state_dict(build(config).model, config);
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const auto& [name, t] : state) shapes[name] = t.sizes().vec();
  // Closed-form shapes of HF's Qwen3ForCausalLM.
  EXPECT_EQ(shapes.size(), 2u + 2u * 11u + 1u);
  EXPECT_EQ(shapes.at("model.embed_tokens.weight"), (std::vector<int64_t>{64, 32}));
  EXPECT_EQ(shapes.at("model.layers.1.self_attn.q_proj.weight"), (std::vector<int64_t>{32, 32}));
  EXPECT_EQ(shapes.at("model.layers.1.self_attn.k_proj.weight"), (std::vector<int64_t>{16, 32}));
  EXPECT_EQ(shapes.at("model.layers.1.self_attn.o_proj.weight"), (std::vector<int64_t>{32, 32}));
  EXPECT_EQ(shapes.at("model.layers.0.self_attn.q_norm.weight"), (std::vector<int64_t>{8}));
  EXPECT_EQ(shapes.at("model.layers.0.mlp.down_proj.weight"), (std::vector<int64_t>{32, 48}));
  EXPECT_EQ(shapes.at("model.norm.weight"), (std::vector<int64_t>{32}));
  EXPECT_EQ(shapes.at("lm_head.weight"), (std::vector<int64_t>{64, 32}));
}

TEST(PretrainedTest, Build_InitLikeTransformers) {
  torch::manual_seed(0);
  const ModelConfig config = tiny_config("llama", /*tied=*/true);
  const Pretrained pre = build(config);
  auto* embedding = pre.model->ptr(0)->as<EmbeddingImpl>();
  auto* head = pre.model->ptr(3)->as<LmHeadImpl>();
  EXPECT_TRUE(head->lm_head->weight.is_same(embedding->embed_tokens->weight));
  EXPECT_EQ(unique_parameters(*pre.model).size(), pre.model->parameters().size() - 1);
  EXPECT_TRUE(embedding->embed_tokens->weight[5].eq(0).all().item<bool>()) << "padding row not zero";
  std::vector<at::Tensor> linear;
  for (const auto& [name, t] : hf_state_dict(pre.model, config)) {
    EXPECT_EQ(t.scalar_type(), at::kFloat) << name;
    if (name.find("norm") != std::string::npos) {
      EXPECT_TRUE(t.eq(1).all().item<bool>()) << name;
    } else {
      linear.push_back(t.flatten());
    }
  }
  const double std = torch::cat(linear).std().item<double>();
  EXPECT_NEAR(std, 0.02, 0.002);
}

TEST(PretrainedTest, SaveLoad_RoundTripsShardedAndDtype) {
  ScratchDir dir;
  torch::manual_seed(1);
  const ModelConfig config = tiny_config("qwen3", /*tied=*/false);
  const Pretrained pre = build(config);
  save_pretrained(pre.model, config, dir.path(), SaveOptions().max_shard_bytes(20000));
  EXPECT_TRUE(file_exists(dir.file("model.safetensors.index.json")));
  EXPECT_TRUE(file_exists(dir.file("model-00001-of-00004.safetensors")) ||
              file_exists(dir.file("model-00001-of-00005.safetensors")) ||
              file_exists(dir.file("model-00001-of-00003.safetensors")));
  const Pretrained back = load_pretrained(dir.path());
  EXPECT_EQ(back.config.dtype, c10::kFloat);  // save_pretrained states the dtype it wrote
  ModelConfig expected = config;
  expected.dtype = c10::kFloat;
  EXPECT_TRUE(back.config == expected);
  const auto a = hf_state_dict(pre.model, config);
  const auto b = hf_state_dict(back.model, back.config);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].first, b[i].first);
    EXPECT_TENSOR_EQ(b[i].second, a[i].second);
  }
  // bf16 on save; the load takes the config's dtype by default, and an explicit one wins.
  ScratchDir dir16;
  save_pretrained(pre.model, config, dir16.path(), SaveOptions().dtype(at::kBFloat16));
  const Pretrained b16 = load_pretrained(dir16.path());
  EXPECT_EQ(b16.config.dtype, c10::kBFloat16);
  EXPECT_EQ(hf_state_dict(b16.model, b16.config)[3].second.scalar_type(), at::kBFloat16);
  EXPECT_TENSOR_EQ(hf_state_dict(b16.model, b16.config)[3].second, a[3].second.to(at::kBFloat16));
  const Pretrained b32 = load_pretrained(dir16.path(), LoadOptions().dtype(at::kFloat));
  EXPECT_EQ(hf_state_dict(b32.model, b32.config)[3].second.scalar_type(), at::kFloat);
}

TEST(PretrainedTest, Load_MissingTensorNamesIt) {
  ScratchDir dir;
  const ModelConfig config = tiny_config("llama", /*tied=*/false);
  save_pretrained(build(config).model, config, dir.path());
  auto state = hf_state_dict(build(config).model, config);
  std::vector<std::pair<std::string, at::Tensor>> without;
  for (auto& item : state) {
    if (item.first != "model.layers.1.mlp.up_proj.weight") without.push_back(item);
  }
  save_checkpoint(dir.path(), without);
  EXPECT_THROW_WITH(load_pretrained(dir.path()), "no tensor \"model.layers.1.mlp.up_proj.weight\"");
  // An untied model needs lm_head.weight.
  without.clear();
  for (auto& item : state) {
    if (item.first != "lm_head.weight") without.push_back(item);
  }
  save_checkpoint(dir.path(), without);
  EXPECT_THROW_WITH(load_pretrained(dir.path()), "no tensor \"lm_head.weight\"");
}

TEST(PretrainedTest, Load_TiedAcceptsWithOrWithoutLmHead) {
  ScratchDir dir;
  torch::manual_seed(2);
  const ModelConfig config = tiny_config("llama", /*tied=*/true);
  const Pretrained pre = build(config);
  save_pretrained(pre.model, config, dir.path());
  const Pretrained back = load_pretrained(dir.path());
  auto* embedding = back.model->ptr(0)->as<EmbeddingImpl>();
  auto* head = back.model->ptr(3)->as<LmHeadImpl>();
  EXPECT_TRUE(head->lm_head->weight.is_same(embedding->embed_tokens->weight));
  EXPECT_TENSOR_EQ(embedding->embed_tokens->weight, pre.model->ptr(0)->as<EmbeddingImpl>()->embed_tokens->weight);
  auto state = hf_state_dict(pre.model, config);
  state.emplace_back("lm_head.weight", state.front().second);
  save_checkpoint(dir.path(), state);
  EXPECT_NO_THROW(load_pretrained(dir.path()));
}

TEST(PretrainedTest, Load_UnexpectedTensorNamesIt) {
  ScratchDir dir;
  const ModelConfig config = tiny_config("llama", /*tied=*/false);
  save_pretrained(build(config).model, config, dir.path());
  auto state = hf_state_dict(build(config).model, config);
  state.emplace_back("model.layers.0.self_attn.q_norm.weight", torch::ones({8}));
  state.emplace_back("model.layers.0.self_attn.rotary_emb.inv_freq", torch::ones({4}));  // ignored, as in HF
  save_checkpoint(dir.path(), state);
  EXPECT_THROW_WITH(load_pretrained(dir.path()), "\"model.layers.0.self_attn.q_norm.weight\"");
}

TEST(PretrainedTest, Load_ShapeMismatchNamesIt) {
  ScratchDir dir;
  const ModelConfig config = tiny_config("llama", /*tied=*/false);
  save_pretrained(build(config).model, config, dir.path());
  auto state = hf_state_dict(build(config).model, config);
  for (auto& item : state) {
    if (item.first == "model.layers.0.self_attn.k_proj.weight") item.second = torch::zeros({32, 32});
  }
  save_checkpoint(dir.path(), state);
  EXPECT_THROW_WITH(load_pretrained(dir.path()),
                    "\"model.layers.0.self_attn.k_proj.weight\" has shape [32, 32] but the model expects [16, 32]");
}

TEST(PretrainedTest, Clone_LayerComputesTheSame) {
  torch::manual_seed(3);
  const ModelConfig config = tiny_config("qwen3", /*tied=*/false);
  Pretrained pre = build(config);
  auto layer = pre.model->ptr(1);
  auto copy = layer->clone();
  auto* a = layer->as<DecoderLayerImpl>();
  auto* b = copy->as<DecoderLayerImpl>();
  ASSERT_NE(b, nullptr);
  EXPECT_FALSE(b->self_attn->q_proj->weight.is_same(a->self_attn->q_proj->weight));
  const auto x = torch::randn({2, 5, 32});
  EXPECT_TENSOR_EQ(b->forward(x), a->forward(x));
  auto whole = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(pre.model->clone());
  const auto ids = torch::randint(0, 64, {2, 5}, torch::kLong);
  EXPECT_TENSOR_EQ(whole->forward(ids), pre.model->forward(ids));
}

// Reference: explicit per-token negative log-likelihood with log_softmax in double.
TEST(PretrainedTest, CausalLmLoss_ShiftsAndIgnoresMinus100) {
  torch::manual_seed(4);
  const auto logits = torch::randn({2, 6, 11}).to(at::kBFloat16);
  auto labels = torch::randint(0, 11, {2, 6}, torch::kLong);
  labels[0][3] = -100;
  labels[1][0] = -100;  // position 0 is never a target anyway
  const auto logp = torch::log_softmax(logits.to(at::kDouble), -1);
  double sum = 0;
  int count = 0;
  for (int b = 0; b < 2; ++b) {
    for (int t = 0; t + 1 < 6; ++t) {
      const int64_t target = labels[b][t + 1].item<int64_t>();
      if (target == -100) continue;
      sum -= logp[b][t][target].item<double>();
      ++count;
    }
  }
  const auto loss = causal_lm_loss(logits, labels);
  EXPECT_EQ(loss.scalar_type(), at::kFloat);
  EXPECT_EQ(count, 9);
  EXPECT_NEAR(loss.item<double>(), sum / count, 1e-5);
  EXPECT_THROW_WITH(causal_lm_loss(logits, labels.to(at::kFloat)), "integer token ids");
  EXPECT_THROW_WITH(causal_lm_loss(logits, labels.narrow(1, 0, 5)), "labels must be [batch, seq]");
}

TEST(PretrainedTest, Forward_RejectsFloatInput) {
  const ModelConfig config = tiny_config("llama", /*tied=*/false);
  EXPECT_THROW_WITH(build(config).model->forward(torch::zeros({1, 4})), "integer token ids of shape [batch, seq]");
}

TEST(PretrainedTest, LoadHfStateDict_ChecksLayout) {
  const ModelConfig config = tiny_config("llama", /*tied=*/false);
  ModelConfig other = config;
  other.num_hidden_layers = 3;
  auto model = build(config).model;
  EXPECT_THROW_WITH(hf_state_dict(model, other), "the model has 4 layers but its config (num_hidden_layers = 3)");
}

}  // namespace
}  // namespace roundpipe::testing
