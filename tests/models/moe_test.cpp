// Mixture-of-experts presets (Qwen3-MoE, Mixtral) against transformers 5 on tiny random models made
// by transformers itself (float32, eager attention and eager experts): logits, the load-balancing
// loss, every gradient of CE + coef * aux, both checkpoint layouts, the export, and the same
// training step through RoundPipe on 1 and 3 CPU devices with recompute (routing replayed).
#include "roundpipe/models/moe.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <map>

#include "roundpipe/models/detail/moe_experts.h"
#include "roundpipe/models/layers.h"
#include "roundpipe/models/lora.h"
#include "roundpipe/models/pretrained.h"
#include "roundpipe/models/safetensors.h"
#include "roundpipe/recompute_data.h"
#include "roundpipe/round_pipe.h"
#include "tests/common/python_oracle.h"
#include "tests/common/sanitizer_memory.h"
#include "tests/common/tensor_compare.h"
#include "tests/models/hf_oracle.h"

namespace roundpipe::testing {
namespace {

using namespace roundpipe::models;

constexpr int64_t kRows = 3, kTokens = 20, kVocab = 128;

struct MoeSpec {
  std::string config_class;  // "Qwen3MoeConfig", "MixtralConfig"
  std::string kwargs;        // Python dict literal
};

MoeSpec qwen3_moe_spec() {
  // A dense layer in the middle (mlp_only_layers), renormalized top-2 of 6 experts, q/k norms.
  return {"Qwen3MoeConfig",
          "dict(vocab_size=128, hidden_size=32, intermediate_size=48, moe_intermediate_size=24, num_hidden_layers=3, "
          "num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=6, num_experts_per_tok=2, "
          "norm_topk_prob=True, mlp_only_layers=[1], router_aux_loss_coef=0.3)"};
}

MoeSpec mixtral_spec() {
  // Top-2 of 4 experts in every layer, a sliding window shorter than the sequence.
  return {"MixtralConfig",
          "dict(vocab_size=128, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4, "
          "num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, sliding_window=7, "
          "router_aux_loss_coef=0.2)"};
}

MoeSpec gpt_oss_spec() {
  // Sliding (window 5 < 20 tokens) and full layers, sinks, biases, a clamp that engages (limit 1),
  // YaRN rotary embeddings (attention factor on cos and sin).
  return {"GptOssConfig",
          "dict(vocab_size=128, hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4, "
          "num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=5, "
          "swiglu_limit=1.0, router_aux_loss_coef=0.2)"};  // GptOssConfig's YaRN rope
}

// Builds `model` in transformers (config `cfg`, inputs x, y) with random weights large enough that
// routing matters, and defines margin(model). Fails if a token's k-th and (k+1)-th router
// probabilities are within 1e-4 (rounding could then pick other experts).
std::string init_snippet(const MoeSpec& spec) {
  return "import transformers\n"
         "import torch.nn.functional as F\n"
         "from transformers import AutoModelForCausalLM, " +
         spec.config_class +
         "\n"
         "cfg = " +
         spec.config_class + "(**" + spec.kwargs +
         ", output_router_logits=True,\n"
         "    attn_implementation='eager', experts_implementation='eager')\n"
         "x, y = inputs['x'], inputs['y']\n"
         "k = cfg.num_experts_per_tok\n"
         "def margin(model):\n"
         "    with torch.no_grad():\n"
         "        logits = model(input_ids=x, output_router_logits=True).router_logits\n"
         "    return min((lambda s: (s[:, k - 1] - s[:, k]).min().item())(torch.softmax(l.float(), -1).sort(-1, "
         "True)[0])\n"
         "               for l in logits)\n"
         "for seed in range(4321, 4421):\n"
         "    torch.manual_seed(seed)\n"
         "    model = AutoModelForCausalLM.from_config(cfg)\n"
         "    with torch.no_grad():\n"
         "        for name, p in model.named_parameters():\n"
         "            if name.endswith('norm.weight'):\n"
         "                p.copy_(1 + 0.2 * torch.randn_like(p))\n"
         "            elif name.endswith(('gate.weight', 'router.weight')):\n"
         "                p.normal_(0, 0.6)\n"
         "            else:\n"
         "                p.normal_(0, 0.15)\n"
         "    if margin(model) >= 1e-4:\n"
         "        break\n"
         "assert margin(model) >= 1e-4, 'no seed gives router margins >= 1e-4'\n";
}

// The model of init_snippet saved in both expert layouts, and for inputs x, targets y: the eval
// logits, CE, aux and the gradient of every parameter of CE + coef * aux.
std::string oracle_snippet(const MoeSpec& spec, const std::string& dir) {
  return init_snippet(spec) + "model.save_pretrained('" + dir +
         "/orig')\n"
         "model.save_pretrained('" +
         dir +
         "/fused', save_original_format=False)\n"
         "model.eval()\n"
         "with torch.no_grad():\n"
         "    outputs['logits'] = model(input_ids=x).logits\n"
         "model.train()\n"
         "out = model(input_ids=x, output_router_logits=True)\n"
         "ce = F.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]), y.reshape(-1))\n"
         "outputs['ce'] = ce.detach()\n"
         "outputs['aux'] = out.aux_loss.detach()\n"
         "(ce + cfg.router_aux_loss_coef * out.aux_loss).backward()\n"
         "for name, p in model.named_parameters():\n"
         "    outputs['grad:' + name] = p.grad\n";
}

std::string reload_snippet(const std::string& dir) {
  return "from transformers import AutoModelForCausalLM\n"
         "m, info = AutoModelForCausalLM.from_pretrained('" +
         dir +
         "', output_loading_info=True,\n"
         "    attn_implementation='eager', experts_implementation='eager')\n"
         "outputs['missing'] = len(info['missing_keys'])\n"
         "outputs['unexpected'] = len(info['unexpected_keys'])\n"
         "outputs['mismatched'] = len(info['mismatched_keys'])\n"
         "with torch.no_grad():\n"
         "    outputs['logits'] = m.eval()(input_ids=inputs['x']).logits\n";
}

struct Batch {
  at::Tensor x, y;
};

Batch make_batch() {
  torch::manual_seed(11);
  const at::Tensor ids = torch::randint(0, kVocab, {kRows, kTokens + 1}, torch::kLong);
  return {ids.narrow(1, 0, kTokens).contiguous(), ids.narrow(1, 1, kTokens).contiguous()};
}

at::Tensor grad_of(const torch::nn::Sequential& model, const ModelConfig& config, const std::string& hf_name) {
  for (const auto& p : model->named_parameters()) {
    if (hf_parameter_name(p.key(), config.num_hidden_layers) == hf_name) return p.value().grad();
  }
  return {};
}

double max_abs(const at::Tensor& t) { return t.abs().max().item<double>(); }

// Every gradient of `model` (named by HF) against the oracle's.
void expect_grads_match(const torch::nn::Sequential& model, const ModelConfig& config, const TensorMap& ref,
                        double tolerance) {
  int compared = 0;
  for (const auto& [key, expected] : ref) {
    if (key.rfind("grad:", 0) != 0) continue;
    const std::string name = key.substr(5);
    const at::Tensor grad = grad_of(model, config, name);
    ASSERT_TRUE(grad.defined()) << name << " has no gradient in our model";
    EXPECT_LE(max_abs_diff(grad, expected), tolerance * std::max(1.0, max_abs(expected))) << name;
    ++compared;
  }
  EXPECT_EQ(compared, static_cast<int>(model->parameters().size()));
}

void expect_matches_transformers(const MoeSpec& spec) {
  ROUNDPIPE_REQUIRE_ORACLE();
  ScratchDir scratch;
  const std::string dir = scratch.file("hf");
  const Batch batch = make_batch();
  const auto ref = run_python(oracle_snippet(spec, dir), {{"x", batch.x}, {"y", batch.y}});

  // Both layouts load, to the same values.
  Pretrained pre = load_pretrained(dir + "/orig");
  Pretrained fused = load_pretrained(dir + "/fused");
  ASSERT_TRUE(pre.config.is_moe());
  for (const auto& [name, tensor] : hf_state_dict(pre.model, pre.config)) {
    bool found = false;
    for (const auto& [other, value] : hf_state_dict(fused.model, fused.config)) {
      if (other != name) continue;
      found = true;
      EXPECT_TRUE(value.equal(tensor)) << name << " differs between the per-expert and the fused checkpoint";
    }
    EXPECT_TRUE(found) << name;
  }

  // Eval: logits, and the head's loss is plain CE.
  pre.model->eval();
  {
    torch::NoGradGuard no_grad;
    EXPECT_LE(max_abs_diff(models::forward(pre.model, batch.x), ref.at("logits")), 1e-4);
    const double ce = models::forward(pre.model, batch.x, batch.y).item<double>() / batch.y.numel();
    EXPECT_NEAR(ce, ref.at("ce").item<double>(), 1e-5);
  }

  // Training: CE + coef * aux, every gradient; the aux through the log.
  pre.model->train();
  auto log = std::make_shared<RouterLossLog>();
  auto head = pre.model->ptr<LmHeadImpl>(pre.model->size() - 1);
  head->set_router_loss_log(log);
  const at::Tensor loss = models::forward(pre.model, batch.x, batch.y) / static_cast<double>(batch.y.numel());
  const double expected_loss =
      ref.at("ce").item<double>() + pre.config.router_aux_loss_coef * ref.at("aux").item<double>();
  EXPECT_NEAR(loss.item<double>(), expected_loss, 1e-5);
  EXPECT_NEAR(log->take(), ref.at("aux").item<double>(), 1e-6);
  loss.backward();
  expect_grads_match(pre.model, pre.config, ref, 1e-5);

  // The export loads in transformers with no missing or unexpected keys, to the same logits.
  save_pretrained(pre.model, pre.config, dir + "/ours");
  const auto back = run_python(reload_snippet(dir + "/ours"), {{"x", batch.x}});
  EXPECT_EQ(back.at("missing").item<double>(), 0);
  EXPECT_EQ(back.at("unexpected").item<double>(), 0);
  EXPECT_EQ(back.at("mismatched").item<double>(), 0);
  EXPECT_LE(max_abs_diff(back.at("logits"), ref.at("logits")), 1e-5);
}

TEST(Qwen3MoeTest, MatchesTransformers_LogitsAuxAndEveryGradient) { expect_matches_transformers(qwen3_moe_spec()); }

TEST(MixtralTest, MatchesTransformers_LogitsAuxAndEveryGradient) { expect_matches_transformers(mixtral_spec()); }

TEST(GptOssTest, MatchesTransformers_LogitsAuxAndEveryGradient) { expect_matches_transformers(gpt_oss_spec()); }

// gpt-oss's released layout: MXFP4 expert blocks + scales (quantization_config in config.json) load
// dequantized exactly as transformers' convert_moe_packed_tensors, and the export is bf16/fp32
// fused without the quantization_config.
TEST(GptOssTest, Mxfp4Checkpoint_LoadsDequantizedAsTransformers) {
  ROUNDPIPE_REQUIRE_ORACLE();
  ScratchDir scratch;
  const std::string dir = scratch.file("hf");
  const auto ref = run_python(
      "import json\n"
      "from safetensors.torch import load_file, save_file\n"
      "from transformers import AutoModelForCausalLM, GptOssConfig\n"
      "from transformers.integrations.mxfp4 import convert_moe_packed_tensors\n"
      "torch.manual_seed(2)\n"
      "cfg = GptOssConfig(vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=1,"
      " num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=3, num_experts_per_tok=2)\n"
      "AutoModelForCausalLM.from_config(cfg).save_pretrained('" +
      dir +
      "')\n"
      "sd = load_file('" +
      dir +
      "/model.safetensors')\n"
      "for n in ['gate_up_proj', 'down_proj']:\n"
      "    key = 'model.layers.0.mlp.experts.' + n\n"
      "    w = sd.pop(key)\n"
      "    rows, cols = w.shape[2], w.shape[1]\n"
      "    blocks = torch.randint(0, 256, (3, rows, cols // 32, 16), dtype=torch.uint8)\n"
      "    scales = torch.randint(120, 134, (3, rows, cols // 32), dtype=torch.uint8)\n"
      "    sd[key + '_blocks'], sd[key + '_scales'] = blocks, scales\n"
      "    outputs[n] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)\n"
      "save_file(sd, '" +
      dir +
      "/model.safetensors', metadata={'format': 'pt'})\n"
      "c = json.load(open('" +
      dir +
      "/config.json'))\n"
      "c['quantization_config'] = {'quant_method': 'mxfp4', 'modules_to_not_convert': ['model.layers.*.self_attn',"
      " 'model.layers.*.mlp.router', 'model.embed_tokens', 'lm_head']}\n"
      "json.dump(c, open('" +
      dir + "/config.json', 'w'))\n");
  Pretrained pre = load_pretrained(dir);
  std::map<std::string, at::Tensor> params;
  for (const auto& [name, tensor] : hf_state_dict(pre.model, pre.config)) params[name] = tensor;
  EXPECT_TRUE(params.at("model.layers.0.mlp.experts.gate_up_proj").equal(ref.at("gate_up_proj")));
  EXPECT_TRUE(params.at("model.layers.0.mlp.experts.down_proj").equal(ref.at("down_proj")));
  save_pretrained(pre.model, pre.config, dir + "/ours");
  EXPECT_EQ(read_bytes(dir + "/ours/config.json").find("quantization_config"), std::string::npos);
  EXPECT_TRUE(CheckpointReader::open(dir + "/ours").contains("model.layers.0.mlp.experts.gate_up_proj"));
}

// The gpt-oss test can tell: sinks, the sliding window and the SwiGLU clamp each change the logits.
TEST(GptOssTest, Ablations_SinksWindowAndClampChangeTheResult) {
  const std::string base = R"("model_type": "gpt_oss", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 24,
      "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
      "num_local_experts": 4, "num_experts_per_tok": 2, "rope_parameters": {"rope_type": "default", "rope_theta": 150000.0})";
  auto logits_of = [&](const std::string& extra, bool zero_sinks) {
    ModelConfig config = parse_model_config("{" + base + extra + "}");
    torch::manual_seed(8);
    Pretrained pre = build(config);
    torch::NoGradGuard no_grad;
    for (auto& p : pre.model->parameters()) p.normal_(0, 0.5);
    if (zero_sinks) {
      for (const auto& p : pre.model->named_parameters()) {
        if (p.key().find("sinks") != std::string::npos) p.value().fill_(-1e4);
      }
    }
    pre.model->eval();
    return models::forward(pre.model, make_batch().x);
  };
  const at::Tensor reference = logits_of(R"(, "sliding_window": 5, "swiglu_limit": 1.0)", false);
  EXPECT_GT(max_abs_diff(reference, logits_of(R"(, "sliding_window": 5, "swiglu_limit": 1.0)", true)), 1e-3) << "sinks";
  EXPECT_GT(max_abs_diff(reference, logits_of(R"(, "sliding_window": 64, "swiglu_limit": 1.0)", false)), 1e-3)
      << "window";
  EXPECT_GT(max_abs_diff(reference, logits_of(R"(, "sliding_window": 5, "swiglu_limit": 100.0)", false)), 1e-3)
      << "clamp";
}

// The tests above can tell: renormalizing or not, and the aux coefficient, change the result.
TEST(Qwen3MoeTest, Ablations_NormTopkAndAuxChangeTheResult) {
  ModelConfig config = parse_model_config(
      R"({"model_type": "qwen3_moe", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 48,
          "moe_intermediate_size": 24, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 8, "num_experts": 6, "num_experts_per_tok": 2, "norm_topk_prob": true,
          "router_aux_loss_coef": 0.3})");
  torch::manual_seed(3);
  Pretrained a = build(config);
  for (auto& p : a.model->parameters()) {
    torch::NoGradGuard no_grad;
    p.normal_(0, 0.3);
  }
  ModelConfig unnormalized = config;
  unnormalized.norm_topk_prob = false;
  torch::nn::Sequential b = make_model(unnormalized);
  load_hf_state_dict(b, unnormalized, [&](const std::string& name) {
    for (const auto& [n, t] : hf_state_dict(a.model, config)) {
      if (n == name) return t;
    }
    return at::Tensor();
  });
  const Batch batch = make_batch();
  torch::NoGradGuard no_grad;
  a.model->eval();
  b->eval();
  EXPECT_GT(max_abs_diff(models::forward(a.model, batch.x), models::forward(b, batch.x)), 1e-3);

