// The cross-key rules of the launcher configuration (see config_schema.h): each checks one
// combination of keys after all keys have been parsed and throws ConfigError naming them.
#include <algorithm>
#include <nlohmann/json.hpp>

#include "roundpipe/launcher/atomic_file.h"
#include "roundpipe/launcher/detail/config_schema.h"
#include "roundpipe/launcher/detail/yaml_value.h"
#include "roundpipe/models/model_config.h"

namespace roundpipe::launcher::detail {
namespace {

using C = LauncherConfig;

std::string quoted(const std::string& s) { return "'" + s + "'"; }

std::optional<int64_t> model_vocab_size(const LauncherConfig& c) {
  nlohmann::json config = nlohmann::json::parse(resolved_model_config_json(c));
  auto it = config.find("vocab_size");
  if (it != config.end() && it->is_number_integer()) {
    return it->get<int64_t>();
  }
  return std::nullopt;
}

std::vector<Rule> build_rules() {
  std::vector<Rule> r;
  r.push_back({"Exactly one of `model.pretrained` and `model.preset` is set.", [](const C& c) {
                 if (c.model.pretrained.empty() && !c.model.preset) {
                   config_fail("model", "{pretrained: null, preset: null}",
                               "set model.pretrained (a Hugging Face checkpoint directory) or "
                               "model.preset (llama or qwen3, to train from scratch)");
                 }
                 if (!c.model.pretrained.empty() && c.model.preset) {
                   config_fail("model.preset", models::model_type_name(*c.model.preset),
                               "model.pretrained is set too (" + quoted(c.model.pretrained) +
                                   "): set only one of them (the architecture of a pretrained "
                                   "model comes from its config.json)");
                 }
               }});
  r.push_back({"`model.pretrained` is a directory holding config.json.", [](const C& c) {
                 if (c.model.pretrained.empty()) {
                   return;
                 }
                 if (!is_directory(c.model.pretrained)) {
                   config_fail("model.pretrained", quoted(c.model.pretrained),
                               "directory not found: download the checkpoint (config.json + "
                               "*.safetensors) there or fix the path");
                 }
                 if (!is_regular_file(join_path(c.model.pretrained, "config.json"))) {
                   config_fail("model.pretrained", quoted(c.model.pretrained),
                               "the directory holds no config.json: point it at a Hugging Face "
                               "checkpoint directory");
                 }
               }});
  r.push_back({"`model.lora` requires `model.pretrained` (LoRA adapts a pretrained model).", [](const C& c) {
                 if (c.model.lora && c.model.pretrained.empty()) {
                   config_fail("model.lora", "{rank: " + std::to_string(c.model.lora->rank) + ", ...}",
                               "LoRA fine-tunes a pretrained model but model.pretrained is not "
                               "set: set it, or remove model.lora to train all weights");
                 }
               }});
  r.push_back(
      {"`model.lora.targets` names projections of the presets (q_proj, k_proj, v_proj, o_proj, "
       "gate_proj, up_proj, down_proj) or is `all-linear`; `model.lora.adapter`, when set, is a "
       "directory holding adapter_config.json.",
       [](const C& c) {
         if (!c.model.lora) {
           return;
         }
         const std::vector<std::string> known = {"q_proj",    "k_proj",  "v_proj",    "o_proj",
                                                 "gate_proj", "up_proj", "down_proj", "all-linear"};
         for (const std::string& target : c.model.lora->targets) {
           if (std::find(known.begin(), known.end(), target) == known.end()) {
             config_fail("model.lora.targets", quoted(target),
                         "not a Linear module of the Llama/Mistral/Qwen3 models; available: "
                         "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj (or "
                         "all-linear for all of them)");
           }
         }
         const std::string& adapter = c.model.lora->adapter;
         if (!adapter.empty() && !is_regular_file(join_path(adapter, "adapter_config.json"))) {
           config_fail("model.lora.adapter", quoted(adapter),
                       "no adapter_config.json there: point it at a PEFT adapter directory "
                       "(a LoRA checkpoint of `roundpipe train` or `roundpipe export` output)");
         }
       }});
  r.push_back(
      {"`model.master_dtype` is float32, or bfloat16 with `model.dtype: bfloat16`, `optimizer.name: "
       "adam`/`adamw` and `run.step_mode: sync` (the bf16 compute copies are the masters); "
       "`optimizer.kahan_sum: true` compensates them, without it `roundpipe train` warns that small "
       "updates are lost (plain bf16 weights, as torchtune's bf16 training).",
       [](const C& c) {
         const std::string given = models::dtype_name(c.model.master_dtype);
         if (c.model.master_dtype == c10::kFloat) return;
         if (c.model.master_dtype != c10::kBFloat16) {
           config_fail("model.master_dtype", given,
                       "master weights must be float32, or bfloat16 (with optimizer.kahan_sum; float16 "
                       "masters lose small updates and overflow); keep master_dtype: float32 and set "
                       "model.dtype for lower-precision compute");
         }
         const bool adam = c.optimizer.name == OptimizerName::kAdam || c.optimizer.name == OptimizerName::kAdamW;
         if (!adam) {
           config_fail("model.master_dtype", given,
                       std::string("bf16 masters are updated by adam / adamw only (optimizer.name is ") +
                           optimizer_name(c.optimizer.name) + "): use adamw, or master_dtype: float32");
         }
         if (c.model.dtype != c10::kBFloat16) {
           config_fail("model.master_dtype", given,
                       "bf16 masters are the compute copies themselves, so model.dtype must be bfloat16 "
                       "too (it is " +
                           models::dtype_name(c.model.dtype) + ")");
         }
         if (c.run.step_mode != StepMode::kSync) {
           config_fail("model.master_dtype", given,
                       "bf16 masters are the compute copies themselves, which an async step would update "
                       "while the next iteration computes with them: set run.step_mode: sync");
         }
       }});
  r.push_back(
      {"`optimizer.kahan_sum` compensates bf16 masters: it needs `model.master_dtype: bfloat16`.", [](const C& c) {
         if (c.optimizer.kahan_sum && c.model.master_dtype != c10::kBFloat16) {
           config_fail("optimizer.kahan_sum", "true",
                       "Kahan compensation applies to bfloat16 master weights, model.master_dtype is " +
                           models::dtype_name(c.model.master_dtype) +
                           ": remove kahan_sum, or set master_dtype: bfloat16");
         }
       }});
  r.push_back(
      {"Formats `tokens` and `bytes` need `data.train`, an existing file; `data.valid`, "
       "when set, exists too. `synthetic` takes no files.",
       [](const C& c) {
         const bool synthetic = c.data.format == DataFormat::kSynthetic;
         for (const auto& [path, value] : {std::pair<const char*, const std::string*>{"data.train", &c.data.train},
                                           {"data.valid", &c.data.valid}}) {
           if (synthetic) {
             if (!value->empty()) {
               config_fail(path, quoted(*value),
                           "data.format is synthetic (generated data, no files): remove " + std::string(path) +
                               " or set data.format to tokens, bytes or chat");
             }
             continue;
           }
           if (value->empty()) {
             if (std::string(path) == "data.train") {
               config_fail(path, "null",
                           std::string("data.format ") + data_format_name(c.data.format) +
                               " needs a training file: set data.train, or use "
                               "data.format: synthetic");
             }
             continue;
           }
           if (!is_regular_file(*value)) {
             config_fail(path, quoted(*value),
                         "file not found" +
                             std::string(c.data.format == DataFormat::kTokens
                                             ? ": make token files with scripts/prepare_data.py"
                                             : "") +
                             " (relative paths start at the working directory)");
           }
         }
       }});
  r.push_back(
      {"`chat` data needs `model.pretrained` (its tokenizer.json and chat template); "
       "`data.train_on` and `data.packing` are for `chat` only.",
       [](const C& c) {
         if (c.data.format != DataFormat::kChat) {
           if (c.data.train_on != models::ChatTrainOn::kAssistant) {
             config_fail("data.train_on", train_on_name(c.data.train_on),
                         std::string("only chat data has turns to choose from (data.format is ") +
                             data_format_name(c.data.format) + "): remove data.train_on");
           }
           if (c.data.packing) {
             config_fail("data.packing", "true",
                         std::string("packing applies to chat data (data.format is ") +
                             data_format_name(c.data.format) +
                             "; token streams are already cut into full windows): remove data.packing");
           }
           return;
         }
         if (c.model.pretrained.empty()) {
           config_fail("data.format", "chat",
                       "chat data is rendered with the model's chat template and tokenizer, "
                       "read from model.pretrained (tokenizer.json, chat_template.jinja or "
                       "tokenizer_config.json): set model.pretrained to a Hugging Face model "
                       "directory");
         }
         if (!is_regular_file(join_path(c.model.pretrained, "tokenizer.json"))) {
           config_fail("model.pretrained", quoted(c.model.pretrained),
                       "chat data needs the model's tokenizer.json in that directory (save it with "
                       "transformers' tokenizer.save_pretrained(DIR))");
         }
       }});
  r.push_back(
      {"`data.vocab_size` is for `synthetic` only, which needs it or the model's "
       "vocab_size (model.config or the pretrained config.json).",
       [](const C& c) {
         if (c.data.format != DataFormat::kSynthetic) {
           if (c.data.vocab_size) {
             config_fail("data.vocab_size", std::to_string(*c.data.vocab_size),
                         std::string("only synthetic data takes a vocab_size (data.format "
                                     "is ") +
                             data_format_name(c.data.format) + "): remove it; the model's vocab_size applies");
           }
           return;
         }
         if (!c.data.vocab_size && !model_vocab_size(c)) {
           config_fail("data.vocab_size", "null",
                       "synthetic data needs a vocabulary: set data.vocab_size or "
                       "model.config.vocab_size");
         }
       }});
  r.push_back(
      {"The data's tokens fit the model's vocabulary: `bytes` needs a model vocab_size >= "
       "256, `synthetic` a data.vocab_size <= the model's.",
       [](const C& c) {
         std::optional<int64_t> model_vocab = model_vocab_size(c);
         std::optional<int64_t> data_vocab = data_vocab_size(c);
         if (model_vocab && data_vocab && *data_vocab > *model_vocab) {
           const bool bytes = c.data.format == DataFormat::kBytes;
           config_fail(bytes ? "data.format" : "data.vocab_size", bytes ? "bytes" : std::to_string(*data_vocab),
                       "the data has " + std::to_string(*data_vocab) +
                           " distinct tokens but the model's vocab_size is " + std::to_string(*model_vocab) +
                           ": raise model.config.vocab_size" + (bytes ? std::string() : " or lower data.vocab_size"));
         }
       }});
  r.push_back({"`schedule.min_lr` <= `optimizer.lr`.", [](const C& c) {
                 if (c.schedule.min_lr > c.optimizer.lr) {
                   config_fail("schedule.min_lr", format_double(c.schedule.min_lr),
                               "above optimizer.lr = " + format_double(c.optimizer.lr) +
                                   ": the decay goes down to min_lr; lower it");
                 }
               }});
  r.push_back(
      {"`optimizer.momentum` is for `sgd` only (0 otherwise; Adam's momentum is "
       "`betas[0]`).",
       [](const C& c) {
         if (c.optimizer.momentum != 0 && c.optimizer.name != OptimizerName::kSgd) {
           config_fail("optimizer.momentum", format_double(c.optimizer.momentum),
                       std::string("momentum applies to sgd only, optimizer.name is ") +
                           optimizer_name(c.optimizer.name) + ": remove it (use optimizer.betas for Adam)");
         }
       }});
  r.push_back({"`optimizer.state_dtype: int8` is for `adam` / `adamw` only.", [](const C& c) {
                 const bool adam =
                     c.optimizer.name == OptimizerName::kAdam || c.optimizer.name == OptimizerName::kAdamW;
                 if (c.optimizer.state_dtype == OptimizerStateDtype::kInt8 && !adam) {
                   config_fail("optimizer.state_dtype", "int8",
                               std::string("8-bit states exist for adam and adamw only, optimizer.name is ") +
                                   optimizer_name(c.optimizer.name) + ": use adamw, or state_dtype: float32");
                 }
               }});
  r.push_back(
      {"`eval.every` > 0 and `eval.at_start` need evaluation data: `data.valid`, or `synthetic` data.", [](const C& c) {
         if (c.eval.at_start && c.data.valid.empty() && c.data.format != DataFormat::kSynthetic) {
           config_fail("eval.at_start", "true",
                       "there is no evaluation data: set data.valid (or remove eval.at_start)");
         }
         if (c.eval.every > 0 && c.data.valid.empty() && c.data.format != DataFormat::kSynthetic) {
           config_fail("eval.every", std::to_string(c.eval.every),
                       "evaluation needs data.valid: set it, or set eval.every: 0");
         }
       }});
  r.push_back(
      {"`amp.scaler` with a `model.dtype` other than float16 is allowed (the scale then "
       "rarely changes).",
       [](const C&) {}});
  return r;
}

}  // namespace

const std::vector<Rule>& config_rules() {
  static const std::vector<Rule> rules = build_rules();
  return rules;
}

}  // namespace roundpipe::launcher::detail
