// The parts of pretrained.h that need no files: building the Sequential, HF parameter names,
// state dicts and the loss.
#include <ATen/core/Reduction.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/cross_entropy_loss.h>
#include <c10/util/Exception.h>

#include <set>
#include <string>

#include "roundpipe/models/layers.h"
#include "roundpipe/models/linear_cross_entropy.h"
#include "roundpipe/models/moe.h"
#include "roundpipe/models/pretrained.h"

namespace roundpipe::models {
namespace {

// Checks that `model` is [Embedding, DecoderLayer x N, LmHead] (MoeDecoderLayer for a mixture of
// experts) for `config` and returns the embedding and head.
std::pair<EmbeddingImpl*, LmHeadImpl*> check_layout(const torch::nn::Sequential& model, const ModelConfig& config) {
  TORCH_CHECK(model, "the model is empty (a null Sequential)");
  const int64_t n = config.num_hidden_layers;
  TORCH_CHECK(static_cast<int64_t>(model->size()) == n + 2, "the model has ", model->size(),
              " layers but its config (num_hidden_layers = ", n,
              ") needs ", n + 2, ": Embedding, ", n, config.is_moe() ? " MoeDecoderLayer" : " DecoderLayer", ", LmHead");
  auto* embedding = model->ptr(0)->as<EmbeddingImpl>();
  auto* head = model->ptr(n + 1)->as<LmHeadImpl>();
  TORCH_CHECK(embedding != nullptr, "layer 0 of the model is a ", model->ptr(0)->name(), ", expected Embedding");
  TORCH_CHECK(head != nullptr, "layer ", n + 1, " of the model is a ", model->ptr(n + 1)->name(), ", expected LmHead");
  for (int64_t i = 1; i <= n; ++i) {
    const bool fits = config.is_moe() ? model->ptr(i)->as<MoeDecoderLayerImpl>() != nullptr
                                      : model->ptr(i)->as<DecoderLayerImpl>() != nullptr;
    TORCH_CHECK(fits, "layer ", i, " of the model is a ", model->ptr(i)->name(), ", expected ",
                config.is_moe() ? "MoeDecoderLayer (model_type " + std::string(model_type_name(config.architecture)) + ")" : std::string("DecoderLayer"));
  }
  return {embedding, head};
}

bool is_tied_head(const std::string& hf_name, const ModelConfig& config) {
  return config.tie_word_embeddings && hf_name == "lm_head.weight";
}

}  // namespace

torch::nn::Sequential make_model(const ModelConfig& config, const at::TensorOptions& options) {
  torch::nn::Sequential model;
  auto embedding = Embedding(config, options);
  model->push_back("0", embedding);
  for (int64_t i = 0; i < config.num_hidden_layers; ++i) {
    if (config.is_moe()) {
      model->push_back(std::to_string(i + 1), MoeDecoderLayer(config, i, options));
    } else {
      model->push_back(std::to_string(i + 1), DecoderLayer(config, i, options));
    }
  }
  auto head = LmHead(config, options);
  if (config.tie_word_embeddings) head->lm_head->share_weight(embedding->embed_tokens->weight);
  model->push_back(std::to_string(config.num_hidden_layers + 1), head);
  return model;
}

Pretrained build(const ModelConfig& config) {
  torch::nn::Sequential model = make_model(config, at::TensorOptions().dtype(at::kFloat));
  init_weights(*model, config.initializer_range);
  return {model, config};
}

std::string hf_parameter_name(const std::string& sequential_name, int64_t num_hidden_layers) {
  const auto dot = sequential_name.find('.');
  TORCH_CHECK(dot != std::string::npos && dot > 0, "\"", sequential_name,
              "\" is not a parameter name of the Sequential (expected \"<layer>.<name>\")");
  int64_t layer = -1;
  try {
    size_t used = 0;
    layer = std::stoll(sequential_name.substr(0, dot), &used);
    TORCH_CHECK(used == dot, "");
  } catch (const std::exception&) {
    TORCH_CHECK(false, "\"", sequential_name, "\" does not start with a layer index");
  }
  const std::string rest = sequential_name.substr(dot + 1);
  TORCH_CHECK(layer >= 0 && layer <= num_hidden_layers + 1, "\"", sequential_name, "\" names layer ", layer,
              ", outside [0, ", num_hidden_layers + 1, "]");
  if (layer == 0) return "model." + rest;
  if (layer <= num_hidden_layers) return "model.layers." + std::to_string(layer - 1) + "." + rest;
  if (rest.rfind("lm_head.", 0) == 0) return rest;
  return "model." + rest;
}

std::vector<std::pair<std::string, at::Tensor>> hf_state_dict(const torch::nn::Sequential& model,
                                                              const ModelConfig& config) {
  check_layout(model, config);
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& item : model->named_parameters(/*recurse=*/true)) {
    TORCH_CHECK(item.key().find(".lora_") == std::string::npos, "the model has LoRA adapters (", item.key(),
                "): save them with save_lora_adapter, or fold them into the weights with merge_lora first");
    std::string name = hf_parameter_name(item.key(), config.num_hidden_layers);
    if (is_tied_head(name, config)) continue;
    out.emplace_back(std::move(name), item.value().detach());
  }
  return out;
}

