// The one table of launcher configuration keys (see config_schema.h); the rules are in
// config_rules.cpp.
#include "roundpipe/launcher/detail/config_schema.h"

#include <c10/util/Exception.h>

#include <cmath>
#include <cstdio>
#include <map>

#include "roundpipe/launcher/detail/config_error.h"
#include "roundpipe/models/architecture.h"

namespace roundpipe::launcher::detail {
namespace {

// Every architecture of the models module (architecture.h), in enum order: a new one is a preset
// without an edit here.
std::vector<std::string> preset_names() {
  std::vector<std::string> names;
  for (const models::ArchitectureTraits& row : models::all_architectures()) names.emplace_back(row.model_type);
  return names;
}

std::string number_text(double v) {
  char buffer[32];
  std::snprintf(buffer, sizeof(buffer), "%g", v);
  return buffer;
}

Bounds gt(double lo) { return Bounds{lo, true}; }
Bounds ge(double lo) { return Bounds{lo, false}; }
Bounds in_co(double lo, double hi) { return Bounds{lo, false, hi, true}; }
Bounds in_cc(double lo, double hi) { return Bounds{lo, false, hi, false}; }

// ---- Bindings between Value and struct fields ----------------------------------------------------

void assign(int64_t& field, const Value& v) { field = std::get<int64_t>(v); }
void assign(uint64_t& field, const Value& v) { field = static_cast<uint64_t>(std::get<int64_t>(v)); }
void assign(double& field, const Value& v) { field = std::get<double>(v); }
void assign(bool& field, const Value& v) { field = std::get<bool>(v); }
void assign(std::string& field, const Value& v) {
  field = std::holds_alternative<std::string>(v) ? std::get<std::string>(v) : "";
}
void assign(std::optional<int64_t>& field, const Value& v) {
  field = std::holds_alternative<int64_t>(v) ? std::optional<int64_t>(std::get<int64_t>(v)) : std::nullopt;
}
void assign(std::optional<double>& field, const Value& v) {
  field = std::holds_alternative<double>(v) ? std::optional<double>(std::get<double>(v)) : std::nullopt;
}
void assign(std::array<double, 2>& field, const Value& v) {
  const auto& pair = std::get<std::vector<double>>(v);
  field = {pair.at(0), pair.at(1)};
}
void assign(std::vector<std::string>& field, const Value& v) { field = std::get<std::vector<std::string>>(v); }

Value value_of(int64_t v) { return v; }
Value value_of(uint64_t v) { return static_cast<int64_t>(v); }
Value value_of(double v) { return v; }
Value value_of(bool v) { return v; }
Value value_of(const std::string& v) { return v; }
Value value_of(const std::optional<int64_t>& v) { return v ? Value(*v) : Value(); }
Value value_of(const std::optional<double>& v) { return v ? Value(*v) : Value(); }
Value value_of(const std::array<double, 2>& v) { return std::vector<double>{v[0], v[1]}; }
Value value_of(const std::vector<std::string>& v) { return v; }

/// Builder of one table row.
class Key {
 public:
  Key(std::string path, KeyKind kind, std::string default_yaml, std::string doc) {
    spec_.path = std::move(path);
    spec_.kind = kind;
    spec_.default_yaml = std::move(default_yaml);
    spec_.doc = std::move(doc);
  }
  Key& range(Bounds bounds) {
    spec_.bounds = bounds;
    return *this;
  }
  Key& one_of(std::vector<std::string> choices) {
    spec_.choices = std::move(choices);
    return *this;
  }
  Key& nullable() {
    spec_.nullable = true;
    return *this;
  }
  /// A top-level section: no field of its own.
  KeySpec section() { return spec_; }

  /// Binds to the field `field(config)` returns (a reference).
  template <class F>
  KeySpec field(F field) {
    const bool nullable = spec_.nullable;
    spec_.set = [field](LauncherConfig& c, const Value& v) { assign(field(c), v); };
    spec_.get = [field, nullable](const LauncherConfig& c) {
      Value v = value_of(field(const_cast<LauncherConfig&>(c)));
      // An empty optional string is unset: print it as null.
      if (nullable && std::holds_alternative<std::string>(v) && std::get<std::string>(v).empty()) {
        return Value();
      }
      return v;
    };
    return spec_;
  }

