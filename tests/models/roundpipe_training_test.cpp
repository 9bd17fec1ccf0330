// Training parity of the presets inside RoundPipe: from the same Hugging Face weights, 3 SGD steps
// with RoundPipe on 3 CPU devices (sync step, 3 microbatches) give the weights that transformers +
// torch.optim.SGD give in Python, tied embeddings included (the embedding and the LM head sit in
// different stages and share one weight). The RoundPipe overload of save_pretrained writes them.
#include <torch/torch.h>

#include <gtest/gtest.h>

#include <map>

#include "roundpipe/models/layers.h"
#include "roundpipe/models/linear_cross_entropy.h"
#include "roundpipe/models/pretrained.h"
#include "roundpipe/models/safetensors.h"
#include "roundpipe/round_pipe.h"
#include "tests/common/python_oracle.h"
#include "tests/common/tensor_compare.h"
#include "tests/models/hf_oracle.h"

namespace roundpipe::testing {
namespace {

constexpr int64_t kSteps = 3, kRows = 6, kTokens = 16, kVocab = 128;
constexpr double kLr = 0.1;

std::string train_snippet(const std::string& config_class, const std::string& kwargs, const std::string& dir) {
  return "from transformers import AutoModelForCausalLM, " + config_class + "\n"
         "torch.manual_seed(99)\n"
         "model = AutoModelForCausalLM.from_config(" + config_class + "(**" + kwargs + "))\n"
         "with torch.no_grad():\n"
         "    for name, p in model.named_parameters():\n"
         "        p.copy_(1 + 0.2 * torch.randn_like(p)) if name.endswith('norm.weight') else p.normal_(0, 0.1)\n"
         "model.save_pretrained('" + dir + "')\n"
         "model.train()\n"
         "opt = torch.optim.SGD(model.parameters(), lr=" + std::to_string(kLr) + ")\n"
         "for step in range(" + std::to_string(kSteps) + "):\n"
         "    opt.zero_grad()\n"
         "    ids = inputs['ids'][step]\n"
         "    model(input_ids=ids, labels=ids).loss.backward()\n"
         "    opt.step()\n"
         "outputs['tied'] = model.lm_head.weight is model.model.embed_tokens.weight\n"
         "for name, p in model.named_parameters():\n"
         "    outputs['p:' + name] = p.detach()\n";
}

// How the RoundPipe side computes the loss: from full logits in loss_fn, or in the LM head given
// the label (RoundPipeOptions::label_to_last_layer, models::linear_cross_entropy) with chunks of a
// few tokens that do not divide a microbatch's 2 x 16 tokens.
enum class Head { kLogits, kFusedLoss };

void expect_training_matches(const std::string& config_class, const std::string& kwargs, bool tied,
                             Head head = Head::kLogits) {
  using namespace roundpipe::models;
  ScratchDir scratch;
  const std::string hf_dir = scratch.file("hf"), out_dir = scratch.file("trained");
  torch::manual_seed(5);
  const at::Tensor ids = torch::randint(0, kVocab, {kSteps, kRows, kTokens}, torch::kLong);
  auto ref = run_python(train_snippet(config_class, kwargs, hf_dir), {{"ids", ids}});
  ASSERT_EQ(ref.at("tied").item<bool>(), tied);

  Pretrained pre = load_pretrained(hf_dir);
  const bool fused = head == Head::kFusedLoss;
  if (fused) {
    // 5 tokens a chunk: 16 * 4 bytes is the fp32 head's bytes per token at vocab 128.
    pre.model->ptr<LmHeadImpl>(pre.model->size() - 1)->set_loss_chunk_bytes(5 * kVocab * 4);
  }
  RoundPipe model(pre.model, RoundPipeOptions()
                                 .devices(std::vector<c10::Device>(3, c10::kCPU))
                                 .seed(1)
                                 .label_to_last_layer(fused));
  auto optimizer = [&] {
    OptimizerCtx ctx;
    return torch::optim::SGD(model.parameters(), torch::optim::SGDOptions(kLr));
  }();
  RunConfig cfg;
  cfg.num_microbatch = 3;
  // transformers' loss is the mean over every scored token of the batch; a microbatch's share is
  // its own mean weighted by its rows (every row scores kTokens - 1 tokens).
  const LossFn loss_fn = [](const at::Tensor& logits, const at::Tensor& labels) {
    return causal_lm_loss(logits, labels) * (static_cast<double>(logits.size(0)) / kRows);
  };
  // The fused head returns the microbatch's summed loss; the mean is over the batch's scored tokens.
  const LossFn summed_loss_fn = [](const at::Tensor& summed, const at::Tensor&) {
    return summed / static_cast<double>(kRows * (kTokens - 1));
  };
  for (int64_t step = 0; step < kSteps; ++step) {
    if (fused) {
      model.forward_backward({ids[step]}, shift_labels(ids[step]), summed_loss_fn, cfg);
    } else {
      model.forward_backward({ids[step]}, ids[step], loss_fn, cfg);
    }
    model.step([&] {
      optimizer.step();
      optimizer.zero_grad();
    }, StepMode::kSync);
  }
  save_pretrained(model, pre.config, out_dir);
  auto saved = CheckpointReader::open(out_dir);
  int64_t compared = 0;
  for (const auto& [key, expected] : ref) {
    if (key.rfind("p:", 0) != 0) continue;
    const std::string name = key.substr(2);
    ASSERT_TRUE(saved.contains(name)) << name << " is missing from the saved checkpoint";
    EXPECT_TRUE(tensors_close(saved.get(name), expected, 1e-5)) << name;
    ++compared;
  }
  EXPECT_EQ(compared, static_cast<int64_t>(saved.names().size()));  // nothing more, nothing less
  EXPECT_EQ(saved.contains("lm_head.weight"), !tied);
}

TEST(PretrainedTrainingTest, RoundPipeSgdMatchesTransformers_Llama) {
  ROUNDPIPE_REQUIRE_TRANSFORMERS();
  expect_training_matches(
      "LlamaConfig",
      "dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,"
      " num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)",
      /*tied=*/false);
}

TEST(PretrainedTrainingTest, RoundPipeSgdMatchesTransformers_Qwen3TiedEmbeddings) {
  ROUNDPIPE_REQUIRE_TRANSFORMERS();
  expect_training_matches(
      "Qwen3Config",
      "dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,"
      " num_key_value_heads=2, head_dim=16, max_position_embeddings=64, tie_word_embeddings=True)",
      /*tied=*/true);
}

TEST(PretrainedTrainingTest, RoundPipeSgdMatchesTransformers_LlamaFusedChunkedHeadLoss) {
  ROUNDPIPE_REQUIRE_TRANSFORMERS();
  expect_training_matches(
      "LlamaConfig",
      "dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,"
      " num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)",
      /*tied=*/false, Head::kFusedLoss);
}

TEST(PretrainedTrainingTest, RoundPipeSgdMatchesTransformers_Qwen3TiedFusedChunkedHeadLoss) {
  ROUNDPIPE_REQUIRE_TRANSFORMERS();
  expect_training_matches(
      "Qwen3Config",
      "dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,"
      " num_key_value_heads=2, head_dim=16, max_position_embeddings=64, tie_word_embeddings=True)",
      /*tied=*/true, Head::kFusedLoss);
}

}  // namespace
}  // namespace roundpipe::testing
