// The `roundpipe` executable against transformers (the oracle Python): eval prints the loss that
// transformers computes on the same windows, export writes a directory transformers loads with
// the trained weights, and the GPU configs validate against a transformers-made model directory.
#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "cli_test_util.h"
#include "roundpipe/launcher/token_data.h"
#include "roundpipe/models/safetensors.h"
#include "tests/common/python_oracle.h"
#include "tests/models/test_files.h"

namespace roundpipe::launcher::testing {
namespace {

using roundpipe::testing::run_python;

// A random tiny Llama (vocab 64) made and saved by transformers.
std::string make_hf_dir(const ScratchDir& dir) {
  const std::string hf = dir.file("hf");
  run_python("from transformers import LlamaConfig, AutoModelForCausalLM\n"
             "torch.manual_seed(3)\n"
             "cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,"
             " num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,"
             " tie_word_embeddings=False)\n"
             "model = AutoModelForCausalLM.from_config(cfg)\n"
             "with torch.no_grad():\n"
             "    for name, p in model.named_parameters():\n"
             "        p.normal_(0, 0.2) if not name.endswith('norm.weight') else p.uniform_(0.8, 1.2)\n"
             "model.save_pretrained('" + hf + "')\n");
  return hf;
}

std::string pretrained_config(const std::string& hf, const std::string& tokens) {
  return "out_dir: run\nmodel: {pretrained: " + hf + ", dtype: float32}\n"
         "data: {train: " + tokens + ", valid: " + tokens + ", format: tokens, seq_len: 8}\n"
         "train: {steps: 3, batch_size: 3, seed: 1}\n"
         "optimizer: {name: sgd, lr: 0.05}\n"
         "run: {devices: 2, num_microbatch: 1, step_mode: sync}\n";
}

TEST(CliOracleTest, Eval_MatchesTransformersLossOnTheSameWindows) {
  ROUNDPIPE_REQUIRE_PYTHON("transformers");
  ScratchDir dir;
  const std::string hf = make_hf_dir(dir);
  // 70 tokens: 7 windows of 9 (seq_len + 1), 7 tokens left over; batches of 3, 3, 1 windows.
  std::vector<int64_t> tokens;
  for (int64_t i = 0; i < 70; ++i) tokens.push_back((i * 37 + i / 5) % 64);
  write_token_file(dir.file("data.bin"), tokens, TokenWidth::kUint16);
  dir.write("eval.yaml", pretrained_config(hf, dir.file("data.bin")));
  CliResult r = run_cli(dir, "eval eval.yaml");
  ASSERT_EQ(r.code, 0) << r.err;
  const std::string line = last_line(r.out);
  ASSERT_EQ(line.rfind("eval_loss=", 0), 0u) << r.out;
  const double ours = std::stod(line.substr(10));

  at::Tensor ids = at::tensor(std::vector<int64_t>(tokens.begin(), tokens.begin() + 63)).view({7, 9});
  auto ref = run_python("from transformers import AutoModelForCausalLM\n"
                        "import torch.nn.functional as F\n"
                        "model = AutoModelForCausalLM.from_pretrained('" + hf + "', dtype=torch.float32).eval()\n"
                        "w = inputs['ids']\n"
                        "with torch.no_grad():\n"
                        "    logits = model(input_ids=w[:, :-1]).logits\n"
                        "outputs['loss'] = F.cross_entropy(logits.reshape(-1, logits.size(-1)), w[:, 1:].reshape(-1))\n",
                        {{"ids", ids}});
  EXPECT_NEAR(ours, ref.at("loss").item<double>(), 1e-4);
  EXPECT_TRUE(is_regular_file(dir.file("run/metrics.jsonl")));
}

// Long sequence, Qwen3's vocabulary: one window of 8,192 tokens x 151,936 logits would be 5 GiB in
// fp32; the launcher's eval gets the loss from the LmHead's chunks (64 MiB: 110 tokens each) and
// transformers' reference is computed from its hidden states chunk by chunk.
TEST(CliOracleTest, Eval_LongSequenceLargeVocabulary_MatchesTransformersChunked) {
  ROUNDPIPE_REQUIRE_PYTHON("transformers");
  constexpr int64_t kVocab = 151936, kSeq = 8192;
  ScratchDir dir;
  const std::string hf = dir.file("hf");
  run_python("from transformers import Qwen3Config, AutoModelForCausalLM\n"
             "torch.manual_seed(4)\n"
             "cfg = Qwen3Config(vocab_size=" + std::to_string(kVocab) + ", hidden_size=32, intermediate_size=48,"
             " num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,"
             " max_position_embeddings=" + std::to_string(kSeq) + ", tie_word_embeddings=True)\n"
             "model = AutoModelForCausalLM.from_config(cfg)\n"
             "with torch.no_grad():\n"
             "    for name, p in model.named_parameters():\n"
             "        p.normal_(0, 0.2) if not name.endswith('norm.weight') else p.uniform_(0.8, 1.2)\n"
             "model.save_pretrained('" + hf + "')\n");
  std::vector<int64_t> tokens;
  for (int64_t i = 0; i <= kSeq; ++i) tokens.push_back((i * 7919 + i / 3) % kVocab);
  write_token_file(dir.file("data.bin"), tokens, TokenWidth::kUint32);
  dir.write("eval.yaml", "out_dir: run\nmodel: {pretrained: " + hf + ", dtype: float32}\n"
                         "data: {train: " + dir.file("data.bin") + ", valid: " + dir.file("data.bin") +
                         ", format: tokens, seq_len: " + std::to_string(kSeq) + "}\n"
                         "train: {batch_size: 1}\n"
                         "run: {devices: 1, loss_chunk_mib: 64}\n");
  CliResult r = run_cli(dir, "eval eval.yaml");
  ASSERT_EQ(r.code, 0) << r.err;
  const std::string line = last_line(r.out);
  ASSERT_EQ(line.rfind("eval_loss=", 0), 0u) << r.out;
  const double ours = std::stod(line.substr(10));

  auto ref = run_python("from transformers import AutoModelForCausalLM\n"
                        "import torch.nn.functional as F\n"
                        "model = AutoModelForCausalLM.from_pretrained('" + hf + "', dtype=torch.float32).eval()\n"
                        "w = inputs['ids'].view(1, -1)\n"
                        "total = torch.zeros((), dtype=torch.float64)\n"
                        "with torch.no_grad():\n"
                        "    h = model.model(input_ids=w[:, :-1]).last_hidden_state[0]\n"
                        "    y = w[0, 1:]\n"
                        "    for c in range(0, h.size(0), 1024):\n"
                        "        logits = model.lm_head(h[c:c + 1024]).float()\n"
                        "        total += F.cross_entropy(logits, y[c:c + 1024], reduction='sum').double()\n"
                        "outputs['loss'] = total / y.numel()\n",
                        {{"ids", at::tensor(tokens)}});
  EXPECT_NEAR(ours, ref.at("loss").item<double>(), 1e-4);
}

TEST(CliOracleTest, Export_LoadsInTransformersWithTheTrainedWeights) {
  ROUNDPIPE_REQUIRE_PYTHON("transformers");
  ScratchDir dir;
  const std::string hf = make_hf_dir(dir);
  std::vector<int64_t> tokens;
  for (int64_t i = 0; i < 200; ++i) tokens.push_back((i * 11) % 64);
  write_token_file(dir.file("data.bin"), tokens, TokenWidth::kUint16);
  dir.write("train.yaml", pretrained_config(hf, dir.file("data.bin")));
  CliResult trained = run_cli(dir, "train train.yaml");
  ASSERT_EQ(trained.code, 0) << trained.err;
  CliResult exported = run_cli(dir, "export run/checkpoints/latest exported");
  ASSERT_EQ(exported.code, 0) << exported.err;

  auto ref = run_python("from transformers import AutoModelForCausalLM\n"
                        "model = AutoModelForCausalLM.from_pretrained('" + dir.file("exported") + "')\n"
                        "for name, p in model.named_parameters():\n"
                        "    outputs[name] = p.detach()\n");
  auto trained_weights = models::CheckpointReader::open(dir.file("run/checkpoints/step-000003"));
  auto initial = models::CheckpointReader::open(hf);
  ASSERT_EQ(ref.size(), trained_weights.names().size());
  int64_t changed = 0;
  for (const auto& [name, loaded] : ref) {
    ASSERT_TRUE(trained_weights.contains(name)) << name;
    EXPECT_TRUE(loaded.equal(trained_weights.get(name))) << name;
    changed += loaded.equal(initial.get(name, loaded.scalar_type())) ? 0 : 1;
  }
  EXPECT_GT(changed, 0) << "training changed no weight";

  CliResult missing = run_cli(dir, "export run exported2");
  EXPECT_EQ(missing.code, 1);
  EXPECT_NE(missing.err.find("not a checkpoint directory"), std::string::npos) << missing.err;
}

TEST(CliOracleTest, GpuConfigs_ValidateWithATransformersModel) {
  ROUNDPIPE_REQUIRE_PYTHON("transformers");
  ScratchDir dir;
  const std::string hf = make_hf_dir(dir);
  write_token_file(dir.file("data.bin"), std::vector<int64_t>(100, 1), TokenWidth::kUint16);
  for (const char* name : {"llama-3.2-1b", "qwen3-1.7b", "llama-3.1-8b", "llama-3.1-8b-lora"}) {
    const std::string config = std::string(ROUNDPIPE_SOURCE_DIR) + "/configs/" + name + ".yaml";
    CliResult r = run_cli(dir, "validate " + config + " model.pretrained=" + hf + " data.train=" +
                                   dir.file("data.bin") + " data.valid=" + dir.file("data.bin"));
    EXPECT_EQ(r.code, 0) << name << ": " << r.err;
    EXPECT_NE(r.out.find("dtype: bfloat16"), std::string::npos) << name << ": " << r.out;
  }
}

}  // namespace
}  // namespace roundpipe::launcher::testing