  a.model->train();
  auto head = a.model->ptr<LmHeadImpl>(a.model->size() - 1);
  const double with_aux = models::forward(a.model, batch.x, batch.y).item<double>();
  head->set_router_aux_loss_coef(0.0);
  const double without_aux = models::forward(a.model, batch.x, batch.y).item<double>();
  EXPECT_GT(std::abs(with_aux - without_aux) / batch.y.numel(), 1e-4);
}

// Note [Recompute data]: a recompute uses the forward's routing even where the input changed so
// that routing anew would choose other experts.
TEST(SparseMoeBlockTest, RecomputeReplaysTheForwardsRouting) {
  ModelConfig config = parse_model_config(
      R"({"model_type": "mixtral", "vocab_size": 16, "hidden_size": 16, "intermediate_size": 8,
          "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2, "num_local_experts": 4,
          "num_experts_per_tok": 1})");
  torch::manual_seed(5);
  SparseMoeBlock block(config, 0);
  init_weights(*block, 0.5);
  const at::Tensor x = torch::randn({1, 12, 16});
  const at::Tensor other = torch::randn({1, 12, 16});
  roundpipe::detail::RecomputeSlot slot;
  at::Tensor first_counts, replay_counts, fresh_counts;
  {
    roundpipe::detail::RecomputePassScope pass(&slot, roundpipe::detail::PassKind::kSaves, c10::kCPU);
    first_counts = block(x)[1][0];
  }
  ASSERT_FALSE(slot.entries.empty()) << "the forward saved no routing";
  {
    roundpipe::detail::RecomputePassScope pass(&slot, roundpipe::detail::PassKind::kReplays, c10::kCPU);
    EXPECT_TRUE(roundpipe::in_recompute());
    replay_counts = block(other)[1][0];
  }
  fresh_counts = block(other)[1][0];
  EXPECT_TRUE(replay_counts.equal(first_counts));
  EXPECT_FALSE(fresh_counts.equal(first_counts)) << "the test inputs route alike; pick others";
  // Outside a pass nothing is saved or replayed.
  EXPECT_FALSE(roundpipe::recompute_data("moe.routing").has_value());
  EXPECT_FALSE(roundpipe::in_recompute());
}

