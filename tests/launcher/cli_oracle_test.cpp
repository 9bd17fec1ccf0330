// The `roundpipe` executable against transformers (the oracle Python): eval prints the loss that
// transformers computes on the same windows, export writes a directory transformers loads with
// the trained weights, and the GPU configs validate against a transformers-made model directory.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <vector>

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
  run_python(
      "from transformers import LlamaConfig, AutoModelForCausalLM\n"
      "torch.manual_seed(3)\n"
      "cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,"
      " num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,"
      " tie_word_embeddings=False)\n"
      "model = AutoModelForCausalLM.from_config(cfg)\n"
      "with torch.no_grad():\n"
      "    for name, p in model.named_parameters():\n"
      "        p.normal_(0, 0.2) if not name.endswith('norm.weight') else p.uniform_(0.8, 1.2)\n"
      "model.save_pretrained('" +
      hf + "')\n");
  return hf;
}

std::string pretrained_config(const std::string& hf, const std::string& tokens) {
  return "out_dir: run\nmodel: {pretrained: " + hf +
         ", dtype: float32}\n"
         "data: {train: " +
         tokens + ", valid: " + tokens +
         ", format: tokens, seq_len: 8}\n"
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
  auto ref = run_python(
      "from transformers import AutoModelForCausalLM\n"
      "import torch.nn.functional as F\n"
      "model = AutoModelForCausalLM.from_pretrained('" +
          hf +
          "', dtype=torch.float32).eval()\n"
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
  run_python(
      "from transformers import Qwen3Config, AutoModelForCausalLM\n"
      "torch.manual_seed(4)\n"
      "cfg = Qwen3Config(vocab_size=" +
      std::to_string(kVocab) +
      ", hidden_size=32, intermediate_size=48,"
      " num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,"
      " max_position_embeddings=" +
      std::to_string(kSeq) +
      ", tie_word_embeddings=True)\n"
      "model = AutoModelForCausalLM.from_config(cfg)\n"
      "with torch.no_grad():\n"
      "    for name, p in model.named_parameters():\n"
      "        p.normal_(0, 0.2) if not name.endswith('norm.weight') else p.uniform_(0.8, 1.2)\n"
      "model.save_pretrained('" +
      hf + "')\n");
  std::vector<int64_t> tokens;
  for (int64_t i = 0; i <= kSeq; ++i) tokens.push_back((i * 7919 + i / 3) % kVocab);
  write_token_file(dir.file("data.bin"), tokens, TokenWidth::kUint32);
  dir.write("eval.yaml", "out_dir: run\nmodel: {pretrained: " + hf +
                             ", dtype: float32}\n"
                             "data: {train: " +
                             dir.file("data.bin") + ", valid: " + dir.file("data.bin") +
                             ", format: tokens, seq_len: " + std::to_string(kSeq) +
                             "}\n"
                             "train: {batch_size: 1}\n"
                             "run: {devices: 1, loss_chunk_mib: 64}\n");
  CliResult r = run_cli(dir, "eval eval.yaml");
  ASSERT_EQ(r.code, 0) << r.err;
  const std::string line = last_line(r.out);
  ASSERT_EQ(line.rfind("eval_loss=", 0), 0u) << r.out;
  const double ours = std::stod(line.substr(10));

  auto ref = run_python(
      "from transformers import AutoModelForCausalLM\n"
      "import torch.nn.functional as F\n"
      "model = AutoModelForCausalLM.from_pretrained('" +
          hf +
          "', dtype=torch.float32).eval()\n"
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

  auto ref = run_python(
      "from transformers import AutoModelForCausalLM\n"
      "model = AutoModelForCausalLM.from_pretrained('" +
      dir.file("exported") +
      "')\n"
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

// Qwen3-MoE through the launcher: `eval` prints transformers' CE, and one SGD step on a batch of
// the file's only window (every draw starts at 0) gives transformers' step on CE + coef * aux
// (output_router_logits, eager experts) on every parameter, read back from the export by
// transformers itself. The aux term moves that step by more than the tolerance.
TEST(CliOracleTest, MoeTrainStepAndEval_MatchTransformers) {
  ROUNDPIPE_REQUIRE_PYTHON("transformers");
  constexpr int64_t kSeq = 16;
  ScratchDir dir;
  const std::string hf = dir.file("hf");
  std::vector<int64_t> tokens;
  for (int64_t i = 0; i <= kSeq; ++i) tokens.push_back((i * 29 + i / 3) % 64);
  write_token_file(dir.file("data.bin"), tokens, TokenWidth::kUint16);
  const at::Tensor window = at::tensor(tokens).view({1, kSeq + 1});
  run_python(
      "from transformers import Qwen3MoeConfig, AutoModelForCausalLM\n"
      "cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,"
      " num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,"
      " num_experts_per_tok=2, norm_topk_prob=False, router_aux_loss_coef=0.5,"
      " attn_implementation='eager', experts_implementation='eager')\n"
      "x = inputs['w'][:, :-1]\n"
      "for seed in range(100):\n"
      "    torch.manual_seed(seed)\n"
      "    model = AutoModelForCausalLM.from_config(cfg)\n"
      "    with torch.no_grad():\n"
      "        for name, p in model.named_parameters():\n"
      "            p.normal_(0, 0.6 if name.endswith('gate.weight') else 0.2) "
      "if not name.endswith('norm.weight') else p.uniform_(0.8, 1.2)\n"
      "        ls = model(input_ids=x, output_router_logits=True).router_logits\n"
      "    s = [torch.softmax(l.float(), -1).sort(-1, True)[0] for l in ls]\n"
      "    if min((v[:, 1] - v[:, 2]).min().item() for v in s) >= 1e-4:\n"
      "        break\n"
      "model.save_pretrained('" +
          hf + "')\n",
      {{"w", window}});
  dir.write("run.yaml", "out_dir: run\nmodel: {pretrained: " + hf +
                            ", dtype: float32}\n"
                            "data: {train: " +
                            dir.file("data.bin") + ", valid: " + dir.file("data.bin") +
                            ", format: tokens, seq_len: " + std::to_string(kSeq) +
                            "}\n"
                            "train: {steps: 1, batch_size: 2, seed: 1}\n"
                            "optimizer: {name: sgd, lr: 0.5}\n"
                            "run: {devices: 2, num_microbatch: 1, step_mode: sync}\n");
  CliResult evaluated = run_cli(dir, "eval run.yaml");
  ASSERT_EQ(evaluated.code, 0) << evaluated.err;
  const std::string line = last_line(evaluated.out);
  ASSERT_EQ(line.rfind("eval_loss=", 0), 0u) << evaluated.out;
  CliResult trained = run_cli(dir, "train run.yaml");
  ASSERT_EQ(trained.code, 0) << trained.err;
  ASSERT_EQ(run_cli(dir, "export run/checkpoints/latest exported").code, 0);
  const std::string metrics = read_file(dir.file("run/metrics.jsonl"));
  EXPECT_NE(metrics.find("\"aux_loss\""), std::string::npos) << metrics;

  auto ref = run_python(
      "from transformers import AutoModelForCausalLM\n"
      "import torch.nn.functional as F\n"
      "def load(d):\n"
      "    return AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32,"
      " attn_implementation='eager', experts_implementation='eager')\n"
      "w = inputs['w'].repeat(2, 1)\n"
      "x, y = w[:, :-1], w[:, 1:]\n"
      "def step(coef):\n"
      "    model = load('" +
          hf +
          "').train()\n"
          "    out = model(input_ids=x, output_router_logits=True)\n"
          "    ce = F.cross_entropy(out.logits.reshape(-1, out.logits.size(-1)), y.reshape(-1))\n"
          "    (ce + coef * out.aux_loss).backward()\n"
          "    torch.optim.SGD(model.parameters(), lr=0.5).step()\n"
          "    return model, ce.item(), out.aux_loss.item()\n"
          "model, ce, aux = step(0.5)\n"
          "plain, _, _ = step(0.0)\n"
          "ours = dict(load('" +
          dir.file("exported") +
          "').named_parameters())\n"
          "params = dict(model.named_parameters())\n"
          "outputs['ce'] = ce\n"
          "outputs['aux'] = aux\n"
          "outputs['max_diff'] = max((ours[n] - p).abs().max().item() for n, p in params.items())\n"
          "outputs['aux_effect'] = max((p - q).abs().max().item() for p, q in"
          " zip(model.parameters(), plain.parameters()))\n"
          "outputs['count'] = len(ours) == len(params)\n",
      {{"w", window}});
  EXPECT_NEAR(std::stod(line.substr(10)), ref.at("ce").item<double>(), 1e-4);
  EXPECT_TRUE(ref.at("count").item<bool>());
  EXPECT_LE(ref.at("max_diff").item<double>(), 1e-5);
  EXPECT_GT(ref.at("aux_effect").item<double>(), 1e-4) << "the aux term must matter in this test";
  // The logged loss is the cross-entropy; aux_loss its own field.
  EXPECT_NE(metrics.find("\"loss\":"), std::string::npos);
}

// optimizer.name: adafactor through the launcher (two pipeline stages, sync steps) against
// transformers' model trained by torch.optim.Adafactor on the same batches: one window in the
// data, so every batch is that window twice whatever the order.
TEST(CliOracleTest, AdafactorTwoSteps_MatchTransformersAndTorchAdafactor) {
  ROUNDPIPE_REQUIRE_PYTHON("transformers");
  constexpr int64_t kSeq = 16;
  ScratchDir dir;
  const std::string hf = make_hf_dir(dir);
  std::vector<int64_t> tokens;
  for (int64_t i = 0; i <= kSeq; ++i) tokens.push_back((i * 29 + i / 3) % 64);
  write_token_file(dir.file("data.bin"), tokens, TokenWidth::kUint16);
  const at::Tensor window = at::tensor(tokens).view({1, kSeq + 1});
  dir.write("run.yaml", "out_dir: run\nmodel: {pretrained: " + hf +
                            ", dtype: float32}\n"
                            "data: {train: " +
                            dir.file("data.bin") + ", valid: " + dir.file("data.bin") +
                            ", format: tokens, seq_len: " + std::to_string(kSeq) +
                            "}\n"
                            "train: {steps: 2, batch_size: 2, seed: 1}\n"
                            "optimizer: {name: adafactor, lr: 1.0e-2, weight_decay: 0.1}\n"
                            "eval: {every: 0}\n"
                            "run: {devices: 2, num_microbatch: 1, step_mode: sync}\n");
  CliResult trained = run_cli(dir, "train run.yaml");
  ASSERT_EQ(trained.code, 0) << trained.err;
  ASSERT_EQ(run_cli(dir, "export run/checkpoints/latest exported").code, 0);
  auto ref = run_python(
      "from transformers import AutoModelForCausalLM\n"
      "import torch.nn.functional as F\n"
      "def load(d):\n"
      "    return AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)\n"
      "model = load('" +
          hf +
          "').train()\n"
          "start = {n: p.detach().clone() for n, p in model.named_parameters()}\n"
          "opt = torch.optim.Adafactor(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)\n"
          "w = inputs['w'].repeat(2, 1)\n"
          "x, y = w[:, :-1], w[:, 1:]\n"
          "for _ in range(2):\n"
          "    opt.zero_grad()\n"
          "    logits = model(input_ids=x).logits\n"
          "    F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1)).backward()\n"
          "    opt.step()\n"
          "ours = dict(load('" +
          dir.file("exported") +
          "').named_parameters())\n"
          "params = dict(model.named_parameters())\n"
          "outputs['max_diff'] = max((ours[n] - p).abs().max().item() for n, p in params.items())\n"
          "outputs['moved'] = min((p - start[n]).abs().max().item() for n, p in params.items())\n"
          "outputs['count'] = len(ours) == len(params)\n",
      {{"w", window}});
  EXPECT_TRUE(ref.at("count").item<bool>());
  EXPECT_LE(ref.at("max_diff").item<double>(), 1e-5);
  EXPECT_GT(ref.at("moved").item<double>(), 1e-4) << "every tensor must have trained";
}

TEST(CliOracleTest, GpuConfigs_ValidateWithATransformersModel) {
  ROUNDPIPE_REQUIRE_PYTHON("transformers");
  ScratchDir dir;
  const std::string hf = make_hf_dir(dir);
  write_token_file(dir.file("data.bin"), std::vector<int64_t>(100, 1), TokenWidth::kUint16);
  for (const char* name : {"llama-3.2-1b", "qwen3-1.7b", "llama-3.1-8b", "llama-3.1-8b-lora"}) {
    const std::string config = std::string(ROUNDPIPE_SOURCE_DIR) + "/configs/" + name + ".yaml";
    CliResult r = run_cli(dir, "validate " + config + " model.pretrained=" + hf +
                                   " data.train=" + dir.file("data.bin") + " data.valid=" + dir.file("data.bin"));
    EXPECT_EQ(r.code, 0) << name << ": " << r.err;
    EXPECT_NE(r.out.find("dtype: bfloat16"), std::string::npos) << name << ": " << r.out;
  }
}

}  // namespace
}  // namespace roundpipe::launcher::testing
