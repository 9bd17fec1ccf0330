#include "roundpipe/launcher/config.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <nlohmann/json.hpp>

#include "launcher_test_util.h"
#include "tests/common/test_config.h"

namespace roundpipe::launcher {
namespace {

using testing::ScratchDir;

// A valid configuration without files: a from-scratch Llama on synthetic data.
const char* kSynthetic = R"(
model:
  preset: llama
  config: {vocab_size: 64, hidden_size: 32}
data:
  format: synthetic
)";

/// kSynthetic with more YAML appended (later keys must not repeat kSynthetic's sections).
LauncherConfig parse_with(const std::string& extra, const std::vector<std::string>& overrides = {}) {
  return parse_config(std::string(kSynthetic) + extra, overrides, "test.yaml");
}

TEST(ConfigTest, Defaults_MatchTheDocumentedValues) {
  LauncherConfig c;
  EXPECT_EQ(c.out_dir, "runs/example");
  EXPECT_EQ(c.model.pretrained, "");
  EXPECT_FALSE(c.model.preset.has_value());
  EXPECT_EQ(c.model.config_json, "{}");
  EXPECT_EQ(c.model.dtype, c10::kFloat);
  EXPECT_EQ(c.model.master_dtype, c10::kFloat);
  EXPECT_FALSE(c.model.lora.has_value());
  EXPECT_EQ(c.data.format, DataFormat::kTokens);
  EXPECT_EQ(c.data.seq_len, 256);
  EXPECT_FALSE(c.data.vocab_size.has_value());
  EXPECT_EQ(c.optimizer.name, OptimizerName::kAdamW);
  EXPECT_DOUBLE_EQ(c.optimizer.lr, 3.0e-4);
  EXPECT_DOUBLE_EQ(c.optimizer.betas[0], 0.9);
  EXPECT_DOUBLE_EQ(c.optimizer.betas[1], 0.95);
  EXPECT_DOUBLE_EQ(c.optimizer.eps, 1.0e-8);
  EXPECT_DOUBLE_EQ(c.optimizer.weight_decay, 0.0);
  EXPECT_DOUBLE_EQ(c.optimizer.momentum, 0.0);
  EXPECT_EQ(c.schedule.warmup_steps, 0);
  EXPECT_EQ(c.schedule.decay, LrDecay::kConstant);
  EXPECT_DOUBLE_EQ(c.schedule.min_lr, 0.0);
  EXPECT_EQ(c.train.steps, 100);
  EXPECT_EQ(c.train.batch_size, 8);
  EXPECT_EQ(c.train.grad_accum, 1);
  EXPECT_DOUBLE_EQ(c.train.clip_grad_norm, 0.0);
  EXPECT_EQ(c.train.seed, 1234u);
  EXPECT_FALSE(c.run.devices.has_value());
  EXPECT_FALSE(c.run.num_microbatch.has_value());
  EXPECT_EQ(c.run.recompute, RecomputeGrain::kStage);
  EXPECT_EQ(c.run.step_mode, StepMode::kAsync);
  EXPECT_FALSE(c.amp.scaler);
  EXPECT_DOUBLE_EQ(c.amp.init_scale, 65536.0);
  EXPECT_EQ(c.amp.growth_interval, 2000);
  EXPECT_EQ(c.checkpoint.every, 0);
  EXPECT_EQ(c.checkpoint.keep, 3);
  EXPECT_EQ(c.eval.every, 0);
  EXPECT_EQ(c.eval.max_batches, 0);
  EXPECT_EQ(c.log.every, 1);
  EXPECT_EQ(c.log.level, LogLevel::kInfo);
}

TEST(ConfigTest, Load_ReadsEverySectionAndLoraDefaults) {
  ScratchDir dir;
  dir.write("ckpt/config.json", R"({"vocab_size": 300, "hidden_size": 64})");
  std::string train = dir.write("train.bin", "bytes");
  std::string yaml = "out_dir: " + dir.file("run") + "\nmodel:\n  pretrained: " + dir.file("ckpt") +
                     "\n  dtype: bfloat16\n  lora: {}\ndata: {train: " + train +
                     ", format: bytes, seq_len: 4}\n"
                     "optimizer: {name: sgd, lr: 0.5, momentum: 0.9}\n"
                     "schedule: {warmup_steps: 3, decay: cosine, min_lr: 0.01}\n"
                     "train: {steps: 7, seed: 99}\nrun: {devices: [cpu, cpu], num_microbatch: 4, "
                     "recompute: layer, step_mode: sync}\namp: {scaler: true}\nlog: {level: debug}\n";
  LauncherConfig c = parse_config(yaml);
  EXPECT_EQ(c.model.dtype, c10::kBFloat16);
  ASSERT_TRUE(c.model.lora.has_value());
  EXPECT_EQ(c.model.lora->rank, 8);
  EXPECT_DOUBLE_EQ(c.model.lora->alpha, 16.0);
  EXPECT_EQ(c.model.lora->targets, (std::vector<std::string>{"q_proj", "v_proj"}));
  EXPECT_EQ(c.data.format, DataFormat::kBytes);
  EXPECT_EQ(c.optimizer.name, OptimizerName::kSgd);
  EXPECT_DOUBLE_EQ(c.optimizer.momentum, 0.9);
  EXPECT_EQ(c.schedule.decay, LrDecay::kCosine);
  EXPECT_EQ(c.train.seed, 99u);
  ASSERT_TRUE(c.run.devices.has_value());
  EXPECT_EQ(*c.run.devices, (std::vector<c10::Device>{c10::Device("cpu"), c10::Device("cpu")}));
  EXPECT_EQ(c.run.num_microbatch, 4);
  EXPECT_EQ(c.run.recompute, RecomputeGrain::kLayer);
  EXPECT_EQ(c.run.step_mode, StepMode::kSync);
  EXPECT_EQ(c.log.level, LogLevel::kDebug);
  EXPECT_EQ(data_vocab_size(c), 256);
}

TEST(ConfigTest, Enums_ParseFromAndPrintAsTheirYamlNames) {
  EXPECT_EQ(parse_with("").distributed.backend, DistributedBackend::kAuto);
  const LauncherConfig c = parse_with("distributed: {backend: nccl}\nlog: {level: warn}\n");
  EXPECT_EQ(c.distributed.backend, DistributedBackend::kNccl);
  EXPECT_EQ(c.log.level, LogLevel::kWarn);
  const std::string yaml = to_yaml(c);
  EXPECT_NE(yaml.find("backend: nccl"), std::string::npos) << yaml;
  EXPECT_NE(yaml.find("level: warn"), std::string::npos) << yaml;
  EXPECT_CONFIG_ERROR(parse_with("", {"distributed.backend=mpi"}), "distributed.backend", "mpi");
}

TEST(ConfigTest, UnknownKey_NamesPathAndSuggestsClosest) {
  EXPECT_CONFIG_ERROR(parse_with("optimizer: {lrr: 0.1}\n"), "optimizer.lrr", "did you mean 'optimizer.lr'?",
                      "test.yaml:7:");
  EXPECT_CONFIG_ERROR(parse_with("optimiser: {lr: 0.1}\n"), "optimiser", "did you mean 'optimizer'?");
  // A key in the wrong section.
  EXPECT_CONFIG_ERROR(parse_with("train: {lr: 0.1}\n"), "train.lr", "did you mean 'optimizer.lr'?");
  // No close name: the valid keys are listed.
  EXPECT_CONFIG_ERROR(parse_with("amp: {zzzzzz: 1}\n"), "amp.zzzzzz", "scaler, init_scale, growth_interval");
  // A dotted key in the file would match a schema path but not be read: refused, the fix shown.
  EXPECT_CONFIG_ERROR(parse_with("data.seq_len: 4\n"), "data.seq_len", "cannot contain '.'", "data: {seq_len: 4}");
  EXPECT_CONFIG_ERROR(parse_with("train: {a.b: 1}\n"), "train.a.b", "cannot contain '.'");
}

TEST(ConfigTest, WrongType_NamesPathAndValue) {
  EXPECT_CONFIG_ERROR(parse_with("optimizer: {lr: fast}\n"), "optimizer.lr = fast", "wrong type", "expected float");
  EXPECT_CONFIG_ERROR(parse_with("train: {steps: 1.5}\n"), "train.steps = 1.5", "expected int");
  EXPECT_CONFIG_ERROR(parse_with("optimizer: {betas: 0.9}\n"), "optimizer.betas = 0.9", "expected list of 2 floats");
  EXPECT_CONFIG_ERROR(parse_with("amp: {scaler: yes}\n"), "amp.scaler = yes", "expected bool");
  EXPECT_CONFIG_ERROR(parse_with("train: 5\n"), "train = 5", "expected map");
  EXPECT_CONFIG_ERROR(parse_with("schedule: {decay: cosin}\n"), "schedule.decay = cosin", "did you mean 'cosine'?");
  EXPECT_CONFIG_ERROR(parse_with("train: {steps: '5'}\n"), "train.steps = '5'", "got a string");
}

TEST(ConfigTest, OutOfRange_NamesPathValueAndBound) {
  EXPECT_CONFIG_ERROR(parse_with("optimizer: {lr: -1}\n"), "optimizer.lr = -1", "must be > 0");
  EXPECT_CONFIG_ERROR(parse_with("optimizer: {lr: 0}\n"), "optimizer.lr = 0", "must be > 0");
  EXPECT_CONFIG_ERROR(parse_with("optimizer: {betas: [0.9, 1.0]}\n"), "optimizer.betas = [0.9, 1.0]", "element 1",
                      "in [0, 1)");
  EXPECT_CONFIG_ERROR(parse_with("train: {steps: 0}\n"), "train.steps = 0", ">= 1");
  EXPECT_CONFIG_ERROR(parse_with("checkpoint: {keep: 0}\n"), "checkpoint.keep = 0", ">= 1");
  EXPECT_CONFIG_ERROR(parse_with("data2: 1\n", {"data.seq_len=0"}), "data2");  // unknown first
  EXPECT_CONFIG_ERROR(parse_with("", {"data.seq_len=0"}), "data.seq_len = 0", ">= 1");
  EXPECT_CONFIG_ERROR(parse_with("optimizer: {eps: .nan}\n"), "optimizer.eps", "finite");
}

TEST(ConfigTest, MissingFile_NamesPathAndFile) {
  ScratchDir dir;
  const std::string absent = dir.file("absent.bin");
  EXPECT_CONFIG_ERROR(parse_config("model: {preset: llama}\ndata: {train: " + absent + "}\n"),
                      "data.train = '" + absent + "'", "file not found", "prepare_data.py");
  std::string train = dir.write("train.bin", "x");
  EXPECT_CONFIG_ERROR(parse_config("model: {preset: llama}\ndata: {train: " + train + ", valid: " + absent + "}\n"),
                      "data.valid = '" + absent + "'", "file not found");
  EXPECT_CONFIG_ERROR(parse_config("model: {preset: llama}\n"), "data.train = null", "set data.train");
  dir.write("empty_ckpt/weights.bin", "");
  EXPECT_CONFIG_ERROR(
      parse_config("model: {pretrained: " + dir.file("empty_ckpt") + "}\ndata: {format: synthetic, vocab_size: 8}\n"),
      "model.pretrained = '" + dir.file("empty_ckpt") + "'", "no config.json");
  EXPECT_CONFIG_ERROR(load_config(dir.file("nope.yaml")), dir.file("nope.yaml"), "not found");
}

TEST(ConfigTest, IncompatibleCombination_NamesTheKeys) {
  EXPECT_CONFIG_ERROR(parse_with("", {"model.lora.rank=4"}), "model.lora", "model.pretrained");
  EXPECT_CONFIG_ERROR(parse_with("", {"model.master_dtype=float16"}), "model.master_dtype = float16", "float32");
  EXPECT_CONFIG_ERROR(parse_config("data: {format: synthetic, vocab_size: 8}\n"), "model = ", "model.preset");
  EXPECT_CONFIG_ERROR(parse_config("model: {preset: llama}\ndata: {format: synthetic}\n"), "data.vocab_size = null",
                      "model.config.vocab_size");
  EXPECT_CONFIG_ERROR(parse_with("", {"data.vocab_size=100"}), "data.vocab_size = 100", "model's vocab_size is 64");
  EXPECT_CONFIG_ERROR(parse_with("", {"optimizer.momentum=0.9"}), "optimizer.momentum = 0.9", "sgd");
  EXPECT_CONFIG_ERROR(parse_with("", {"optimizer.lr=0.1", "schedule.min_lr=0.2"}), "schedule.min_lr = 0.2",
                      "optimizer.lr = 0.1");
  EXPECT_CONFIG_ERROR(parse_with("", {"data.train=x.bin"}), "data.train = 'x.bin'", "synthetic");
  // Allowed: a scaler with a dtype other than float16.
  EXPECT_NO_THROW(parse_with("amp: {scaler: true}\n", {"model.dtype=bfloat16"}));
}

// model.master_dtype: bfloat16 needs all four of its conditions, each error naming the fix.
// bf16 masters need adam/adamw, bf16 compute and sync steps; Kahan compensation is recommended,
// not required (plain bf16 masters: `train` warns, CliTest.Bf16MastersWithKahan_...).
TEST(ConfigTest, Bf16Masters_NeedAdamBf16ComputeAndSyncSteps) {
  const std::vector<std::string> ok = {"model.dtype=bfloat16", "model.master_dtype=bfloat16",
                                       "optimizer.kahan_sum=true", "run.step_mode=sync"};
  EXPECT_NO_THROW(parse_with("", ok));
  auto without = [&](const std::string& key, const std::string& replacement) {
    std::vector<std::string> out;
    for (const auto& o : ok) {
      if (o.rfind(key + "=", 0) != 0) out.push_back(o);
    }
    if (!replacement.empty()) out.push_back(replacement);
    return out;
  };
  EXPECT_NO_THROW(parse_with("", without("optimizer.kahan_sum", "")));
  EXPECT_CONFIG_ERROR(parse_with("", without("model.dtype", "")), "model.master_dtype = bfloat16",
                      "model.dtype must be bfloat16 too (it is float32)");
  EXPECT_CONFIG_ERROR(parse_with("", without("run.step_mode", "")), "model.master_dtype = bfloat16",
                      "set run.step_mode: sync");
  std::vector<std::string> sgd = ok;
  sgd.push_back("optimizer.name=sgd");
  EXPECT_CONFIG_ERROR(parse_with("", sgd), "model.master_dtype = bfloat16", "use adamw");
  EXPECT_CONFIG_ERROR(parse_with("", {"optimizer.kahan_sum=true"}), "optimizer.kahan_sum = true",
                      "set master_dtype: bfloat16");
}

TEST(ConfigTest, Overrides_SetNestedListAndFreeMapKeys) {
  LauncherConfig c =
      parse_with("optimizer: {lr: 0.1}\n", {"optimizer.lr=1e-3", "optimizer.betas=[0.9,0.99]", "train.steps=7",
                                            "model.config.hidden_size=256", "model.config.rope_scaling={type: linear}",
                                            "run.devices=[cpu, cpu]", "run.devices=3", "data.seq_len=16"});
  EXPECT_DOUBLE_EQ(c.optimizer.lr, 1e-3);
  EXPECT_DOUBLE_EQ(c.optimizer.betas[1], 0.99);
  EXPECT_EQ(c.train.steps, 7);
  EXPECT_EQ(c.data.seq_len, 16);
  ASSERT_TRUE(c.run.devices.has_value());
  EXPECT_EQ(c.run.devices->size(), 3u);  // the later override wins
  nlohmann::json model = nlohmann::json::parse(c.model.config_json);
  EXPECT_EQ(model["hidden_size"], 256);
  EXPECT_EQ(model["vocab_size"], 64);
  EXPECT_EQ(model["rope_scaling"]["type"], "linear");
}

TEST(ConfigTest, Overrides_ErrorsNameTheOverride) {
  EXPECT_CONFIG_ERROR(parse_with("", {"optimizer.lr=-1"}), "override 'optimizer.lr=-1'", "optimizer.lr = -1", "> 0");
  EXPECT_CONFIG_ERROR(parse_with("", {"optimizer.weight_decy=1"}), "override 'optimizer.weight_decy=1'",
                      "did you mean 'optimizer.weight_decay'?");
  EXPECT_CONFIG_ERROR(parse_with("", {"optimizer.lr"}), "override 'optimizer.lr'", "key=value");
  EXPECT_CONFIG_ERROR(parse_with("", {"run.devices=[gpu:0]"}), "run.devices[0] = 'gpu:0'", "cuda:N");
}

// Regression (fuzz/fuzz_config): a free map with a key that is not UTF-8 used to escape as
// nlohmann::json::type_error (std::terminate in the launcher) instead of a ConfigError.
TEST(ConfigTest, FreeMap_InvalidUtf8_IsAConfigError) {
  EXPECT_CONFIG_ERROR(parse_config("model:\n  preset: qwen3\n  config: {vocab_size: 64, hidden_size\xc8 32}\n"
                                   "data: {format: synthetic}\n",
                                   {}, "test.yaml"),
                      "model.config", "not valid UTF-8");
  EXPECT_CONFIG_ERROR(parse_with("", {"model.config.name=\xff"}), "model.config", "not valid UTF-8");
  // Found by fuzz/fuzz_config: a plain string key with such bytes printed as U+FFFD in quotes,
  // which read back as another string. Refused too, in string lists as well.
  EXPECT_CONFIG_ERROR(parse_with("out_dir: \xfe\xff\xff\xf8runs/fuzz\n"), "out_dir", "not valid UTF-8");
  EXPECT_CONFIG_ERROR(parse_with("", {"out_dir=run\xc3"}), "out_dir", "not valid UTF-8");
  EXPECT_EQ(parse_with("out_dir: r\xc3\xa9sultats\n").out_dir, "r\xc3\xa9sultats");  // UTF-8 is fine
}

TEST(ConfigTest, Load_ReportsFileLineAndColumn) {
  ScratchDir dir;
  std::string path = dir.write("run.yaml", std::string(kSynthetic) + "train:\n  steps: -3\n");
  EXPECT_CONFIG_ERROR(load_config(path), path + ":8:3: train.steps = -3");
  EXPECT_CONFIG_ERROR(parse_config("a: [1, 2\n", {}, "bad.yaml"), "bad.yaml:", "YAML syntax error");
  EXPECT_CONFIG_ERROR(parse_with("train: {steps: 1}\ntrain: {steps: 2}\n"), "train", "twice");
}

TEST(ConfigTest, Devices_AcceptAutoCountAndList) {
  EXPECT_FALSE(parse_with("run: {devices: auto}\n").run.devices.has_value());
  auto two = parse_with("run: {devices: 2}\n").run.devices;
  ASSERT_TRUE(two.has_value());
  EXPECT_EQ(*two, (std::vector<c10::Device>{c10::Device("cpu"), c10::Device("cpu")}));
  auto cuda = parse_with("run: {devices: [cuda:0, cuda:1]}\n").run.devices;
  ASSERT_TRUE(cuda.has_value());
  EXPECT_EQ((*cuda)[1], c10::Device(c10::kCUDA, 1));
  EXPECT_CONFIG_ERROR(parse_with("run: {devices: 0}\n"), "run.devices = 0", "in [1, 1024]");
  EXPECT_EQ(parse_with("run: {devices: 1024}\n").run.devices->size(), 1024u);
  // Found by fuzz/fuzz_config: a huge count was expanded into a list before any check.
  EXPECT_CONFIG_ERROR(parse_with("run: {devices: 1000000000000000}\n"), "run.devices = 1000000000000000",
                      "in [1, 1024]");
  EXPECT_CONFIG_ERROR(parse_with("run: {devices: 99999999999999999999999}\n"), "run.devices", "in [1, 1024]");
  EXPECT_CONFIG_ERROR(parse_with("run: {devices: some}\n"), "run.devices = some", "wrong type");
}

TEST(ConfigTest, ToYaml_RoundTripsThroughLoad) {
  ScratchDir dir;
  dir.write("ckpt/config.json", R"({"vocab_size": 512, "hidden_size": 64})");
  std::string yaml = "out_dir: '123'\nmodel:\n  pretrained: " + dir.file("ckpt") +
                     "\n  config: {torch_dtype: '7', rope_scaling: null, layers: [1, 2.5, x], "
                     "nested: {flag: true}}\n  lora: {rank: 4, targets: [q_proj]}\n"
                     "data: {format: synthetic, vocab_size: 100, seq_len: 9}\n"
                     "optimizer: {lr: 1.0e-3, betas: [0.8, 0.999], eps: 1e-6}\n"
                     "run: {devices: [cpu, cpu], num_microbatch: 3}\namp: {init_scale: 1024}\n";
  LauncherConfig first = parse_config(yaml);
  std::string printed = to_yaml(first);
  LauncherConfig second = parse_config(printed, {}, "printed");
  EXPECT_EQ(to_yaml(second), printed);
  EXPECT_EQ(second.out_dir, "123");
  EXPECT_EQ(second.model.pretrained, dir.file("ckpt"));
  ASSERT_TRUE(second.model.lora.has_value());
  EXPECT_EQ(second.model.lora->rank, 4);
  EXPECT_EQ(second.model.lora->targets, std::vector<std::string>{"q_proj"});
  EXPECT_DOUBLE_EQ(second.optimizer.betas[1], 0.999);
  EXPECT_DOUBLE_EQ(second.optimizer.eps, 1e-6);
  EXPECT_DOUBLE_EQ(second.amp.init_scale, 1024.0);
  EXPECT_EQ(second.run.num_microbatch, 3);
  EXPECT_EQ(second.data.vocab_size, 100);
  EXPECT_EQ(nlohmann::json::parse(second.model.config_json), nlohmann::json::parse(first.model.config_json));
  nlohmann::json model = nlohmann::json::parse(second.model.config_json);
  EXPECT_EQ(model["torch_dtype"], "7");  // a quoted number stays a string
  EXPECT_TRUE(model["rope_scaling"].is_null());
  EXPECT_EQ(model["layers"][1], 2.5);
  // Defaults print too, so the printed file documents the whole run.
  EXPECT_NE(printed.find("growth_interval: 2000"), std::string::npos) << printed;
}

// Regression (fuzz/fuzz_config, CI of 2026-11-29): a plain scalar holding a carriage return
// ("511 \r" before a comment) was printed plain, and "511 \r\n" reads back as "511": the printed
// config no longer read back as itself. Strings with control characters print double-quoted.
TEST(ConfigTest, ToYaml_ControlCharactersRoundTrip) {
  LauncherConfig first = parse_config(
      "model:\n  preset: qwen3\n  config:\n    name: 511 \r   # bytes\n    \"k\\te\\ry\": \"a\\x7fb\"\n"
      "data: {format: synthetic, vocab_size: 64}\n",
      {}, "test.yaml");
  nlohmann::json model = nlohmann::json::parse(first.model.config_json);
  EXPECT_EQ(model["name"], "511 \r");
  EXPECT_EQ(model["k\te\ry"],
            "a\x7f"
            "b");
  std::string printed = to_yaml(first);
  LauncherConfig second = parse_config(printed, {}, "printed");
  EXPECT_EQ(to_yaml(second), printed);
  EXPECT_EQ(nlohmann::json::parse(second.model.config_json), model) << printed;
  EXPECT_NE(printed.find("name: \"511 \\r\""), std::string::npos) << printed;
}

TEST(ConfigTest, ResolvedModelConfig_LaysModelConfigOverPretrained) {
  ScratchDir dir;
  dir.write("ckpt/config.json", R"({"vocab_size": 100, "hidden_size": 64, "rope_theta": 10000})");
  LauncherConfig c = parse_config("model: {pretrained: " + dir.file("ckpt") +
                                  ", config: {hidden_size: 32}}\ndata: {format: synthetic}\n");
  nlohmann::json resolved = nlohmann::json::parse(resolved_model_config_json(c));
  EXPECT_EQ(resolved, nlohmann::json::parse(R"({"vocab_size": 100, "hidden_size": 32, "rope_theta": 10000})"));
  EXPECT_EQ(data_vocab_size(c), 100);  // synthetic takes the pretrained model's vocabulary
}

TEST(ConfigTest, DefaultYaml_LoadsWithSyntheticData) {
  const std::string path = std::string(ROUNDPIPE_SOURCE_DIR) + "/configs/default.yaml";
  LauncherConfig c = load_config(path, {"data.format=synthetic", "data.train=", "data.valid="});
  EXPECT_TRUE(c.model.preset == models::Architecture::kLlama);
  EXPECT_EQ(data_vocab_size(c), 256);
}

TEST(ConfigTest, ReferenceDoc_MatchesSchema) {
  const std::string path = std::string(ROUNDPIPE_SOURCE_DIR) + "/docs/config-reference.md";
  const std::string generated = config_reference_markdown();
  const char* update = std::getenv("ROUNDPIPE_UPDATE_DOCS");
  if (update != nullptr && std::string(update) == "1") {
    write_file_atomically(path, generated);
  }
  ASSERT_TRUE(is_regular_file(path)) << path;
  EXPECT_EQ(read_file(path), generated)
      << "docs/config-reference.md is stale: run with ROUNDPIPE_UPDATE_DOCS=1 to regenerate it";
  // Every key of the table appears in the reference.
  for (const char* key : {"`optimizer.lr`", "`model.lora.targets`", "`run.devices`", "`log.level`"}) {
    EXPECT_NE(generated.find(key), std::string::npos) << key;
  }
}

}  // namespace
}  // namespace roundpipe::launcher