// An expert that no token chose gets a zero gradient (not stale, not NaN).
TEST(SparseMoeBlockTest, ExpertWithoutTokensGetsZeroGradient) {
  ModelConfig config = parse_model_config(
      R"({"model_type": "mixtral", "vocab_size": 16, "hidden_size": 8, "intermediate_size": 8,
          "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2, "num_local_experts": 4,
          "num_experts_per_tok": 1})");
  torch::manual_seed(6);
  SparseMoeBlock block(config, 0);
  init_weights(*block, 0.5);
  {
    torch::NoGradGuard no_grad;
    block->gate->weight[3].fill_(-100.0);  // expert 3 never wins against the others
  }
  const at::Tensor x = torch::rand({2, 5, 8}) + 0.1;
  const auto out = block(x);
  ASSERT_EQ(out[1][0][3].item<double>(), 0.0);
  out[0].sum().backward();
  const at::Tensor g = block->experts->gate_up_proj.grad();
  ASSERT_TRUE(g.defined());
  EXPECT_TRUE(g[3].eq(0).all().item<bool>());
  EXPECT_GT(g[0].abs().sum().item<double>() + g[1].abs().sum().item<double>() + g[2].abs().sum().item<double>(), 0);
  EXPECT_TRUE(torch::isfinite(g).all().item<bool>());
}

// On a GPU (the *_CUDA twin of the CPU tests above; scripts/gpu-validate.sh runs it): the sparse
// block of each architecture (SwiGLU with renormalized bf16-style weights, Mixtral's fp32
// products, gpt-oss's clamped GLU with biases) gives the CPU's output, router statistics and
// gradients within fp32 rounding, and two CUDA runs are bitwise equal: each expert's index_add_
// sees a token at most once (Note [Sorted experts]), so CUDA's atomics cannot reorder a sum. The
// routing margin is checked on the CPU first (no near-tie that rounding could flip).
TEST(SparseMoeBlockTest, MatchesCpuAndIsDeterministic_CUDA) {
  const std::vector<std::string> configs = {
      R"({"model_type": "qwen3_moe", "vocab_size": 16, "hidden_size": 64, "intermediate_size": 64,
          "moe_intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": true})",
      R"({"model_type": "mixtral", "vocab_size": 16, "hidden_size": 64, "intermediate_size": 48,
          "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 8,
          "num_experts_per_tok": 2})",
      R"({"model_type": "gpt_oss", "vocab_size": 16, "hidden_size": 64, "intermediate_size": 48,
          "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
          "num_local_experts": 8, "num_experts_per_tok": 2, "swiglu_limit": 1.0})"};
  torch::manual_seed(20);
  const at::Tensor x = torch::randn({2, 37, 64});
  const at::Tensor g = torch::randn({2, 37, 64});
  std::vector<SparseMoeBlock> blocks;
  for (const std::string& json : configs) {
    const ModelConfig config = parse_model_config(json);
    SCOPED_TRACE(model_type_name(config.architecture));
    // The first seed whose router has no near-tie between a token's 2nd and 3rd experts.
    double margin = 0;
    for (int seed = 21; seed < 41 && margin < 1e-4; ++seed) {
      torch::manual_seed(seed);
      SparseMoeBlock block(config, 0);
      init_weights(*block, 0.3);
      torch::NoGradGuard no_grad;
      const at::Tensor top = std::get<0>(at::topk(block->gate(x.reshape({-1, 64})), 3, -1));
      margin = (top.select(1, 1) - top.select(1, 2)).min().item<double>();
      if (margin >= 1e-4) blocks.push_back(block);
    }
    ASSERT_GE(margin, 1e-4) << "no seed in [21, 41) routes without a near-tie";
  }
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  auto run = [&](SparseMoeBlock& block, c10::Device device) {
    block->zero_grad();
    const at::Tensor xd = x.to(device).requires_grad_();
    const auto out = block(xd);
    ((out[0] * g.to(device)).sum() + out[1][1].sum() * 0.1).backward();
    // The output, the statistics, the gradient of x and of every parameter.
    std::vector<at::Tensor> values = {out[0].detach().cpu(), out[1].detach().cpu(), xd.grad().cpu()};
    for (const auto& p : block->parameters()) values.push_back(p.grad().cpu());
    return values;
  };
  const c10::Device cuda(c10::kCUDA, 0);
  for (SparseMoeBlock& cpu : blocks) {
    const auto ref = run(cpu, c10::kCPU);
    SparseMoeBlock gpu(std::dynamic_pointer_cast<SparseMoeBlockImpl>(cpu->clone()));
    gpu->to(cuda);
    const auto first = run(gpu, cuda);
    const auto second = run(gpu, cuda);
    ASSERT_EQ(first.size(), ref.size());
    for (size_t i = 0; i < ref.size(); ++i) {
      const double scale = std::max(1.0, ref[i].abs().max().item<double>());
      EXPECT_LT(max_abs_diff(first[i], ref[i]), 1e-4 * scale) << "tensor " << i;
      EXPECT_TRUE(first[i].equal(second[i])) << "tensor " << i << " differs between two CUDA runs";
    }
  }
}

