// Text generation for the models of roundpipe::models (pretrained.h): greedy or sampled decoding
// of one sequence with a KV cache, the prompt prefilled in one forward and then one token per
// step, each token streamed to a callback. Sampling follows transformers' generate (temperature,
// top-k, top-p). docs/models.md, "Generation".
#pragma once

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/nn/modules/container/sequential.h>

#include <cstdint>
#include <functional>
#include <vector>

#include "roundpipe/models/layers.h"
#include "roundpipe/models/model_config.h"

namespace roundpipe {
class RoundPipe;
}  // namespace roundpipe

namespace roundpipe::models {

/// Options of generate(). check_generate_options() states what is refused.
struct GenerateOptions {
  /// Tokens to generate at most (>= 1); fewer when a stop token comes first or the sequence
  /// reaches the model's max_position_embeddings.
  TORCH_ARG(int64_t, max_new_tokens) = 128;
  /// 0: greedy (the argmax, the first on ties, as torch.argmax); > 0: sample from
  /// softmax(logits / temperature) after top_k and top_p.
  TORCH_ARG(double, temperature) = 0.0;
  /// Nucleus sampling in (0, 1] (1: off): keep the most probable tokens whose cumulative
  /// probability reaches top_p, at least one (transformers' TopPLogitsWarper).
  TORCH_ARG(double, top_p) = 1.0;
  /// Keep the top_k most probable tokens, ties at the k-th kept (0: off; transformers'
  /// TopKLogitsWarper). transformers' GenerationConfig defaults to 50; here the default is off.
  TORCH_ARG(int64_t, top_k) = 0;
  /// Seed of the CPU generator the samples are drawn from (same seed, same tokens).
  TORCH_ARG(uint64_t, seed) = 0;
  /// Generation stops after emitting any of these (it is returned and streamed too, as
  /// transformers includes the eos token in its output).
  TORCH_ARG(std::vector<int64_t>, stop_token_ids) = {};
};

/// Throws c10::Error naming the option and value: max_new_tokens < 1, temperature < 0 or not
/// finite, top_p outside (0, 1], top_k < 0.
void check_generate_options(const GenerateOptions& options);

/// The KV caches of one sequence: a LayerKvCache per decoder layer (layers.h). Not synchronized:
/// one thread uses it, with one model.
class KvCache {
 public:
  explicit KvCache(const ModelConfig& config);
  /// Tokens the model has seen through this cache (the position of the next one).
  int64_t length() const;
  LayerKvCache& layer(int64_t index);
  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }
  /// Forgets everything (length 0, no left padding).
  void clear();
  /// Rows of the sequences it holds (0 when empty).
  int64_t batch_size() const;
  /// Forgets the tokens from `length` on (0 <= length <= length()), so that generation can go on
  /// from a shared prefix (a conversation's next turn: docs/models.md, "Generation"). Returns
  /// false and changes nothing when a sliding-window layer of `config` (the cache's model) has
  /// already dropped keys that positions from `length` on would see; then clear() and start over.
  bool truncate(int64_t length, const ModelConfig& config);
  /// Marks the rows of the batch about to be prefilled as left-padded: row b's first
  /// left_padding[b] tokens are padding that no token attends to, and its real tokens sit at
  /// positions 0, 1, ... (LayerKvCache::left_padding). Before the first forward only (length 0);
  /// int64 [B] on the model's device, each value >= 0.
  void set_left_padding(const at::Tensor& left_padding);

 private:
  std::vector<LayerKvCache> layers_;
};

/// Which positions forward_cached computes logits for.
enum class CachedLogits {
  kLastPosition,   ///< [B, 1, vocab]: the LmHead on the last position only (generation)
  kEveryPosition,  ///< [B, T, vocab]
};

/// Runs `input_ids` [B, T] at positions cache.length() .. cache.length() + T - 1 through `model`
/// ([Embedding, DecoderLayer or MoeDecoderLayer x N, LmHead] of `cache`'s config), attending to
/// what the cache holds and appending to it (Attention::forward_cached). Returns logits in the
/// model's dtype. Call it without autograd and in eval mode (generate() does both).
at::Tensor forward_cached(const torch::nn::Sequential& model, const at::Tensor& input_ids, KvCache& cache,
                          CachedLogits which = CachedLogits::kLastPosition);

/// The distribution a sampled token is drawn from, float32 [vocab], for logits [vocab] (any float
/// dtype; computed in float32 as transformers does): logits / temperature, then top_k, then
/// top_p filtering (filtered tokens get probability 0), then softmax. temperature must be > 0.
at::Tensor sampling_probs(const at::Tensor& logits, const GenerateOptions& options);

/// The next token for logits [vocab]: the argmax when temperature is 0, else one draw
/// (at::multinomial) from sampling_probs with `generator` (a CPU generator).
int64_t next_token(const at::Tensor& logits, const GenerateOptions& options, at::Generator& generator);

