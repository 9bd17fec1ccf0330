// The layers of a Llama-family decoder (Llama, Mistral, Qwen3) as LibTorch modules, matching
// Hugging Face transformers' LlamaForCausalLM / Qwen3ForCausalLM numerically. A model is a
// torch::nn::Sequential [Embedding, DecoderLayer x N, LmHead] (see pretrained.h: build,
// load_pretrained), so RoundPipe can stream it layer by layer.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/TensorOptions.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/modules/common.h>
#include <torch/nn/modules/container/any_value.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <tuple>

#include "roundpipe/models/model_config.h"

namespace roundpipe::models {

// Note [Uninitialised parameters]: these modules allocate their parameters with at::empty in
// reset() and never fill them there. Cloneable::clone() calls reset() and then overwrites every
// parameter, and RoundPipe clones layers, so a random init in reset() (as torch::nn::Linear does)
// would be wasted work on every clone; loading a checkpoint would pay for it too. build()
// (pretrained.h) or init_weights() fills them. Parameters are created with the dtype and device
// given at construction, or those of the module being cloned.
//
// Thread-safety of every module here: forward() may run concurrently on distinct clones; the
// same instance may run concurrent forwards (no mutable state besides parameters).

/// Side inputs (roundpipe/side_inputs.h) of a packed batch that the attention layers read, each
/// an integer tensor [batch, seq]: every token's position in its own sequence (restarting at 0 for
/// each packed sequence), and which sequence it belongs to (docs/models.md, "Packed sequences").
inline constexpr char kPositionIds[] = "position_ids";
inline constexpr char kSegmentIds[] = "segment_ids";
/// Side input the LmHead reads in a forward without targets: int64 [batch], one position per row;
/// the head then computes only those positions' logits, [batch, 1, vocab] (as transformers'
/// logits_to_keep, one index per row): generation through RoundPipe::forward on right-padded rows
/// (generate_batch_streamed, generate.h).
inline constexpr char kLogitPositions[] = "logit_positions";

/// y = x W^T (+ b), weight [out_features, in_features], as torch.nn.Linear.
class LinearImpl : public torch::nn::Cloneable<LinearImpl> {
 public:
  LinearImpl(int64_t in_features, int64_t out_features, bool bias, const at::TensorOptions& options = {});
  void reset() override;
  at::Tensor forward(const at::Tensor& x);
  /// Makes `weight_tensor` (same shape) this module's weight parameter: the same tensor, so
  /// gradients and updates are shared (tied embeddings). A clone gets its own copy again.
  void share_weight(const at::Tensor& weight_tensor);
  /// Adds LoRA adapters (PEFT's LoraLayer): forward becomes
  /// x W^T + b + lora_B(lora_A(dropout(x))) * alpha / rank, with children lora_A (weight
  /// [rank, in]) and lora_B (weight [out, rank]), uninitialised (see lora.h: apply_lora).
  void enable_lora(int64_t rank, double alpha, double dropout);
  /// Folds the adapters into the weight (W += B A * alpha / rank) and removes them.
  void merge_lora();
  bool has_lora() const { return lora_rank_ > 0; }
  int64_t lora_rank() const { return lora_rank_; }
  double lora_alpha() const { return lora_alpha_; }
  double lora_dropout() const { return lora_dropout_; }

  at::Tensor weight;
  at::Tensor bias;                             ///< undefined without bias
  std::shared_ptr<LinearImpl> lora_A, lora_B;  ///< null without LoRA

 private:
  int64_t in_features_, out_features_;
  bool has_bias_;
  at::TensorOptions options_;
  int64_t lora_rank_ = 0;
  double lora_alpha_ = 0, lora_dropout_ = 0;
};
TORCH_MODULE(Linear);

/// HF LlamaRMSNorm: x is normalised in fp32, cast back to its dtype, then scaled by weight. With
/// `weight_in_fp32` (GptOssRMSNorm) the weight multiplies the fp32 normalised x before the cast.
class RMSNormImpl : public torch::nn::Cloneable<RMSNormImpl> {
 public:
  RMSNormImpl(int64_t dim, double eps, const at::TensorOptions& options = {}, bool weight_in_fp32 = false);
  void reset() override;
  at::Tensor forward(const at::Tensor& x);

