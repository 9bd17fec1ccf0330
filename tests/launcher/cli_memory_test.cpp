// The memory model through the `roundpipe` executable (roundpipe/launcher/cli/memory_plan.h):
// `plan` prints the predicted peaks (checked against a hand computation for the tiny preset),
// `train` refuses before loading a run whose device or host prediction does not fit.
#include <gtest/gtest.h>

#include <string>

#include "cli_test_util.h"

namespace roundpipe::launcher::testing {
namespace {

// tiny_config's model (vocab 64, hidden 32, intermediate 64, 2 layers, 4 heads / 2 kv heads of 8,
// fp32) on one CPU device, seq_len 16, 4 rows in 2 microbatches: one fused stage [0, 4) with
// t = 32 tokens a microbatch. By hand (scheduler/memory_model.cpp, Note [Memory model]):
constexpr int64_t kParams = 2 * 64 * 32 + 2 * (2 * 32 * 32 + 2 * 16 * 32 + 3 * 32 * 64 + 2 * 32) + 32;  // 22,688
// Saved per token per decoder layer, fp32, CPU (k and v repeated to 4 heads):
// 4 (4h + 3q + 3kv + 4I) + 4 heads + 4 x 2 (q - kv).
constexpr int64_t kDecoderSaved = 4 * (4 * 32 + 3 * 32 + 3 * 16 + 4 * 64) + 4 * 4 + 4 * 2 * (32 - 16);
constexpr int64_t kTokens = 32;
constexpr int64_t kStagePeak = 2 * kParams * 4                                   // weights + gradients
                               + (8 + 2 * kDecoderSaved + 2 * 32 * 4) * kTokens  // saved activations
                               + kDecoderSaved * kTokens                         // one layer's backward
                               + (kTokens * 64 * 4 + 64 * 32 * 4 + kTokens * 32 * 4 + 13 * kTokens)  // head
                               + 2 * 2 * kTokens * 32 * 4;  // stage inputs/outputs

TEST(CliMemoryTest, Plan_PrintsPeaksLongestSequenceAndHostBytes) {
  ScratchDir dir;
  dir.write("run.yaml", tiny_config("run"));
  CliResult r = run_cli(dir, "plan run.yaml run.devices=1 run.device_memory_gib=1");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(kStagePeak, 443808);
  EXPECT_NE(r.out.find("stage 0 (fused, layers [0, 4))  peak 433.41 KiB (" + std::to_string(kStagePeak) + " B)"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("estimated device memory: peak 433.41 KiB (443808 B) (stage 0) of 1.00 GiB "
                       "(run.device_memory_gib): fits"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("longest data.seq_len under 1.00 GiB (multiples of 1024, 2 row(s) a microbatch): "),
            std::string::npos)
      << r.out;
  // Host, fp32 AdamW, async: compute 4 + master 4 + gradients 4 + 4 (async) + moments 8 B/param,
  // + the CPU device's clone of every layer + the stage's activations.
  const int64_t activations = kStagePeak - 2 * kParams * 4;
  const int64_t host = (4 + 4 + 8 + 8) * kParams + kParams * 4 + activations;
  EXPECT_NE(r.out.find("estimated host memory: peak "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("(" + std::to_string(host) + " B) = "), std::string::npos) << host << "\n" << r.out;
  EXPECT_NE(r.out.find(" x " + std::to_string(kParams) + " parameters"), std::string::npos) << r.out;
}

TEST(CliMemoryTest, Train_RefusesAStageOverTheDeviceMemory_BeforeLoading) {
  ScratchDir dir;
  dir.write("run.yaml", tiny_config("run"));
  // 0.0003 GiB = 322,122 bytes < the fused stage's 443,808. With t tokens a microbatch the stage
  // needs 2 x 90,752 (weights, gradients) + 8,192 (fp32 weight-gradient accumulator)
  // + 7,941 t (saved 4,776 + recompute 2,256 + logits 256 + grad_hidden 128 + targets 13 +
  // boundaries 512): t <= 16, i.e. data.seq_len <= 8 at 2 rows; one row of 16 tokens fits.
  CliResult r = run_cli(dir, "train run.yaml run.devices=1 run.device_memory_gib=0.0003");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("run.device_memory_gib: stage 0 (fused, layers [0, 4)) is predicted to need 433.41 KiB "
                       "(443808 B)"),
            std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("at data.seq_len 16 with 2 row(s) a microbatch, more than the device's 314.57 KiB"),
            std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("What fits: data.seq_len <= 8; or one row a microbatch (run.num_microbatch = "
                       "train.batch_size = 4: peak 309.33 KiB, fits)"),
            std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("run.recompute: layer"), std::string::npos) << r.err;
  // Under the weights and gradients themselves no length fits.
  r = run_cli(dir, "train run.yaml run.devices=1 run.device_memory_gib=0.0001");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("no data.seq_len with this plan (weights and gradients alone: 177.25 KiB)"), std::string::npos)
      << r.err;
  EXPECT_FALSE(path_exists(dir.file("run/config.yaml")));  // refused before the model was built
  // The same run under a size that holds it trains.
  EXPECT_EQ(run_cli(dir, "train run.yaml run.devices=1 run.device_memory_gib=1 train.steps=1").code, 0);
}

TEST(CliMemoryTest, Train_RefusesAModelOverTheHostMemory_NamingWhatFits) {
  ScratchDir dir;
  dir.write("run.yaml", tiny_config("run"));
  // ~170B parameters: terabytes of predicted host memory on any machine.
  const std::string big =
      "model.config={vocab_size: 32000, hidden_size: 8192, intermediate_size: 28672, num_hidden_layers: 200, "
      "num_attention_heads: 64, num_key_value_heads: 8}";
  CliResult r = run_cli(dir, "train run.yaml '" + big + "'");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("host memory: the run is predicted to peak at "), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("MemAvailable in /proc/meminfo"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("optimizer.state_dtype: int8: "), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("model.lora: {rank: 8, targets: [all-linear]}"), std::string::npos) << r.err;
  EXPECT_FALSE(path_exists(dir.file("run/config.yaml")));
}

}  // namespace
}  // namespace roundpipe::launcher::testing