// Note [Sorted experts], Note [Routing weights in the experts]: the experts over gathered token
// rows (tokens repeated across rows, as top-k makes them; an expert without rows; a token without
// rows) == plain autograd expert by expert (index_select, the expert's MLP, (y.to(w) * w).to(x),
// index_add_) on the output and on the gradients of x, every weight and the row weights. SwiGLU
// and gpt-oss's clamped GLU (with biases and a clamp that engages); fp32 tightly, bf16 rows with
// fp32 weights (Mixtral's fp32 products) against the fp32 reference within bf16 rounding.
TEST(SortedExpertsTest, GatheredRowsWithRowWeightsMatchPlainAutograd) {
  const int64_t N = 7, H = 16, I = 8, E = 4;
  const std::vector<int64_t> counts = {3, 0, 5, 2};
  const at::Tensor token_of_row = torch::tensor({0, 2, 5, 1, 2, 3, 5, 0, 3, 5}, torch::kLong);  // token 4 has none
  const int64_t M = token_of_row.size(0);
  for (const bool clamped : {false, true}) {
    SCOPED_TRACE(clamped ? "clamped GLU (gpt-oss)" : "SwiGLU");
    torch::manual_seed(11);
    const double alpha = 1.702, limit = 0.7;
    std::vector<at::Tensor> init = {torch::randn({N, H})};
    if (clamped) {
      init.push_back(torch::randn({E, H, 2 * I}) * 0.3);
      init.push_back(torch::randn({E, 2 * I}) * 0.3);
      init.push_back(torch::randn({E, I, H}) * 0.3);
      init.push_back(torch::randn({E, H}) * 0.3);
    } else {
      init.push_back(torch::randn({E, 2 * I, H}) * 0.3);
      init.push_back(torch::randn({E, H, I}) * 0.3);
    }
    const at::Tensor w0 = torch::rand({M}) + 0.1, g_out = torch::randn({N, H});
    // [out, grad x, grad of each weight..., grad w]
    auto run = [&](bool ours, at::ScalarType dtype) {
      std::vector<at::Tensor> leaves;
      for (const at::Tensor& t : init) leaves.push_back(t.to(dtype, false, /*copy=*/true).requires_grad_());
      const at::Tensor w = w0.clone().requires_grad_();
      const at::Tensor& x = leaves[0];
      at::Tensor out;
      if (ours) {
        out = clamped ? models::detail::clamped_glu_experts(x, token_of_row, leaves[1], leaves[2], leaves[3], leaves[4],
                                                            counts, alpha, limit, w)
                      : models::detail::swiglu_experts(x, token_of_row, leaves[1], leaves[2], counts, w);
      } else {
        out = torch::zeros({N, H}, x.options());
        int64_t offset = 0;
        for (int64_t e = 0; e < E; ++e) {
          const int64_t n = counts[static_cast<size_t>(e)];
          const at::Tensor idx = token_of_row.narrow(0, offset, n);
          const at::Tensor xe = x.index_select(0, idx);
          at::Tensor ye;
          if (clamped) {
            const at::Tensor h = at::mm(xe, leaves[1][e]) + leaves[2][e];
            const at::Tensor g = h.slice(1, 0, 2 * I, 2).clamp_max(limit);
            const at::Tensor u = h.slice(1, 1, 2 * I, 2).clamp(-limit, limit);
            ye = at::mm((u + 1) * (g * at::sigmoid(g * alpha)), leaves[3][e]) + leaves[4][e];
          } else {
            const at::Tensor h = at::mm(xe, leaves[1][e].t());
            ye = at::mm(at::silu(h.narrow(1, 0, I)) * h.narrow(1, I, I), leaves[2][e].t());
          }
          out = out.index_add(0, idx, (ye.to(at::kFloat) * w.narrow(0, offset, n).unsqueeze(1)).to(dtype));
          offset += n;
        }
      }
      (out.to(at::kFloat) * g_out).sum().backward();
      std::vector<at::Tensor> result = {out.detach().to(at::kFloat)};
      for (const at::Tensor& leaf : leaves) result.push_back(leaf.grad().to(at::kFloat));
      result.push_back(w.grad());
      return result;
    };
    const auto ref = run(false, at::kFloat), ours = run(true, at::kFloat);
    ASSERT_EQ(ours.size(), ref.size());
    for (size_t i = 0; i < ref.size(); ++i) EXPECT_TRUE(tensors_close(ours[i], ref[i], 1e-5)) << "tensor " << i;
    EXPECT_TRUE(ours[0][4].eq(0).all().item<bool>());  // token 4 has no rows
    EXPECT_TRUE(ours[2][1].eq(0).all().item<bool>());  // expert 1 has no rows
    EXPECT_TRUE(ours[clamped ? 4 : 3][1].eq(0).all().item<bool>());
    if (clamped) {  // the clamp engages on both halves, so its masks are exercised
      const at::Tensor h = at::mm(init[0].index_select(0, token_of_row.narrow(0, 0, 3)), init[1][0]) + init[2][0];
      EXPECT_TRUE(h.slice(1, 0, 2 * I, 2).gt(limit).any().item<bool>());
      EXPECT_TRUE(h.slice(1, 1, 2 * I, 2).lt(-limit).any().item<bool>());
    }
    const auto bf16 = run(true, at::kBFloat16);
    for (size_t i = 0; i < ref.size(); ++i) {
      EXPECT_LT((bf16[i] - ref[i]).abs().max().item<double>(), 3e-2 * ref[i].abs().max().item<double>())
          << "tensor " << i;
    }
  }
  // Rows already sorted (Experts::forward): each row is its own token, unweighted without weights.
  torch::manual_seed(12);
  const at::Tensor x = torch::randn({M, H}), gu = torch::randn({E, 2 * I, H}) * 0.3, dn = torch::randn({E, H, I}) * 0.3;
  const at::Tensor w = torch::rand({M}) + 0.1;
  at::NoGradGuard no_grad;
  const at::Tensor sorted = models::detail::sorted_swiglu_experts(x, gu, dn, counts);
  EXPECT_TRUE(
      tensors_close(models::detail::sorted_swiglu_experts(x, gu, dn, counts, w), sorted * w.unsqueeze(1), 1e-6));
}

