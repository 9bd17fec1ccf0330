#include "roundpipe/models/moe.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/argsort.h>
#include <ATen/ops/baddbmm.h>
#include <ATen/ops/bincount.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/floor_divide.h>
#include <ATen/ops/gather.h>
#include <ATen/ops/index_add.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/topk.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <utility>

#include "roundpipe/models/detail/moe_experts.h"
#include "roundpipe/models/detail/param_options.h"
#include "roundpipe/recompute_data.h"

namespace roundpipe::models {
namespace {

using detail::param_options;

// The key under which a sparse block saves its routing for the recompute (Note [Recompute data]).
constexpr const char* kRoutingKey = "moe.routing";

// The top-k expert indices [N, k] of each token, and how many rows each expert gets.
struct Routing {
  at::Tensor indices;           // int64 [N, k], on the layer's device
  at::Tensor host_counts;       // int64 [E], on the CPU
  std::vector<int64_t> counts;  // the same, as integers
};

void set_counts(Routing& r, at::Tensor host_counts) {
  r.host_counts = std::move(host_counts);
  const auto* data = r.host_counts.data_ptr<int64_t>();
  r.counts.assign(data, data + r.host_counts.numel());
}

Routing route(const at::Tensor& probs, int64_t k, int64_t num_experts) {
  Routing r;
  r.indices = std::get<1>(at::topk(probs, k, /*dim=*/-1));
  // One device-to-host read per layer and microbatch on a GPU (replayed in recompute).
  set_counts(r, at::bincount(r.indices.reshape({-1}), /*weights=*/{}, num_experts).to(at::kCPU));
  return r;
}

// PEFT's ParamWrapper with one adapter (its _LoraFactorsProxy), as the experts take its factors
// (Note [Expert LoRA on the rows] in detail/moe_experts.h): lora_A [E r, in] -> A [E, r, in],
// lora_B [out, r E] -> [out, r, E] -> B [E, out, r], in the weight's dtype; scaling alpha / r.
detail::ExpertLora expert_lora(const at::Tensor& weight, const at::Tensor& lora_a, const at::Tensor& lora_b,
                               int64_t experts, int64_t rank, double alpha) {
  if (!lora_a.defined()) return {};
  return {lora_a.reshape({experts, rank, lora_a.size(1)}).to(weight.scalar_type()),
          lora_b.reshape({lora_b.size(0), rank, experts}).permute({2, 0, 1}).to(weight.scalar_type()),
          alpha / static_cast<double>(rank)};
}

}  // namespace

at::Tensor empty_router_stats(int64_t num_experts, c10::Device device) {
  return at::zeros({2, num_experts}, at::TensorOptions().dtype(at::kFloat).device(device));
}

at::Tensor router_aux_loss(const at::Tensor& stats, int64_t tokens, int64_t sparse_layers) {
  TORCH_CHECK(stats.dim() == 2 && stats.size(0) == 2, "router_aux_loss: stats must be [2, num_experts], got ",
              stats.sizes());
  if (sparse_layers == 0 || tokens == 0) return at::zeros({}, stats.options());
  const double rows = static_cast<double>(tokens) * static_cast<double>(sparse_layers);
  return (stats[0] / rows * (stats[1] / rows)).sum() * static_cast<double>(stats.size(1));
}

// ---- Experts -------------------------------------------------------------------------------------

ExpertsImpl::ExpertsImpl(const ModelConfig& config, const at::TensorOptions& options)
    : config_(config), options_(options) {
  TORCH_CHECK(config.num_experts > 0 && config.moe_intermediate_size > 0, "Experts: the config has ",
              config.num_experts, " experts of width ", config.moe_intermediate_size, "; both must be positive");
  reset();
}

void ExpertsImpl::reset() {
  const int64_t e = config_.num_experts;
  const int64_t h = config_.hidden_size;
  const int64_t i = config_.moe_intermediate_size;
  if (config_.architecture == Architecture::kGptOss) {
    gate_up_proj = register_parameter("gate_up_proj", at::empty({e, h, 2 * i}, param_options(gate_up_proj, options_)));
    gate_up_proj_bias =
        register_parameter("gate_up_proj_bias", at::empty({e, 2 * i}, param_options(gate_up_proj_bias, options_)));
    down_proj = register_parameter("down_proj", at::empty({e, i, h}, param_options(down_proj, options_)));
    down_proj_bias = register_parameter("down_proj_bias", at::empty({e, h}, param_options(down_proj_bias, options_)));
    register_lora();
    return;
  }
  gate_up_proj = register_parameter("gate_up_proj", at::empty({e, 2 * i, h}, param_options(gate_up_proj, options_)));
  down_proj = register_parameter("down_proj", at::empty({e, h, i}, param_options(down_proj, options_)));
  register_lora();
}

void ExpertsImpl::register_lora() {
  if (lora_rank_ == 0) return;
  const int64_t er = config_.num_experts * lora_rank_;
  const int64_t h = config_.hidden_size;
  const int64_t i = config_.moe_intermediate_size;
  // A clone gets its own adapters (Cloneable::clone then copies their values).
  const auto options = lora_A_gate_up_proj.defined() ? lora_A_gate_up_proj.options()
                       : lora_A_down_proj.defined()  ? lora_A_down_proj.options()
                                                     : down_proj.options().requires_grad(false);
  if (lora_gate_up_) {
    lora_A_gate_up_proj = register_parameter("lora_A_gate_up_proj", at::empty({er, h}, options));
    lora_B_gate_up_proj = register_parameter("lora_B_gate_up_proj", at::empty({2 * i, er}, options));
  }
  if (lora_down_) {
    lora_A_down_proj = register_parameter("lora_A_down_proj", at::empty({er, i}, options));
    lora_B_down_proj = register_parameter("lora_B_down_proj", at::empty({h, er}, options));
  }
}

void ExpertsImpl::enable_lora(bool gate_up, bool down, int64_t rank, double alpha) {
  TORCH_CHECK(gate_up || down, "Experts::enable_lora: name gate_up_proj, down_proj or both");
  TORCH_CHECK(rank > 0, "LoRA rank must be > 0, got ", rank);
  TORCH_CHECK(lora_rank_ == 0, "these experts already have LoRA adapters (rank ", lora_rank_, ")");
  lora_gate_up_ = gate_up;
  lora_down_ = down;
  lora_rank_ = rank;
  lora_alpha_ = alpha;
  register_lora();
}

// W + scaling B A for weights stored [E, out, in], W + scaling A^T B^T for gpt-oss's [E, in, out],
// in the weight's dtype (expert_lora's A and B).
at::Tensor ExpertsImpl::adapted(const at::Tensor& weight, const at::Tensor& lora_a, const at::Tensor& lora_b) const {
  if (!lora_a.defined()) return weight;
  const detail::ExpertLora l = expert_lora(weight, lora_a, lora_b, config_.num_experts, lora_rank_, lora_alpha_);
  if (config_.architecture == Architecture::kGptOss) {
    return at::baddbmm(weight, l.a.transpose(1, 2), l.b.transpose(1, 2), /*beta=*/1, /*alpha=*/l.scaling);
  }
  return at::baddbmm(weight, l.b, l.a, /*beta=*/1, /*alpha=*/l.scaling);
}

void ExpertsImpl::merge_lora() {
  if (lora_rank_ == 0) return;
  {
    at::NoGradGuard no_grad;
    if (lora_gate_up_) gate_up_proj.copy_(adapted(gate_up_proj, lora_A_gate_up_proj, lora_B_gate_up_proj));
    if (lora_down_) down_proj.copy_(adapted(down_proj, lora_A_down_proj, lora_B_down_proj));
  }
  for (const char* name : {"lora_A_gate_up_proj", "lora_B_gate_up_proj", "lora_A_down_proj", "lora_B_down_proj"}) {
    if (parameters_.contains(name)) parameters_.erase(name);
  }
  lora_A_gate_up_proj = lora_B_gate_up_proj = lora_A_down_proj = lora_B_down_proj = at::Tensor();
  lora_gate_up_ = lora_down_ = false;
  lora_rank_ = 0;
}

at::Tensor ExpertsImpl::forward(const at::Tensor& x, const std::vector<int64_t>& counts,
                                const at::Tensor& row_weights) {
  TORCH_CHECK(x.dim() == 2, "Experts: expected sorted rows [M, ", config_.hidden_size, "], got ", x.sizes());
  return forward_tokens(x, at::arange(x.size(0), x.options().dtype(at::kLong)), counts, row_weights);
}

at::Tensor ExpertsImpl::forward_tokens(const at::Tensor& x, const at::Tensor& token_of_row,
                                       const std::vector<int64_t>& counts, const at::Tensor& row_weights) {
  const int64_t e = config_.num_experts;
  const detail::ExpertLora gate_up_lora =
      expert_lora(gate_up_proj, lora_A_gate_up_proj, lora_B_gate_up_proj, e, lora_rank_, lora_alpha_);
  const detail::ExpertLora down_lora =
      expert_lora(down_proj, lora_A_down_proj, lora_B_down_proj, e, lora_rank_, lora_alpha_);
  if (!gate_up_proj_bias.defined()) {
    return detail::swiglu_experts(x, token_of_row, gate_up_proj, down_proj, counts, row_weights, gate_up_lora,
                                  down_lora);
  }
  return detail::clamped_glu_experts(x, token_of_row, gate_up_proj, gate_up_proj_bias, down_proj, down_proj_bias,
                                     counts, config_.swiglu_alpha, config_.swiglu_limit, row_weights, gate_up_lora,
                                     down_lora);
}

// ---- SparseMoeBlock ------------------------------------------------------------------------------

SparseMoeBlockImpl::SparseMoeBlockImpl(const ModelConfig& config, int64_t layer_index, const at::TensorOptions& options)
    : config_(config), layer_index_(layer_index), options_(options) {
  reset();
}

void SparseMoeBlockImpl::reset() {
  const auto options = experts ? param_options(experts->gate_up_proj, options_) : options_;
  const bool gpt_oss = config_.architecture == Architecture::kGptOss;
  if (gpt_oss) {  // transformers' order: GptOssMLP registers the router first, the others last
    gate = register_module("router", Linear(config_.hidden_size, config_.num_experts, /*bias=*/true, options));
  }
  experts = register_module("experts", Experts(config_, options));
  if (!gpt_oss)
    gate = register_module("gate", Linear(config_.hidden_size, config_.num_experts, /*bias=*/false, options));
}

std::vector<at::Tensor> SparseMoeBlockImpl::forward(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 3 && x.size(2) == config_.hidden_size, "SparseMoeBlock (layer ", layer_index_,
              "): expected hidden states [batch, seq, ", config_.hidden_size, "], got ", x.sizes());
  const int64_t h = config_.hidden_size;
  const int64_t k = config_.num_experts_per_tok;
  const int64_t num_experts = config_.num_experts;
  const at::Tensor flat = x.reshape({-1, h});
  const int64_t tokens = flat.size(0);
  const at::Tensor logits = gate(flat);  // [N, E], the model's dtype
  const bool gpt_oss = config_.architecture == Architecture::kGptOss;
  // gpt-oss chooses on the raw logits; the others on p = softmax in fp32 (the same order).
  const at::Tensor probs = gpt_oss ? at::Tensor() : at::softmax(logits, -1, at::kFloat);

