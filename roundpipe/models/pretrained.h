// Llama / Mistral / Qwen3 / Qwen3-MoE / Mixtral models compatible with Hugging Face transformers:
// build one from a ModelConfig, load and save transformers checkpoint directories (config.json +
// safetensors), map parameters to HF names, and HF's causal-LM loss. The model is a
// torch::nn::Sequential [Embedding, DecoderLayer x N, LmHead] (layers.h; MoeDecoderLayer for the
// mixtures of experts, moe.h), ready for RoundPipe.
//
//   auto pre = roundpipe::models::load_pretrained("/models/SmolLM2-135M",
//                                                 LoadOptions().dtype(at::kBFloat16));
//   at::Tensor logits = pre.model->forward(input_ids);           // [B, T, vocab]
//   at::Tensor loss = roundpipe::models::causal_lm_loss(logits, input_ids);
//   roundpipe::models::save_pretrained(pre.model, pre.config, "/tmp/out");
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <c10/core/TensorOptions.h>
#include <torch/arg.h>
#include <torch/nn/modules/container/sequential.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "roundpipe/models/model_config.h"

namespace roundpipe {
class RoundPipe;
}  // namespace roundpipe

namespace roundpipe::models {

/// Options of load_pretrained.
struct LoadOptions {
  /// Parameter dtype; default: the config's `dtype`, else float32.
  TORCH_ARG(std::optional<c10::ScalarType>, dtype) = std::nullopt;
  /// Where the parameters are allocated.
  TORCH_ARG(c10::Device, device) = c10::kCPU;
};

/// Options of save_pretrained.
struct SaveOptions {
  /// dtype written to the files (and to config.json); default: the model's parameter dtype.
  TORCH_ARG(std::optional<c10::ScalarType>, dtype) = std::nullopt;
  /// Shard size limit (transformers' max_shard_size): larger models are written as
  /// model-0000i-of-0000N.safetensors + model.safetensors.index.json.
  TORCH_ARG(int64_t, max_shard_bytes) = 5LL << 30;
};

/// A model and the configuration it was built from.
struct Pretrained {
  torch::nn::Sequential model;
  ModelConfig config;
};

// Note [Tied embeddings]: with tie_word_embeddings the LmHead's lm_head weight IS the embedding's
// weight tensor (one parameter in two modules), as in transformers. LibTorch's
// Module::parameters() does not remove duplicates, so the tensor is listed twice; use
// unique_parameters() for an optimizer. Cloning the Sequential (or one layer) unties the copy.

/// The uninitialised model for `config` (see Note [Uninitialised parameters] in layers.h), with
/// parameters allocated with `options` and tied embeddings shared.
torch::nn::Sequential make_model(const ModelConfig& config, const at::TensorOptions& options = {});

/// A float32 CPU model with HF's random init: normal(0, initializer_range) for Linear and
/// embedding weights, zero biases and padding row, ones for norms.
Pretrained build(const ModelConfig& config);

/// Loads a transformers checkpoint directory: config.json and model.safetensors (or
/// model.safetensors.index.json and its shards). Fails naming the tensor when one is missing
/// (lm_head.weight may be absent only when tied), has the wrong shape, or is not a parameter of the
/// model (old checkpoints' `rotary_emb.inv_freq` buffers are ignored, as transformers does).
/// Mixture-of-experts weights may be fused (mlp.experts.gate_up_proj, as transformers keeps them
/// in memory) or one tensor per expert (released checkpoints; Mixtral's block_sparse_moe names).
Pretrained load_pretrained(const std::string& hf_dir, const LoadOptions& options = {});

/// Writes config.json and the safetensors file(s) into `hf_dir` (created if missing; its parent
/// must exist) so that transformers' from_pretrained loads it. Tied models omit lm_head.weight.
/// Mixture-of-experts weights are written one tensor per expert, the layout of released
/// checkpoints and of transformers' own save_pretrained.
void save_pretrained(const torch::nn::Sequential& model, const ModelConfig& config, const std::string& hf_dir,
                     const SaveOptions& options = {});

/// The same for a model wrapped in RoundPipe: waits for queued optimizer steps (synchronize())
/// and saves the master weights (RoundPipe::optim_named_parameters(), e.g. fp32 with bf16 compute
/// copies), not the compute copies. Caller thread of `model`.
void save_pretrained(RoundPipe& model, const ModelConfig& config, const std::string& hf_dir,
                     const SaveOptions& options = {});

/// HF's causal-LM loss (transformers ForCausalLMLoss): `labels` are the input ids [B, T]; logits
/// [B, T, V] at position t are scored against labels[t + 1]; labels equal to -100 are ignored; the
/// mean is over the scored tokens, computed in float32. Returns a 0-dim float32 tensor.
at::Tensor causal_lm_loss(const at::Tensor& logits, const at::Tensor& labels);

/// The HF name of a parameter of the Sequential, e.g. "3.mlp.up_proj.weight" ->
/// "model.layers.2.mlp.up_proj.weight", "0.embed_tokens.weight" -> "model.embed_tokens.weight",
/// "{N+1}.norm.weight" -> "model.norm.weight", "{N+1}.lm_head.weight" -> "lm_head.weight".
std::string hf_parameter_name(const std::string& sequential_name, int64_t num_hidden_layers);

/// The model's parameters under their HF names (tied models omit lm_head.weight), detached, in
/// module order. Checks that the model has the layout of `config`.
std::vector<std::pair<std::string, at::Tensor>> hf_state_dict(const torch::nn::Sequential& model,
                                                              const ModelConfig& config);

/// Copies every parameter from `get(hf_name)` (converted to the parameter's dtype and device).
/// `get` returns an undefined tensor (or throws) for a name it lacks; that fails naming the tensor,
/// as does a shape mismatch. A tied model reads only model.embed_tokens.weight.
void load_hf_state_dict(torch::nn::Sequential& model, const ModelConfig& config,
                        const std::function<at::Tensor(const std::string&)>& get);

/// Runs `model` ([Embedding, DecoderLayer or MoeDecoderLayer x N, LmHead]) on `input_ids` [B, T] as
/// RoundPipe runs it: logits [B, T, vocab], or with `targets` the LmHead's summed loss (layers.h).
/// The layers of a mixture-of-experts model pass two tensors on (moe.h), so its Sequential's own
/// forward() does not apply; this works for both.
at::Tensor forward(const torch::nn::Sequential& model, const at::Tensor& input_ids, const at::Tensor& targets = {});

/// The model's parameters with shared tensors (tied embeddings) listed once, in module order.
std::vector<at::Tensor> unique_parameters(const torch::nn::Module& model);

}  // namespace roundpipe::models
