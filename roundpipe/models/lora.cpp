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
#include <tuple>

#include "roundpipe/models/detail/files.h"
#include "roundpipe/models/layers.h"
#include "roundpipe/models/moe.h"
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

// The decoder layers of a preset Sequential: [Embedding, layers..., LmHead].
int64_t decoder_layers(const torch::nn::Sequential& model) { return static_cast<int64_t>(model->size()) - 2; }

// Adapter names come from the model's layer indices; they must be the config's.
void check_layer_count(const torch::nn::Sequential& model, const ModelConfig& config, const char* caller) {
  TORCH_CHECK(decoder_layers(model) == config.num_hidden_layers, caller, ": the model has ", decoder_layers(model),
              " decoder layers but the config ", config.num_hidden_layers);
}

// One adapter weight: its parameter name in the Sequential, its PEFT key, the tensor.
struct LoraEntry {
  std::string sequential_name;
  std::string peft_name;
  at::Tensor weight;
};

// Every adapter weight of `model` in module order. Expert adapters are named as PEFT nests its
// ParamWrappers on one experts module: it wraps the targeted weights in registration order
// (gate_up_proj, then down_proj), each wrapper around the previous one, so the first targeted
// weight's factors sit under one "base_layer." per later target.
std::vector<LoraEntry> lora_entries(const torch::nn::Sequential& model) {
  const int64_t layers = decoder_layers(model);
  std::vector<LoraEntry> out;
  for (const auto& item : model->named_modules("", /*include_self=*/false)) {
    if (auto linear = std::dynamic_pointer_cast<LinearImpl>(item.value()); linear && linear->has_lora()) {
      const std::string hf = hf_parameter_name(item.key() + ".x", layers);
      const std::string base = kPeftPrefix + hf.substr(0, hf.size() - 2);
      out.push_back({item.key() + ".lora_A.weight", base + ".lora_A.weight", linear->lora_A->weight});
      out.push_back({item.key() + ".lora_B.weight", base + ".lora_B.weight", linear->lora_B->weight});
      continue;
    }
    auto experts = std::dynamic_pointer_cast<ExpertsImpl>(item.value());
    if (!experts || !experts->has_lora()) continue;
    const std::string hf = hf_parameter_name(item.key() + ".x", layers);
    const std::string base = kPeftPrefix + hf.substr(0, hf.size() - 2);
    const bool both = experts->lora_A_gate_up_proj.defined() && experts->lora_A_down_proj.defined();
    for (const auto& [target, a, b] :
         {std::make_tuple(std::string("gate_up_proj"), experts->lora_A_gate_up_proj, experts->lora_B_gate_up_proj),
          std::make_tuple(std::string("down_proj"), experts->lora_A_down_proj, experts->lora_B_down_proj)}) {
      if (!a.defined()) continue;
      const std::string prefix = base + (both && target == "gate_up_proj" ? ".base_layer" : "");
      out.push_back({item.key() + ".lora_A_" + target, prefix + ".lora_A.weight", a});
      out.push_back({item.key() + ".lora_B_" + target, prefix + ".lora_B.weight", b});
    }
  }
  return out;
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// PEFT's target_parameters match: the parameter's full name equals the target or ends with
// "." + target.
bool matches_parameter(const std::string& hf_name, const std::string& target) {
  return hf_name == target || ends_with(hf_name, "." + target);
}

// Adds expert adapters for options.target_parameters; returns how many expert weights it adapted.
int64_t apply_expert_lora(torch::nn::Sequential& model, const LoraOptions& options) {
  const auto& targets = options.target_parameters();
  if (targets.empty()) return 0;
  for (const auto& t : targets) {
    TORCH_CHECK(!(ends_with(t, "gate.weight") || ends_with(t, "router.weight") || ends_with(t, "router.bias")),
                "LoraOptions::target_parameters: '", t, "' is the router; RoundPipe never adapts the router (a "
                "trained router changes which experts see which tokens). Target the experts: gate_up_proj, down_proj");
  }
  TORCH_CHECK(options.dropout() == 0, "LoraOptions::target_parameters needs dropout 0, got ", options.dropout(),
              " (as PEFT: dropout cannot be applied to a weight update, only to a layer input)");
  const int64_t layers = decoder_layers(model);
  std::set<std::string> unmatched(targets.begin(), targets.end());
  int64_t adapted = 0, sparse_layers = 0;
  for (const auto& item : model->named_modules("", /*include_self=*/false)) {
    auto experts = std::dynamic_pointer_cast<ExpertsImpl>(item.value());
    if (!experts) continue;
    ++sparse_layers;
    bool hit[2] = {false, false};
    const char* names[2] = {"gate_up_proj", "down_proj"};
    for (int w = 0; w < 2; ++w) {
      const std::string hf = hf_parameter_name(item.key() + "." + names[w], layers);
      for (const auto& t : targets) {
        if (!matches_parameter(hf, t)) continue;
        hit[w] = true;
        unmatched.erase(t);
      }
    }
    if (!hit[0] && !hit[1]) continue;
    experts->enable_lora(hit[0], hit[1], options.rank(), options.alpha());
    at::NoGradGuard no_grad;
    for (auto [a, b] : {std::pair(&experts->lora_A_gate_up_proj, &experts->lora_B_gate_up_proj),
                        std::pair(&experts->lora_A_down_proj, &experts->lora_B_down_proj)}) {
      if (!a->defined()) continue;
      kaiming_uniform_sqrt5(*a);  // PEFT: lora_A is a Linear(in, E r), lora_B starts at zero
      b->zero_();
      a->requires_grad_(true);
      b->requires_grad_(true);
    }
    adapted += (hit[0] ? 1 : 0) + (hit[1] ? 1 : 0);
  }
  TORCH_CHECK(sparse_layers > 0, "LoraOptions::target_parameters (", join(targets), ") adapt the experts of a ",
              "mixture-of-experts model, and this model has none; use target_modules");
  TORCH_CHECK(unmatched.empty(), "LoraOptions::target_parameters: '", *unmatched.begin(), "' matches no expert ",
              "weight of the model; use gate_up_proj or down_proj, optionally with a layer prefix such as ",
              "3.mlp.experts.gate_up_proj");
  return adapted;
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
      {"target_parameters", options.target_parameters().empty()
                                ? nlohmann::ordered_json(nullptr)
                                : nlohmann::ordered_json(options.target_parameters())},
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
  TORCH_CHECK(!options.target_modules().empty() || !options.target_parameters().empty(),
              "LoraOptions::target_modules is empty; name at least one of ",
              "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj (or expert target_parameters)");
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
  TORCH_CHECK(adapted > 0 || options.target_modules().empty(), "apply_lora: no Linear module of the model is named ",
              join(options.target_modules()));
  return adapted + apply_expert_lora(model, options);
}

std::vector<std::pair<std::string, at::Tensor>> lora_state_dict(const torch::nn::Sequential& model,
                                                                const ModelConfig& config) {
  check_layer_count(model, config, "lora_state_dict");
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& e : lora_entries(model)) out.emplace_back(e.peft_name, e.weight.detach());
  return out;
}