  Routing routing;
  if (auto saved = recompute_data(kRoutingKey)) {
    // The recompute: exactly the forward's choice (Note [Recompute data]).
    routing.indices = saved->at(0);
    set_counts(routing, saved->at(1));
    TORCH_CHECK(routing.indices.size(0) == tokens, "SparseMoeBlock (layer ", layer_index_, "): the recompute has ",
                tokens, " tokens but the forward routed ", routing.indices.size(0));
  } else {
    at::NoGradGuard no_grad;
    routing = route(gpt_oss ? logits : probs, k, num_experts);
    save_for_recompute(kRoutingKey, {routing.indices, routing.host_counts});
  }

  // Routing weights, gathered (so the router gets their gradient): gpt-oss softmaxes the chosen
  // logits in their dtype; the others renormalize the chosen p.
  at::Tensor weights;
  if (gpt_oss) {
    weights = at::softmax(logits.gather(1, routing.indices), 1, logits.scalar_type());
  } else {
    weights = probs.gather(1, routing.indices);
    if (config_.norm_topk_prob) weights = weights / weights.sum(-1, /*keepdim=*/true);
  }
  const bool fp32_products = config_.architecture == Architecture::kMixtral;
  if (!fp32_products) weights = weights.to(logits.scalar_type());

  // Tokens sorted by expert (stable: within an expert, in (token, slot) order).
  const at::Tensor flat_experts = routing.indices.reshape({-1});
  const at::Tensor order = at::argsort(flat_experts, /*stable=*/true);
  const at::Tensor token_of_row = at::floor_divide(order, k);
  // Each row's expert output times its routing weight, in the weights' dtype (fp32 for Mixtral),
  // added into its token inside the experts' loop (Note [Routing weights in the experts]).
  const at::Tensor row_weights = weights.reshape({-1}).index_select(0, order);
  const at::Tensor out = experts->forward_tokens(flat, token_of_row, routing.counts, row_weights);  // [N, H]