/// Receives each generated token as soon as it is chosen.
using TokenCallback = std::function<void(int64_t token)>;

/// Receives each generated token of a batch as soon as it is chosen, with its row (the prompt's
/// index in generate_batch's `prompts`).
using BatchTokenCallback = std::function<void(int64_t row, int64_t token)>;

/// generate() for several prompts at once, in one batch: the prompts are left-padded to the
/// longest (KvCache::set_left_padding; each row's positions start at 0 on its first real token,
/// as transformers' generate with an attention mask), and each step runs every row in one forward.
/// Each row stops by generate()'s rules on its own (a finished row is still fed, its tokens
/// dropped); returns each row's tokens. Greedy tokens are generate()'s for each prompt alone (up
/// to rounding: the padded batch multiplies in other shapes). Sampling draws the rows in order
/// from one generator, so a batch of one is generate() exactly, but a row of a larger batch is
/// not the same draw as its prompt alone. Throws as generate(), naming the prompt, and for no
/// prompts.
std::vector<std::vector<int64_t>> generate_batch(const torch::nn::Sequential& model, const ModelConfig& config,
                                                 const std::vector<std::vector<int64_t>>& prompts,
                                                 const GenerateOptions& options = {},
                                                 const BatchTokenCallback& on_token = {});

/// generate_batch through `pipe` (a RoundPipe over an [Embedding, decoder layers, LmHead] model of
/// `config`): for a model that does not fit one device, each step is one RoundPipe::forward that
/// streams the stages over pipe's devices. No KV cache: each step runs every unfinished row's whole
/// sequence (prompt + tokens so far), right-padded to the longest, causal, and the LmHead computes
/// only each row's last real position (side input kLogitPositions, layers.h). Right padding comes
/// after a row's real tokens, so causal attention never sees it: each row computes as alone.
/// Finished rows leave the batch. Cost: a step reads every weight once, as any streamed step must,
/// plus the whole sequences' compute, which a KV cache would save; with a model that fits one
/// device, generate_batch is faster. Runs the module in eval mode (restored after) with
/// RunConfig num_microbatch = min(rows, its default) and the output on the CPU. Same rules,
/// options and errors as generate_batch; greedy tokens equal it (up to rounding).
std::vector<std::vector<int64_t>> generate_batch_streamed(RoundPipe& pipe, const ModelConfig& config,
                                                          const std::vector<std::vector<int64_t>>& prompts,
                                                          const GenerateOptions& options = {},
                                                          const BatchTokenCallback& on_token = {});

/// Generates up to options.max_new_tokens tokens after `prompt` (token ids of one sequence: batch
/// size 1) and returns them (the stop token included when one ended generation). The prompt goes
/// through the model in one causal forward that fills a KvCache, then each new token in a forward
/// of one position; only the last position's logits are computed. The model runs in eval mode
/// without autograd (its training flag is restored after). Stops after a stop token, after
/// max_new_tokens, or when prompt + generated tokens reach config.max_position_embeddings (a
/// documented choice: no position past the model's range). Throws c10::Error for bad options, an
/// empty prompt, a prompt of max_position_embeddings tokens or more, and ids outside the
/// vocabulary. Caller thread; the model must not run elsewhere meanwhile if it is in training
/// mode (the mode is switched).
///
///   auto pre = load_pretrained(dir);
///   std::vector<int64_t> ids = tokenizer.encode(prompt_text);
///   std::vector<int64_t> out = generate(pre.model, pre.config, ids,
///                                       GenerateOptions().max_new_tokens(64).stop_token_ids({eos}),
///                                       [&](int64_t t) { std::cout << tokenizer.decode({t}); });
std::vector<int64_t> generate(const torch::nn::Sequential& model, const ModelConfig& config,
                              const std::vector<int64_t>& prompt, const GenerateOptions& options = {},
                              const TokenCallback& on_token = {});

/// generate() continuing `cache` (one sequence, no padding; empty or filled by an earlier call):
/// `tokens` (at least one) run at positions cache.length() onward, then generation goes on as
/// generate() does, for a sequence of cache.length() + tokens.size() prompt tokens. On return the
/// cache holds everything fed: the tokens and every generated token but the last. A conversation
/// keeps the ids its cache holds, truncate()s it to their common prefix with the next turn's
/// prompt and feeds the rest (roundpipe chat does). Same options and errors as generate();
/// greedy tokens equal generate() on the whole sequence (up to rounding: the prefix was computed
/// in other shapes).
std::vector<int64_t> generate(const torch::nn::Sequential& model, const ModelConfig& config, KvCache& cache,
                              const std::vector<int64_t>& tokens, const GenerateOptions& options = {},
                              const TokenCallback& on_token = {});

}  // namespace roundpipe::models