  at::Tensor weight;

 private:
  int64_t dim_;
  double eps_;
  at::TensorOptions options_;
  bool weight_in_fp32_;
};
TORCH_MODULE(RMSNorm);

/// The model's RMSNorm of width `dim` (GptOssRMSNorm for gpt_oss, else LlamaRMSNorm).
RMSNorm make_rms_norm(const ModelConfig& config, int64_t dim, const at::TensorOptions& options);

/// Embedding table [vocab, hidden]; the row `padding_idx` (if any) gets no gradient, as in
/// torch.nn.Embedding.
class TokenEmbeddingImpl : public torch::nn::Cloneable<TokenEmbeddingImpl> {
 public:
  TokenEmbeddingImpl(int64_t num_embeddings, int64_t dim, std::optional<int64_t> padding_idx,
                     const at::TensorOptions& options = {});
  void reset() override;
  at::Tensor forward(const at::Tensor& ids);

  at::Tensor weight;
  std::optional<int64_t> padding_idx() const { return padding_idx_; }

 private:
  int64_t num_embeddings_, dim_;
  std::optional<int64_t> padding_idx_;
  at::TensorOptions options_;
};
TORCH_MODULE(TokenEmbedding);

/// Pipeline layer 0: token ids int64 [B, T] -> hidden states [B, T, hidden_size].
/// Child: embed_tokens (HF "model.embed_tokens").
class EmbeddingImpl : public torch::nn::Cloneable<EmbeddingImpl> {
 public:
  explicit EmbeddingImpl(const ModelConfig& config, const at::TensorOptions& options = {});
  void reset() override;
  at::Tensor forward(const at::Tensor& input_ids);

  TokenEmbedding embed_tokens{nullptr};

 private:
  ModelConfig config_;
  at::TensorOptions options_;
};
TORCH_MODULE(Embedding);

/// The keys and values one attention layer has seen, for generation with a KV cache (generate.h;
/// docs/models.md, "Generation"). Owned by the caller; one
/// cache per decoder layer and sequence, used by one thread at a time.
struct LayerKvCache {
  /// [B, kv_heads, S, head_dim] after the rotary embedding, for positions [length - S, length):
  /// every position seen, or on a sliding-window layer the last window - 1. Undefined when empty.
  at::Tensor k, v;
  int64_t length = 0;  ///< tokens seen so far: the position of the next token
  /// A left-padded batch (generate_batch): int64 [B], the padding tokens at the start of each row.
  /// Row b's token at cache index i sits at rotary position i - left_padding[b], and no query
  /// attends to row b's first left_padding[b] keys (docs/models.md, "Generation"). Undefined: no
  /// padding, every row's positions are its cache indices.
  at::Tensor left_padding;
};

/// Causal self-attention with rotary embeddings and grouped-query heads. Children: q_proj,
/// k_proj, v_proj, o_proj, and for Qwen3 and Qwen3-MoE q_norm, k_norm (RMSNorm over head_dim).
/// gpt_oss adds the parameter `sinks` [heads]: a learned logit per head that joins every row's
/// softmax and is dropped after it (rows sum to less than one), as transformers' eager
/// GptOssAttention; computed in query blocks, exact (docs/models.md, "Mixture of experts").
class AttentionImpl : public torch::nn::Cloneable<AttentionImpl> {
 public:
  AttentionImpl(const ModelConfig& config, int64_t layer_index, const at::TensorOptions& options = {});
  void reset() override;
  /// x [B, T, hidden] -> [B, T, hidden], positions 0..T-1, causal. A packed batch: the side
  /// inputs kPositionIds (rotary positions) and kSegmentIds (attention only within a segment,
  /// causal) when set (docs/models.md, "Packed sequences").
  at::Tensor forward(const at::Tensor& x);
  /// x [B, T, hidden] at positions cache.length .. cache.length + T - 1 -> [B, T, hidden]: attends
  /// to the cached keys and its own (causal; the last `sliding_window` positions on a sliding
  /// layer), then appends its keys and values to `cache`. Inference only (no dropout). Into an
  /// empty cache without left padding it computes exactly as forward(x).
  at::Tensor forward_cached(const at::Tensor& x, LayerKvCache& cache);
  /// The attention dropout a training forward applies (config.json's attention_dropout).
  double dropout() const { return config_.attention_dropout; }

  Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};
  RMSNorm q_norm{nullptr}, k_norm{nullptr};  ///< Qwen3 and Qwen3-MoE only
  at::Tensor sinks;                          ///< gpt_oss only