std::vector<std::pair<std::string, std::string>> lora_parameter_names(const torch::nn::Sequential& model) {
  std::vector<std::pair<std::string, std::string>> out;
  for (const auto& e : lora_entries(model)) out.emplace_back(e.sequential_name, e.peft_name);
  return out;
}

void save_lora_adapter(const torch::nn::Sequential& model, const ModelConfig& config, const LoraOptions& options,
                       const std::string& dir, const std::string& base_model) {
  write_adapter_dir(lora_state_dict(model, config), options, dir, base_model);
}

void save_lora_adapter(RoundPipe& model, const ModelConfig& config, const LoraOptions& options,
                       const std::string& dir, const std::string& base_model) {
  model.synchronize();
  check_layer_count(model.module(), config, "save_lora_adapter");
  std::map<std::string, at::Tensor> masters;
  for (const auto& [name, master] : model.optim_named_parameters()) masters[name] = master;
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const auto& e : lora_entries(model.module())) {
    auto it = masters.find(e.sequential_name);
    tensors.emplace_back(e.peft_name, (it != masters.end() ? it->second : e.weight).detach());
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
  TORCH_CHECK(targets.is_array() || (targets.is_null() && json.contains("target_parameters")), config_path,
              ": target_modules = ", targets.dump(),
              " must be a list of module names (regular expressions are not supported)");
  const nlohmann::json parameters = json.value("target_parameters", nlohmann::json());
  TORCH_CHECK(parameters.is_null() || parameters.is_array(), config_path, ": target_parameters = ", parameters.dump(),
              " must be a list of parameter names or null");
  LoraOptions options;
  try {
    options.rank(key("r").get<int64_t>());
    options.alpha(key("lora_alpha").get<double>());
    options.dropout(json.value("lora_dropout", 0.0));
    options.target_modules(targets.is_null() ? std::vector<std::string>{} : targets.get<std::vector<std::string>>());
    if (!parameters.is_null()) options.target_parameters(parameters.get<std::vector<std::string>>());
  } catch (const nlohmann::json::exception& e) {
    TORCH_CHECK(false, config_path, ": ", e.what());
  }
  apply_lora(model, options);
  auto file = SafetensorsFile::open(dir + "/adapter_model.safetensors");
  std::set<std::string> unused;
  for (const auto& name : file->names()) unused.insert(name);
  at::NoGradGuard no_grad;
  check_layer_count(model, config, "load_lora_adapter");
  for (auto& e : lora_entries(model)) {
    TORCH_CHECK(file->contains(e.peft_name), dir, "/adapter_model.safetensors has no tensor \"", e.peft_name, "\"");
    const at::Tensor source = file->get(e.peft_name);
    TORCH_CHECK(source.sizes() == e.weight.sizes(), "adapter tensor \"", e.peft_name, "\" has shape ", source.sizes(),
                " but the model's is ", e.weight.sizes(), " (another rank or model shape?)");
    e.weight.copy_(source);
    unused.erase(e.peft_name);
  }
  TORCH_CHECK(unused.empty(), dir, "/adapter_model.safetensors has tensors the model does not use, e.g. \"",
              unused.empty() ? "" : *unused.begin(), "\" (adapter for another architecture or targets?)");
  return options;
}

void merge_lora(torch::nn::Sequential& model) {
  for (const auto& [name, linear] : lora_linears(model)) linear->merge_lora();
  for (const auto& item : model->named_modules("", /*include_self=*/false)) {
    if (auto experts = std::dynamic_pointer_cast<ExpertsImpl>(item.value())) experts->merge_lora();
  }
}

}  // namespace roundpipe::models
