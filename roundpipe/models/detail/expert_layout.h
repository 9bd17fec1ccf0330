// The two on-disk layouts of mixture-of-experts weights (internal to pretrained.cpp): transformers
// 5 keeps an MoE layer's experts fused in memory (mlp.experts.gate_up_proj [E, 2I, H],
// mlp.experts.down_proj [E, H, I]), which is also what our parameters are, while released
// checkpoints (and transformers' save_pretrained by default) hold one tensor per expert:
//   qwen3_moe: mlp.experts.{e}.gate_proj.weight [I, H], .up_proj.weight [I, H], .down_proj.weight [H, I]
//   mixtral:   block_sparse_moe.experts.{e}.w1.weight (gate), .w3.weight (up), .w2.weight (down),
//              and the router as block_sparse_moe.gate.weight (mlp.gate.weight in memory).
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <utility>
#include <vector>

#include "roundpipe/models/model_config.h"

namespace roundpipe::models::detail {

/// The per-expert checkpoint names that hold parameter `name` (an HF in-memory name such as
/// "model.layers.3.mlp.experts.gate_up_proj"), in the order assemble_experts takes them; empty
/// when the parameter is stored under its own name in both layouts.
std::vector<std::string> per_expert_names(const std::string& name, const ModelConfig& config);

/// gpt-oss's released (MXFP4) checkpoints: {name + "_blocks", name + "_scales"} for the expert
/// weights mlp.experts.gate_up_proj / down_proj of a gpt_oss config, else empty.
std::vector<std::string> mxfp4_names(const std::string& name, const ModelConfig& config);

/// The parameter `name` from its per-expert tensors (ordered as per_expert_names).
at::Tensor assemble_experts(const std::string& name, const std::vector<at::Tensor>& parts, const ModelConfig& config);

/// `tensors` (HF in-memory names) in the per-expert layout: fused expert tensors split per expert
/// (views, no copies), Mixtral's names mapped back. Tensors of dense models pass through.
std::vector<std::pair<std::string, at::Tensor>> to_per_expert_layout(
    std::vector<std::pair<std::string, at::Tensor>> tensors, const ModelConfig& config);

}  // namespace roundpipe::models::detail
