#include "roundpipe/models/generate.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/argmax.h>
#include <ATen/ops/full.h>
#include <ATen/ops/multinomial.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/sort.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/topk.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>

#include "roundpipe/models/moe.h"

namespace roundpipe::models {
namespace {

// Puts a module into eval mode for a scope and restores its training flag after.
class EvalModeGuard {
 public:
  explicit EvalModeGuard(const torch::nn::Sequential& model) : model_(model), was_training_(model->is_training()) {
    model_->eval();
  }
  ~EvalModeGuard() {
    if (was_training_) model_->train();
  }
  EvalModeGuard(const EvalModeGuard&) = delete;
  EvalModeGuard& operator=(const EvalModeGuard&) = delete;

 private:
  torch::nn::Sequential model_;
  bool was_training_;
};

constexpr double kMinusInfinity = -std::numeric_limits<double>::infinity();

}  // namespace

void check_generate_options(const GenerateOptions& options) {
  TORCH_CHECK(options.max_new_tokens() >= 1, "generate: max_new_tokens = ", options.max_new_tokens(),
              " must be at least 1");
  TORCH_CHECK(std::isfinite(options.temperature()) && options.temperature() >= 0.0, "generate: temperature = ",
              options.temperature(), " must be finite and >= 0 (0 = greedy)");
  TORCH_CHECK(options.top_p() > 0.0 && options.top_p() <= 1.0, "generate: top_p = ", options.top_p(),
              " must be in (0, 1] (1 = off)");
  TORCH_CHECK(options.top_k() >= 0, "generate: top_k = ", options.top_k(), " must be >= 0 (0 = off)");
}

// ---- KvCache -------------------------------------------------------------------------------------

KvCache::KvCache(const ModelConfig& config) : layers_(static_cast<size_t>(config.num_hidden_layers)) {}

int64_t KvCache::length() const { return layers_.empty() ? 0 : layers_.front().length; }

LayerKvCache& KvCache::layer(int64_t index) {
  TORCH_CHECK(index >= 0 && index < num_layers(), "KvCache: layer ", index, " is outside [0, ", num_layers(), ")");
  return layers_[static_cast<size_t>(index)];
}

void KvCache::clear() {
  for (LayerKvCache& layer : layers_) layer = LayerKvCache();
}

// ---- forward_cached ------------------------------------------------------------------------------

at::Tensor forward_cached(const torch::nn::Sequential& model, const at::Tensor& input_ids, KvCache& cache,
                          CachedLogits which) {
  const int64_t num_layers = cache.num_layers();
  TORCH_CHECK(static_cast<int64_t>(model->size()) == num_layers + 2, "forward_cached: the model has ", model->size(),
              " modules but the cache is for ", num_layers,
              " decoder layers (expected [Embedding, decoder layers, LmHead])");
  auto embedding = std::dynamic_pointer_cast<EmbeddingImpl>(model->ptr(0));
  auto head = std::dynamic_pointer_cast<LmHeadImpl>(model->ptr(static_cast<size_t>(num_layers + 1)));
  TORCH_CHECK(embedding && head, "forward_cached: the model's first module must be an Embedding and its last an LmHead");
  at::Tensor hidden = embedding->forward(input_ids);
  for (int64_t i = 0; i < num_layers; ++i) {
    const std::shared_ptr<torch::nn::Module> layer = model->ptr(static_cast<size_t>(i + 1));
    if (auto* dense = dynamic_cast<DecoderLayerImpl*>(layer.get())) {
      hidden = dense->forward_cached(hidden, cache.layer(i));
    } else if (auto* moe = dynamic_cast<MoeDecoderLayerImpl*>(layer.get())) {
      hidden = moe->forward_cached(hidden, cache.layer(i));
    } else {
      TORCH_CHECK(false, "forward_cached: module ", i + 1, " (", layer->name(),
                  ") is not a DecoderLayer or MoeDecoderLayer");
    }
  }
  if (which == CachedLogits::kLastPosition) hidden = hidden.narrow(1, hidden.size(1) - 1, 1);
  return head->forward(hidden);
}

// ---- sampling ------------------------------------------------------------------------------------

at::Tensor sampling_probs(const at::Tensor& logits, const GenerateOptions& options) {
  check_generate_options(options);
  TORCH_CHECK(options.temperature() > 0.0, "sampling_probs: temperature must be > 0 (0 is greedy), got ",
              options.temperature());
  TORCH_CHECK(logits.dim() == 1 && logits.numel() > 0, "sampling_probs: logits must be [vocab], got ",
              logits.sizes());
  // transformers: TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, in that order, on
  // float32 scores; filtered scores become -inf.
  at::Tensor scores = logits.to(at::kFloat) / options.temperature();
  const int64_t vocab = scores.numel();
  if (options.top_k() > 0 && options.top_k() < vocab) {
    const at::Tensor kth = std::get<0>(at::topk(scores, options.top_k())).narrow(0, options.top_k() - 1, 1);
    scores = scores.masked_fill(scores < kth, kMinusInfinity);
  }
  if (options.top_p() < 1.0) {
    auto [sorted, order] = at::sort(scores, /*dim=*/0, /*descending=*/false);
    const at::Tensor cumulative = at::softmax(sorted, 0).cumsum(0);
    at::Tensor remove = cumulative <= (1.0 - options.top_p());
    remove.narrow(0, vocab - 1, 1).fill_(false);  // keep at least the most probable token
    scores = scores.masked_fill(remove.scatter(0, order, remove), kMinusInfinity);
  }
  return at::softmax(scores, 0);
}

int64_t next_token(const at::Tensor& logits, const GenerateOptions& options, at::Generator& generator) {
  TORCH_CHECK(logits.dim() == 1, "next_token: logits must be [vocab], got ", logits.sizes());
  if (options.temperature() == 0.0) return at::argmax(logits.to(at::kFloat)).item<int64_t>();
  const at::Tensor probs = sampling_probs(logits, options).to(at::kCPU);
  return at::multinomial(probs, 1, /*replacement=*/false, generator).item<int64_t>();
}

// ---- generate ------------------------------------------------------------------------------------

std::vector<int64_t> generate(const torch::nn::Sequential& model, const ModelConfig& config,
                              const std::vector<int64_t>& prompt, const GenerateOptions& options,
                              const TokenCallback& on_token) {
  check_generate_options(options);
  const auto prompt_len = static_cast<int64_t>(prompt.size());
  TORCH_CHECK(prompt_len > 0, "generate: the prompt is empty (give at least one token)");
  TORCH_CHECK(prompt_len < config.max_position_embeddings, "generate: the prompt has ", prompt_len,
              " tokens but the model's max_position_embeddings is ", config.max_position_embeddings,
              ": at most ", config.max_position_embeddings - 1, " prompt tokens leave room for a new one");
  for (int64_t id : prompt) {
    TORCH_CHECK(id >= 0 && id < config.vocab_size, "generate: prompt token id ", id, " is outside [0, vocab_size = ",
                config.vocab_size, ")");
  }
  at::NoGradGuard no_grad;
  EvalModeGuard eval(model);
  const c10::Device device = model->ptr<EmbeddingImpl>(0)->embed_tokens->weight.device();
  at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(options.seed());
  const std::vector<int64_t>& stops = options.stop_token_ids();

  KvCache cache(config);
  at::Tensor input = at::tensor(prompt, at::TensorOptions().dtype(at::kLong)).to(device).unsqueeze(0);
  std::vector<int64_t> out;
  for (;;) {
    const at::Tensor logits = forward_cached(model, input, cache);  // [1, 1, vocab]
    const int64_t token = next_token(logits[0][0], options, generator);
    out.push_back(token);
    if (on_token) on_token(token);
    const bool stopped = std::find(stops.begin(), stops.end(), token) != stops.end();
    const auto total = prompt_len + static_cast<int64_t>(out.size());
    if (stopped || static_cast<int64_t>(out.size()) >= options.max_new_tokens() ||
        total >= config.max_position_embeddings) {
      break;
    }
    input = at::full({1, 1}, token, at::TensorOptions().dtype(at::kLong).device(device));
  }
  return out;
}

}  // namespace roundpipe::models