// Note [Expert LoRA on the rows]: the experts with LoRA factors on both weights (frozen base
// weights, as PEFT's target_parameters leaves them) == the same experts on PEFT's adapted weights
// W + scaling B A (gpt-oss: W + scaling A^T B^T), materialized by baddbmm under autograd, on the
// output and on the gradients of x, both factors of both weights and the row weights (an expert
// without rows: zero factor gradients), for SwiGLU and the clamped GLU; and a forward keeps no
// copy of the adapted weights (heap in use with the output held), while the base weights get no
// gradient.
TEST(SortedExpertsTest, LoraOnTheRowsMatchesTheAdaptedWeightsAndKeepsNoWeightCopy) {
  const int64_t N = 7, H = 16, I = 8, E = 4, r = 3;
  const std::vector<int64_t> counts = {3, 0, 5, 2};
  const at::Tensor token_of_row = torch::tensor({0, 2, 5, 1, 2, 3, 5, 0, 3, 5}, torch::kLong);
  const int64_t M = token_of_row.size(0);
  const double scaling = 2.5, alpha = 1.702, limit = 0.7;
  for (const bool clamped : {false, true}) {
    SCOPED_TRACE(clamped ? "clamped GLU (gpt-oss)" : "SwiGLU");
    torch::manual_seed(21);
    // [in, out] of gate_up and down
    const int64_t gu_in = H, gu_out = 2 * I, dn_in = I, dn_out = H;
    const at::Tensor x0 = torch::randn({N, H}), w0 = torch::rand({M}) + 0.1, g_out = torch::randn({N, H});
    const at::Tensor gate_up = clamped ? torch::randn({E, H, 2 * I}) * 0.3 : torch::randn({E, 2 * I, H}) * 0.3;
    const at::Tensor down = clamped ? torch::randn({E, I, H}) * 0.3 : torch::randn({E, H, I}) * 0.3;
    const at::Tensor gate_up_bias = torch::randn({E, 2 * I}) * 0.3, down_bias = torch::randn({E, H}) * 0.3;
    const std::vector<at::Tensor> factors0 = {torch::randn({E, r, gu_in}) * 0.3, torch::randn({E, gu_out, r}) * 0.3,
                                              torch::randn({E, r, dn_in}) * 0.3, torch::randn({E, dn_out, r}) * 0.3};
    // [out, grad x, grad of each factor..., grad w]
    auto run = [&](bool on_rows) {
      const at::Tensor x = x0.clone().requires_grad_(), w = w0.clone().requires_grad_();
      std::vector<at::Tensor> f;
      for (const at::Tensor& t : factors0) f.push_back(t.clone().requires_grad_());
      at::Tensor gu = gate_up, dn = down;
      models::detail::ExpertLora gu_lora, dn_lora;
      if (on_rows) {
        gu_lora = {f[0], f[1], scaling};
        dn_lora = {f[2], f[3], scaling};
      } else if (clamped) {  // [E, in, out] + scaling A^T B^T
        gu = at::baddbmm(gate_up, f[0].transpose(1, 2), f[1].transpose(1, 2), 1, scaling);
        dn = at::baddbmm(down, f[2].transpose(1, 2), f[3].transpose(1, 2), 1, scaling);
      } else {  // [E, out, in] + scaling B A
        gu = at::baddbmm(gate_up, f[1], f[0], 1, scaling);
        dn = at::baddbmm(down, f[3], f[2], 1, scaling);
      }
      const at::Tensor out = clamped
                                 ? models::detail::clamped_glu_experts(x, token_of_row, gu, gate_up_bias, dn, down_bias,
                                                                       counts, alpha, limit, w, gu_lora, dn_lora)
                                 : models::detail::swiglu_experts(x, token_of_row, gu, dn, counts, w, gu_lora, dn_lora);
      (out * g_out).sum().backward();
      std::vector<at::Tensor> result = {out.detach(), x.grad()};
      for (const at::Tensor& t : f) result.push_back(t.grad());
      result.push_back(w.grad());
      return result;
    };
    const auto ref = run(false), ours = run(true);
    ASSERT_EQ(ours.size(), ref.size());
    for (size_t i = 0; i < ref.size(); ++i) {
      ASSERT_TRUE(ours[i].defined()) << "tensor " << i;
      const double scale = std::max(1.0, ref[i].abs().max().item<double>());
      EXPECT_LE((ours[i] - ref[i]).abs().max().item<double>(), 1e-6 * scale) << "tensor " << i;
    }
    for (size_t i = 2; i < 6; ++i) {
      EXPECT_TRUE(ours[i][1].eq(0).all().item<bool>()) << "expert 1 has no rows: factor " << i - 2;
      EXPECT_GT(ours[i].abs().max().item<double>(), 0.0) << "factor " << i - 2;
    }
    EXPECT_FALSE(gate_up.grad().defined());
    EXPECT_FALSE(down.grad().defined());
  }

  // What a SwiGLU forward keeps for the backward: the adapted weights (E 3 I H floats) with PEFT's
  // materialization, none on the rows (x G^T | x U^T rows and bookkeeping).
  const int64_t e = 8, h = 256, i = 128, m = 64;
  torch::manual_seed(22);
  const at::Tensor x = torch::randn({m, h}).requires_grad_();
  const at::Tensor tokens = torch::arange(m, torch::kLong);
  const std::vector<int64_t> even(static_cast<size_t>(e), m / e);
  const at::Tensor gate_up = torch::randn({e, 2 * i, h}), down = torch::randn({e, h, i});
  const at::Tensor a_gu = torch::randn({e, r, h}).requires_grad_(), b_gu = torch::randn({e, 2 * i, r}).requires_grad_();
  const at::Tensor a_dn = torch::randn({e, r, i}).requires_grad_(), b_dn = torch::randn({e, h, r}).requires_grad_();
  auto kept = [&](auto forward) {
    forward();  // a first call, so that one-time allocations are not counted
    const double before = heap_in_use();
    const at::Tensor y = forward();
    return heap_in_use() - before - static_cast<double>(y.nbytes());
  };
  const double adapted_bytes = static_cast<double>(gate_up.nbytes() + down.nbytes());
  const double materialized = kept([&] {
    return models::detail::swiglu_experts(x, tokens, at::baddbmm(gate_up, b_gu, a_gu, 1, scaling),
                                          at::baddbmm(down, b_dn, a_dn, 1, scaling), even);
  });
  const double on_rows = kept([&] {
    return models::detail::swiglu_experts(x, tokens, gate_up, down, even, {}, {a_gu, b_gu, scaling},
                                          {a_dn, b_dn, scaling});
  });
  EXPECT_GT(materialized, 0.9 * adapted_bytes) << "the reference keeps the adapted weights (the measure works)";
  EXPECT_LT(on_rows, 0.2 * adapted_bytes) << "on the rows: " << on_rows << " bytes kept";
}

