#include "roundpipe/models/generate.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/argmax.h>
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
#include <optional>
#include <string>

#include "roundpipe/models/moe.h"
#include "roundpipe/round_pipe.h"
#include "roundpipe/run_config.h"
#include "roundpipe/side_inputs.h"

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

// Checks one prompt as generate_batch documents: `tokens` after `held` tokens already in a cache
// (0 for a prompt of its own); `which` names it in a batch.
void check_prompt(const ModelConfig& config, const std::vector<int64_t>& tokens, int64_t held,
                  const std::string& which) {
  const int64_t length = held + static_cast<int64_t>(tokens.size());
  TORCH_CHECK(length > 0, "generate: the prompt", which, " is empty (give at least one token)");
  TORCH_CHECK(length < config.max_position_embeddings, "generate: the prompt", which, " has ", length,
              " tokens but the model's max_position_embeddings is ", config.max_position_embeddings, ": at most ",
              config.max_position_embeddings - 1, " prompt tokens leave room for a new one");
  for (int64_t id : tokens) {
    TORCH_CHECK(id >= 0 && id < config.vocab_size, "generate: prompt", which, " token id ", id,
                " is outside [0, vocab_size = ", config.vocab_size, ")");
  }
}

// Checks options and prompts as generate_batch documents; returns the longest prompt's length.
int64_t check_prompts(const ModelConfig& config, const std::vector<std::vector<int64_t>>& prompts,
                      const GenerateOptions& options) {
  check_generate_options(options);
  TORCH_CHECK(!prompts.empty(), "generate: no prompts (give at least one)");
  int64_t longest = 0;
  for (size_t r = 0; r < prompts.size(); ++r) {
    check_prompt(config, prompts[r], 0, prompts.size() > 1 ? " (prompt " + std::to_string(r) + ")" : "");
    longest = std::max(longest, static_cast<int64_t>(prompts[r].size()));
  }
  return longest;
}

// generate()'s callback as a batch callback (its one row).
BatchTokenCallback one_row(const TokenCallback& on_token) {
  if (!on_token) return {};
  return [&on_token](int64_t /*row*/, int64_t token) { on_token(token); };
}

// The pad token of left/right padding: the config's pad_token_id when it is a token, else 0.
int64_t padding_token(const ModelConfig& config) {
  const int64_t configured = config.pad_token_id.value_or(0);
  return configured >= 0 && configured < config.vocab_size ? configured : 0;
}

// Whether `token` ends its row, by generate()'s rules.
bool row_ends(const GenerateOptions& options, const ModelConfig& config, int64_t token, size_t prompt_len,
              size_t generated) {
  const std::vector<int64_t>& stops = options.stop_token_ids();
  return std::find(stops.begin(), stops.end(), token) != stops.end() ||
         static_cast<int64_t>(generated) >= options.max_new_tokens() ||
         static_cast<int64_t>(prompt_len + generated) >= config.max_position_embeddings;
}

}  // namespace