 private:
  // q [B, heads, T, d], k and v [B, kv_heads, T, d] of x at positions start..start+T-1.
  // With `left_padding` [B] defined, row b's positions are start - left_padding[b] onwards.
  std::tuple<at::Tensor, at::Tensor, at::Tensor> project(const at::Tensor& x, int64_t start,
                                                         const at::Tensor& left_padding = {});
  // Causal attention of T queries on their own T keys -> [B, heads, T, d]; with `segments`
  // [B, T] defined, block-diagonal causal (docs/models.md, "Packed sequences").
  at::Tensor attend_causal(at::Tensor q, at::Tensor k, at::Tensor v, const at::Tensor& segments);
  // This layer's sliding window, or nullopt for full attention.
  std::optional<int64_t> window() const;

  ModelConfig config_;
  int64_t layer_index_;
  at::TensorOptions options_;
};
TORCH_MODULE(Attention);

/// SwiGLU MLP: down_proj(silu(gate_proj(x)) * up_proj(x)), of config.intermediate_size.
class MlpImpl : public torch::nn::Cloneable<MlpImpl> {
 public:
  MlpImpl(const ModelConfig& config, const at::TensorOptions& options = {});
  void reset() override;
  at::Tensor forward(const at::Tensor& x);

  Linear gate_proj{nullptr}, up_proj{nullptr}, down_proj{nullptr};

 private:
  ModelConfig config_;
  at::TensorOptions options_;
};
TORCH_MODULE(Mlp);

/// One pre-norm decoder block (HF "model.layers.{i}"): hidden [B, T, H] -> [B, T, H].
/// Children: input_layernorm, self_attn, post_attention_layernorm, mlp.
class DecoderLayerImpl : public torch::nn::Cloneable<DecoderLayerImpl> {
 public:
  DecoderLayerImpl(const ModelConfig& config, int64_t layer_index, const at::TensorOptions& options = {});
  void reset() override;
  at::Tensor forward(const at::Tensor& hidden);
  /// forward() through Attention::forward_cached (generation, inference only).
  at::Tensor forward_cached(const at::Tensor& hidden, LayerKvCache& cache);

  RMSNorm input_layernorm{nullptr}, post_attention_layernorm{nullptr};
  Attention self_attn{nullptr};
  Mlp mlp{nullptr};

  int64_t layer_index() const { return layer_index_; }

 private:
  ModelConfig config_;
  int64_t layer_index_;
  at::TensorOptions options_;
};
TORCH_MODULE(DecoderLayer);

class RouterLossLog;