void load_hf_state_dict(torch::nn::Sequential& model, const ModelConfig& config,
                        const std::function<at::Tensor(const std::string&)>& get) {
  auto [embedding, head] = check_layout(model, config);
  if (config.tie_word_embeddings && !head->lm_head->weight.is_same(embedding->embed_tokens->weight)) {
    // A model built untied (or a clone) is re-tied, so that loading one tensor fills both.
    head->lm_head->share_weight(embedding->embed_tokens->weight);
  }
  at::NoGradGuard no_grad;
  for (const auto& item : model->named_parameters(/*recurse=*/true)) {
    const std::string name = hf_parameter_name(item.key(), config.num_hidden_layers);
    if (is_tied_head(name, config)) continue;
    const at::Tensor source = get(name);
    TORCH_CHECK(source.defined(), "the checkpoint has no tensor \"", name, "\" (parameter ", item.key(),
                " of the model): is it a ", model_type_name(config.architecture), " checkpoint with this config.json?");
    at::Tensor param = item.value();
    TORCH_CHECK(source.sizes() == param.sizes(), "checkpoint tensor \"", name, "\" has shape ", source.sizes(),
                " but the model expects ", param.sizes(), " (check config.json: hidden_size, heads, head_dim)");
    param.copy_(source);
  }
}

at::Tensor forward(const torch::nn::Sequential& model, const at::Tensor& input_ids, const at::Tensor& targets) {
  TORCH_CHECK(model && model->size() >= 2, "models::forward: the model must be [Embedding, layers..., LmHead]");
  auto* embedding = model->ptr(0)->as<EmbeddingImpl>();
  TORCH_CHECK(embedding != nullptr, "models::forward: layer 0 of the model is a ", model->ptr(0)->name(),
              ", expected Embedding");
  std::vector<at::Tensor> acts = {embedding->forward(input_ids)};
  const size_t last = model->size() - 1;
  for (size_t i = 1; i < last; ++i) {
    if (auto* dense = model->ptr(i)->as<DecoderLayerImpl>()) {
      acts = {dense->forward(acts.at(0))};
    } else if (auto* moe = model->ptr(i)->as<MoeDecoderLayerImpl>()) {
      acts = moe->forward(acts.at(0), acts.size() > 1 ? acts[1] : at::Tensor());
    } else {
      TORCH_CHECK(false, "models::forward: layer ", i, " of the model is a ", model->ptr(i)->name(),
                  ", expected DecoderLayer or MoeDecoderLayer");
    }
  }
  auto* head = model->ptr(last)->as<LmHeadImpl>();
  TORCH_CHECK(head != nullptr, "models::forward: the last layer is a ", model->ptr(last)->name(), ", expected LmHead");
  if (acts.size() > 1) return head->forward(acts[0], acts[1], targets);
  return head->forward(acts[0], targets);
}

std::vector<at::Tensor> unique_parameters(const torch::nn::Module& model) {
  std::vector<at::Tensor> out;
  std::set<const void*> seen;
  for (const auto& p : model.parameters(/*recurse=*/true)) {
    if (seen.insert(p.unsafeGetTensorImpl()).second) out.push_back(p);
  }
  return out;
}

at::Tensor causal_lm_loss(const at::Tensor& logits, const at::Tensor& labels) {
  TORCH_CHECK(logits.dim() == 3, "causal_lm_loss: logits must be [batch, seq, vocab], got ", logits.sizes());
  TORCH_CHECK(labels.dim() == 2 && labels.size(0) == logits.size(0) && labels.size(1) == logits.size(1),
              "causal_lm_loss: labels must be [batch, seq] = [", logits.size(0), ", ", logits.size(1), "], got ",
              labels.sizes());
  TORCH_CHECK(!at::isFloatingType(labels.scalar_type()) && !at::isComplexType(labels.scalar_type()),
              "causal_lm_loss: labels must hold integer token ids, got ", labels.scalar_type());
  // As transformers' ForCausalLMLoss: pad the labels with the ignore index and shift them left,
  // so logits[:, t] is scored against labels[:, t + 1] and the last position is ignored.
  const int64_t vocab = logits.size(2);
  const at::Tensor shifted = shift_labels(labels);
  return at::cross_entropy_loss(logits.to(at::kFloat).reshape({-1, vocab}), shifted.reshape({-1}).to(logits.device()),
                                /*weight=*/{}, at::Reduction::Mean, kIgnoreIndex);
}

}  // namespace roundpipe::models
