// LoRA (roundpipe/models/lora.h) against PEFT: logits of the same adapter weights, adapter
// directories exchanged both ways, merging; and inside RoundPipe: frozen base weights cost no
// master copy, gradient or optimizer state, and training equals a plain loop.
#include <torch/torch.h>

#include <gtest/gtest.h>

#include <algorithm>

#include "roundpipe/models/layers.h"
#include "roundpipe/models/lora.h"
#include "roundpipe/models/pretrained.h"
#include "roundpipe/round_pipe.h"
#include "tests/common/python_oracle.h"
#include "tests/common/tensor_compare.h"
#include "tests/common/test_macros.h"
#include "tests/models/hf_oracle.h"

namespace roundpipe::testing {
namespace {

constexpr const char* kLlama =
    "LlamaConfig(vocab_size=96, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,"
    " num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)";

// Base model and PEFT adapter (random lora_B, so the adapters matter) saved by Python, and
// PEFT's logits on `ids`.
std::string peft_snippet(const std::string& base_dir, const std::string& adapter_dir) {
  return std::string("from transformers import AutoModelForCausalLM, LlamaConfig\n"
                     "from peft import LoraConfig, get_peft_model\n"
                     "torch.manual_seed(3)\n"
                     "model = AutoModelForCausalLM.from_config(") + kLlama + ")\n"
         "with torch.no_grad():\n"
         "    for name, p in model.named_parameters():\n"
         "        p.copy_(1 + 0.2 * torch.randn_like(p)) if name.endswith('norm.weight') else p.normal_(0, 0.1)\n"
         "model.save_pretrained('" + base_dir + "')\n"
         "cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=['q_proj', 'v_proj', 'down_proj'],"
         " task_type='CAUSAL_LM')\n"
         "peft_model = get_peft_model(model, cfg)\n"
         "with torch.no_grad():\n"
         "    for name, p in peft_model.named_parameters():\n"
         "        if 'lora_B' in name: p.normal_(0, 0.1)\n"
         "peft_model.save_pretrained('" + adapter_dir + "')\n"
         "peft_model.eval()\n"
         "with torch.no_grad():\n"
         "    outputs['logits'] = peft_model(input_ids=inputs['ids']).logits\n"
         "outputs['trainable'] = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)\n";
}

std::string peft_load_snippet(const std::string& base_dir, const std::string& adapter_dir) {
  return "from transformers import AutoModelForCausalLM\n"
         "from peft import PeftModel\n"
         "base = AutoModelForCausalLM.from_pretrained('" + base_dir + "')\n"
         "m = PeftModel.from_pretrained(base, '" + adapter_dir + "').eval()\n"
         "with torch.no_grad():\n"
         "    outputs['logits'] = m(input_ids=inputs['ids']).logits\n";
}

TEST(LoraTest, MatchesPeft_LogitsAdapterRoundTripAndMerge) {
  ROUNDPIPE_REQUIRE_PYTHON("transformers peft");
  using namespace roundpipe::models;
  ScratchDir scratch;
  const std::string base_dir = scratch.file("base"), peft_dir = scratch.file("peft"), our_dir = scratch.file("ours");
  torch::manual_seed(8);
  const at::Tensor ids = torch::randint(0, 96, {2, 12}, torch::kLong);
  auto ref = run_python(peft_snippet(base_dir, peft_dir), {{"ids", ids}});

  Pretrained pre = load_pretrained(base_dir);
  const LoraOptions options = load_lora_adapter(pre.model, pre.config, peft_dir);
  EXPECT_EQ(options.rank(), 4);
  EXPECT_EQ(options.alpha(), 8.0);
  auto targets = options.target_modules();  // PEFT stores them as a set: any order
  std::sort(targets.begin(), targets.end());
  EXPECT_EQ(targets, (std::vector<std::string>{"down_proj", "q_proj", "v_proj"}));
  int64_t trainable = 0;
  for (const auto& p : unique_parameters(*pre.model)) trainable += p.requires_grad() ? p.numel() : 0;
  EXPECT_EQ(trainable, ref.at("trainable").item<int64_t>());  // the same parameters train as in PEFT
  pre.model->eval();
  at::Tensor logits;
  {
    torch::NoGradGuard no_grad;
    logits = pre.model->forward(ids);
  }
  EXPECT_LE(max_abs_diff(logits, ref.at("logits")), 1e-5);

  // Our adapter directory loads in PEFT with the same logits.
  save_lora_adapter(pre.model, pre.config, options, our_dir, base_dir);
  auto back = run_python(peft_load_snippet(base_dir, our_dir), {{"ids", ids}});
  EXPECT_LE(max_abs_diff(back.at("logits"), ref.at("logits")), 1e-5);

  // Merged: the adapters folded into the weights give the same logits, and save as plain HF.
  merge_lora(pre.model);
  {
    torch::NoGradGuard no_grad;
    EXPECT_LE(max_abs_diff(pre.model->forward(ids), ref.at("logits")), 1e-5);
  }
  EXPECT_TRUE(lora_state_dict(pre.model, pre.config).empty());
}

TEST(LoraTest, ApplyLora_InitLikePeftAndErrors) {
  using namespace roundpipe::models;
  ModelConfig config = parse_model_config(
      R"({"model_type": "llama", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 32,
          "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1})");
  auto pre = build(config);
  const auto ids = torch::randint(0, 32, {2, 6}, torch::kLong);
  torch::NoGradGuard no_grad;
  const auto before = pre.model->forward(ids);
  EXPECT_EQ(apply_lora(pre.model, LoraOptions().rank(2).target_modules({"q_proj", "gate_proj"})), 4);
  EXPECT_TRUE(torch::equal(pre.model->forward(ids), before));  // lora_B starts at zero
  for (const auto& item : pre.model->named_parameters()) {
    const bool adapter = item.key().find(".lora_") != std::string::npos;
    EXPECT_EQ(item.value().requires_grad(), adapter) << item.key();
    if (item.key().find("lora_A") != std::string::npos) {
      EXPECT_LE(item.value().abs().max().item<double>(), 1.0 / std::sqrt(item.value().size(1)));  // kaiming(a=sqrt 5)
    }
  }
  auto fresh = build(config);
  EXPECT_THROW_WITH(apply_lora(fresh.model, LoraOptions().target_modules({"qkv"})), "'qkv' is not supported");
  EXPECT_THROW_WITH(save_pretrained(pre.model, pre.config, "/nonexistent/x"), "save_lora_adapter");
}

// draws_in_training (the launcher's preserve_rng_state): only dropout draws: attention dropout,
// LoRA dropout, a torch::nn dropout module with p > 0; not a plain preset, LoRA without dropout or
// a dropout of p = 0.
TEST(LoraTest, DrawsInTraining_OnlyWithDropout) {
  using namespace roundpipe::models;
  const std::string json =
      R"({"model_type": "qwen3", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 32,
          "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8)";
  const ModelConfig config = parse_model_config(json + "}");
  auto plain = build(config);
  EXPECT_FALSE(draws_in_training(*plain.model));
  EXPECT_TRUE(draws_in_training(*build(parse_model_config(json + R"(, "attention_dropout": 0.1})")).model));
  apply_lora(plain.model, LoraOptions().rank(2));
  EXPECT_FALSE(draws_in_training(*plain.model));
  auto lora = build(config);
  apply_lora(lora.model, LoraOptions().rank(2).dropout(0.05));
  EXPECT_TRUE(draws_in_training(*lora.model));
  torch::nn::ModuleList extra(torch::nn::Linear(4, 4), torch::nn::Dropout(0.0));
  EXPECT_FALSE(draws_in_training(*extra));
  extra->push_back(torch::nn::ModuleList(torch::nn::Dropout(0.2)));
  EXPECT_TRUE(draws_in_training(*extra));
}

// A LoRA model in RoundPipe: no master, gradient or optimizer state for the frozen base; SGD on
// the adapters equals a plain loop.
TEST(LoraTest, RoundPipe_FrozenBaseCostsOnlyItsComputeCopy) {
  using namespace roundpipe::models;
  ModelConfig config = parse_model_config(
      R"({"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2})");
  auto make = [&] {
    torch::manual_seed(12);
    auto pre = build(config);
    apply_lora(pre.model, LoraOptions().rank(4).alpha(8).target_modules({"q_proj", "v_proj", "up_proj"}));
    torch::NoGradGuard no_grad;
    for (const auto& item : pre.model->named_parameters()) {
      if (item.key().find("lora_B") != std::string::npos) item.value().normal_(0, 0.05);
    }
    return pre;
  };
  auto pre = make();
  auto reference = make();
  int64_t frozen = 0, adapter_bytes = 0;
  for (const auto& p : unique_parameters(*pre.model)) {
    if (p.requires_grad()) {
      adapter_bytes += p.nbytes();
    } else {
      frozen += p.numel();
    }
  }
  RoundPipe model(pre.model, RoundPipeOptions().devices(std::vector<c10::Device>(2, c10::kCPU)).seed(2));
  auto optimizer = [&] {
    OptimizerCtx ctx;
    return torch::optim::SGD(model.parameters(), torch::optim::SGDOptions(0.5));
  }();
  int64_t master_bytes = 0;
  for (const auto& m : model.optim_parameters()) master_bytes += m.nbytes();
  EXPECT_EQ(master_bytes, adapter_bytes);  // masters only for the adapters
  RecordProperty("frozen_params", std::to_string(frozen));
  RecordProperty("master_bytes_per_frozen_param", "0");
  std::vector<at::Tensor> ref_params;
  for (const auto& p : unique_parameters(*reference.model)) {
    if (p.requires_grad()) ref_params.push_back(p);
  }
  torch::optim::SGD ref_optimizer(ref_params, torch::optim::SGDOptions(0.5));
  RunConfig cfg;
  cfg.num_microbatch = 2;
  for (int step = 0; step < 2; ++step) {
    torch::manual_seed(40 + step);
    const auto ids = torch::randint(0, 64, {4, 10}, torch::kLong);
    const LossFn loss_fn = [](const at::Tensor& logits, const at::Tensor& labels) {
      return causal_lm_loss(logits, labels) * (static_cast<double>(logits.size(0)) / 4);
    };
    model.forward_backward({ids}, ids, loss_fn, cfg);
    // No gradient reached a frozen parameter (none computed, downloaded or handed over).
    for (const auto& p : unique_parameters(*pre.model)) {
      if (!p.requires_grad()) {
        EXPECT_FALSE(p.grad().defined());
      }
    }
    model.step([&] {
      optimizer.step();
      optimizer.zero_grad();
    }, StepMode::kSync);
    ref_optimizer.zero_grad();
    causal_lm_loss(reference.model->forward(ids), ids).backward();
    ref_optimizer.step();
  }
  EXPECT_TRUE(tensor_lists_close(model.optim_parameters(), ref_params, 1e-5));
}

}  // namespace
}  // namespace roundpipe::testing
