#include "roundpipe/models/lora.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <iterator>
#include <map>
#include <set>
#include <sstream>

#include "roundpipe/models/detail/files.h"
#include "roundpipe/models/layers.h"
#include "roundpipe/models/pretrained.h"
#include "roundpipe/models/safetensors.h"
#include "roundpipe/round_pipe.h"

namespace roundpipe::models {
namespace {

const std::set<std::string>& supported_targets() {
  static const std::set<std::string> names = {"q_proj", "k_proj", "v_proj", "o_proj",
                                              "gate_proj", "up_proj", "down_proj"};
  return names;
}

std::string last_component(const std::string& name) {
  const auto dot = name.rfind('.');
  return dot == std::string::npos ? name : name.substr(dot + 1);
}

std::string join(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& n : names) out += (out.empty() ? "" : ", ") + n;
  return out;
}

// PEFT's key of a model parameter: "base_model.model." + its HF name.
constexpr const char* kPeftPrefix = "base_model.model.";

// PEFT's lora_A init: torch.nn.init.kaiming_uniform_(w, a=sqrt(5)), i.e. U(-b, b) with
// b = sqrt(6 / ((1 + a^2) fan_in)) = 1 / sqrt(fan_in).
void kaiming_uniform_sqrt5(at::Tensor& w) {
  const double bound = 1.0 / std::sqrt(static_cast<double>(w.size(1)));
  at::NoGradGuard no_grad;
  w.uniform_(-bound, bound);
}

// The adapted Linear modules of `model`, by their Sequential names ("1.self_attn.q_proj").
std::vector<std::pair<std::string, std::shared_ptr<LinearImpl>>> lora_linears(const torch::nn::Sequential& model) {
  std::vector<std::pair<std::string, std::shared_ptr<LinearImpl>>> out;
  for (const auto& item : model->named_modules("", /*include_self=*/false)) {
    auto linear = std::dynamic_pointer_cast<LinearImpl>(item.value());
    if (linear && linear->has_lora()) out.emplace_back(item.key(), linear);
  }
  return out;
}

void write_adapter_dir(std::vector<std::pair<std::string, at::Tensor>> tensors, const LoraOptions& options,
                       const std::string& dir, const std::string& base_model) {
  TORCH_CHECK(!tensors.empty(), "save_lora_adapter: the model has no LoRA adapters (call apply_lora first)");
  nlohmann::ordered_json config = {
      {"peft_type", "LORA"},
      {"task_type", "CAUSAL_LM"},
      {"base_model_name_or_path", base_model.empty() ? nullptr : nlohmann::ordered_json(base_model)},
      {"r", options.rank()},
      {"lora_alpha", options.alpha()},
      {"lora_dropout", options.dropout()},
      {"target_modules", options.target_modules()},
      {"bias", "none"},
      {"fan_in_fan_out", false},
      {"init_lora_weights", true},
      {"inference_mode", true},
      {"modules_to_save", nullptr},
      {"use_rslora", false},
      {"use_dora", false},
      {"layers_to_transform", nullptr},
      {"rank_pattern", nlohmann::ordered_json::object()},
      {"alpha_pattern", nlohmann::ordered_json::object()},
  };
  detail::make_directory(dir);
  save_safetensors(dir + "/adapter_model.safetensors", tensors, {{"format", "pt"}});
  detail::write_text_atomically(dir + "/adapter_config.json", config.dump(2) + "\n");
}

}  // namespace

int64_t apply_lora(torch::nn::Sequential& model, const LoraOptions& options) {
  TORCH_CHECK(!options.target_modules().empty(), "LoraOptions::target_modules is empty; name at least one of ",
              "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj");
  for (const auto& t : options.target_modules()) {
    TORCH_CHECK(supported_targets().count(t), "LoraOptions::target_modules: '", t, "' is not supported; use ",
                "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj or down_proj");
  }
  TORCH_CHECK(options.rank() > 0, "LoraOptions::rank must be > 0, got ", options.rank());
  const std::set<std::string> targets(options.target_modules().begin(), options.target_modules().end());
  // PEFT freezes the base model first, then adds trainable adapters.
  for (auto& p : model->parameters()) p.requires_grad_(false);
  int64_t adapted = 0;
  for (const auto& item : model->named_modules("", /*include_self=*/false)) {
    auto linear = std::dynamic_pointer_cast<LinearImpl>(item.value());
    if (!linear || !targets.count(last_component(item.key()))) continue;
    linear->enable_lora(options.rank(), options.alpha(), options.dropout());
    kaiming_uniform_sqrt5(linear->lora_A->weight);
    {
      at::NoGradGuard no_grad;
      linear->lora_B->weight.zero_();
    }
    linear->lora_A->weight.requires_grad_(true);
    linear->lora_B->weight.requires_grad_(true);
    ++adapted;
  }
  TORCH_CHECK(adapted > 0, "apply_lora: no Linear module of the model is named ", join(options.target_modules()));
  return adapted;
}