  // This layer's router statistics (Note [Router statistics]): assignment counts (no gradient)
  // and probabilities as transformers' load_balancing_loss_func computes them.
  const at::Tensor layer_counts = routing.host_counts.to(x.device(), at::kFloat);
  const at::Tensor aux_probs =
      probs.defined() && logits.scalar_type() == at::kFloat ? probs : at::softmax(logits, -1).to(at::kFloat);
  const at::Tensor stats = at::stack({layer_counts, aux_probs.sum(0)});
  return {out.view(x.sizes()), stats};
}

// ---- MoeDecoderLayer -----------------------------------------------------------------------------

MoeDecoderLayerImpl::MoeDecoderLayerImpl(const ModelConfig& config, int64_t layer_index,
                                         const at::TensorOptions& options)
    : config_(config), layer_index_(layer_index), options_(options) {
  TORCH_CHECK(config.is_moe(), "MoeDecoderLayer: model_type ", model_type_name(config.architecture),
              " is not a mixture of experts; use DecoderLayer");
  TORCH_CHECK(layer_index >= 0 && layer_index < config.num_hidden_layers,
              "MoeDecoderLayer: layer_index = ", layer_index,
              " is outside [0, num_hidden_layers = ", config.num_hidden_layers, ")");
  reset();
}

