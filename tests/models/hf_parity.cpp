#include "tests/models/hf_parity.h"

#include <torch/torch.h>

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <map>

#include "roundpipe/models/pretrained.h"
#include "tests/common/python_oracle.h"
#include "tests/common/tensor_compare.h"
#include "tests/models/hf_oracle.h"

namespace roundpipe::testing {
namespace {

// Parameters whose gradients are compared (those a model lacks are skipped on both sides).
constexpr const char* kGradNames = R"PY([
    'model.embed_tokens.weight', 'lm_head.weight', 'model.norm.weight',
    'model.layers.0.self_attn.q_proj.weight', 'model.layers.0.self_attn.k_proj.weight',
    'model.layers.0.self_attn.v_proj.weight', 'model.layers.0.self_attn.q_proj.bias',
    'model.layers.0.self_attn.q_norm.weight', 'model.layers.0.self_attn.k_norm.weight',
    'model.layers.1.mlp.down_proj.weight', 'model.layers.1.mlp.gate_proj.bias',
    'model.layers.1.input_layernorm.weight', 'model.layers.1.post_attention_layernorm.weight'])PY";

std::string make_snippet(const TinyModelSpec& spec, const std::string& dir) {
  return "import transformers\n"
         "from transformers import AutoModelForCausalLM, " + spec.config_class + "\n"
         "torch.manual_seed(1234)\n"
         "cfg = " + spec.config_class + "(**" + spec.kwargs + ")\n"
         "model = AutoModelForCausalLM.from_config(cfg)\n"
         "with torch.no_grad():\n"
         "    for name, p in model.named_parameters():\n"
         "        if name.endswith('norm.weight'):\n"
         "            p.copy_(1 + 0.2 * torch.randn_like(p))\n"
         "        else:\n"
         "            p.normal_(0, 0.15)\n"
         "model.eval()\n"
         "model.save_pretrained('" + dir + "')\n"
         "ids = inputs['ids']\n"
         "out = model(input_ids=ids, labels=ids)\n"
         "out.loss.backward()\n"
         "outputs['logits'] = out.logits\n"
         "outputs['loss'] = out.loss\n"
         "outputs['tied'] = model.lm_head.weight is model.model.embed_tokens.weight\n"
         "params = dict(model.named_parameters())\n"
         "for name in " + kGradNames + ":\n"
         "    if name in params:\n"
         "        outputs['grad:' + name] = params[name].grad\n"
         "m16 = AutoModelForCausalLM.from_pretrained('" + dir + "', dtype=torch.bfloat16).eval()\n"
         "with torch.no_grad():\n"
         "    outputs['logits_bf16'] = m16(input_ids=ids).logits.float()\n";
}

std::string reload_snippet(const std::string& dir) {
  return "from transformers import AutoModelForCausalLM\n"
         "from safetensors import safe_open\n"
         "import os\n"
         "m, info = AutoModelForCausalLM.from_pretrained('" + dir + "', output_loading_info=True)\n"
         "outputs['missing'] = len(info['missing_keys'])\n"
         "outputs['unexpected'] = len(info['unexpected_keys'])\n"
         "outputs['mismatched'] = len(info['mismatched_keys'])\n"
         "outputs['tied'] = m.lm_head.weight is m.model.embed_tokens.weight\n"
         "with safe_open('" + dir + "/model.safetensors', framework='pt') as f:\n"
         "    outputs['has_lm_head'] = 'lm_head.weight' in f.keys()\n"
         "with torch.no_grad():\n"
         "    outputs['logits'] = m.eval()(input_ids=inputs['ids']).logits\n";
}

double max_abs(const at::Tensor& t) { return t.abs().max().item<double>(); }

std::string sci(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.3g", v);
  return buf;
}

}  // namespace