void check_generate_options(const GenerateOptions& options) {
  TORCH_CHECK(options.max_new_tokens() >= 1, "generate: max_new_tokens = ", options.max_new_tokens(),
              " must be at least 1");
  TORCH_CHECK(std::isfinite(options.temperature()) && options.temperature() >= 0.0,
              "generate: temperature = ", options.temperature(), " must be finite and >= 0 (0 = greedy)");
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

int64_t KvCache::batch_size() const {
  for (const LayerKvCache& layer : layers_) {
    if (layer.k.defined()) return layer.k.size(0);
  }
  return 0;
}

bool KvCache::truncate(int64_t length, const ModelConfig& config) {
  const int64_t held = this->length();
  TORCH_CHECK(length >= 0 && length <= held, "KvCache::truncate: length ", length, " is outside [0, ", held, "]");
  TORCH_CHECK(static_cast<int64_t>(layers_.size()) == config.num_hidden_layers, "KvCache::truncate: the cache is for ",
              layers_.size(), " layers, the config has ", config.num_hidden_layers);
  if (length == held) return true;
  // Every layer must hold the keys that the positions from `length` on can see: all of them on a
  // full layer, the last window - 1 on a sliding one (which keeps no more: Note [Cached attention]).
  for (int64_t i = 0; i < num_layers(); ++i) {
    const LayerKvCache& layer = layers_[static_cast<size_t>(i)];
    const int64_t first_held = held - (layer.k.defined() ? layer.k.size(2) : 0);
    const std::optional<int64_t> window =
        config.layer_uses_sliding_window(i) ? config.sliding_window : std::optional<int64_t>();
    const int64_t first_needed = window ? std::max<int64_t>(0, length - (*window - 1)) : 0;
    if (first_held > first_needed) return false;
  }
  for (LayerKvCache& layer : layers_) {
    if (length == 0) {
      layer.k = at::Tensor();
      layer.v = at::Tensor();
    } else {
      const int64_t keep = length - (held - layer.k.size(2));
      layer.k = layer.k.narrow(2, 0, keep);
      layer.v = layer.v.narrow(2, 0, keep);
    }
    layer.length = length;
  }
  return true;
}

void KvCache::set_left_padding(const at::Tensor& left_padding) {
  TORCH_CHECK(length() == 0, "KvCache::set_left_padding: the cache already holds ", length(),
              " tokens; set the padding before the first forward (or clear() first)");
  TORCH_CHECK(left_padding.dim() == 1 && left_padding.scalar_type() == at::kLong,
              "KvCache::set_left_padding: expected int64 [batch], got ", left_padding.scalar_type(), " ",
              left_padding.sizes());
  TORCH_CHECK(left_padding.numel() == 0 || left_padding.min().item<int64_t>() >= 0,
              "KvCache::set_left_padding: padding counts must be >= 0");
  for (LayerKvCache& layer : layers_) layer.left_padding = left_padding;
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
  TORCH_CHECK(embedding && head,
              "forward_cached: the model's first module must be an Embedding and its last an LmHead");
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
  TORCH_CHECK(logits.dim() == 1 && logits.numel() > 0, "sampling_probs: logits must be [vocab], got ", logits.sizes());
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

namespace {

// The decoding loop of generate_batch and the continued generate: `input` [rows, T] on the model's
// device goes through `cache`, then one token per running row per step until every row ends;
// `prompt_lengths[r]`: the tokens row r holds before its first new one (its positions).
std::vector<std::vector<int64_t>> decode(const torch::nn::Sequential& model, const ModelConfig& config, KvCache& cache,
                                         at::Tensor input, const std::vector<size_t>& prompt_lengths,
                                         const GenerateOptions& options, const BatchTokenCallback& on_token) {
  const auto rows = static_cast<int64_t>(prompt_lengths.size());
  const c10::Device device = input.device();
  const auto ids = at::TensorOptions().dtype(at::kLong);
  at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(options.seed());
  std::vector<std::vector<int64_t>> out(static_cast<size_t>(rows));
  std::vector<int64_t> last(static_cast<size_t>(rows), padding_token(config));
  std::vector<bool> done(static_cast<size_t>(rows), false);
  int64_t running = rows;
  while (running > 0) {
    const at::Tensor logits = forward_cached(model, input, cache);  // [B, 1, vocab], next_token reads it there
    for (int64_t r = 0; r < rows; ++r) {
      const auto i = static_cast<size_t>(r);
      if (done[i]) continue;
      const int64_t token = next_token(logits[r][0], options, generator);
      out[i].push_back(token);
      last[i] = token;
      if (on_token) on_token(r, token);
      if (row_ends(options, config, token, prompt_lengths[i], out[i].size())) {
        done[i] = true;
        --running;
      }
    }
    if (running > 0) input = at::tensor(last, ids).view({rows, 1}).to(device);
  }
  return out;
}

c10::Device model_device(const torch::nn::Sequential& model) {
  return model->ptr<EmbeddingImpl>(0)->embed_tokens->weight.device();
}

}  // namespace

std::vector<std::vector<int64_t>> generate_batch(const torch::nn::Sequential& model, const ModelConfig& config,
                                                 const std::vector<std::vector<int64_t>>& prompts,
                                                 const GenerateOptions& options, const BatchTokenCallback& on_token) {
  const int64_t longest = check_prompts(config, prompts, options);
  const auto rows = static_cast<int64_t>(prompts.size());
  at::NoGradGuard no_grad;
  EvalModeGuard eval(model);
  const c10::Device device = model_device(model);
  const auto ids = at::TensorOptions().dtype(at::kLong);

  // Left padding with the config's pad token (0 without one): its embedding never reaches a real
  // token (Note [Left-padded generation]).
  std::vector<int64_t> padded(static_cast<size_t>(rows * longest), padding_token(config));
  std::vector<int64_t> padding(static_cast<size_t>(rows));
  std::vector<size_t> lengths;
  for (int64_t r = 0; r < rows; ++r) {
    const std::vector<int64_t>& prompt = prompts[static_cast<size_t>(r)];
    const int64_t pad = longest - static_cast<int64_t>(prompt.size());
    padding[static_cast<size_t>(r)] = pad;
    std::copy(prompt.begin(), prompt.end(), padded.begin() + r * longest + pad);
    lengths.push_back(prompt.size());
  }
  KvCache cache(config);
  if (std::any_of(padding.begin(), padding.end(), [](int64_t p) { return p > 0; })) {
    cache.set_left_padding(at::tensor(padding, ids).to(device));
  }
  return decode(model, config, cache, at::tensor(padded, ids).view({rows, longest}).to(device), lengths, options,
                on_token);
}

std::vector<int64_t> generate(const torch::nn::Sequential& model, const ModelConfig& config, KvCache& cache,
                              const std::vector<int64_t>& tokens, const GenerateOptions& options,
                              const TokenCallback& on_token) {
  TORCH_CHECK(cache.num_layers() == config.num_hidden_layers, "generate: the cache is for ", cache.num_layers(),
              " layers, the config has ", config.num_hidden_layers);
  TORCH_CHECK(cache.batch_size() <= 1 && !cache.layer(0).left_padding.defined(),
              "generate: continuing a cache takes a cache of one unpadded sequence (this one holds ",
              cache.batch_size(), " rows)");
  TORCH_CHECK(!tokens.empty(), "generate: no new tokens to feed the cache (give at least one)");
  check_generate_options(options);
  // The whole sequence's rules: its length is what the cache holds plus the new tokens.
  const int64_t held = cache.length();
  check_prompt(config, tokens, held, "");
  at::NoGradGuard no_grad;
  EvalModeGuard eval(model);
  const at::Tensor input =
      at::tensor(tokens, at::TensorOptions().dtype(at::kLong)).view({1, -1}).to(model_device(model));
  return decode(model, config, cache, input, {static_cast<size_t>(held) + tokens.size()}, options, one_row(on_token))
      .front();
}

std::vector<std::vector<int64_t>> generate_batch_streamed(RoundPipe& pipe, const ModelConfig& config,
                                                          const std::vector<std::vector<int64_t>>& prompts,
                                                          const GenerateOptions& options,
                                                          const BatchTokenCallback& on_token) {
  check_prompts(config, prompts, options);
  const torch::nn::Sequential model = pipe.module();
  TORCH_CHECK(static_cast<int64_t>(model->size()) == config.num_hidden_layers + 2 &&
                  std::dynamic_pointer_cast<EmbeddingImpl>(model->ptr(0)) &&
                  std::dynamic_pointer_cast<LmHeadImpl>(model->ptr(model->size() - 1)),
              "generate_batch_streamed: the RoundPipe's model must be [Embedding, ", config.num_hidden_layers,
              " decoder layers, LmHead] of the config");
  EvalModeGuard eval(model);
  const auto ids = at::TensorOptions().dtype(at::kLong);
  at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(options.seed());
  const int64_t pad_id = padding_token(config);
  const auto default_microbatches = default_num_microbatch(static_cast<int64_t>(pipe.devices().size()));

  // sequences[r]: prompt r and its tokens so far; the running rows in prompt order.
  std::vector<std::vector<int64_t>> sequences = prompts;
  std::vector<std::vector<int64_t>> out(prompts.size());
  std::vector<size_t> running(prompts.size());
  for (size_t i = 0; i < running.size(); ++i) running[i] = i;
  while (!running.empty()) {
    const auto rows = static_cast<int64_t>(running.size());
    int64_t longest = 0;
    for (size_t i : running) longest = std::max(longest, static_cast<int64_t>(sequences[i].size()));
    std::vector<int64_t> padded(static_cast<size_t>(rows * longest), pad_id);
    std::vector<int64_t> last_positions;
    for (int64_t r = 0; r < rows; ++r) {
      const std::vector<int64_t>& sequence = sequences[running[static_cast<size_t>(r)]];
      std::copy(sequence.begin(), sequence.end(), padded.begin() + r * longest);
      last_positions.push_back(static_cast<int64_t>(sequence.size()) - 1);
    }
    at::Tensor logits;
    {
      SideInputScope side({{kLogitPositions, at::tensor(last_positions, ids)}});
      RunConfig call;
      call.num_microbatch = std::min(rows, default_microbatches);
      call.output_device = c10::Device(c10::kCPU);
      logits = pipe.forward({at::tensor(padded, ids).view({rows, longest})}, call);  // [rows, 1, vocab]
    }
    std::vector<size_t> still;
    for (int64_t r = 0; r < rows; ++r) {
      const size_t i = running[static_cast<size_t>(r)];
      const int64_t token = next_token(logits[r][0], options, generator);
      out[i].push_back(token);
      sequences[i].push_back(token);
      if (on_token) on_token(static_cast<int64_t>(i), token);
      if (!row_ends(options, config, token, prompts[i].size(), out[i].size())) still.push_back(i);
    }
    running = std::move(still);
  }
  return out;
}

std::vector<int64_t> generate(const torch::nn::Sequential& model, const ModelConfig& config,
                              const std::vector<int64_t>& prompt, const GenerateOptions& options,
                              const TokenCallback& on_token) {
  return generate_batch(model, config, {prompt}, options, one_row(on_token)).front();
}

}  // namespace roundpipe::models
