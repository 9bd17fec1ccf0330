// Mixture-of-experts layers of Qwen3-MoE and Mixtral as LibTorch modules, matching transformers'
// Qwen3MoeSparseMoeBlock / MixtralSparseMoeBlock numerically: a router, fused expert weights
// (HF "mlp.gate", "mlp.experts"), experts computed on tokens sorted by expert, the routing replayed
// in RoundPipe's recompute, and the load-balancing loss statistics carried to the LmHead. See
// docs/models.md, "Mixture of experts".
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/TensorOptions.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/modules/common.h>
#include <torch/nn/modules/container/any_value.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <mutex>
#include <vector>

#include "roundpipe/models/layers.h"
#include "roundpipe/models/model_config.h"

namespace roundpipe::models {

// Note [Router statistics]: the load-balancing loss (transformers' load_balancing_loss_func) of a
// forward over N tokens and L sparse layers is
//   aux = E * sum_e (C_e / (N L)) * (P_e / (N L)),
// with C_e the number of (token, slot) assignments to expert e summed over the layers (each token
// counts k times per layer) and P_e the router probabilities of expert e summed over tokens and
// layers (softmax of the router logits in their dtype, then fp32, as transformers). Each decoder
// layer of an MoE model takes and returns a [2, E] float32 tensor `stats` = [C; P] accumulated over
// the layers so far (a dense layer passes it on), so the statistics travel with the hidden state
// through RoundPipe's stages and recompute; the LmHead turns them into aux (router_aux_loss).
// The gradient reaches the routers through P only, as in transformers.

/// The statistics of no layer: zeros [2, num_experts] float32 on `device`.
at::Tensor empty_router_stats(int64_t num_experts, c10::Device device);

/// aux of Note [Router statistics] (0-dim float32) from `stats` after the last layer, for `tokens`
/// tokens and `sparse_layers` sparse layers. Zero when sparse_layers is 0.
at::Tensor router_aux_loss(const at::Tensor& stats, int64_t tokens, int64_t sparse_layers);

/// The fused expert weights of one sparse layer (HF "mlp.experts"), as transformers 5 keeps them in
/// memory. Qwen3-MoE, Mixtral: gate_up_proj [E, 2I, H] (gate rows first, then up) and down_proj
/// [E, H, I], used as x W^T; checkpoints with one tensor per expert are converted on load
/// (pretrained.h). gpt-oss: gate_up_proj [E, H, 2I] (gate and up interleaved by column: gate
/// the even ones), gate_up_proj_bias [E, 2I], down_proj [E, I, H], down_proj_bias [E, H], used as
/// x W + b, with the clamped SwiGLU (ModelConfig::swiglu_alpha, swiglu_limit).
class ExpertsImpl : public torch::nn::Cloneable<ExpertsImpl> {
 public:
  ExpertsImpl(const ModelConfig& config, const at::TensorOptions& options = {});
  void reset() override;
  /// x [M, H] sorted by expert, `counts` rows per expert (host integers summing to M) -> [M, H]:
  /// each expert's MLP on its rows (docs/models.md, "Mixture of experts": experts, fast). With
  /// `row_weights` [M], each output row is multiplied by its routing weight (in the weights'
  /// dtype, then cast to x's), as transformers weighs an expert's output.
  at::Tensor forward(const at::Tensor& x, const std::vector<int64_t>& counts, const at::Tensor& row_weights = {});
  /// The same on the tokens x [N, H], the rows being gathered: row r of the expert-sorted order
  /// is token token_of_row[r] (int64 [M]); returns [N, H], each token's (weighted) expert outputs
  /// summed expert by expert, as transformers' loop. What SparseMoeBlock calls: no [M, H] tensor
  /// is made (docs/models.md, "Mixture of experts": experts, fast).
  at::Tensor forward_tokens(const at::Tensor& x, const at::Tensor& token_of_row, const std::vector<int64_t>& counts,
                            const at::Tensor& row_weights = {});

  /// Expert LoRA in PEFT's `target_parameters` format (PEFT's ParamWrapper on a 3-D expert
  /// weight), on gate_up_proj and/or down_proj. For a target with in/out features (gate_up_proj:
  /// H -> 2I, down_proj: I -> H, whichever way the weight is stored) the factors are lora_A
  /// [E r, in] (expert e's A: rows e r .. e r + r - 1) and lora_B [out, r E] (expert e's B: columns
  /// j E + e), and the forward uses W_e + (alpha / r) B_e A_e, as PEFT's parametrization does,
  /// computed on each expert's rows without materializing it (docs/models.md, "LoRA on the
  /// experts"). Parameters lora_A_gate_up_proj,
  /// lora_B_gate_up_proj, lora_A_down_proj, lora_B_down_proj (undefined when not targeted),
  /// uninitialised: lora.h's apply_lora initialises them as PEFT does.
  void enable_lora(bool gate_up, bool down, int64_t rank, double alpha);
  /// Folds the adapters into the weights (W_e += (alpha / r) B_e A_e) and removes them.
  void merge_lora();
  bool has_lora() const { return lora_rank_ > 0; }
  int64_t lora_rank() const { return lora_rank_; }
  double lora_alpha() const { return lora_alpha_; }