// Note [Expert gradients in place]: from the second microbatch on, the experts add each expert's
// weight gradient into the existing .grad instead of returning a whole fresh one: the .grad is
// bitwise the first microbatch's gradient + the second's (what AccumulateGrad's grad += new makes),
// for both expert kinds, fp32 and bf16, with an expert that has rows in the first microbatch only;
// a hook on the weight sees only the first microbatch's gradient, an undefined one for the second
// (the documented difference).
TEST(SortedExpertsTest, LaterMicrobatchesAddIntoTheGradBitwise) {
  const int64_t N = 6, H = 16, I = 8, E = 4;
  struct Microbatch {
    std::vector<int64_t> counts;
    at::Tensor token_of_row, x, w, g_out;
  };
  torch::manual_seed(13);
  const std::vector<Microbatch> microbatches = {{{2, 3, 1, 2},
                                                 torch::tensor({0, 4, 1, 2, 5, 3, 0, 2}, torch::kLong),
                                                 torch::randn({N, H}),
                                                 torch::rand({8}) + 0.1,
                                                 torch::randn({N, H})},
                                                {{3, 0, 4, 1},
                                                 torch::tensor({1, 3, 5, 0, 2, 4, 5, 3}, torch::kLong),
                                                 torch::randn({N, H}),
                                                 torch::rand({8}) + 0.1,
                                                 torch::randn({N, H})}};
  for (const bool clamped : {false, true}) {
    const std::vector<at::Tensor> init =
        clamped ? std::vector<at::Tensor>{torch::randn({E, H, 2 * I}) * 0.3, torch::randn({E, 2 * I}) * 0.3,
                                          torch::randn({E, I, H}) * 0.3, torch::randn({E, H}) * 0.3}
                : std::vector<at::Tensor>{torch::randn({E, 2 * I, H}) * 0.3, torch::randn({E, H, I}) * 0.3};
    for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
      SCOPED_TRACE(::testing::Message() << (clamped ? "clamped GLU " : "SwiGLU ") << c10::toString(dtype));
      std::vector<at::Tensor> weights;
      for (const at::Tensor& t : init) weights.push_back(t.to(dtype, false, /*copy=*/true).requires_grad_());
      auto backward = [&](const Microbatch& mb) {
        const at::Tensor x = mb.x.to(dtype).requires_grad_();
        const at::Tensor out =
            clamped ? models::detail::clamped_glu_experts(x, mb.token_of_row, weights[0], weights[1], weights[2],
                                                          weights[3], mb.counts, 1.702, 0.7, mb.w)
                    : models::detail::swiglu_experts(x, mb.token_of_row, weights[0], weights[1], mb.counts, mb.w);
        (out.to(at::kFloat) * mb.g_out).sum().backward();
      };
      // Each microbatch's gradients alone (.grad cleared in between), added as AccumulateGrad adds.
      std::vector<at::Tensor> expected;
      for (size_t m = 0; m < microbatches.size(); ++m) {
        for (at::Tensor& w : weights) w.mutable_grad() = at::Tensor();
        backward(microbatches[m]);
        for (size_t i = 0; i < weights.size(); ++i) {
          if (m == 0)
            expected.push_back(weights[i].grad().clone());
          else
            expected[i] = expected[i] + weights[i].grad();
        }
      }
      // Both microbatches into one .grad.
      for (at::Tensor& w : weights) w.mutable_grad() = at::Tensor();
      int hook_calls = 0;
      weights[0].register_hook([&](const at::Tensor& g) { hook_calls += g.defined() ? 1 : 0; });
      for (const Microbatch& mb : microbatches) backward(mb);
      EXPECT_EQ(hook_calls, 1) << "the second microbatch's expert gradient goes into .grad in place";
      for (size_t i = 0; i < weights.size(); ++i) {
        EXPECT_TRUE(weights[i].grad().equal(expected[i])) << "weight " << i;
      }
      const at::Tensor& gate_up_grad = weights[0].grad();
      EXPECT_FALSE(gate_up_grad[1].eq(0).all().item<bool>()) << "expert 1: rows in the first microbatch only";
    }
  }
}

// Note [Experts in parallel on CPU]: on 2 intra-op threads the experts run in parallel (one
// thread each, outputs and input-row gradients combined in expert order per group of experts),
// in fp32 bitwise equal to the serial loop on 1 thread (where every GEMM runs on one thread too;
// bf16 within its rounding, and bitwise the same on every parallel run): the
// output, x's gradient, the routing weights' and every weight's and LoRA factor's gradient, over a
// first backward and a second one adding into the existing .grad (per-thread scratch), for both
// expert kinds, fp32 and bf16, with experts without rows and enough rows for several groups.
TEST(SortedExpertsTest, ParallelExpertsEqualTheSerialLoopBitwise) {
  const int previous_threads = at::get_num_threads();
  const int64_t N = 40, H = 16, I = 8, E = 12, k = 3, r = 2;
  torch::manual_seed(31);
  // Each token's k distinct experts among those other than 3 and 7 (no rows for them), sorted by expert.
  const at::Tensor scores = torch::rand({N, E}).index_fill_(1, torch::tensor({3, 7}), -1.0);
  const at::Tensor experts = std::get<1>(scores.topk(k)).flatten();
  const at::Tensor order = experts.argsort(/*stable=*/true);
  const at::Tensor token_of_row = order.div(k, "floor");
  const at::Tensor bincount = experts.bincount({}, E);
  const std::vector<int64_t> counts(bincount.data_ptr<int64_t>(), bincount.data_ptr<int64_t>() + E);
  const int64_t M = N * k;
  const at::Tensor x0 = torch::randn({N, H}), w0 = torch::rand({M}) + 0.1, g_out = torch::randn({N, H});
  for (const bool clamped : {false, true}) {
    const std::vector<at::Tensor> init =
        clamped ? std::vector<at::Tensor>{torch::randn({E, H, 2 * I}) * 0.3, torch::randn({E, 2 * I}) * 0.3,
                                          torch::randn({E, I, H}) * 0.3, torch::randn({E, H}) * 0.3}
                : std::vector<at::Tensor>{torch::randn({E, 2 * I, H}) * 0.3, torch::randn({E, H, I}) * 0.3};
    const int64_t gu_in = clamped ? H : H, gu_out = 2 * I, dn_in = I, dn_out = H;
    const std::vector<at::Tensor> factors0 = {torch::randn({E, r, gu_in}) * 0.3, torch::randn({E, gu_out, r}) * 0.3,
                                              torch::randn({E, r, dn_in}) * 0.3, torch::randn({E, dn_out, r}) * 0.3};
    for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
      SCOPED_TRACE(::testing::Message() << (clamped ? "clamped GLU " : "SwiGLU ") << c10::toString(dtype));
      // [out, x grad, w grad, weight grads..., factor grads...] after two backward passes.
      auto run = [&](int threads) {
        at::set_num_threads(threads);
        std::vector<at::Tensor> weights, factors;
        for (const at::Tensor& t : init) weights.push_back(t.to(dtype, false, /*copy=*/true).requires_grad_());
        for (const at::Tensor& t : factors0) factors.push_back(t.to(dtype, false, /*copy=*/true).requires_grad_());
        const at::Tensor x = x0.to(dtype, false, /*copy=*/true).requires_grad_(), w = w0.clone().requires_grad_();
        const models::detail::ExpertLora gu_lora{factors[0], factors[1], 2.0}, dn_lora{factors[2], factors[3], 2.0};
        at::Tensor out;
        for (int pass = 0; pass < 2; ++pass) {
          out = clamped ? models::detail::clamped_glu_experts(x, token_of_row, weights[0], weights[1], weights[2],
                                                              weights[3], counts, 1.702, 0.7, w, gu_lora, dn_lora)
                        : models::detail::swiglu_experts(x, token_of_row, weights[0], weights[1], counts, w, gu_lora,
                                                         dn_lora);
          (out.to(at::kFloat) * g_out).sum().backward();
        }
        std::vector<at::Tensor> result = {out.detach(), x.grad(), w.grad()};
        for (const at::Tensor& t : weights) result.push_back(t.grad());
        for (const at::Tensor& t : factors) result.push_back(t.grad());
        return result;
      };
      const auto serial = run(1);
      at::set_num_threads(2);
      ASSERT_GT(models::detail::expert_threads(x0, counts), 1) << "the parallel path must run";
      const auto parallel = run(2), again = run(2);
      at::set_num_threads(previous_threads);
      ASSERT_EQ(parallel.size(), serial.size());
      for (size_t i = 0; i < serial.size(); ++i) {
        ASSERT_TRUE(serial[i].defined() && parallel[i].defined()) << "tensor " << i;
        const double diff = (parallel[i].to(at::kFloat) - serial[i].to(at::kFloat)).abs().max().item<double>();
        if (dtype == at::kFloat) {
          EXPECT_TRUE(parallel[i].equal(serial[i])) << "tensor " << i << ": max difference " << diff;
        } else {
          // bf16 products go through oneDNN, whose blocking depends on the threads it sees: the
          // same on every run, not across thread counts.
          const double scale = std::max(1.0, serial[i].abs().max().item<double>());
          EXPECT_LE(diff, 2e-2 * scale) << "tensor " << i;
        }
        EXPECT_TRUE(again[i].equal(parallel[i])) << "tensor " << i << ": the parallel path is deterministic";
      }
      EXPECT_TRUE(parallel[3][3].eq(0).all().item<bool>()) << "expert 3 has no rows";
    }
  }
  EXPECT_EQ(models::detail::expert_threads(x0.to(at::kMeta), counts), 1) << "not on CPU: serial";
}