std::vector<std::pair<std::string, at::Tensor>> lora_state_dict(const torch::nn::Sequential& model,
                                                                const ModelConfig& config) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& [name, linear] : lora_linears(model)) {
    const std::string hf = hf_parameter_name(name + ".x", config.num_hidden_layers);
    const std::string base = kPeftPrefix + hf.substr(0, hf.size() - 2);
    out.emplace_back(base + ".lora_A.weight", linear->lora_A->weight.detach());
    out.emplace_back(base + ".lora_B.weight", linear->lora_B->weight.detach());
  }
  return out;
}

void save_lora_adapter(const torch::nn::Sequential& model, const ModelConfig& config, const LoraOptions& options,
                       const std::string& dir, const std::string& base_model) {
  write_adapter_dir(lora_state_dict(model, config), options, dir, base_model);
}

void save_lora_adapter(RoundPipe& model, const ModelConfig& config, const LoraOptions& options,
                       const std::string& dir, const std::string& base_model) {
  model.synchronize();
  auto tensors = lora_state_dict(model.module(), config);
  std::map<std::string, at::Tensor> masters;
  for (const auto& [name, master] : model.optim_named_parameters()) {
    masters[kPeftPrefix + hf_parameter_name(name, config.num_hidden_layers)] = master;
  }
  for (auto& [name, tensor] : tensors) {
    auto it = masters.find(name);
    if (it != masters.end()) tensor = it->second.detach();
  }
  write_adapter_dir(std::move(tensors), options, dir, base_model);
}

LoraOptions load_lora_adapter(torch::nn::Sequential& model, const ModelConfig& config, const std::string& dir) {
  const std::string config_path = dir + "/adapter_config.json";
  std::ifstream in(config_path);
  TORCH_CHECK(in.good(), "load_lora_adapter: cannot read ", config_path, " (is ", dir, " a PEFT adapter directory?)");
  nlohmann::json json;
  try {
    json = nlohmann::json::parse(std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()));
  } catch (const std::exception& e) {
    TORCH_CHECK(false, config_path, ": not valid JSON: ", e.what());
  }
  auto key = [&](const char* name) -> const nlohmann::json& {
    TORCH_CHECK(json.contains(name), config_path, ": missing key \"", name, "\"");
    return json.at(name);
  };
  TORCH_CHECK(key("peft_type") == "LORA", config_path, ": peft_type is ", key("peft_type").dump(),
              "; only LORA adapters are supported");
  for (const char* flag : {"use_dora", "use_rslora"}) {
    TORCH_CHECK(!json.contains(flag) || json.at(flag).is_null() || json.at(flag) == false, config_path, ": ", flag,
                " = ", json.at(flag).dump(), " is not supported");
  }
  TORCH_CHECK(!json.contains("bias") || json.at("bias") == "none", config_path, ": bias = ", json.value("bias", ""),
              " is not supported (only \"none\")");
  for (const char* pattern : {"rank_pattern", "alpha_pattern"}) {
    TORCH_CHECK(!json.contains(pattern) || json.at(pattern).is_null() || json.at(pattern).empty(), config_path,
                ": a non-empty ", pattern, " is not supported");
  }
  const auto& targets = key("target_modules");
  TORCH_CHECK(targets.is_array(), config_path, ": target_modules = ", targets.dump(),
              " must be a list of module names (regular expressions are not supported)");
  LoraOptions options;
  try {
    options.rank(key("r").get<int64_t>());
    options.alpha(key("lora_alpha").get<double>());
    options.dropout(json.value("lora_dropout", 0.0));
    options.target_modules(targets.get<std::vector<std::string>>());
  } catch (const nlohmann::json::exception& e) {
    TORCH_CHECK(false, config_path, ": ", e.what());
  }
  apply_lora(model, options);
  auto file = SafetensorsFile::open(dir + "/adapter_model.safetensors");
  std::set<std::string> unused;
  for (const auto& name : file->names()) unused.insert(name);
  at::NoGradGuard no_grad;
  for (const auto& [name, linear] : lora_linears(model)) {
    const std::string hf = hf_parameter_name(name + ".x", config.num_hidden_layers);
    const std::string base = kPeftPrefix + hf.substr(0, hf.size() - 2);
    for (const auto& [suffix, weight] : {std::make_pair(std::string(".lora_A.weight"), linear->lora_A->weight),
                                         std::make_pair(std::string(".lora_B.weight"), linear->lora_B->weight)}) {
      const std::string key_name = base + suffix;
      TORCH_CHECK(file->contains(key_name), dir, "/adapter_model.safetensors has no tensor \"", key_name, "\"");
      const at::Tensor source = file->get(key_name);
      TORCH_CHECK(source.sizes() == weight.sizes(), "adapter tensor \"", key_name, "\" has shape ", source.sizes(),
                  " but the model's is ", weight.sizes(), " (another rank or model shape?)");
      weight.copy_(source);
      unused.erase(key_name);
    }
  }
  TORCH_CHECK(unused.empty(), dir, "/adapter_model.safetensors has tensors the model does not use, e.g. \"",
              unused.empty() ? "" : *unused.begin(), "\" (adapter for another architecture or targets?)");
  return options;
}

void merge_lora(torch::nn::Sequential& model) {
  for (const auto& [name, linear] : lora_linears(model)) linear->merge_lora();
}

}  // namespace roundpipe::models
