// LoRA for the presets (roundpipe::models): low-rank adapters on the attention and MLP
// projections with PEFT's initialisation, scaling and checkpoint format (adapter_config.json +
// adapter_model.safetensors), loading, saving and merging. Above the runtime: a LoRA model trains
// in RoundPipe with its frozen base weights costing no master copy, gradient or optimizer state.
#pragma once

#include <torch/arg.h>
#include <torch/nn/modules/container/sequential.h>

#include <cstdint>
#include <string>
#include <vector>

#include "roundpipe/models/model_config.h"

namespace roundpipe {
class RoundPipe;
}  // namespace roundpipe

namespace roundpipe::models {

/// PEFT's LoraConfig (the fields RoundPipe supports).
struct LoraOptions {
  /// r: the adapters' rank.
  TORCH_ARG(int64_t, rank) = 8;
  /// lora_alpha: the update is scaled by alpha / rank.
  TORCH_ARG(double, alpha) = 16.0;
  /// lora_dropout: dropout on the adapters' input (training mode only).
  TORCH_ARG(double, dropout) = 0.0;
  /// target_modules: names of the Linear modules to adapt, among q_proj, k_proj, v_proj, o_proj,
  /// gate_proj, up_proj, down_proj.
  TORCH_ARG(std::vector<std::string>, target_modules) = std::vector<std::string>{"q_proj", "v_proj"};
  /// target_parameters: the mixture-of-experts weights to adapt, in PEFT's format (its
  /// ParamWrapper): "gate_up_proj" and/or "down_proj" (every sparse layer's experts), or a suffix
  /// of the HF name ("mlp.experts.down_proj", "7.mlp.experts.gate_up_proj": that layer only), as
  /// PEFT matches them. Needs dropout 0 (as in PEFT). The router is never adapted (refused).
  /// docs/models.md, "LoRA on the experts".
  TORCH_ARG(std::vector<std::string>, target_parameters) = std::vector<std::string>{};
};

/// Adds LoRA adapters to every targeted Linear of `model` (built by build/load_pretrained) and
/// freezes everything else (requires_grad false), as PEFT's get_peft_model does. Adapters are
/// initialised like PEFT's default: lora_A Kaiming-uniform (a = sqrt(5), torch.nn.Linear's
/// default), lora_B zero, so the model's output is unchanged. Returns the number of adapted
/// Linear modules plus adapted expert weights; fails naming the targets when none matches or a
/// name is not supported. Call it before wrapping the model in RoundPipe.
int64_t apply_lora(torch::nn::Sequential& model, const LoraOptions& options);

/// The adapter weights under PEFT's names
/// ("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"; expert adapters as PEFT
/// nests its ParamWrappers: with both expert weights targeted, gate_up_proj's are
/// "...mlp.experts.base_layer.lora_A.weight" and down_proj's "...mlp.experts.lora_A.weight").
std::vector<std::pair<std::string, at::Tensor>> lora_state_dict(const torch::nn::Sequential& model,
                                                                const ModelConfig& config);

/// Each adapter weight's PEFT key (as in lora_state_dict) by its parameter name in the Sequential,
/// in module order: "1.self_attn.q_proj.lora_A.weight" ->
/// "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight".
std::vector<std::pair<std::string, std::string>> lora_parameter_names(const torch::nn::Sequential& model);

/// Writes a PEFT adapter directory: adapter_config.json and adapter_model.safetensors (atomic
/// files). `base_model` is recorded as base_model_name_or_path.
void save_lora_adapter(const torch::nn::Sequential& model, const ModelConfig& config, const LoraOptions& options,
                       const std::string& dir, const std::string& base_model = "");
/// The same from RoundPipe: synchronizes and saves the adapters' master weights.
void save_lora_adapter(RoundPipe& model, const ModelConfig& config, const LoraOptions& options,
                       const std::string& dir, const std::string& base_model = "");

/// Reads a PEFT adapter directory (LoRA only: peft_type LORA, no DoRA/rsLoRA/bias training, a list
/// of target_modules, optionally target_parameters on MoE experts), applies LoRA to `model` with
/// its options and loads its weights (converted to the model's dtype). Errors name the key or tensor. Returns the options it applied.
LoraOptions load_lora_adapter(torch::nn::Sequential& model, const ModelConfig& config, const std::string& dir);

/// Folds every adapter into its base weight (W += B A * alpha / rank) and removes the adapters,
/// like PEFT's merge_and_unload. requires_grad flags of the base weights are left as they are.
void merge_lora(torch::nn::Sequential& model);

}  // namespace roundpipe::models