void expect_matches_transformers(const TinyModelSpec& spec) {
  using namespace roundpipe::models;
  ScratchDir scratch;
  const std::string hf_dir = scratch.file("hf");
  const std::string our_dir = scratch.file("ours");
  torch::manual_seed(7);
  const at::Tensor ids = torch::randint(0, 128, {2, spec.seq}, torch::kLong);
  auto ref = run_python(make_snippet(spec, hf_dir), {{"ids", ids}});
  ASSERT_EQ(ref.at("tied").item<bool>(), spec.tied) << "the spec's tie_word_embeddings disagrees with transformers";

  // fp32: logits, loss and gradients.
  Pretrained pre = load_pretrained(hf_dir);
  EXPECT_EQ(pre.config.tie_word_embeddings, spec.tied);
  pre.model->eval();
  const at::Tensor logits = pre.model->forward(ids);
  EXPECT_EQ(logits.scalar_type(), at::kFloat);
  const double fp32_diff = max_abs_diff(logits, ref.at("logits"));
  ::testing::Test::RecordProperty("fp32_logits_max_abs_diff", sci(fp32_diff));
  EXPECT_LE(fp32_diff, 1e-4) << "max |logit| " << max_abs(ref.at("logits"));
  const at::Tensor loss = causal_lm_loss(logits, ids);
  ::testing::Test::RecordProperty("loss_abs_diff",
                                   sci(std::abs(loss.item<double>() - ref.at("loss").item<double>())));
  EXPECT_NEAR(loss.item<double>(), ref.at("loss").item<double>(), 1e-5);
  loss.backward();
  std::map<std::string, at::Tensor> params;
  for (const auto& [name, tensor] : hf_state_dict(pre.model, pre.config)) params[name] = tensor;
  if (spec.tied) params["lm_head.weight"] = params.at("model.embed_tokens.weight");
  int compared = 0;
  for (const auto& [key, expected] : ref) {
    if (key.rfind("grad:", 0) != 0) continue;
    const std::string name = key.substr(5);
    ASSERT_TRUE(params.count(name)) << name << " has a gradient in transformers but is not in our model";
    // hf_state_dict detaches: read the gradient through the parameter itself.
    at::Tensor grad;
    for (const auto& p : pre.model->named_parameters()) {
      if (hf_parameter_name(p.key(), pre.config.num_hidden_layers) == name ||
          (spec.tied && name == "lm_head.weight" && p.key() == "0.embed_tokens.weight")) {
        grad = p.value().grad();
        break;
      }
    }
    ASSERT_TRUE(grad.defined()) << name << " has no gradient";
    EXPECT_LE(max_abs_diff(grad, expected), 1e-4 * std::max(1.0, max_abs(expected))) << name;
    ++compared;
  }
  EXPECT_GE(compared, 8);

  // bf16 against transformers in bf16.
  Pretrained pre16 = load_pretrained(hf_dir, LoadOptions().dtype(at::kBFloat16));
  pre16.model->eval();
  at::Tensor logits16;
  {
    torch::NoGradGuard no_grad;
    logits16 = pre16.model->forward(ids);
  }
  EXPECT_EQ(logits16.scalar_type(), at::kBFloat16);
  const double scale = max_abs(ref.at("logits_bf16"));
  const double bf16_diff = max_abs_diff(logits16.to(at::kFloat), ref.at("logits_bf16"));
  ::testing::Test::RecordProperty("bf16_logits_max_abs_diff_over_max_logit", sci(bf16_diff / scale));
  EXPECT_LE(bf16_diff, 5e-2 * scale);

  // save_pretrained, read back by transformers.
  save_pretrained(pre.model, pre.config, our_dir);
  auto back = run_python(reload_snippet(our_dir), {{"ids", ids}});
  EXPECT_EQ(back.at("missing").item<double>(), 0);
  EXPECT_EQ(back.at("unexpected").item<double>(), 0);
  EXPECT_EQ(back.at("mismatched").item<double>(), 0);
  EXPECT_EQ(back.at("tied").item<bool>(), spec.tied);
  EXPECT_EQ(back.at("has_lm_head").item<bool>(), !spec.tied);
  EXPECT_LE(max_abs_diff(back.at("logits"), ref.at("logits")), 1e-6);
}

}  // namespace roundpipe::testing