  at::Tensor gate_up_proj, down_proj;
  at::Tensor gate_up_proj_bias, down_proj_bias;         ///< gpt-oss only
  at::Tensor lora_A_gate_up_proj, lora_B_gate_up_proj;  ///< expert LoRA on gate_up_proj, else undefined
  at::Tensor lora_A_down_proj, lora_B_down_proj;        ///< expert LoRA on down_proj, else undefined

 private:
  void register_lora();
  /// `weight` (gate_up_proj or down_proj) plus its adapters' update, or `weight` itself (merge_lora).
  at::Tensor adapted(const at::Tensor& weight, const at::Tensor& lora_a, const at::Tensor& lora_b) const;

  ModelConfig config_;
  at::TensorOptions options_;
  bool lora_gate_up_ = false, lora_down_ = false;
  int64_t lora_rank_ = 0;
  double lora_alpha_ = 0;
};
TORCH_MODULE(Experts);

/// One sparse MLP (HF "model.layers.{i}.mlp" of a sparse layer). Children: the router, a Linear
/// [E, H] (HF "gate", without bias; gpt-oss "router", with bias; member `gate` either way), and
/// experts.
///
/// Routing, as transformers: p = softmax(gate(x)) in fp32; the top num_experts_per_tok experts of
/// p; their weights p renormalized to sum to one (Mixtral always, Qwen3-MoE when norm_topk_prob),
/// cast back to the model dtype for Qwen3-MoE, kept fp32 for Mixtral (whose products with the
/// expert outputs are then fp32, cast when summed). gpt-oss: the top k of the raw logits, weights
/// the softmax of those k logits in the model dtype. The output of a token is the weighted sum of
/// its experts' outputs, summed in expert order. Under RoundPipe the forward stage saves the
/// top-k indices and counts and the recompute replays them (Note [Recompute data] in
/// roundpipe/recompute_data.h): a recompute never routes anew.
class SparseMoeBlockImpl : public torch::nn::Cloneable<SparseMoeBlockImpl> {
 public:
  SparseMoeBlockImpl(const ModelConfig& config, int64_t layer_index, const at::TensorOptions& options = {});
  void reset() override;
  /// x [B, T, H] -> {y [B, T, H], this layer's router statistics [2, E] (Note [Router
  /// statistics])}.
  std::vector<at::Tensor> forward(const at::Tensor& x);

  Linear gate{nullptr};
  Experts experts{nullptr};

 private:
  ModelConfig config_;
  int64_t layer_index_;
  at::TensorOptions options_;
};
TORCH_MODULE(SparseMoeBlock);

/// One pre-norm decoder block of a mixture-of-experts model (HF "model.layers.{i}"), sparse or
/// dense (Qwen3-MoE's mlp_only_layers / decoder_sparse_step). Children: input_layernorm,
/// self_attn, post_attention_layernorm, and "mlp": a SparseMoeBlock (member moe) or an Mlp of
/// intermediate_size (member mlp).
/// forward(hidden [B, T, H], stats = undefined) -> {hidden, stats + this layer's statistics}
/// (Note [Router statistics]; undefined stats count as zeros).
class MoeDecoderLayerImpl : public torch::nn::Cloneable<MoeDecoderLayerImpl> {
 public:
  MoeDecoderLayerImpl(const ModelConfig& config, int64_t layer_index, const at::TensorOptions& options = {});
  void reset() override;
  std::vector<at::Tensor> forward(const at::Tensor& hidden, const at::Tensor& stats = {});
  /// hidden [B, T, H] -> hidden through Attention::forward_cached (generation, inference only; the
  /// router statistics are not computed into anything).
  at::Tensor forward_cached(const at::Tensor& hidden, LayerKvCache& cache);

  RMSNorm input_layernorm{nullptr}, post_attention_layernorm{nullptr};
  Attention self_attn{nullptr};
  Mlp mlp{nullptr};             ///< dense layers only
  SparseMoeBlock moe{nullptr};  ///< sparse layers only (registered as "mlp")

  int64_t layer_index() const { return layer_index_; }

 protected:
  FORWARD_HAS_DEFAULT_ARGS({1, torch::nn::AnyValue(at::Tensor())})

 private:
  ModelConfig config_;
  int64_t layer_index_;
  at::TensorOptions options_;
};
TORCH_MODULE(MoeDecoderLayer);

/// The load-balancing loss of training forwards, for metrics: LmHead adds each microbatch's
/// tokens * aux here (set_router_loss_log). Thread-safe (one mutex): heads on any worker add,
/// the trainer takes.
class RouterLossLog {
 public:
  /// Adds tokens * aux of one microbatch (a 0-dim tensor on any device; detached here).
  void add(const at::Tensor& tokens_times_aux, int64_t tokens);
  /// The token-weighted mean aux of everything added since the last take (0 when nothing was),
  /// and clears. Reads the values to the host.
  double take();

 private:
  std::mutex mutex_;
  std::vector<at::Tensor> values_;  // guarded by mutex_
  int64_t tokens_ = 0;              // guarded by mutex_
};

}  // namespace roundpipe::models