/// Last pipeline layer: final norm and output projection. Children: norm (HF "model.norm"),
/// lm_head (HF "lm_head").
/// - forward(hidden): hidden [B, T, H] -> logits [B, T, vocab] in the model's dtype.
/// - forward(hidden, targets): the summed cross-entropy (0-dim float32) of the logits against
///   targets [B, T] (the target of each position, -100 ignored: shift_labels() of HF-style
///   labels), through linear_cross_entropy: chunked, the logits never materialized
///   (docs/models.md, "Long sequences"). RoundPipe passes each microbatch's label here with
///   RoundPipeOptions::label_to_last_layer. A head with LoRA adapters or a bias computes the
///   same loss from full logits.
/// - Mixture-of-experts models (config.is_moe()): forward(hidden, stats) and
///   forward(hidden, stats, targets), with the router statistics of the decoder layers (Note
///   [Router statistics] in moe.h). In training mode the loss with targets is
///   CE_sum + router_aux_loss_coef * N * aux, N = B * T: divided by the step's token count (as the
///   launcher does) it adds coef * aux weighted by the microbatch's share of the tokens, which is
///   transformers' CE + coef * aux when the step is one microbatch. In eval mode it is CE_sum.
class LmHeadImpl : public torch::nn::Cloneable<LmHeadImpl> {
 public:
  explicit LmHeadImpl(const ModelConfig& config, const at::TensorOptions& options = {});
  void reset() override;
  at::Tensor forward(const at::Tensor& hidden, const at::Tensor& second = {}, const at::Tensor& third = {});

  /// Bytes of one chunk's logits buffers in forward(hidden, targets)
  /// (LinearCrossEntropyOptions::chunk_bytes; default 256 MiB). Kept by clones.
  void set_loss_chunk_bytes(int64_t bytes);
  int64_t loss_chunk_bytes() const { return loss_chunk_bytes_; }

  /// Evaluation with targets (eval mode, no autograd): return [1, 2] {summed loss, number of
  /// correctly predicted targets} instead of the 0-dim summed loss, so RoundPipe::forward(inputs,
  /// label) gives [microbatches, 2] (token accuracy = correct / trained tokens). Training is
  /// unchanged. Default off; kept by clones.
  void set_report_correct(bool on) { report_correct_ = on; }
  bool report_correct() const { return report_correct_; }

  /// Mixture-of-experts models: the weight of the load-balancing loss (default: the config's
  /// router_aux_loss_coef). Kept by clones.
  void set_router_aux_loss_coef(double coef);
  double router_aux_loss_coef() const { return router_aux_loss_coef_; }
  /// Mixture-of-experts models: where training forwards with targets add N * aux (for metrics);
  /// null: nowhere. Shared by clones.
  void set_router_loss_log(std::shared_ptr<RouterLossLog> log) { router_loss_log_ = std::move(log); }

  RMSNorm norm{nullptr};
  Linear lm_head{nullptr};

 protected:
  FORWARD_HAS_DEFAULT_ARGS({1, torch::nn::AnyValue(at::Tensor())}, {2, torch::nn::AnyValue(at::Tensor())})

 private:
  at::Tensor cross_entropy_sum(const at::Tensor& h, const at::Tensor& targets);

  ModelConfig config_;
  at::TensorOptions options_;
  int64_t loss_chunk_bytes_ = int64_t{256} << 20;
  bool report_correct_ = false;
  double router_aux_loss_coef_ = 0.0;
  std::shared_ptr<RouterLossLog> router_loss_log_;
};
TORCH_MODULE(LmHead);

/// HF's init (PreTrainedModel._init_weights for Llama/Qwen3/Qwen3-MoE/Mixtral) over every module
/// in `module`: Linear, TokenEmbedding and expert weights ~ normal(0, std), biases zero, the
/// padding row zero, RMSNorm weights one. Draws from the default generator of each parameter's device.
void init_weights(torch::nn::Module& module, double std);

/// Whether a training forward of `module` can draw random numbers: an Attention with
/// attention_dropout > 0, a Linear with LoRA dropout > 0, or a torch::nn dropout module with
/// p > 0 anywhere in the tree. Other modules are taken not to draw: true of every layer in this
/// file and moe.h (a new layer that draws must be added here). The launcher runs RoundPipe without
/// preserve_rng_state when this is false: seeding would change nothing, and on CPU devices its
/// lock serializes the workers' forwards (docs/launcher.md, "Resume": Dropout).
bool draws_in_training(const torch::nn::Module& module);

}  // namespace roundpipe::models
