// `roundpipe plan` on the original RoundPipe's headline mixture-of-experts workloads, from their
// published config.json alone (configs/models/: no weights, no GPU): stages for 8 GPUs of 24 GiB
// at the original's sequence lengths, the parameter count against one computed here from the
// config.json values, the host bytes of full and LoRA fine-tuning. And on tiny MoE models, the
// config-only counts against `roundpipe train`'s, which count the built model.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

#include "cli_test_util.h"
#include "tests/common/test_config.h"

namespace roundpipe::launcher::testing {
namespace {

const std::string kConfigs = std::string(ROUNDPIPE_SOURCE_DIR) + "/configs/";
const char* const kEightGpus = "'run.devices=[cuda:0,cuda:1,cuda:2,cuda:3,cuda:4,cuda:5,cuda:6,cuda:7]'";

// Parameters of a HF qwen3_moe / gpt_oss config.json, counted from its keys (transformers' module
// shapes), not through the memory model: embeddings and an untied head, then per layer attention
// (q, k, v, o; biases on all four when attention_bias), q/k norms (qwen3_moe), sinks (gpt_oss),
// two norms, the router (+ bias for gpt_oss) and every expert's gate, up and down (+ gpt_oss's
// gate_up and down biases); the final norm.
struct Counts {
  int64_t total = 0;
  int64_t attention_lora = 0;  ///< rank-16 adapters on q, k, v, o: r (in + out) each
};

Counts count_from_config(const nlohmann::json& c, int64_t lora_rank) {
  const bool gpt_oss = c.at("model_type") == "gpt_oss";
  const int64_t V = c.at("vocab_size"), h = c.at("hidden_size"), L = c.at("num_hidden_layers");
  const int64_t d = c.at("head_dim"), q = int64_t{c.at("num_attention_heads")} * d;
  const int64_t kv = int64_t{c.at("num_key_value_heads")} * d;
  const int64_t E = gpt_oss ? c.at("num_local_experts") : c.at("num_experts");
  const int64_t I = gpt_oss ? c.at("intermediate_size") : c.at("moe_intermediate_size");
  int64_t layer = h * q + 2 * h * kv + q * h + 2 * h + E * h + E * 3 * h * I;
  if (c.at("attention_bias").get<bool>()) layer += q + 2 * kv + h;
  if (gpt_oss) layer += int64_t{c.at("num_attention_heads")} + E + E * 2 * I + E * h;
  if (!gpt_oss) layer += 2 * d;
  EXPECT_FALSE(c.at("tie_word_embeddings").get<bool>());
  Counts counts;
  counts.total = 2 * V * h + h + L * layer;
  counts.attention_lora = L * lora_rank * ((h + q) + 2 * (h + kv) + (q + h));
  return counts;
}

nlohmann::json read_config(const std::string& name) {
  return nlohmann::json::parse(read_file(kConfigs + "models/" + name + "/config.json"));
}

// The number after `key` in `text` ("stages (12)" -> 12 for key "stages ("), -1 when absent.
int64_t number_after(const std::string& text, const std::string& key) {
  const size_t at = text.find(key);
  if (at == std::string::npos) return -1;
  return std::stoll(text.substr(at + key.size()));
}

// "estimated host memory: peak 12.00 GiB (12884901888 B) = ..." -> 12884901888.
int64_t host_bytes(const std::string& out) {
  const size_t at = out.find("estimated host memory: peak ");
  if (at == std::string::npos) return -1;
  return number_after(out.substr(at), "(");
}

// The host bytes of the layer inputs a stage-grain run keeps for its recomputes (Note [Memory
// model], host), from the backward stages `plan` prints ("  stage k (bwd, layers [b, e))"): each
// backward stage's input but the fused tail's, for each of the 9 one-row microbatches; the
// embeddings' input is the token ids (8 B a token), any other the bf16 hidden states.
int64_t stage_inputs_bytes(const std::string& out, int64_t seq_len, int64_t hidden) {
  int64_t bytes = 0;
  const std::string key = " (bwd, layers [";
  for (size_t at = out.find(key); at != std::string::npos; at = out.find(key, at + 1)) {
    const int64_t begin = std::stoll(out.substr(at + key.size()));
    bytes += 9 * (begin == 0 ? 8 * seq_len : seq_len * hidden * 2);
  }
  return bytes;
}

std::string full_yaml(const std::string& model_dir, int64_t seq_len) {
  return "out_dir: run\nmodel: {pretrained: " + model_dir +
         ", dtype: bfloat16, master_dtype: float32}\n"
         "data: {format: synthetic, seq_len: " +
         std::to_string(seq_len) +
         "}\n"
         "optimizer: {name: adamw, lr: 1.0e-4}\n"
         "train: {steps: 1, batch_size: 9}\n"
         "run: {num_microbatch: 9, recompute: stage, step_mode: async}\n";
}

struct Workload {
  const char* model;       ///< configs/models/<model>/config.json
  const char* lora_yaml;   ///< configs/<lora_yaml>.yaml, with model.pretrained pointed at the model
  int64_t seq_len;         ///< the original's length (docs/launcher.md, "Plans of the headline workloads")
  double published_total;  ///< the model card's parameter count
};

const Workload kWorkloads[] = {
    {"gpt-oss-20b", "gpt-oss-20b-lora", 39936, 20.9e9},
    {"qwen3-30b-a3b", "qwen3-30b-a3b-lora", 31744, 30.5e9},
    {"qwen3-235b-a22b", "qwen3-30b-a3b-lora", 31744, 235.0e9},
};

void check_plan(const CliResult& r, const nlohmann::json& config, int64_t total, const std::string& what) {
  ASSERT_EQ(r.code, 0) << what << "\n" << r.err;
  EXPECT_NE(r.out.find("model: " + config.at("model_type").get<std::string>() + ", " +
                       std::to_string(int64_t{config.at("num_hidden_layers")}) + " decoder layers, " +
                       std::to_string(total) + " parameters, compute bfloat16"),
            std::string::npos)
      << what << "\n"
      << r.out;
  EXPECT_NE(r.out.find("devices (8): cuda:0 cuda:1 cuda:2 cuda:3 cuda:4 cuda:5 cuda:6 cuda:7"), std::string::npos)
      << what << "\n"
      << r.out;
  EXPECT_GE(number_after(r.out, "stages ("), 8) << what << "\n" << r.out;
  // Every stage's predicted peak, then the verdict against 24 GiB less the CUDA allowance: fits,
  // or says that it does not and how long a sequence would.
  EXPECT_NE(r.out.find("  stage 0 (fwd, layers [0, "), std::string::npos) << what << "\n" << r.out;
  const bool fits =
      r.out.find("of 24.00 GiB (run.device_memory_gib) less 1.00 GiB reserved for CUDA: fits") != std::string::npos;
  const bool refused =
      r.out.find("less 1.00 GiB reserved for CUDA: DOES NOT FIT (roundpipe train refuses it)") != std::string::npos;
  EXPECT_TRUE(fits != refused) << what << "\n" << r.out;
  EXPECT_GE(number_after(r.out, "longest data.seq_len under 24.00 GiB (multiples of 1024, 1 row(s) a microbatch): "), 0)
      << what << "\n"
      << r.out;
}

TEST(CliMoePlanTest, Plan_HeadlineWorkloadsFromConfigJsonAlone_FullAndLora) {
  ScratchDir dir;
  for (const Workload& w : kWorkloads) {
    SCOPED_TRACE(w.model);
    const nlohmann::json config = read_config(w.model);
    const Counts counts = count_from_config(config, 16);
    EXPECT_LT(std::abs(static_cast<double>(counts.total) / w.published_total - 1.0), 0.01) << counts.total;
    const std::string model_dir = kConfigs + "models/" + w.model;
    // No data files either: synthetic data stands in for the examples' token files.
    const std::string overrides = std::string(" ") + kEightGpus +
                                  " run.device_memory_gib=24 data.format=synthetic data.train=null data.valid=null "
                                  "data.seq_len=" +
                                  std::to_string(w.seq_len);

    // Full fine-tuning: bf16 compute copies 2 + fp32 masters 4 + gradients 2 (+ 2 async; AdamW
    // reads them in bf16, no fp32 cast buffer: Note [Gradients in the compute dtype]) + AdamW
    // moments 8 = 18 B/param of host memory, every parameter (experts included), and the backward
    // stages' inputs kept for the recompute.
    const int64_t hidden = config.at("hidden_size");
    dir.write("full.yaml", full_yaml(model_dir, w.seq_len));
    CliResult full = run_cli(dir, "plan full.yaml" + overrides);
    check_plan(full, config, counts.total, "full");
    const int64_t full_inputs = stage_inputs_bytes(full.out, w.seq_len, hidden);
    EXPECT_GT(full_inputs, 0) << full.out;
    EXPECT_EQ(host_bytes(full.out), 18 * counts.total + full_inputs) << full.out;

    // LoRA (the shipped example's rank-16 attention adapters): the frozen base's bf16 copy only,
    // and 16 B per adapter parameter (as above without the bf16 copy), and the kept inputs.
    CliResult lora = run_cli(dir, "plan " + kConfigs + w.lora_yaml + ".yaml model.pretrained=" + model_dir + overrides);
    check_plan(lora, config, counts.total + counts.attention_lora, "lora");
    EXPECT_NE(lora.out.find("trainable parameters: "), std::string::npos) << lora.out;
    EXPECT_EQ(host_bytes(lora.out), 2 * (counts.total + counts.attention_lora) + 16 * counts.attention_lora +
                                        stage_inputs_bytes(lora.out, w.seq_len, hidden))
        << lora.out;
    EXPECT_LT(host_bytes(lora.out) * 5, host_bytes(full.out)) << "LoRA needs far less host memory";
  }
}

// A Qwen3-235B-A22B decoder layer (2,487,755,008 parameters, all 128 experts: bf16 weights and
// gradients 9,951,020,032 B) alone exceeds RoundPipe's per-stage budget on GPUs of 8 GiB (half of
// them): a config error naming the key.
TEST(CliMoePlanTest, Plan_LayerOverTheRuntimeBudget_IsAConfigError) {
  ScratchDir dir;
  dir.write("full.yaml", full_yaml(kConfigs + "models/qwen3-235b-a22b", 4096));
  const CliResult r = run_cli(dir, std::string("plan full.yaml ") + kEightGpus + " run.device_memory_gib=8");
  EXPECT_EQ(r.code, 2) << r.out << r.err;
  EXPECT_NE(r.err.find("run.device_memory_gib: no plan fits RoundPipe's per-stage budget of half the device's "
                       "memory (4.00 GiB): layer 1 needs 9951020032 bytes"),
            std::string::npos)
      << r.err;
}

// The "trainable parameters: ..." line of `plan` (stdout) is in `train`'s stderr.
void expect_same_counts(const ScratchDir& dir, const std::string& args) {
  const CliResult plan = run_cli(dir, "plan " + args);
  ASSERT_EQ(plan.code, 0) << args << "\n" << plan.err;
  const CliResult train = run_cli(dir, "train " + args);
  ASSERT_EQ(train.code, 0) << args << "\n" << train.err;
  const size_t at = plan.out.find("trainable parameters: ");
  ASSERT_NE(at, std::string::npos) << plan.out;
  const std::string line = plan.out.substr(at, plan.out.find('\n', at) - at);
  EXPECT_NE(train.err.find(line), std::string::npos) << args << "\n" << line << "\n" << train.err;
}

// The plan counts from the configuration (scheduler/memory_model.h); train counts the model it
// built. Tiny models with every parameter kind the count must know: gpt-oss's sinks, q/k/v/o and
// expert biases and router bias; Qwen3-MoE's dense layers (mlp_only_layers) with adapted MLPs;
// Mixtral; Llama's MLP biases and tied embeddings. Each from scratch (model.preset), then with
// LoRA on its one-step checkpoint (model.pretrained).
TEST(CliMoePlanTest, Plan_CountsParametersAsTheBuiltModel) {
  ScratchDir dir;
  struct Tiny {
    const char* preset;
    const char* config;
    const char* lora_targets;  ///< nullptr: no LoRA run
  };
  const Tiny models[] = {
      {"gpt_oss",
       "{vocab_size: 64, hidden_size: 32, intermediate_size: 16, num_hidden_layers: 2, num_attention_heads: 4, "
       "num_key_value_heads: 2, head_dim: 8, num_local_experts: 4, num_experts_per_tok: 2, sliding_window: 4, "
       "max_position_embeddings: 64}",
       "[q_proj, v_proj, o_proj]"},
      {"qwen3_moe",
       "{vocab_size: 64, hidden_size: 32, intermediate_size: 48, moe_intermediate_size: 16, num_hidden_layers: 3, "
       "num_attention_heads: 4, num_key_value_heads: 2, head_dim: 8, num_experts: 4, num_experts_per_tok: 2, "
       "mlp_only_layers: [1], max_position_embeddings: 64}",
       "[k_proj, gate_proj, down_proj]"},
      {"mixtral",
       "{vocab_size: 64, hidden_size: 32, intermediate_size: 16, num_hidden_layers: 2, num_attention_heads: 4, "
       "num_key_value_heads: 2, num_local_experts: 4, num_experts_per_tok: 2, max_position_embeddings: 64}",
       nullptr},
      {"llama",
       "{vocab_size: 64, hidden_size: 32, intermediate_size: 48, num_hidden_layers: 2, num_attention_heads: 4, "
       "num_key_value_heads: 2, mlp_bias: true, attention_bias: true, tie_word_embeddings: true, "
       "max_position_embeddings: 64}",
       "[q_proj, up_proj]"},
  };
  for (const Tiny& m : models) {
    SCOPED_TRACE(m.preset);
    const std::string out_dir = std::string("base-") + m.preset;
    dir.write("run.yaml", "out_dir: " + out_dir + "\nmodel: {preset: " + m.preset + ", config: " + m.config +
                              "}\ndata: {format: synthetic, seq_len: 8}\ntrain: {steps: 1, batch_size: 2}\n"
                              "run: {devices: 1}\n");
    expect_same_counts(dir, "run.yaml");
    if (m.lora_targets == nullptr) continue;
    expect_same_counts(dir, std::string("run.yaml out_dir=lora model.preset=null model.config={} model.pretrained=") +
                                out_dir + "/checkpoints/step-000001 'model.lora={rank: 2, targets: " + m.lora_targets +
                                "}'");
  }
}

}  // namespace
}  // namespace roundpipe::launcher::testing
