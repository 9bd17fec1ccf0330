#include "roundpipe/models/detail/expert_layout.h"

#include <ATen/ops/cat.h>
#include <ATen/ops/stack.h>
#include <c10/util/Exception.h>

namespace roundpipe::models::detail {
namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

enum class ExpertTensor { kNone, kGateUp, kDown, kRouter };

// Splits "model.layers.{i}.mlp.<rest>" into its layer prefix "model.layers.{i}." and the kind.
ExpertTensor classify(const std::string& name, const ModelConfig& config, std::string* prefix) {
  // gpt-oss checkpoints hold the fused tensors under the parameters' own names.
  if (!config.is_moe() || config.architecture == Architecture::kGptOss || name.rfind("model.layers.", 0) != 0) {
    return ExpertTensor::kNone;
  }
  const size_t dot = name.find('.', 13);
  if (dot == std::string::npos) return ExpertTensor::kNone;
  *prefix = name.substr(0, dot + 1);
  const std::string rest = name.substr(dot + 1);
  if (rest == "mlp.experts.gate_up_proj") return ExpertTensor::kGateUp;
  if (rest == "mlp.experts.down_proj") return ExpertTensor::kDown;
  if (rest == "mlp.gate.weight" && config.architecture == Architecture::kMixtral) return ExpertTensor::kRouter;
  return ExpertTensor::kNone;
}

// The per-expert weight names of expert e: {gate, up, down}.
std::vector<std::string> expert_weight_names(const std::string& prefix, const ModelConfig& config, int64_t e) {
  if (config.architecture == Architecture::kMixtral) {
    const std::string base = prefix + "block_sparse_moe.experts." + std::to_string(e) + ".";
    return {base + "w1.weight", base + "w3.weight", base + "w2.weight"};
  }
  const std::string base = prefix + "mlp.experts." + std::to_string(e) + ".";
  return {base + "gate_proj.weight", base + "up_proj.weight", base + "down_proj.weight"};
}

}  // namespace

std::vector<std::string> mxfp4_names(const std::string& name, const ModelConfig& config) {
  if (config.architecture != Architecture::kGptOss || name.rfind("model.layers.", 0) != 0) return {};
  if (!ends_with(name, ".mlp.experts.gate_up_proj") && !ends_with(name, ".mlp.experts.down_proj")) return {};
  return {name + "_blocks", name + "_scales"};
}

std::vector<std::string> per_expert_names(const std::string& name, const ModelConfig& config) {
  std::string prefix;
  const ExpertTensor kind = classify(name, config, &prefix);
  std::vector<std::string> out;
  switch (kind) {
    case ExpertTensor::kNone:
      break;
    case ExpertTensor::kRouter:
      out.push_back(prefix + "block_sparse_moe.gate.weight");
      break;
    case ExpertTensor::kGateUp:
      for (int64_t e = 0; e < config.num_experts; ++e) {
        auto names = expert_weight_names(prefix, config, e);
        out.push_back(names[0]);
        out.push_back(names[1]);
      }
      break;
    case ExpertTensor::kDown:
      for (int64_t e = 0; e < config.num_experts; ++e) out.push_back(expert_weight_names(prefix, config, e)[2]);
      break;
  }
  return out;
}

at::Tensor assemble_experts(const std::string& name, const std::vector<at::Tensor>& parts, const ModelConfig& config) {
  std::string prefix;
  const ExpertTensor kind = classify(name, config, &prefix);
  TORCH_CHECK(parts.size() == per_expert_names(name, config).size() && !parts.empty(), "assemble_experts: ",
              parts.size(), " parts for ", name);
  if (kind == ExpertTensor::kRouter) return parts[0];
  if (kind == ExpertTensor::kDown) return at::stack(parts);
  std::vector<at::Tensor> experts;
  for (size_t e = 0; e + 1 < parts.size(); e += 2) {
    TORCH_CHECK(parts[e].sizes() == parts[e + 1].sizes(), "checkpoint: the gate and up weights of an expert of ", name,
                " differ in shape (", parts[e].sizes(), " vs ", parts[e + 1].sizes(), ")");
    experts.push_back(at::cat({parts[e], parts[e + 1]}, 0));
  }
  return at::stack(experts);
}

std::vector<std::pair<std::string, at::Tensor>> to_per_expert_layout(
    std::vector<std::pair<std::string, at::Tensor>> tensors, const ModelConfig& config) {
  if (!config.is_moe()) return tensors;
  std::vector<std::pair<std::string, at::Tensor>> out;
  out.reserve(tensors.size());
  for (auto& [name, tensor] : tensors) {
    const std::vector<std::string> names = per_expert_names(name, config);
    if (names.empty()) {
      out.emplace_back(std::move(name), std::move(tensor));
    } else if (names.size() == 1) {
      out.emplace_back(names[0], std::move(tensor));
    } else if (ends_with(name, "gate_up_proj")) {
      const int64_t inter = tensor.size(1) / 2;
      for (int64_t e = 0; e < tensor.size(0); ++e) {
        out.emplace_back(names[static_cast<size_t>(2 * e)], tensor[e].narrow(0, 0, inter));
        out.emplace_back(names[static_cast<size_t>(2 * e + 1)], tensor[e].narrow(0, inter, inter));
      }
    } else {
      for (int64_t e = 0; e < tensor.size(0); ++e) out.emplace_back(names[static_cast<size_t>(e)], tensor[e]);
    }
  }
  return out;
}

}  // namespace roundpipe::models::detail