void MoeDecoderLayerImpl::reset() {
  const auto options = input_layernorm ? param_options(input_layernorm->weight, options_) : options_;
  input_layernorm = register_module("input_layernorm", make_rms_norm(config_, config_.hidden_size, options));
  self_attn = register_module("self_attn", Attention(config_, layer_index_, options));
  post_attention_layernorm =
      register_module("post_attention_layernorm", make_rms_norm(config_, config_.hidden_size, options));
  if (config_.layer_is_sparse(layer_index_)) {
    moe = register_module("mlp", SparseMoeBlock(config_, layer_index_, options));
  } else {
    mlp = register_module("mlp", Mlp(config_, options));
  }
}

std::vector<at::Tensor> MoeDecoderLayerImpl::forward(const at::Tensor& hidden, const at::Tensor& stats) {
  TORCH_CHECK(!stats.defined() || (stats.dim() == 2 && stats.size(0) == 2 && stats.size(1) == config_.num_experts),
              "MoeDecoderLayer (layer ", layer_index_, "): router statistics must be [2, ", config_.num_experts,
              "], got ", stats.sizes());
  const at::Tensor h = hidden + self_attn(input_layernorm(hidden));
  const at::Tensor before = stats.defined() ? stats : empty_router_stats(config_.num_experts, hidden.device());
  if (!moe) return {h + mlp(post_attention_layernorm(h)), before};
  std::vector<at::Tensor> out = moe(post_attention_layernorm(h));
  return {h + out[0], before + out[1]};
}

at::Tensor MoeDecoderLayerImpl::forward_cached(const at::Tensor& hidden, LayerKvCache& cache) {
  const at::Tensor h = hidden + self_attn->forward_cached(input_layernorm(hidden), cache);
  if (!moe) return h + mlp(post_attention_layernorm(h));
  return h + moe(post_attention_layernorm(h))[0];
}

// ---- RouterLossLog -------------------------------------------------------------------------------

void RouterLossLog::add(const at::Tensor& tokens_times_aux, int64_t tokens) {
  std::lock_guard<std::mutex> lock(mutex_);
  values_.push_back(tokens_times_aux.detach());
  tokens_ += tokens;
}

double RouterLossLog::take() {
  std::vector<at::Tensor> values;
  int64_t tokens = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    values.swap(values_);
    std::swap(tokens, tokens_);
  }
  double sum = 0.0;
  for (const at::Tensor& v : values) sum += v.to(at::kCPU).item<double>();
  return tokens > 0 ? sum / static_cast<double>(tokens) : 0.0;
}

}  // namespace roundpipe::models