// RoundPipe: the oracle's gradients through 3 CPU devices with the sparse layers in forward stages
// (their recompute replays the routing), and 1 device (stage grain) vs 3 (layer grain) bitwise
// with 2 microbatches.
TEST(Qwen3MoeTest, RoundPipeMatchesTransformersAndIsDeviceCountInvariant) {
  ROUNDPIPE_REQUIRE_ORACLE();
  ScratchDir scratch;
  const std::string dir = scratch.file("hf");
  const MoeSpec spec = qwen3_moe_spec();
  const Batch batch = make_batch();
  const auto ref = run_python(oracle_snippet(spec, dir), {{"x", batch.x}, {"y", batch.y}});

  // Both sparse layers (1 and 3) in forward stages, so their backward recomputes them.
  const scheduler::ExecutePlan plan({{0, 2}, {2, 4}}, {{4, 5}, {3, 4}, {1, 3}, {0, 1}});
  auto run = [&](int64_t devices, int64_t microbatches, RecomputeGrain grain) {
    Pretrained pre = load_pretrained(dir + "/orig");
    RoundPipe model(pre.model, RoundPipeOptions()
                                   .devices(std::vector<c10::Device>(static_cast<size_t>(devices), c10::kCPU))
                                   .seed(1)
                                   .label_to_last_layer(true));
    RunConfig cfg;
    cfg.num_microbatch = microbatches;
    cfg.execute_plan = plan;
    cfg.recompute_grain = grain;
    const double n = static_cast<double>(batch.y.numel());
    model.forward_backward(
        {batch.x}, batch.y, [n](const at::Tensor& out, const at::Tensor&) { return out / n; }, cfg);
    model.synchronize();
    std::map<std::string, at::Tensor> grads;
    for (const auto& p : model.module()->named_parameters()) {
      grads[hf_parameter_name(p.key(), pre.config.num_hidden_layers)] = p.value().grad().clone();
    }
    return grads;
  };
  const auto three = run(3, 1, RecomputeGrain::kStage);
  for (const auto& [key, expected] : ref) {
    if (key.rfind("grad:", 0) != 0) continue;
    ASSERT_TRUE(three.count(key.substr(5))) << key;
    EXPECT_LE(max_abs_diff(three.at(key.substr(5)), expected), 1e-5 * std::max(1.0, max_abs(expected))) << key;
  }
  const auto one_split = run(1, 2, RecomputeGrain::kStage);
  const auto three_split = run(3, 2, RecomputeGrain::kLayer);
  for (const auto& [name, grad] : one_split) EXPECT_TRUE(grad.equal(three_split.at(name))) << name;
}

// ---- LoRA on the experts (PEFT's target_parameters) ----------------------------------------------

// The model of init_snippet saved as the base, with PEFT adapters on q_proj and the expert weights
// `targets` (a Python list), random lora_A and lora_B so every adapter matters; the adapter, the
// eval logits, CE + coef * aux and the gradient of every trainable parameter under PEFT's names.
std::string peft_experts_snippet(const MoeSpec& spec, const std::string& dir, const std::string& targets) {
  return init_snippet(spec) +
         "from peft import LoraConfig, get_peft_model\n"
         "model.save_pretrained('" +
         dir +
         "/base')\n"
         "peft_model = get_peft_model(model, LoraConfig(r=2, lora_alpha=6, target_modules=['q_proj'],\n"
         "    target_parameters=" +
         targets +
         "))\n"
         "for seed in range(7, 57):\n"
         "    torch.manual_seed(seed)\n"
         "    with torch.no_grad():\n"
         "        for name, p in peft_model.named_parameters():\n"
         "            if 'lora_' in name: p.normal_(0, 0.1)\n"
         "    if margin(peft_model) >= 1e-4:\n"
         "        break\n"
         "assert margin(peft_model) >= 1e-4, 'no adapter seed gives router margins >= 1e-4'\n"
         "peft_model.save_pretrained('" +
         dir +
         "/peft')\n"
         "outputs['trainable'] = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)\n"
         "peft_model.eval()\n"
         "with torch.no_grad():\n"
         "    outputs['logits'] = peft_model(input_ids=x).logits\n"
         "peft_model.train()\n"
         "out = peft_model(input_ids=x, output_router_logits=True)\n"
         "ce = F.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]), y.reshape(-1))\n"
         "loss = ce + cfg.router_aux_loss_coef * out.aux_loss\n"
         "outputs['loss'] = loss.detach()\n"
         "loss.backward()\n"
         "for name, p in peft_model.named_parameters():\n"
         "    if p.requires_grad: outputs['grad:' + name.replace('.default', '')] = p.grad\n";
}

std::string peft_reload_snippet(const std::string& base_dir, const std::string& adapter_dir) {
  return "from transformers import AutoModelForCausalLM\n"
         "from peft import PeftModel\n"
         "base = AutoModelForCausalLM.from_pretrained('" +
         base_dir +
         "', attn_implementation='eager',\n"
         "    experts_implementation='eager')\n"
         "m = PeftModel.from_pretrained(base, '" +
         adapter_dir +
         "').eval()\n"
         "with torch.no_grad():\n"
         "    outputs['logits'] = m(input_ids=inputs['x']).logits\n";
}

// Every trainable parameter's gradient against PEFT's, by PEFT name: lora_state_dict lists the
// adapters in module order, as named_parameters does, and shares their storage.
void expect_lora_grads_match(const torch::nn::Sequential& model, const ModelConfig& config, const TensorMap& ref) {
  std::vector<at::Tensor> trainable;
  for (const auto& p : model->parameters()) {
    if (p.requires_grad()) trainable.push_back(p);
  }
  const auto adapters = lora_state_dict(model, config);
  ASSERT_EQ(adapters.size(), trainable.size());
  int compared = 0;
  for (size_t i = 0; i < adapters.size(); ++i) {
    const auto& [name, weight] = adapters[i];
    ASSERT_EQ(weight.data_ptr(), trainable[i].data_ptr()) << name;
    ASSERT_TRUE(ref.count("grad:" + name)) << name << " is not a PEFT parameter";
    ASSERT_TRUE(trainable[i].grad().defined()) << name;
    const at::Tensor& expected = ref.at("grad:" + name);
    EXPECT_LE(max_abs_diff(trainable[i].grad(), expected), 1e-5 * std::max(1.0, max_abs(expected))) << name;
    ++compared;
  }
  EXPECT_EQ(compared, static_cast<int>(std::count_if(ref.begin(), ref.end(),
                                                     [](const auto& kv) { return kv.first.rfind("grad:", 0) == 0; })));
}

