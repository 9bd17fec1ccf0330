// LoRA fine-tuning with the `roundpipe` executable (docs/launcher.md, "LoRA"): training updates
// only the adapters and logs the parameter counts; checkpoints hold the adapters; `export` writes a
// PEFT adapter directory that PEFT loads with our logits, and with --merge the model PEFT's
// merge_and_unload gives; resume is bitwise exact; bad model.lora values exit 2 naming the key.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "cli_test_util.h"
#include "roundpipe/launcher/metrics.h"
#include "roundpipe/launcher/token_data.h"
#include "roundpipe/models/lora.h"
#include "roundpipe/models/pretrained.h"
#include "roundpipe/models/safetensors.h"
#include "tests/common/python_oracle.h"
#include "tests/common/tensor_compare.h"
#include "tests/common/test_config.h"
#include "tests/models/test_files.h"

namespace roundpipe::launcher::testing {
namespace {

using roundpipe::testing::run_python;
using roundpipe::testing::tensors_close;
using roundpipe::testing::tensors_equal;

// The tiny Llama of cli_test_util.h: hidden 32, intermediate 64, 2 layers, 4 heads, 2 KV heads
// (k/v width 16), vocab 64. LoRA rank 4 on q_proj (32 -> 32), v_proj (32 -> 16) and down_proj
// (64 -> 32) adds r (in + out) per module: 4 (64 + 48 + 96) = 832 per layer.
constexpr int64_t kBaseParams = 2 * 64 * 32 + 2 * (2 * 32 * 32 + 2 * 16 * 32 + 3 * 32 * 64 + 2 * 32) + 32;
constexpr int64_t kLoraParams = 2 * 4 * ((32 + 32) + (32 + 16) + (64 + 32));
constexpr const char* kLoraKeys = "'model.lora={rank: 4, alpha: 8.0, targets: [q_proj, v_proj, down_proj]}'";

std::string peft_name(const std::string& module) { return "base_model.model.model." + module; }

// The weights of a PEFT adapter file.
std::vector<std::pair<std::string, at::Tensor>> adapter_tensors(const std::string& dir) {
  auto file = models::SafetensorsFile::open(join_path(dir, "adapter_model.safetensors"));
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const std::string& name : file->names()) out.emplace_back(name, file->get(name).clone());
  return out;
}

// A random tiny Llama (float32, untied) made and saved by transformers.
std::string make_hf_dir(const ScratchDir& dir) {
  const std::string hf = dir.file("hf");
  run_python("from transformers import LlamaConfig, AutoModelForCausalLM\n"
             "torch.manual_seed(5)\n"
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

// Training on a token file with evaluation at the end (data.valid).
std::string lora_config(const std::string& hf, const std::string& tokens) {
  return "out_dir: run\nmodel:\n  pretrained: " + hf + "\n  dtype: float32\n"
         "  lora: {rank: 4, alpha: 8.0, targets: [q_proj, v_proj, down_proj]}\n"
         "data: {train: " + tokens + ", valid: " + tokens + ", format: tokens, seq_len: 8}\n"
         "train: {steps: 6, batch_size: 3, seed: 1}\n"
         "optimizer: {name: adamw, lr: 2.0e-2, weight_decay: 0.0}\n"
         "eval: {every: 0, max_batches: 0}\n"
         "run: {devices: 2, num_microbatch: 1, step_mode: async}\n";
}

// Note [LoRA oracle test]: one run checks the whole path against PEFT. The eval loss logged at the
// end of training comes from the trained model in memory; PEFT computing the same loss from the
// base directory on disk plus the exported adapters shows both that the exported adapters are the
// trained ones and that the frozen base did not move during training. The logits check compares
// the models library's reading of the export with PEFT's, and the merged export is compared with
// PEFT's merge_and_unload.
TEST(CliLoraTest, TrainExport_PeftLoadsTheAdaptersWithOurLossLogitsAndMerge) {
  ROUNDPIPE_REQUIRE_PYTHON("transformers peft");
  ScratchDir dir;
  const std::string hf = make_hf_dir(dir);
  std::vector<int64_t> tokens;
  for (int64_t i = 0; i < 120; ++i) tokens.push_back((i * 13 + i / 7) % 64);
  write_token_file(dir.file("data.bin"), tokens, TokenWidth::kUint16);
  dir.write("lora.yaml", lora_config(hf, dir.file("data.bin")));

  CliResult trained = run_cli(dir, "train lora.yaml");
  ASSERT_EQ(trained.code, 0) << trained.err;
  EXPECT_NE(trained.err.find("LoRA rank 4 on q_proj, v_proj, down_proj"), std::string::npos) << trained.err;
  EXPECT_NE(trained.err.find("trainable parameters: 1,664 of 24,352 (6.8331%)"), std::string::npos)
      << trained.err;
  static_assert(kLoraParams == 1664 && kBaseParams + kLoraParams == 24352);
  // The checkpoint holds the adapters, not the base.
  const std::string ckpt = dir.file("run/checkpoints/step-000006");
  for (const char* f : {"adapter_config.json", "adapter_model.safetensors", "optimizer.pt", "trainer_state.pt",
                        "config.yaml"}) {
    EXPECT_TRUE(is_regular_file(join_path(ckpt, f))) << f;
  }
  EXPECT_FALSE(path_exists(join_path(ckpt, "model.safetensors")));
  const auto trained_adapters = adapter_tensors(ckpt);
  ASSERT_EQ(trained_adapters.size(), 2u * 3u * 2u);  // A and B of 3 modules in 2 layers
  for (const auto& [name, tensor] : trained_adapters) {
    if (name.find("lora_B") != std::string::npos) {
      EXPECT_GT(tensor.abs().max().item<double>(), 0.0) << name << " did not train (PEFT inits it to 0)";
    }
  }
  MetricsLog log = read_metrics(dir.file("run/metrics.jsonl"));
  ASSERT_EQ(log.eval.size(), 1u);
  const double train_eval_loss = log.eval.back().eval_loss;

  CliResult adapter = run_cli(dir, "export run/checkpoints/latest adapter");
  ASSERT_EQ(adapter.code, 0) << adapter.err;
  EXPECT_FALSE(path_exists(dir.file("adapter/model.safetensors")));
  CliResult merged = run_cli(dir, "export run/checkpoints/latest merged --merge");
  ASSERT_EQ(merged.code, 0) << merged.err;

  // 13 windows of 9 tokens (seq_len + 1) from the start: the evaluation's windows.
  at::Tensor windows = at::tensor(std::vector<int64_t>(tokens.begin(), tokens.begin() + 117)).view({13, 9});
  auto ref = run_python(
      "from transformers import AutoModelForCausalLM\n"
      "from peft import PeftModel\n"
      "import torch.nn.functional as F\n"
      "base = AutoModelForCausalLM.from_pretrained('" + hf + "', dtype=torch.float32)\n"
      "model = PeftModel.from_pretrained(base, '" + dir.file("adapter") + "').eval()\n"
      "w = inputs['ids']\n"
      "with torch.no_grad():\n"
      "    logits = model(input_ids=w[:, :-1]).logits\n"
      "outputs['logits'] = logits\n"
      "outputs['loss'] = F.cross_entropy(logits.reshape(-1, logits.size(-1)), w[:, 1:].reshape(-1))\n"
      "for name, p in model.merge_and_unload().named_parameters():\n"
      "    outputs['merged.' + name] = p.detach()\n",
      {{"ids", windows}});
  EXPECT_NEAR(train_eval_loss, ref.at("loss").item<double>(), 1e-5);

  // The models library reads the exported adapter as PEFT does.
  models::Pretrained ours = models::load_pretrained(hf);
  models::load_lora_adapter(ours.model, ours.config, dir.file("adapter"));
  ours.model->eval();
  at::Tensor logits;
  {
    at::NoGradGuard no_grad;
    logits = ours.model->forward(windows.slice(1, 0, 8));
  }
  EXPECT_TRUE(tensors_close(logits, ref.at("logits"), 1e-5, 1e-5));

  // The merged export equals PEFT's merge_and_unload (float32, like the base).
  auto merged_reader = models::CheckpointReader::open(dir.file("merged"));
  int64_t compared = 0;
  for (const auto& [key, expected] : ref) {
    if (key.rfind("merged.", 0) != 0) continue;
    const std::string name = key.substr(7);
    ASSERT_TRUE(merged_reader.contains(name)) << name;
    const at::Tensor actual = merged_reader.get(name);
    EXPECT_EQ(actual.scalar_type(), at::kFloat) << name;
    EXPECT_TRUE(tensors_close(actual, expected, 1e-6, 1e-6)) << name;
    ++compared;
  }
  EXPECT_EQ(compared, static_cast<int64_t>(merged_reader.names().size()));

  // `eval` of the LoRA config with the trained adapter: the loss of training's final evaluation
  // (the same model: base from disk, adapters from the checkpoint).
  CliResult evaluated = run_cli(dir, "eval lora.yaml out_dir=eval model.lora.adapter=adapter");
  ASSERT_EQ(evaluated.code, 0) << evaluated.err;
  MetricsLog eval_log = read_metrics(dir.file("eval/metrics.jsonl"));
  ASSERT_EQ(eval_log.eval.size(), 1u);
  EXPECT_NEAR(eval_log.eval.back().eval_loss, train_eval_loss, 1e-6);
}

// LoRA on a mixture-of-experts model's experts (model.lora.target_parameters, PEFT's format):
// the expert adapters train, checkpoint under PEFT's nested names, resume bitwise, and PEFT loads
// the export to the loss of training's final evaluation.
TEST(CliLoraTest, MoeExperts_TrainResumeAndPeftLoadsTheExport) {
  ROUNDPIPE_REQUIRE_PYTHON("transformers peft");
  ScratchDir dir;
  const std::string hf = dir.file("hf");
  run_python("from transformers import Qwen3MoeConfig, AutoModelForCausalLM\n"
             "torch.manual_seed(3)\n"
             "cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,"
             " num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,"
             " num_experts_per_tok=2, router_aux_loss_coef=0.1)\n"
             "model = AutoModelForCausalLM.from_config(cfg)\n"
             "with torch.no_grad():\n"
             "    for name, p in model.named_parameters():\n"
             "        p.normal_(0, 0.2) if not name.endswith('norm.weight') else p.uniform_(0.8, 1.2)\n"
             "model.save_pretrained('" + hf + "')\n");
  std::vector<int64_t> tokens;
  for (int64_t i = 0; i < 60; ++i) tokens.push_back((i * 13 + i / 7) % 64);
  write_token_file(dir.file("data.bin"), tokens, TokenWidth::kUint16);
  dir.write("moe.yaml", "out_dir: run\nmodel:\n  pretrained: " + hf + "\n  dtype: float32\n"
                        "  lora: {rank: 2, alpha: 4.0, targets: [q_proj], target_parameters: [gate_up_proj, down_proj]}\n"
                        "data: {train: " + dir.file("data.bin") + ", valid: " + dir.file("data.bin") +
                        ", format: tokens, seq_len: 8}\n"
                        "train: {steps: 4, batch_size: 2, seed: 1}\n"
                        "optimizer: {name: adamw, lr: 2.0e-2, weight_decay: 0.0}\n"
                        "checkpoint: {every: 2}\n"
                        "eval: {every: 0, max_batches: 0}\n"
                        "run: {devices: 2, num_microbatch: 1, step_mode: async}\n");
  CliResult trained = run_cli(dir, "train moe.yaml");
  ASSERT_EQ(trained.code, 0) << trained.err;
  EXPECT_NE(trained.err.find("LoRA rank 2 on q_proj, gate_up_proj, down_proj"), std::string::npos) << trained.err;
  const auto adapters = adapter_tensors(dir.file("run/checkpoints/step-000004"));
  ASSERT_EQ(adapters.size(), 2u * 2u * 3u);  // A and B of q_proj and both expert weights, 2 layers
  for (const char* key : {"layers.1.mlp.experts.base_layer.lora_A.weight", "layers.1.mlp.experts.lora_B.weight"}) {
    bool found = false;
    for (const auto& [name, tensor] : adapters) {
      if (name != peft_name(key)) continue;
      found = true;
      EXPECT_GT(tensor.abs().max().item<double>(), 0.0) << name;
    }
    EXPECT_TRUE(found) << key;
  }

  CliResult resumed = run_cli(dir, "train moe.yaml out_dir=resumed --resume run/checkpoints/step-000002");
  ASSERT_EQ(resumed.code, 0) << resumed.err;
  const auto again = adapter_tensors(dir.file("resumed/checkpoints/step-000004"));
  ASSERT_EQ(again.size(), adapters.size());
  for (size_t i = 0; i < adapters.size(); ++i) {
    EXPECT_EQ(again[i].first, adapters[i].first);
    EXPECT_TRUE(tensors_equal(again[i].second, adapters[i].second)) << adapters[i].first;
  }

  ASSERT_EQ(run_cli(dir, "export run/checkpoints/latest adapter").code, 0);
  MetricsLog log = read_metrics(dir.file("run/metrics.jsonl"));
  ASSERT_EQ(log.eval.size(), 1u);
  at::Tensor windows = at::tensor(std::vector<int64_t>(tokens.begin(), tokens.begin() + 54)).view({6, 9});
  auto ref = run_python("from transformers import AutoModelForCausalLM\n"
                        "from peft import PeftModel\n"
                        "import torch.nn.functional as F\n"
                        "base = AutoModelForCausalLM.from_pretrained('" + hf + "', dtype=torch.float32,"
                        " attn_implementation='eager', experts_implementation='eager')\n"
                        "model = PeftModel.from_pretrained(base, '" + dir.file("adapter") + "').eval()\n"
                        "w = inputs['ids']\n"
                        "with torch.no_grad():\n"
                        "    logits = model(input_ids=w[:, :-1]).logits\n"
                        "outputs['loss'] = F.cross_entropy(logits.reshape(-1, logits.size(-1)), w[:, 1:].reshape(-1))\n",
                        {{"ids", windows}});
  EXPECT_NEAR(log.eval.back().eval_loss, ref.at("loss").item<double>(), 1e-5);

  // On a dense model target_parameters is a configuration error naming the key.
  ScratchDir other;
  CliResult dense = run_cli(dir, "train moe.yaml out_dir=dense model.pretrained=" + make_hf_dir(other));
  EXPECT_EQ(dense.code, 2) << dense.err;
  EXPECT_NE(dense.err.find("model.lora.target_parameters: [gate_up_proj,down_proj]"), std::string::npos)
      << dense.err;
}

// A base model directory made by the launcher itself: one step of the tiny preset, float32.
std::string make_base_with_launcher(const ScratchDir& dir) {
  dir.write("base.yaml", tiny_config("base"));
  CliResult r = run_cli(dir, "train base.yaml train.steps=1 eval.every=0");
  EXPECT_EQ(r.code, 0) << r.err;
  return dir.file("base/checkpoints/step-000001");
}

std::string lora_overrides(const std::string& base) {
  return " model.preset=null model.config={} model.pretrained=" + base + " " + kLoraKeys;
}

// Note [Resume test] for LoRA: 20 straight steps vs 10 + a resume from the straight run's step-10
// checkpoint into another out_dir: bitwise equal adapters, in async mode, with the GradScaler,
// gradient accumulation, clipping, a decaying LR and LoRA dropout (the checkpoint carries
// RoundPipe's iteration index, so the resumed run draws the straight run's dropout masks).
TEST(CliLoraTest, Resume_BitwiseEqualToStraightRun) {
  ScratchDir dir;
  const std::string base = make_base_with_launcher(dir);
  const std::string common = lora_overrides(base) +
                             " model.lora.dropout=0.1"
                             " train.steps=20 checkpoint.every=10 checkpoint.keep=5 amp.scaler=true"
                             " amp.growth_interval=3 train.grad_accum=2 train.clip_grad_norm=0.5 eval.every=0";
  dir.write("run.yaml", tiny_config("straight"));
  CliResult straight = run_cli(dir, "train run.yaml" + common);
  ASSERT_EQ(straight.code, 0) << straight.err;
  CliResult resumed =
      run_cli(dir, "train run.yaml out_dir=resumed" + common + " --resume straight/checkpoints/step-000010");
  ASSERT_EQ(resumed.code, 0) << resumed.err;
  EXPECT_NE(resumed.err.find("resumed from"), std::string::npos) << resumed.err;
  const auto a = adapter_tensors(dir.file("straight/checkpoints/step-000020"));
  const auto b = adapter_tensors(dir.file("resumed/checkpoints/step-000020"));
  const auto at10 = adapter_tensors(dir.file("straight/checkpoints/step-000010"));
  ASSERT_EQ(a.size(), 12u);
  ASSERT_EQ(b.size(), a.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].first, b[i].first);
    EXPECT_TRUE(tensors_equal(a[i].second, b[i].second)) << a[i].first;
    EXPECT_FALSE(a[i].second.equal(at10[i].second)) << a[i].first << " did not change after step 10";
  }
  bool named_like_peft = false;
  for (const auto& [name, tensor] : a) named_like_peft |= name == peft_name("layers.1.self_attn.v_proj.lora_B.weight");
  EXPECT_TRUE(named_like_peft);
  MetricsLog straight_log = read_metrics(dir.file("straight/metrics.jsonl"));
  MetricsLog log = read_metrics(dir.file("resumed/metrics.jsonl"));
  ASSERT_EQ(log.train.size(), 10u);
  EXPECT_EQ(straight_log.train.back().loss, log.train.back().loss);

  // A LoRA checkpoint cannot resume a full fine-tuning run, nor one with another rank.
  CliResult full = run_cli(dir, "train run.yaml out_dir=full model.preset=null model.config={} model.pretrained=" +
                                    base + " --resume straight/checkpoints/step-000010");
  EXPECT_EQ(full.code, 1);
  EXPECT_NE(full.err.find("is a LoRA checkpoint"), std::string::npos) << full.err;
  CliResult rank = run_cli(dir, "train run.yaml out_dir=rank" + common +
                                    " model.lora.rank=2 --resume straight/checkpoints/step-000010");
  EXPECT_EQ(rank.code, 1);
  EXPECT_NE(rank.err.find("r = 4"), std::string::npos) << rank.err;
}

// `plan` counts the frozen base without master, gradient or optimizer state; all-linear adapts
// all seven projections; export --merge refuses a full checkpoint.
TEST(CliLoraTest, PlanAndExport_LoraSpecifics) {
  ScratchDir dir;
  const std::string base = make_base_with_launcher(dir);
  dir.write("run.yaml", tiny_config("run"));
  CliResult plan = run_cli(dir, "plan run.yaml" + lora_overrides(base));
  ASSERT_EQ(plan.code, 0) << plan.err;
  EXPECT_NE(plan.out.find("LoRA: rank 4, alpha 8 on q_proj v_proj down_proj"), std::string::npos) << plan.out;
  EXPECT_NE(plan.out.find("trainable parameters: 1,664 of 24,352"), std::string::npos) << plan.out;
  // Host memory (the memory model, scheduler/memory_model.cpp): compute copies of all parameters;
  // masters, gradients (fp32, + a second set: async) and 2 Adam moments of the adapters only.
  char expected[160];
  std::snprintf(expected, sizeof(expected),
                "compute copies %.2f KiB + masters %.2f KiB + gradients %.2f KiB + optimizer state %.2f KiB",
                24352 * 4 / 1024.0, 1664 * 4 / 1024.0, 1664 * 8 / 1024.0, 1664 * 8 / 1024.0);
  EXPECT_NE(plan.out.find(expected), std::string::npos) << expected << "\n" << plan.out;

  CliResult all = run_cli(dir, "plan run.yaml" + lora_overrides(base) + " model.lora.targets=[all-linear]");
  ASSERT_EQ(all.code, 0) << all.err;
  EXPECT_NE(all.out.find("on q_proj k_proj v_proj o_proj gate_proj up_proj down_proj;"), std::string::npos)
      << all.out;

  CliResult merge_full = run_cli(dir, "export " + base + " merged --merge");
  EXPECT_EQ(merge_full.code, 1);
  EXPECT_NE(merge_full.err.find("not a LoRA checkpoint"), std::string::npos) << merge_full.err;
}

// configs/default-lora.yaml adapts the model of configs/default.yaml (here one step of it) on the
// Debian fortunes; both shortened to a few steps.
TEST(CliLoraTest, DefaultLoraConfig_AdaptsTheDefaultModel) {
  const std::string fortunes = "/usr/share/games/fortunes/fortunes";
  if (!is_regular_file(fortunes) || !is_regular_file("/usr/share/games/fortunes/literature")) {
    ROUNDPIPE_ORACLE_MISSING("Debian's fortunes-min is not installed (scripts/setup.sh)");
  }
  ScratchDir dir;
  const std::string configs = std::string(ROUNDPIPE_SOURCE_DIR) + "/configs/";
  CliResult base = run_cli(dir, "train " + configs + "default.yaml out_dir=base train.steps=1 eval.every=0");
  ASSERT_EQ(base.code, 0) << base.err;
  CliResult lora = run_cli(dir, "train " + configs + "default-lora.yaml model.pretrained=base/checkpoints/latest "
                                "train.steps=2 eval.every=0 eval.max_batches=1");
  ASSERT_EQ(lora.code, 0) << lora.err;
  // 4 layers; rank 8 on q/k/v/o (128 -> 128), gate/up (128 -> 352) and down (352 -> 128):
  // 8 (4 x 256 + 3 x 480) = 19,712 per layer; the base has 869,504 parameters.
  EXPECT_NE(lora.err.find("trainable parameters: 78,848 of 948,352"), std::string::npos) << lora.err;
  EXPECT_TRUE(is_regular_file(dir.file("runs/default-lora/checkpoints/latest/adapter_model.safetensors")));
  MetricsLog log = read_metrics(dir.file("runs/default-lora/metrics.jsonl"));
  ASSERT_EQ(log.eval.size(), 1u);  // at the end (data.valid is set)
  EXPECT_TRUE(std::isfinite(log.eval.back().eval_loss));
}

struct LoraErrorCase {
  const char* name;
  const char* overrides;
  std::vector<const char*> expected;  // texts the message must hold
};

TEST(CliLoraTest, ConfigErrors_ExitWithCode2NamingTheKey) {
  ScratchDir dir;
  dir.write("run.yaml", tiny_config("run"));
  dir.write("hf/config.json", R"({"model_type": "llama", "vocab_size": 64, "hidden_size": 32,
      "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4})");
  const std::string pretrained = " model.preset=null model.config={} model.pretrained=hf ";
  const std::vector<LoraErrorCase> cases = {
      {"rank 0", "'model.lora={rank: 0}'", {"model.lora.rank", "0"}},
      {"negative rank", "'model.lora={rank: -4}'", {"model.lora.rank"}},
      {"alpha 0", "'model.lora={alpha: 0}'", {"model.lora.alpha"}},
      {"dropout 1", "'model.lora={dropout: 1.0}'", {"model.lora.dropout"}},
      {"unknown target", "'model.lora={targets: [q_proj, qkv_proj]}'",
       {"model.lora.targets", "qkv_proj", "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj"}},
      {"lm_head", "'model.lora={targets: [lm_head]}'", {"model.lora.targets", "lm_head"}},
      {"no targets", "'model.lora={targets: []}'", {"model.lora.targets"}},
      {"missing adapter", "'model.lora={adapter: nowhere}'", {"model.lora.adapter", "nowhere"}},
  };
  for (const LoraErrorCase& c : cases) {
    for (const char* command : {"train", "validate"}) {
      CliResult r = run_cli(dir, std::string(command) + " run.yaml" + pretrained + c.overrides);
      EXPECT_EQ(r.code, 2) << c.name << " (" << command << "): " << r.err;
      for (const char* text : c.expected) {
        EXPECT_NE(r.err.find(text), std::string::npos) << c.name << ": " << r.err;
      }
    }
  }
  // The same keys are accepted with valid values.
  CliResult ok = run_cli(dir, "validate run.yaml" + pretrained + "'model.lora={rank: 2, targets: [all-linear]}'");
  EXPECT_EQ(ok.code, 0) << ok.err;
  EXPECT_NE(ok.out.find("rank: 2"), std::string::npos) << ok.out;
}

}  // namespace
}  // namespace roundpipe::launcher::testing