  /// Binds a choice to an enum field: choices[i] <-> values[i].
  template <class E, class F>
  KeySpec enum_field(F field, std::vector<E> values) {
    TORCH_INTERNAL_ASSERT(values.size() == spec_.choices.size(), spec_.path);
    std::vector<std::string> names = spec_.choices;
    spec_.set = [field, names, values](LauncherConfig& c, const Value& v) {
      const std::string& name = std::get<std::string>(v);
      for (size_t i = 0; i < names.size(); ++i) {
        if (names[i] == name) {
          field(c) = values[i];
          return;
        }
      }
    };
    spec_.get = [field, names, values](const LauncherConfig& c) -> Value {
      const E current = field(const_cast<LauncherConfig&>(c));
      for (size_t i = 0; i < values.size(); ++i) {
        if (values[i] == current) {
          return names[i];
        }
      }
      TORCH_INTERNAL_ASSERT(false, "enum value without a name in the config schema");
    };
    return spec_;
  }

  /// Custom binding.
  KeySpec custom(std::function<void(LauncherConfig&, const Value&)> set,
                 std::function<Value(const LauncherConfig&)> get) {
    spec_.set = std::move(set);
    spec_.get = std::move(get);
    return spec_;
  }

 private:
  KeySpec spec_;
};

using C = LauncherConfig;
const std::vector<std::string> kDtypes = {"float32", "bfloat16", "float16"};
const std::vector<c10::ScalarType> kDtypeValues = {c10::kFloat, c10::kBFloat16, c10::kHalf};

std::vector<KeySpec> build_schema() {
  std::vector<KeySpec> t;
  t.push_back(Key("out_dir", KeyKind::kString, "runs/example",
                  "Run directory: the resolved config.yaml, metrics.jsonl, loss.svg, train.log and "
                  "checkpoints/step-NNNNNN/ with the link checkpoints/latest. Created if missing.")
                  .field([](C& c) -> std::string& { return c.out_dir; }));

  // ---- model ----
  t.push_back(Key("model", KeyKind::kSection, "{}",
                  "The model: either `pretrained` (fine-tune a Hugging Face checkpoint) or `preset` "
                  "(a new model of that architecture, sized by `config`).")
                  .section());
  t.push_back(Key("model.pretrained", KeyKind::kString, "null",
                  "Directory of a Hugging Face checkpoint: config.json and *.safetensors weights.")
                  .nullable()
                  .field([](C& c) -> std::string& { return c.model.pretrained; }));
  t.push_back(Key("model.preset", KeyKind::kChoice, "null",
                  "Architecture of a model trained from scratch (random initial weights).")
                  .one_of(preset_names())
                  .nullable()
                  .custom(
                      [](C& c, const Value& v) {
                        c.model.preset = std::holds_alternative<std::string>(v)
                                             ? models::architecture_from_model_type(std::get<std::string>(v))
                                             : std::nullopt;
                      },
                      [](const C& c) -> Value {
                        if (!c.model.preset) return Value();
                        return std::string(models::model_type_name(*c.model.preset));
                      }));
  t.push_back(Key("model.config", KeyKind::kFreeMap, "{}",
                  "Hugging Face config.json keys (hidden_size, num_hidden_layers, "
                  "num_attention_heads, vocab_size, ...), handed to the model as JSON. With "
                  "`pretrained` they override the keys of its config.json.")
                  .field([](C& c) -> std::string& { return c.model.config_json; }));
  t.push_back(Key("model.dtype", KeyKind::kChoice, "float32",
                  "dtype of the weights and activations used in forward and backward.")
                  .one_of(kDtypes)
                  .enum_field([](C& c) -> c10::ScalarType& { return c.model.dtype; }, kDtypeValues));
  t.push_back(Key("model.master_dtype", KeyKind::kChoice, "float32",
                  "dtype of the weights the optimizer updates: `float32`, or `bfloat16` with "
                  "model.dtype bfloat16, adam / adamw and run.step_mode sync (the compute copies are "
                  "then the masters; add optimizer.kahan_sum: true, without it small updates are "
                  "lost and `train` warns; docs/optimizer.md, \"bf16 masters with Kahan "
                  "summation\"). Equal to model.dtype with sync steps, the masters are the compute "
                  "copies (no second copy).")
                  .one_of(kDtypes)
                  .enum_field([](C& c) -> c10::ScalarType& { return c.model.master_dtype; }, kDtypeValues));
  t.push_back(Key("model.lora", KeyKind::kSection, "null",
                  "LoRA adapters for fine-tuning `pretrained`: only the adapters train. Absent or "
                  "null: all weights train. `lora: {}` enables it with the defaults below.")
                  .nullable()
                  .custom(
                      [](C& c, const Value& v) {
                        if (std::holds_alternative<std::monostate>(v)) {
                          c.model.lora.reset();
                        } else if (!c.model.lora) {
                          c.model.lora.emplace();
                        }
                      },
                      [](const C& c) { return c.model.lora ? Value(true) : Value(); }));
  t.push_back(Key("model.lora.rank", KeyKind::kInt, "8", "Rank r of each adapter's update B A (PEFT's `r`).")
                  .range(ge(1))
                  .field([](C& c) -> int64_t& { return c.model.lora->rank; }));
  t.push_back(Key("model.lora.alpha", KeyKind::kFloat, "16.0",
                  "Scale of the update: the adapter adds (alpha / rank) B A x (PEFT's `lora_alpha`).")
                  .range(gt(0))
                  .field([](C& c) -> double& { return c.model.lora->alpha; }));
  t.push_back(Key("model.lora.dropout", KeyKind::kFloat, "0.0",
                  "Dropout on the adapters' input in training (PEFT's `lora_dropout`).")
                  .range(in_co(0, 1))
                  .field([](C& c) -> double& { return c.model.lora->dropout; }));
  t.push_back(Key("model.lora.targets", KeyKind::kStringList, "[q_proj, v_proj]",
                  "Linear layers that get adapters, by the last component of their module name "
                  "(PEFT's `target_modules`): q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, "
                  "down_proj, or `all-linear` for all seven (not lm_head, as in PEFT).")
                  .range(ge(1))
                  .field([](C& c) -> std::vector<std::string>& { return c.model.lora->targets; }));
  t.push_back(Key("model.lora.target_parameters", KeyKind::kStringList, "[]",
                  "Mixture-of-experts weights that get adapters, in PEFT's `target_parameters` "
                  "format: gate_up_proj and/or down_proj (every sparse layer's experts), or a "
                  "suffix of the HF name such as `3.mlp.experts.down_proj` (that layer only). "
                  "Needs `dropout: 0`; the router is never adapted. [] = none.")
                  .field([](C& c) -> std::vector<std::string>& { return c.model.lora->target_parameters; }));
  t.push_back(Key("model.lora.adapter", KeyKind::kString, "null",
                  "PEFT adapter directory (adapter_config.json + adapter_model.safetensors: a LoRA "
                  "checkpoint of `roundpipe train`, an export, or a PEFT save_pretrained) to start "
                  "from or to evaluate; its r, lora_alpha, lora_dropout and target_modules replace "
                  "the keys above. null: fresh adapters (PEFT's init, seeded by `train.seed`).")
                  .nullable()
                  .field([](C& c) -> std::string& { return c.model.lora->adapter; }));

  // ---- data ----
  t.push_back(Key("data", KeyKind::kSection, "{}", "Training and evaluation data.").section());
  t.push_back(Key("data.train", KeyKind::kString, "null",
                  "Training data file: a token file for `tokens` (scripts/prepare_data.py makes "
                  "one), any file for `bytes`, a JSONL file of conversations for `chat`. Not used "
                  "with `synthetic`.")
                  .nullable()
                  .field([](C& c) -> std::string& { return c.data.train; }));
  t.push_back(Key("data.valid", KeyKind::kString, "null",
                  "Evaluation data file in the same format; null: no evaluation data (`synthetic` "
                  "generates its own).")
                  .nullable()
                  .field([](C& c) -> std::string& { return c.data.valid; }));
  t.push_back(Key("data.format", KeyKind::kChoice, "tokens",
                  "`tokens`: a token file (header + uint16/uint32 tokens); `bytes`: every byte of "
                  "the file is a token (vocab 256); `synthetic`: generated learnable sequences, no "
                  "files; `chat`: one conversation a line, `{\"messages\": [{\"role\": ..., "
                  "\"content\": ...}]}`, rendered with model.pretrained's chat template and "
                  "tokenizer, the loss on `data.train_on` (docs/launcher.md, \"Chat data\").")
                  .one_of({"tokens", "bytes", "synthetic", "chat"})
                  .enum_field([](C& c) -> DataFormat& { return c.data.format; },
                              std::vector<DataFormat>{DataFormat::kTokens, DataFormat::kBytes, DataFormat::kSynthetic,
                                                      DataFormat::kChat}));
  t.push_back(Key("data.seq_len", KeyKind::kInt, "256",
                  "Tokens per training sequence (each window holds seq_len + 1 tokens: inputs and "
                  "next-token labels).")
                  .range(ge(1))
                  .field([](C& c) -> int64_t& { return c.data.seq_len; }));
  t.push_back(Key("data.vocab_size", KeyKind::kInt, "null",
                  "Vocabulary of the `synthetic` data (synthetic only); null: the model's "
                  "vocab_size.")
                  .range(ge(2))
                  .nullable()
                  .field([](C& c) -> std::optional<int64_t>& { return c.data.vocab_size; }));
  t.push_back(Key("data.train_on", KeyKind::kChoice, "assistant",
                  "`chat` only: the tokens the loss trains on. `assistant`: every assistant turn "
                  "(its content and end-of-turn token; the template's `{% generation %}` blocks "
                  "when it has them); `last_assistant`: the last assistant turn only; `all`: every "
                  "token.")
                  .one_of({"assistant", "last_assistant", "all"})
                  .enum_field([](C& c) -> models::ChatTrainOn& { return c.data.train_on; },
                              std::vector<models::ChatTrainOn>{models::ChatTrainOn::kAssistant,
                                                               models::ChatTrainOn::kLastAssistant,
                                                               models::ChatTrainOn::kAll}));
  t.push_back(Key("data.packing", KeyKind::kBool, "false",
                  "`chat` only: pack whole conversations into rows of `data.seq_len` positions "
                  "(best-fit decreasing), each attending only to itself with its positions "
                  "restarting at 0, so the loss equals unpacked; false: one conversation a row, "
                  "right-padded to the batch's longest.")
                  .field([](C& c) -> bool& { return c.data.packing; }));

  // ---- optimizer ----
  t.push_back(Key("optimizer", KeyKind::kSection, "{}", "The optimizer (runs on master weights).").section());
  t.push_back(
      Key("optimizer.name", KeyKind::kChoice, "adamw",
          "`adamw` (decoupled weight decay), `adam` (L2 weight decay), `sgd`, `lion` "
          "(sign updates, one state tensor: 4 B/param less host memory than Adam; its lr is "
          "usually 3-10x smaller and its weight_decay 3-10x larger than AdamW's), or "
          "`adafactor` (torch.optim.Adafactor's update with its defaults besides lr and "
          "weight_decay: a factored second moment, (rows + cols) x 4 B per matrix; its "
          "relative step is min(lr, 1/sqrt(step)) scaled by each parameter's RMS, torch's "
          "default lr is 1.0e-2).")
          .one_of({"adamw", "adam", "sgd", "lion", "adafactor"})
          .enum_field([](C& c) -> OptimizerName& { return c.optimizer.name; },
                      std::vector<OptimizerName>{OptimizerName::kAdamW, OptimizerName::kAdam, OptimizerName::kSgd,
                                                 OptimizerName::kLion, OptimizerName::kAdafactor}));
  t.push_back(Key("optimizer.lr", KeyKind::kFloat, "3.0e-4", "Peak learning rate (after warmup).")
                  .range(gt(0))
                  .field([](C& c) -> double& { return c.optimizer.lr; }));
  t.push_back(Key("optimizer.betas", KeyKind::kFloatPair, "[0.9, 0.95]",
                  "Adam(W): decay rates of the first and second moment estimates; lion: the update's "
                  "interpolation and the momentum's decay (the Lion paper uses [0.9, 0.99]).")
                  .range(in_co(0, 1))
                  .field([](C& c) -> std::array<double, 2>& { return c.optimizer.betas; }));
  t.push_back(Key("optimizer.eps", KeyKind::kFloat, "1.0e-8", "Adam(W) denominator epsilon.")
                  .range(gt(0))
                  .field([](C& c) -> double& { return c.optimizer.eps; }));
  t.push_back(Key("optimizer.weight_decay", KeyKind::kFloat, "0.0",
                  "Weight decay coefficient (decoupled for adamw, lion and adafactor).")
                  .range(ge(0))
                  .field([](C& c) -> double& { return c.optimizer.weight_decay; }));
  t.push_back(Key("optimizer.momentum", KeyKind::kFloat, "0.0", "SGD momentum (sgd only).")
                  .range(in_co(0, 1))
                  .field([](C& c) -> double& { return c.optimizer.momentum; }));
  t.push_back(
      Key("optimizer.state_dtype", KeyKind::kChoice, "float32",
          "adam / adamw only: how the two moments are stored. `float32` (8 B/param); `int8`: "
          "block-wise 8-bit with dynamic quantization maps, as bitsandbytes' 8-bit Adam "
          "(2 + 8/256 B/param; parameters under 4,096 elements stay float32; "
          "docs/optimizer.md, \"8-bit states\").")
          .one_of({"float32", "int8"})
          .enum_field([](C& c) -> OptimizerStateDtype& { return c.optimizer.state_dtype; },
                      std::vector<OptimizerStateDtype>{OptimizerStateDtype::kFloat32, OptimizerStateDtype::kInt8}));
  t.push_back(Key("optimizer.kahan_sum", KeyKind::kBool, "false",
                  "adam / adamw with model.master_dtype bfloat16 (recommended there): each update is "
                  "added with Kahan compensation, a bf16 buffer per parameter (2 B/param) that "
                  "carries what rounding to bf16 drops, so small updates accumulate as with fp32 "
                  "masters. Without it bf16 masters are plain bf16 weights: each float32 step is "
                  "rounded once, updates below half an ulp of the weight are lost.")
                  .field([](C& c) -> bool& { return c.optimizer.kahan_sum; }));

  // ---- schedule ----
  t.push_back(Key("schedule", KeyKind::kSection, "{}",
                  "Learning-rate schedule: linear warmup to optimizer.lr, then decay to min_lr at "
                  "train.steps: lr * (step + 1) / warmup_steps during warmup, then with p = "
                  "(step - warmup_steps) / (steps - warmup_steps): constant lr, linear min_lr + "
                  "(lr - min_lr)(1 - p), cosine min_lr + (lr - min_lr)(1 + cos(pi p)) / 2.")
                  .section());
  t.push_back(Key("schedule.warmup_steps", KeyKind::kInt, "0", "Steps of linear warmup.")
                  .range(ge(0))
                  .field([](C& c) -> int64_t& { return c.schedule.warmup_steps; }));
  t.push_back(Key("schedule.decay", KeyKind::kChoice, "constant", "Shape of the decay after warmup.")
                  .one_of({"constant", "linear", "cosine"})
                  .enum_field([](C& c) -> LrDecay& { return c.schedule.decay; },
                              std::vector<LrDecay>{LrDecay::kConstant, LrDecay::kLinear, LrDecay::kCosine}));
  t.push_back(Key("schedule.min_lr", KeyKind::kFloat, "0.0", "Learning rate at the end of the decay.")
                  .range(ge(0))
                  .field([](C& c) -> double& { return c.schedule.min_lr; }));

  // ---- train ----
  t.push_back(Key("train", KeyKind::kSection, "{}", "The training loop.").section());
  t.push_back(Key("train.steps", KeyKind::kInt, "100", "Optimizer steps of the whole run.")
                  .range(ge(1))
                  .field([](C& c) -> int64_t& { return c.train.steps; }));
  t.push_back(Key("train.batch_size", KeyKind::kInt, "8",
                  "Sequences per forward/backward pass (RoundPipe splits them into "
                  "run.num_microbatch microbatches); a step sees batch_size x grad_accum sequences.")
                  .range(ge(1))
                  .field([](C& c) -> int64_t& { return c.train.batch_size; }));
  t.push_back(Key("train.grad_accum", KeyKind::kInt, "1",
                  "Forward/backward passes whose gradients add up before each optimizer step.")
                  .range(ge(1))
                  .field([](C& c) -> int64_t& { return c.train.grad_accum; }));
  t.push_back(Key("train.clip_grad_norm", KeyKind::kFloat, "0.0",
                  "Clip the global gradient 2-norm to this value; 0: no clipping.")
                  .range(ge(0))
                  .field([](C& c) -> double& { return c.train.clip_grad_norm; }));
  t.push_back(Key("train.seed", KeyKind::kInt, "1234", "Seed of the initial weights, dropout and the batch sampler.")
                  .range(ge(0))
                  .field([](C& c) -> uint64_t& { return c.train.seed; }));

  // ---- run ----
  t.push_back(Key("run", KeyKind::kSection, "{}", "How RoundPipe runs the model.").section());
  t.push_back(Key("run.devices", KeyKind::kDevices, "auto",
                  "Devices of the pipeline: `auto` (every visible GPU, else one CPU worker), a count N "
                  "(N CPU workers, at most 1024), or a list such as [cuda:0, cuda:1] or [cpu, cpu].")
                  // The upper bound: a count is expanded into a list of that many "cpu" entries (fuzz_config
                  // found that a count such as 10^15 made that allocation throw std::length_error).
                  .range(in_cc(1, 1024))
                  .custom(
                      [](C& c, const Value& v) {
                        if (std::holds_alternative<std::monostate>(v)) {
                          c.run.devices.reset();
                          return;
                        }
                        std::vector<c10::Device> devices;
                        const auto& names = std::get<std::vector<std::string>>(v);
                        for (size_t i = 0; i < names.size(); ++i) {
                          try {
                            devices.emplace_back(names[i]);
                          } catch (const c10::Error&) {
                            config_fail("run.devices[" + std::to_string(i) + "]", "'" + names[i] + "'",
                                        "not a device name: write cpu, cuda or cuda:N");
                          }
                        }
                        c.run.devices = std::move(devices);
                      },
                      [](const C& c) -> Value {
                        if (!c.run.devices) {
                          return Value();
                        }
                        std::vector<std::string> names;
                        for (const c10::Device& d : *c.run.devices) {
                          names.push_back(d.str());
                        }
                        return names;
                      }));
  t.push_back(Key("run.num_microbatch", KeyKind::kInt, "null",
                  "Microbatches per batch; null: RoundPipe's default (number of devices + 1).")
                  .range(ge(1))
                  .nullable()
                  .field([](C& c) -> std::optional<int64_t>& { return c.run.num_microbatch; }));
  t.push_back(Key("run.recompute", KeyKind::kChoice, "stage",
                  "Activation recomputation grain: `stage` keeps each backward stage's input, "
                  "`layer` every layer's input (in host memory) and recomputes one layer at a time, in the "
                  "fused tail too: a device holds one layer's activations (long sequences), for more copies "
                  "and one more forward of the tail.")
                  .one_of({"stage", "layer"})
                  .enum_field([](C& c) -> RecomputeGrain& { return c.run.recompute; },
                              std::vector<RecomputeGrain>{RecomputeGrain::kStage, RecomputeGrain::kLayer}));
  t.push_back(Key("run.step_mode", KeyKind::kChoice, "async",
                  "`async`: the optimizer step overlaps the next forward; `sync`: it finishes first.")
                  .one_of({"async", "sync"})
                  .enum_field([](C& c) -> StepMode& { return c.run.step_mode; },
                              std::vector<StepMode>{StepMode::kAsync, StepMode::kSync}));

  t.push_back(Key("run.loss_chunk_mib", KeyKind::kInt, "256",
                  "MiB of logits buffers per chunk of the LM head's fused cross-entropy: the loss is computed "
                  "chunk by chunk over tokens and the [tokens, vocab] logits never exist whole "
                  "(docs/models.md, \"Long sequences\"). Larger: fewer, bigger matrix products.")
                  .range(in_cc(1, 65536))
                  .field([](C& c) -> int64_t& { return c.run.loss_chunk_mib; }));
  t.push_back(Key("run.device_memory_gib", KeyKind::kFloat, "null",
                  "Memory of each device in GiB for the memory model (docs/user-guide.md, \"Planning memory\"): "
                  "`roundpipe plan` prints every stage's predicted peak against it and the longest "
                  "data.seq_len that fits, and `roundpipe train` refuses, before loading weights, a "
                  "run whose predicted peak exceeds it. null: the smallest visible CUDA device's "
                  "memory; on CPU devices, plan only reports and train checks host memory alone.")
                  .range(gt(0))
                  .nullable()
                  .field([](C& c) -> std::optional<double>& { return c.run.device_memory_gib; }));

  // ---- amp ----
  t.push_back(Key("amp", KeyKind::kSection, "{}", "Mixed precision: dynamic loss scaling.").section());
  t.push_back(Key("amp.scaler", KeyKind::kBool, "false",
                  "Scale the loss dynamically (GradScaler); meant for float16, allowed with any dtype.")
                  .field([](C& c) -> bool& { return c.amp.scaler; }));
  t.push_back(
      Key("amp.init_scale", KeyKind::kFloat, "65536.0", "Initial loss scale.").range(gt(0)).field([](C& c) -> double& {
        return c.amp.init_scale;
      }));
  t.push_back(Key("amp.growth_interval", KeyKind::kInt, "2000", "Steps without overflow before the scale doubles.")
                  .range(ge(1))
                  .field([](C& c) -> int64_t& { return c.amp.growth_interval; }));

  // ---- checkpoint / eval / log ----
  t.push_back(Key("checkpoint", KeyKind::kSection, "{}",
                  "Checkpoints: out_dir/checkpoints/step-NNNNNN/, published atomically, `latest` "
                  "links the newest (docs/launcher.md).")
                  .section());
  t.push_back(Key("checkpoint.every", KeyKind::kInt, "0", "Steps between checkpoints; 0: only the final one.")
                  .range(ge(0))
                  .field([](C& c) -> int64_t& { return c.checkpoint.every; }));
  t.push_back(Key("checkpoint.keep", KeyKind::kInt, "3", "Newest checkpoints kept; older ones are deleted.")
                  .range(ge(1))
                  .field([](C& c) -> int64_t& { return c.checkpoint.keep; }));
  t.push_back(Key("eval", KeyKind::kSection, "{}", "Evaluation on data.valid.").section());
  t.push_back(Key("eval.every", KeyKind::kInt, "0",
                  "Steps between evaluations; 0: none during training. With data.valid set (or "
                  "synthetic data and every > 0) the run also evaluates at the end.")
                  .range(ge(0))
                  .field([](C& c) -> int64_t& { return c.eval.every; }));
  t.push_back(Key("eval.max_batches", KeyKind::kInt, "0",
                  "Batches (of train.batch_size windows) per evaluation; 0: all of data.valid.")
                  .range(ge(0))
                  .field([](C& c) -> int64_t& { return c.eval.max_batches; }));
  t.push_back(Key("eval.at_start", KeyKind::kBool, "false",
                  "Also evaluate before the first step (logged as step 0; not on --resume), so the "
                  "run shows the loss before and after training. Needs evaluation data.")
                  .field([](C& c) -> bool& { return c.eval.at_start; }));
  t.push_back(Key("distributed", KeyKind::kSection, "{}",
                  "Data parallelism across processes, when started by `roundpipe launch` or torchrun "
                  "(docs/distributed.md); ignored in a single-process run.")
                  .section());
  t.push_back(Key("distributed.backend", KeyKind::kChoice, "auto",
                  "Collective backend: `nccl` with CUDA devices and `gloo` otherwise (`auto`), or forced.")
                  .one_of({"auto", "gloo", "nccl"})
                  .enum_field([](C& c) -> DistributedBackend& { return c.distributed.backend; },
                              std::vector<DistributedBackend>{DistributedBackend::kAuto, DistributedBackend::kGloo,
                                                              DistributedBackend::kNccl}));
  t.push_back(Key("distributed.timeout_s", KeyKind::kFloat, "600.0",
                  "Seconds the rendezvous and each collective may take before the job fails naming the "
                  "missing rank.")
                  .range(gt(0))
                  .field([](C& c) -> double& { return c.distributed.timeout_s; }));
  t.push_back(Key("log", KeyKind::kSection, "{}", "Console output and metrics.").section());
  t.push_back(Key("log.every", KeyKind::kInt, "1", "Steps between metrics.jsonl records and progress-line updates.")
                  .range(ge(1))
                  .field([](C& c) -> int64_t& { return c.log.every; }));
  t.push_back(Key("log.level", KeyKind::kChoice, "info", "Log level of the launcher and RoundPipe.")
                  .one_of({"trace", "debug", "info", "warn", "error", "off"})
                  .enum_field([](C& c) -> LogLevel& { return c.log.level; },
                              std::vector<LogLevel>{LogLevel::kTrace, LogLevel::kDebug, LogLevel::kInfo,
                                                    LogLevel::kWarn, LogLevel::kError, LogLevel::kOff}));
  return t;
}

}  // namespace

bool Bounds::contains(double v) const { return (lo_open ? v > lo : v >= lo) && (hi_open ? v < hi : v <= hi); }

std::string Bounds::describe() const {
  const bool has_lo = std::isfinite(lo), has_hi = std::isfinite(hi);
  if (has_lo && has_hi) {
    return std::string("in ") + (lo_open ? "(" : "[") + number_text(lo) + ", " + number_text(hi) +
           (hi_open ? ")" : "]");
  }
  if (has_lo) {
    return (lo_open ? "> " : ">= ") + number_text(lo);
  }
  if (has_hi) {
    return (hi_open ? "< " : "<= ") + number_text(hi);
  }
  return "";
}

std::string KeySpec::type_name() const {
  std::string name;
  switch (kind) {
    case KeyKind::kSection:
      name = "map";
      break;
    case KeyKind::kBool:
      name = "bool";
      break;
    case KeyKind::kInt:
      name = "int";
      break;
    case KeyKind::kFloat:
      name = "float";
      break;
    case KeyKind::kString:
      name = "string";
      break;
    case KeyKind::kChoice: {
      name = "one of ";
      for (size_t i = 0; i < choices.size(); ++i) {
        name += (i ? ", " : "") + choices[i];
      }
      break;
    }
    case KeyKind::kFloatPair:
      name = "list of 2 floats";
      break;
    case KeyKind::kStringList:
      name = "list of strings";
      break;
    case KeyKind::kDevices:
      name = "auto, an int or a list of devices";
      break;
    case KeyKind::kFreeMap:
      name = "map (any keys)";
      break;
  }
  return nullable ? name + " (or null)" : name;
}

std::string KeySpec::check_text() const {
  const std::string range = bounds.describe();
  if (range.empty()) {
    return "";
  }
  switch (kind) {
    case KeyKind::kFloatPair:
      return "each " + range;
    case KeyKind::kStringList:
      return "length " + range;
    case KeyKind::kDevices:
      return "count " + range;
    default:
      return range;
  }
}

const std::vector<KeySpec>& config_schema() {
  static const std::vector<KeySpec> schema = build_schema();
  return schema;
}

const KeySpec* find_key(const std::string& path) {
  static const std::map<std::string, const KeySpec*> index = [] {
    std::map<std::string, const KeySpec*> m;
    for (const KeySpec& spec : config_schema()) {
      m[spec.path] = &spec;
    }
    return m;
  }();
  auto it = index.find(path);
  return it == index.end() ? nullptr : it->second;
}

void config_fail(const std::string& path, const std::string& value, const std::string& problem) {
  throw KeyError(path, path + " = " + value + ": " + problem);
}

}  // namespace roundpipe::launcher::detail