// A PEFT adapter with expert targets loads, evaluates and trains (every gradient) as PEFT; ours
// loads in PEFT to the same logits; merged, the logits stay.
void expect_expert_lora_matches_peft(const MoeSpec& spec, const std::string& targets,
                                     const std::vector<std::string>& expected_targets) {
  ROUNDPIPE_REQUIRE_PYTHON("transformers peft safetensors");
  ScratchDir scratch;
  const std::string dir = scratch.file("hf");
  const Batch batch = make_batch();
  const auto ref = run_python(peft_experts_snippet(spec, dir, targets), {{"x", batch.x}, {"y", batch.y}});

  Pretrained pre = load_pretrained(dir + "/base");
  const LoraOptions options = load_lora_adapter(pre.model, pre.config, dir + "/peft");
  auto parameters = options.target_parameters();
  std::sort(parameters.begin(), parameters.end());
  EXPECT_EQ(parameters, expected_targets);
  int64_t trainable = 0;
  for (const auto& p : unique_parameters(*pre.model)) trainable += p.requires_grad() ? p.numel() : 0;
  EXPECT_EQ(trainable, ref.at("trainable").item<int64_t>());

  pre.model->eval();
  {
    torch::NoGradGuard no_grad;
    EXPECT_LE(max_abs_diff(models::forward(pre.model, batch.x), ref.at("logits")), 1e-4);
  }
  pre.model->train();
  const at::Tensor loss = models::forward(pre.model, batch.x, batch.y) / static_cast<double>(batch.y.numel());
  EXPECT_NEAR(loss.item<double>(), ref.at("loss").item<double>(), 1e-5);
  loss.backward();
  expect_lora_grads_match(pre.model, pre.config, ref);

  save_lora_adapter(pre.model, pre.config, options, dir + "/ours", dir + "/base");
  const auto back = run_python(peft_reload_snippet(dir + "/base", dir + "/ours"), {{"x", batch.x}});
  EXPECT_LE(max_abs_diff(back.at("logits"), ref.at("logits")), 1e-5);

  merge_lora(pre.model);
  EXPECT_TRUE(lora_state_dict(pre.model, pre.config).empty());
  pre.model->eval();
  torch::NoGradGuard no_grad;
  EXPECT_LE(max_abs_diff(models::forward(pre.model, batch.x), ref.at("logits")), 1e-4);
}

TEST(MoeLoraTest, Qwen3Moe_BothExpertWeightsMatchPeft) {
  expect_expert_lora_matches_peft(qwen3_moe_spec(), "['gate_up_proj', 'down_proj']", {"down_proj", "gate_up_proj"});
}

TEST(MoeLoraTest, Mixtral_DownProjOnlyMatchesPeft) {
  expect_expert_lora_matches_peft(mixtral_spec(), "['mlp.experts.down_proj']", {"mlp.experts.down_proj"});
}

TEST(MoeLoraTest, GptOss_TransposedExpertsMatchPeft) {
  expect_expert_lora_matches_peft(gpt_oss_spec(), "['gate_up_proj', 'down_proj']", {"down_proj", "gate_up_proj"});
}

// Layer-specific targets adapt that layer only; the router, dropout and dense models are refused.
TEST(MoeLoraTest, Targets_LayerSuffixAndRefusals) {
  ModelConfig config = parse_model_config(
      R"({"model_type": "mixtral", "vocab_size": 16, "hidden_size": 8, "intermediate_size": 8,
          "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2, "num_local_experts": 4,
          "num_experts_per_tok": 1})");
  auto fresh = [&] { return build(config).model; };
  auto model = fresh();
  const auto options = LoraOptions().target_modules({}).target_parameters({"1.mlp.experts.gate_up_proj"});
  EXPECT_EQ(apply_lora(model, options), 1);
  const auto adapters = lora_state_dict(model, config);
  ASSERT_EQ(adapters.size(), 2u);
  EXPECT_EQ(adapters[0].first, "base_model.model.model.layers.1.mlp.experts.lora_A.weight");
  EXPECT_EQ(adapters[0].second.sizes(), (std::vector<int64_t>{4 * 8, 8}));      // [E r, H]
  EXPECT_EQ(adapters[1].second.sizes(), (std::vector<int64_t>{2 * 8, 4 * 8}));  // [2I, r E]
  EXPECT_TRUE(adapters[1].second.eq(0).all().item<bool>());                     // lora_B starts at zero, as in PEFT

  auto refused = [&](const LoraOptions& o, const std::string& needle) {
    auto m = fresh();
    try {
      apply_lora(m, o);
      ADD_FAILURE() << "accepted; expected an error naming " << needle;
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what_without_backtrace()).find(needle), std::string::npos) << e.what_without_backtrace();
    }
  };
  refused(LoraOptions().target_parameters({"gate.weight"}), "never adapts the router");
  refused(LoraOptions().target_parameters({"down_proj"}).dropout(0.1), "dropout 0");
  refused(LoraOptions().target_parameters({"experts.up_proj"}), "matches no expert weight");
  ModelConfig dense = parse_model_config(
      R"({"model_type": "llama", "vocab_size": 16, "hidden_size": 8, "intermediate_size": 8,
          "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2})");
  auto dense_model = build(dense).model;
  EXPECT_THROW(apply_lora(dense_model, LoraOptions().target_parameters({"down_proj"})), c10::Error);
}

// Through RoundPipe on 3 CPU devices with the sparse layers recomputed: PEFT's gradients, and the
// adapter saved from RoundPipe's masters is PEFT's after one step of plain SGD.
TEST(MoeLoraTest, RoundPipeMatchesPeft) {
  ROUNDPIPE_REQUIRE_PYTHON("transformers peft safetensors");
  ScratchDir scratch;
  const std::string dir = scratch.file("hf");
  const Batch batch = make_batch();
  const auto ref = run_python(peft_experts_snippet(qwen3_moe_spec(), dir, "['gate_up_proj', 'down_proj']"),
                              {{"x", batch.x}, {"y", batch.y}});
  Pretrained pre = load_pretrained(dir + "/base");
  load_lora_adapter(pre.model, pre.config, dir + "/peft");
  const auto before = lora_state_dict(pre.model, pre.config);
  std::map<std::string, at::Tensor> start;
  for (const auto& [name, w] : before) start[name] = w.clone();
  RoundPipe model(pre.model,
                  RoundPipeOptions().devices(std::vector<c10::Device>(3, c10::kCPU)).seed(1).label_to_last_layer(true));
  RunConfig cfg;
  cfg.num_microbatch = 1;  // the aux loss is per microbatch (docs/models.md); PEFT's is the batch's
  cfg.execute_plan = scheduler::ExecutePlan({{0, 2}, {2, 4}}, {{4, 5}, {3, 4}, {1, 3}, {0, 1}});
  const double n = static_cast<double>(batch.y.numel());
  const at::Tensor loss = model.forward_backward(
      {batch.x}, batch.y, [n](const at::Tensor& out, const at::Tensor&) { return out / n; }, cfg);
  EXPECT_NEAR(loss.item<double>(), ref.at("loss").item<double>(), 1e-5);
  model.synchronize();
  expect_lora_grads_match(model.module(), pre.config, ref);
  constexpr double kLr = 0.5;
  auto masters = model.optim_parameters();
  EXPECT_EQ(masters.size(), before.size());  // the frozen base has no master copy
  model.step(
      [&] {
        torch::NoGradGuard no_grad;
        for (auto& p : masters) p.sub_(p.grad(), kLr);
      },
      StepMode::kSync);
  const LoraOptions options =
      LoraOptions().rank(2).alpha(6).target_modules({"q_proj"}).target_parameters({"gate_up_proj", "down_proj"});
  save_lora_adapter(model, pre.config, options, dir + "/stepped");
  auto file = SafetensorsFile::open(dir + "/stepped/adapter_model.safetensors");
  EXPECT_EQ(file->names().size(), before.size());
  for (const auto& [name, w0] : start) {
    const at::Tensor expected = w0 - kLr * ref.at("grad:" + name);
    EXPECT_LE(max_abs_diff(file->get(name), expected), 1e-5) << name;
  }
}

}  // namespace
}  // namespace roundpipe::testing
