// End-to-end tests of the `roundpipe` executable (docs/launcher.md): train writes metrics,
// checkpoints and the plot; resume is bitwise exact; checkpoints are atomic and pruned; every
// configuration error class exits with code 2 naming the key; plan and validate print what they
// promise.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <regex>
#include <string>
#include <vector>

#include "cli_test_util.h"
#include "roundpipe/launcher/metrics.h"
#include "roundpipe/models/safetensors.h"
#include "tests/common/svg_check.h"
#include "tests/common/test_config.h"

namespace roundpipe::launcher::testing {
namespace {

using ::roundpipe::testing::tags_balanced;

std::string checkpoints(const std::string& run) { return join_path(run, "checkpoints"); }

void expect_same_weights(const std::string& a_dir, const std::string& b_dir) {
  auto a = models::CheckpointReader::open(a_dir);
  auto b = models::CheckpointReader::open(b_dir);
  ASSERT_EQ(a.names(), b.names());
  for (const std::string& name : a.names()) {
    EXPECT_TRUE(a.get(name).equal(b.get(name))) << name << " differs between " << a_dir << " and " << b_dir;
  }
}

TEST(CliTest, Train_WritesMetricsCheckpointsAndPlot) {
  ScratchDir dir;
  dir.write("run.yaml", tiny_config("run"));
  CliResult r = run_cli(dir, "train run.yaml");
  ASSERT_EQ(r.code, 0) << r.err;
  const std::string run = dir.file("run");
  MetricsLog log = read_metrics(join_path(run, "metrics.jsonl"));
  ASSERT_EQ(log.train.size(), 6u);
  for (size_t i = 0; i < log.train.size(); ++i) {
    EXPECT_EQ(log.train[i].step, static_cast<int64_t>(i + 1));
    EXPECT_EQ(log.train[i].tokens, static_cast<int64_t>(i + 1) * 4 * 16);  // batch x seq_len per step
  }
  for (const TrainRecord& record : log.train) EXPECT_TRUE(std::isfinite(record.loss)) << record.step;
  ASSERT_EQ(log.eval.size(), 2u);  // every 3 steps: 3 and 6 (the final one)
  EXPECT_EQ(log.eval[0].step, 3);
  EXPECT_NE(read_file(join_path(run, "loss.svg")).find("train-loss"), std::string::npos);
  EXPECT_TRUE(is_regular_file(join_path(run, "train.log")));
  EXPECT_TRUE(is_regular_file(join_path(run, "config.yaml")));
  // keep: 2 of the checkpoints 2, 4, 6; latest is the final one.
  EXPECT_EQ(list_step_dirs(checkpoints(run)), (std::vector<int64_t>{4, 6}));
  EXPECT_EQ(read_symlink(join_path(checkpoints(run), "latest")), std::optional<std::string>("step-000006"));
  for (const char* f : {"config.json", "model.safetensors", "optimizer.pt", "trainer_state.pt", "config.yaml"}) {
    EXPECT_TRUE(is_regular_file(join_path(join_path(checkpoints(run), "step-000006"), f))) << f;
  }
  EXPECT_NE(r.out.find("loss plot:"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("step-000006"), std::string::npos) << r.out;
  // The process's own peak resident set: LibTorch alone is a few hundred MiB; GiB and KiB agree.
  double gib = 0;
  long kib = 0;
  const size_t at = r.out.find("peak host memory: ");
  ASSERT_NE(at, std::string::npos) << r.out;
  ASSERT_EQ(std::sscanf(r.out.c_str() + at, "peak host memory: %lf GiB resident (%ld KiB)", &gib, &kib), 2) << r.out;
  EXPECT_GT(kib, 100L << 10);
  EXPECT_LT(kib, 8L << 20);
  EXPECT_NEAR(gib, static_cast<double>(kib) / (1 << 20), 0.006);
}

// Note [Resume test]: 20 straight steps vs 10 + a resume from the straight run's step-10
// checkpoint into another out_dir: bitwise equal masters, in async mode, with the GradScaler
// (float32 compute, so it never skips a step, but its state must round-trip), gradient
// accumulation, clipping and a decaying LR.
TEST(CliTest, Resume_BitwiseEqualToStraightRun) {
  ScratchDir dir;
  const std::string common =
      " train.steps=20 checkpoint.every=10 checkpoint.keep=5 amp.scaler=true amp.growth_interval=3"
      " train.grad_accum=2 train.clip_grad_norm=0.5 eval.every=0";
  dir.write("run.yaml", tiny_config("straight"));
  CliResult straight = run_cli(dir, "train run.yaml" + common);
  ASSERT_EQ(straight.code, 0) << straight.err;
  CliResult resumed =
      run_cli(dir, "train run.yaml out_dir=resumed" + common + " --resume straight/checkpoints/step-000010");
  ASSERT_EQ(resumed.code, 0) << resumed.err;
  EXPECT_NE(resumed.err.find("resumed from"), std::string::npos) << resumed.err;
  expect_same_weights(dir.file("straight/checkpoints/step-000020"), dir.file("resumed/checkpoints/step-000020"));
  MetricsLog log = read_metrics(dir.file("resumed/metrics.jsonl"));
  ASSERT_EQ(log.train.size(), 10u);
  EXPECT_EQ(log.train.front().step, 11);
  EXPECT_EQ(log.train.back().tokens, 20 * 2 * 4 * 16);
  MetricsLog straight_log = read_metrics(dir.file("straight/metrics.jsonl"));
  EXPECT_EQ(straight_log.train.back().loss, log.train.back().loss);
  EXPECT_EQ(straight_log.train.back().scale, log.train.back().scale);

  // A checkpoint of another model shape: a clear error naming the tensor.
  CliResult other = run_cli(dir, "train run.yaml out_dir=other model.config.hidden_size=48" + common +
                                     " --resume straight/checkpoints/step-000010");
  EXPECT_EQ(other.code, 1);
  EXPECT_NE(other.err.find("model.embed_tokens.weight"), std::string::npos) << other.err;
}

// optimizer.name: lion (roundpipe::optim::Lion): trains, and its momentum round-trips through the
// checkpoint (a resume without it would diverge from the straight run).
TEST(CliTest, Lion_TrainsAndResumesBitwise) {
  ScratchDir dir;
  const std::string common =
      " optimizer.name=lion optimizer.lr=1.0e-3 optimizer.betas=[0.9,0.99] optimizer.weight_decay=0.1"
      " train.steps=6 checkpoint.every=3 checkpoint.keep=5 eval.every=0";
  dir.write("run.yaml", tiny_config("straight"));
  CliResult straight = run_cli(dir, "train run.yaml" + common);
  ASSERT_EQ(straight.code, 0) << straight.err;
  CliResult resumed =
      run_cli(dir, "train run.yaml out_dir=resumed" + common + " --resume straight/checkpoints/step-000003");
  ASSERT_EQ(resumed.code, 0) << resumed.err;
  expect_same_weights(dir.file("straight/checkpoints/step-000006"), dir.file("resumed/checkpoints/step-000006"));
  MetricsLog log = read_metrics(dir.file("straight/metrics.jsonl"));
  ASSERT_EQ(log.train.size(), 6u);
  for (const TrainRecord& record : log.train) EXPECT_TRUE(std::isfinite(record.loss)) << record.step;
}

// optimizer.name: adafactor (roundpipe::optim::Adafactor): trains, and its factored second moment
// round-trips through the checkpoint (a resume without it would diverge from the straight run).
TEST(CliTest, Adafactor_TrainsAndResumesBitwise) {
  ScratchDir dir;
  const std::string common =
      " optimizer.name=adafactor optimizer.lr=1.0e-2 optimizer.weight_decay=0.1"
      " train.steps=4 checkpoint.every=2 checkpoint.keep=5 eval.every=0";
  dir.write("run.yaml", tiny_config("straight"));
  CliResult straight = run_cli(dir, "train run.yaml" + common);
  ASSERT_EQ(straight.code, 0) << straight.err;
  CliResult resumed =
      run_cli(dir, "train run.yaml out_dir=resumed" + common + " --resume straight/checkpoints/step-000002");
  ASSERT_EQ(resumed.code, 0) << resumed.err;
  expect_same_weights(dir.file("straight/checkpoints/step-000004"), dir.file("resumed/checkpoints/step-000004"));
  MetricsLog log = read_metrics(dir.file("straight/metrics.jsonl"));
  ASSERT_EQ(log.train.size(), 4u);
  for (const TrainRecord& record : log.train) EXPECT_TRUE(std::isfinite(record.loss)) << record.step;
}

// "estimated host memory: peak 1.00 MiB (1048576 B) = ..." -> 1048576; -1 if absent.
int64_t host_peak_bytes(const std::string& out) {
  const std::string key = "estimated host memory: peak ";
  const size_t at = out.find(key);
  if (at == std::string::npos) return -1;
  const size_t open = out.find('(', at + key.size());
  return open == std::string::npos ? -1 : std::stoll(out.substr(open + 1));
}

// model.master_dtype: bfloat16 with optimizer.kahan_sum (the bf16 compute copies are the masters,
// sync steps): trains as close to fp32 masters as bf16 compute allows, the checkpointed weights
// are bf16, the compensation round-trips through the checkpoint (resume == straight, bitwise),
// and `roundpipe plan` counts no master copy. Without kahan_sum (plain bf16 masters) `train`
// warns, trains other weights than with it, resumes bitwise too, and `plan` counts 2 B/param less
// (no compensation).
TEST(CliTest, Bf16MastersWithKahan_TrainAndResumeBitwise) {
  ScratchDir dir;
  const std::string bf16 = " model.dtype=bfloat16 run.step_mode=sync optimizer.lr=3.0e-3";
  const std::string masters = " model.master_dtype=bfloat16 optimizer.kahan_sum=true";
  const std::string common = " train.steps=6 checkpoint.every=3 checkpoint.keep=5 eval.every=0";
  dir.write("run.yaml", tiny_config("straight"));
  CliResult fp32 = run_cli(dir, "train run.yaml out_dir=fp32" + bf16 + common);
  ASSERT_EQ(fp32.code, 0) << fp32.err;
  CliResult straight = run_cli(dir, "train run.yaml" + bf16 + masters + common);
  ASSERT_EQ(straight.code, 0) << straight.err;
  CliResult resumed = run_cli(
      dir, "train run.yaml out_dir=resumed" + bf16 + masters + common + " --resume straight/checkpoints/step-000003");
  ASSERT_EQ(resumed.code, 0) << resumed.err;
  expect_same_weights(dir.file("straight/checkpoints/step-000006"), dir.file("resumed/checkpoints/step-000006"));
  auto weights = models::CheckpointReader::open(dir.file("straight/checkpoints/step-000006"));
  EXPECT_EQ(weights.get("model.layers.0.mlp.up_proj.weight").scalar_type(), torch::kBFloat16);
  const double lb = read_metrics(dir.file("straight/metrics.jsonl")).train.back().loss;
  const double lf = read_metrics(dir.file("fp32/metrics.jsonl")).train.back().loss;
  EXPECT_NEAR(lb, lf, 0.05 * lf);
  CliResult plan = run_cli(dir, "plan run.yaml" + bf16 + masters);
  ASSERT_EQ(plan.code, 0) << plan.err;
  EXPECT_NE(plan.out.find("masters 0 (the compute copies)"), std::string::npos) << plan.out;

  const std::string plain_masters = " model.master_dtype=bfloat16";
  CliResult plain = run_cli(dir, "train run.yaml out_dir=plain" + bf16 + plain_masters + common);
  ASSERT_EQ(plain.code, 0) << plain.err;
  EXPECT_NE(plain.err.find("model.master_dtype: bfloat16 without optimizer.kahan_sum"), std::string::npos) << plain.err;
  CliResult plain_resumed = run_cli(dir, "train run.yaml out_dir=plain_resumed" + bf16 + plain_masters + common +
                                             " --resume plain/checkpoints/step-000003");
  ASSERT_EQ(plain_resumed.code, 0) << plain_resumed.err;
  expect_same_weights(dir.file("plain/checkpoints/step-000006"), dir.file("plain_resumed/checkpoints/step-000006"));
  auto plain_weights = models::CheckpointReader::open(dir.file("plain/checkpoints/step-000006"));
  const std::string key = "model.layers.0.mlp.up_proj.weight";
  EXPECT_FALSE(torch::equal(plain_weights.get(key), weights.get(key))) << "plain rounding == Kahan";
  const double lp = read_metrics(dir.file("plain/metrics.jsonl")).train.back().loss;
  EXPECT_NEAR(lp, lf, 0.05 * lf);  // lr 3e-3 moves bf16 weights: it trains
  CliResult plain_plan = run_cli(dir, "plan run.yaml" + bf16 + plain_masters);
  ASSERT_EQ(plain_plan.code, 0) << plain_plan.err;
  const int64_t with_kahan = host_peak_bytes(plan.out), without = host_peak_bytes(plain_plan.out);
  ASSERT_GT(without, 0) << plain_plan.out;
  // "... B/param x N parameters: ..." -> N; every parameter trains, each has a bf16 compensation.
  const size_t x = plan.out.find(" x ", plan.out.find("estimated host memory: peak "));
  ASSERT_NE(x, std::string::npos) << plan.out;
  const int64_t parameters = std::stoll(plan.out.substr(x + 3));
  EXPECT_EQ(with_kahan - without, 2 * parameters) << plan.out << plain_plan.out;
}

// bf16 compute copies with float32 masters and AdamW (Note [Gradients in the compute dtype] in
// setup.cpp): the optimizer reads the bf16 gradients as they are, so `plan` counts no float32
// gradient buffers (4 B per parameter less than with amp.scaler or SGD, which keep them), and a
// run whose every step clips (optim::clip_grad_norm inside the step) trains about like float32
// and resumes bitwise.
TEST(CliTest, Bf16ComputeAdamW_GradientsReadInBf16_ClippedTrainAndResumeBitwise) {
  ScratchDir dir;
  const std::string bf16 = " model.dtype=bfloat16 model.master_dtype=float32";
  const std::string common =
      " train.clip_grad_norm=0.05 train.steps=6 checkpoint.every=3 checkpoint.keep=5 eval.every=0";
  dir.write("run.yaml", tiny_config("straight"));
  CliResult fp32 = run_cli(dir, "train run.yaml out_dir=fp32" + common);
  ASSERT_EQ(fp32.code, 0) << fp32.err;
  CliResult straight = run_cli(dir, "train run.yaml" + bf16 + common);
  ASSERT_EQ(straight.code, 0) << straight.err;
  CliResult resumed =
      run_cli(dir, "train run.yaml out_dir=resumed" + bf16 + common + " --resume straight/checkpoints/step-000003");
  ASSERT_EQ(resumed.code, 0) << resumed.err;
  expect_same_weights(dir.file("straight/checkpoints/step-000006"), dir.file("resumed/checkpoints/step-000006"));
  const MetricsLog log = read_metrics(dir.file("straight/metrics.jsonl"));
  ASSERT_EQ(log.train.size(), 6u);
  int measured = 0;  // async steps: a record has the norm of the last finished step, none at first
  for (const TrainRecord& record : log.train) {
    if (!record.grad_norm) continue;
    ++measured;
    EXPECT_GT(*record.grad_norm, 0.05) << "step " << record.step << " did not clip";
  }
  EXPECT_GE(measured, 4);
  const double lf = read_metrics(dir.file("fp32/metrics.jsonl")).train.back().loss;
  EXPECT_NEAR(log.train.back().loss, lf, 0.05 * lf);

  CliResult plan = run_cli(dir, "plan run.yaml" + bf16);
  ASSERT_EQ(plan.code, 0) << plan.err;
  EXPECT_NE(plan.out.find("(bfloat16, read by the optimizer as they are)"), std::string::npos) << plan.out;
  const size_t x = plan.out.find(" B/param x ");
  ASSERT_NE(x, std::string::npos) << plan.out;
  const int64_t params = std::stoll(plan.out.substr(x + 11));
  for (const std::string other : {" amp.scaler=true", " optimizer.name=sgd optimizer.momentum=0.9"}) {
    CliResult cast = run_cli(dir, "plan run.yaml" + bf16 + other);
    ASSERT_EQ(cast.code, 0) << cast.err;
    EXPECT_EQ(cast.out.find("read by the optimizer as they are"), std::string::npos) << other << "\n" << cast.out;
    const int64_t extra = other.find("sgd") != std::string::npos ? -4 * params : 0;  // momentum 4 instead of Adam's 8
    EXPECT_EQ(host_peak_bytes(cast.out) - host_peak_bytes(plan.out), 4 * params + extra) << other << "\n" << cast.out;
  }
}

// optimizer.state_dtype: int8 (block-wise 8-bit Adam moments): the option reaches the optimizer
// (the weights differ from float32 states' after a few steps, but the loss stays close), and the
// 8-bit states round-trip through the checkpoint (resume == straight, bitwise).
TEST(CliTest, Int8OptimizerStates_TrainAndResumeBitwise) {
  ScratchDir dir;
  // hidden 64 x intermediate 128: the MLP weights have 8,192 elements, above the 4,096 below
  // which states stay float32.
  const std::string common =
      " model.config.hidden_size=64 model.config.intermediate_size=128 train.steps=6 checkpoint.every=3"
      " checkpoint.keep=5 eval.every=0";
  dir.write("run.yaml", tiny_config("straight"));
  CliResult fp32 = run_cli(dir, "train run.yaml out_dir=fp32" + common);
  ASSERT_EQ(fp32.code, 0) << fp32.err;
  CliResult straight = run_cli(dir, "train run.yaml optimizer.state_dtype=int8" + common);
  ASSERT_EQ(straight.code, 0) << straight.err;
  CliResult resumed = run_cli(dir, "train run.yaml optimizer.state_dtype=int8 out_dir=resumed" + common +
                                       " --resume straight/checkpoints/step-000003");
  ASSERT_EQ(resumed.code, 0) << resumed.err;
  expect_same_weights(dir.file("straight/checkpoints/step-000006"), dir.file("resumed/checkpoints/step-000006"));
  auto a = models::CheckpointReader::open(dir.file("straight/checkpoints/step-000006"));
  auto b = models::CheckpointReader::open(dir.file("fp32/checkpoints/step-000006"));
  const std::string mlp = "model.layers.0.mlp.up_proj.weight";
  EXPECT_FALSE(a.get(mlp).equal(b.get(mlp))) << "int8 states trained exactly as float32 ones: the option was ignored";
  const double l8 = read_metrics(dir.file("straight/metrics.jsonl")).train.back().loss;
  const double l32 = read_metrics(dir.file("fp32/metrics.jsonl")).train.back().loss;
  EXPECT_NEAR(l8, l32, 0.05 * l32);
  // A resume with the other state dtype fails naming the fix.
  CliResult other =
      run_cli(dir, "train run.yaml out_dir=other" + common + " --resume straight/checkpoints/step-000003");
  EXPECT_NE(other.code, 0);
  EXPECT_NE(other.err.find("state_dtype"), std::string::npos) << other.err;
}

// eval.at_start: an evaluation before the first step, logged as step 0 (with its token accuracy),
// and none on --resume.
TEST(CliTest, EvalAtStart_LogsStepZero_NotOnResume) {
  ScratchDir dir;
  dir.write("run.yaml", tiny_config("run"));
  CliResult r = run_cli(dir, "train run.yaml train.steps=2 eval.every=2 eval.at_start=true");
  ASSERT_EQ(r.code, 0) << r.err;
  MetricsLog log = read_metrics(dir.file("run/metrics.jsonl"));
  ASSERT_EQ(log.eval.size(), 2u);  // step 0 and the end
  EXPECT_EQ(log.eval[0].step, 0);
  EXPECT_EQ(log.eval[1].step, 2);
  ASSERT_TRUE(log.eval[0].eval_accuracy.has_value());
  EXPECT_GE(*log.eval[0].eval_accuracy, 0.0);
  EXPECT_LE(*log.eval[0].eval_accuracy, 1.0);
  CliResult resumed = run_cli(dir, "train run.yaml train.steps=3 eval.every=2 eval.at_start=true --resume");
  ASSERT_EQ(resumed.code, 0) << resumed.err;
  log = read_metrics(dir.file("run/metrics.jsonl"));
  ASSERT_EQ(log.eval.size(), 3u);
  EXPECT_EQ(log.eval[2].step, 3);
}

TEST(CliTest, Checkpoint_FailureBeforePublishLeavesLatestValid) {
  ScratchDir dir;
  dir.write("run.yaml", tiny_config("run"));
  CliResult r =
      run_cli(dir, "train run.yaml train.steps=4 eval.every=0", "ROUNDPIPE_TEST_FAIL_AT=checkpoint-publish@4");
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find("injected failure"), std::string::npos) << r.err;
  // One error line (the last), no LibTorch backtrace; the detail is in train.log.
  EXPECT_EQ(last_line(r.err).rfind("roundpipe: error: injected failure", 0), 0u) << r.err;
  EXPECT_EQ(r.err.find("Exception raised from"), std::string::npos) << r.err;
  EXPECT_NE(read_file(dir.file("run/train.log")).find("injected failure"), std::string::npos);
  EXPECT_EQ(read_symlink(dir.file("run/checkpoints/latest")), std::optional<std::string>("step-000002"));
  EXPECT_EQ(list_step_dirs(dir.file("run/checkpoints")), (std::vector<int64_t>{2}));
  // The previous checkpoint loads: resuming from `latest` finishes the run.
  CliResult resumed = run_cli(dir, "train run.yaml train.steps=4 eval.every=0 --resume");
  ASSERT_EQ(resumed.code, 0) << resumed.err;
  EXPECT_EQ(read_symlink(dir.file("run/checkpoints/latest")), std::optional<std::string>("step-000004"));
  EXPECT_TRUE(remove_stale_temporaries(dir.file("run/checkpoints")).empty());  // cleaned at start
}

// Note [Checkpoint host memory]: the optimizer state is streamed into its file; a write that fails
// (here: a file-size limit between the weights' 4.2 MB and the optimizer state's 8.4 MB) is one
// clean error naming the file, not an abort from torch's zip writer, and publishes nothing.
TEST(CliTest, Checkpoint_OptimizerWriteFailureIsAnError) {
  ScratchDir dir;
  dir.write("run.yaml", tiny_config("run"));
  CliResult r = run_cli(dir,
                        "train run.yaml train.steps=1 checkpoint.every=0 eval.every=0 model.config.hidden_size=256 "
                        "model.config.intermediate_size=512",
                        // bash's ulimit counts KiB (dash's 512-byte blocks); SIGXFSZ ignored, so write fails
                        R"(bash -c 'trap "" XFSZ; ulimit -f 6000; exec "$0" "$@"')");
  EXPECT_EQ(r.code, 1) << r.err;
  EXPECT_EQ(last_line(r.err).rfind("roundpipe: error: writing '", 0), 0u) << r.err;
  EXPECT_NE(r.err.find("optimizer.pt' failed: File too large"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("terminate called"), std::string::npos) << r.err;
  EXPECT_FALSE(read_symlink(dir.file("run/checkpoints/latest")).has_value());
}

// Note [Host allocator policy] (roundpipe/launcher/cli/host_allocator.cpp): the policy is logged,
// "retain" keeps glibc's default, and an unknown value is a configuration error naming the
// variable. What the policy saves is measured in bench/host_memory_bench.py, not here.
TEST(CliTest, HostAllocator_PolicyLoggedAndUnknownValueRefused) {
  ScratchDir dir;
  dir.write("run.yaml", tiny_config("run"));
  const std::string clean = "env -u LD_PRELOAD -u MALLOC_MMAP_THRESHOLD_";
  CliResult bad = run_cli(dir, "train run.yaml train.steps=1", clean + " ROUNDPIPE_MALLOC=bogus");
  EXPECT_EQ(bad.code, 2) << bad.err;
  EXPECT_NE(bad.err.find("ROUNDPIPE_MALLOC='bogus'"), std::string::npos) << bad.err;
  EXPECT_NE(bad.err.find("'retain'"), std::string::npos) << bad.err;

  CliResult retain =
      run_cli(dir, "train run.yaml train.steps=1 eval.every=0 out_dir=retain", clean + " ROUNDPIPE_MALLOC=retain");
  ASSERT_EQ(retain.code, 0) << retain.err;
  EXPECT_NE(read_file(dir.file("retain/train.log")).find("host allocator: glibc's default (ROUNDPIPE_MALLOC=retain"),
            std::string::npos);
  CliResult user =
      run_cli(dir, "train run.yaml train.steps=1 eval.every=0 out_dir=user", clean + " MALLOC_MMAP_THRESHOLD_=4194304");
  ASSERT_EQ(user.code, 0) << user.err;
  EXPECT_NE(read_file(dir.file("user/train.log")).find("MALLOC_MMAP_THRESHOLD_ from the environment"),
            std::string::npos);
}

struct ConfigErrorCase {
  const char* name;
  const char* args;
  const char* expected;  // key path (or text) the message must name
};

TEST(CliTest, ConfigErrors_ExitWithCode2NamingTheKey) {
  ScratchDir dir;
  dir.write("run.yaml", tiny_config("run"));
  dir.write("hf/config.json", R"({"model_type": "llama", "vocab_size": 64, "hidden_size": 32,
      "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4})");
  const std::vector<ConfigErrorCase> cases = {
      {"unknown key", "train run.yaml optimizer.lrr=1", "optimizer.lrr"},
      {"wrong type", "train run.yaml train.steps=many", "train.steps"},
      {"out of range", "eval run.yaml optimizer.lr=-1", "optimizer.lr"},
      {"missing file", "train run.yaml data.format=bytes data.train=missing.txt", "data.train"},
      {"incompatible combination", "plan run.yaml model.master_dtype=float16", "model.master_dtype"},
      {"lora without pretrained", "train run.yaml model.lora={}", "model.lora"},
      {"vocabulary", "train run.yaml data.format=bytes data.train=run.yaml", "vocab_size"},
      {"usage: no subcommand", "", nullptr},
      {"usage: unknown option", "train run.yaml --bogus", nullptr},
  };
  for (const ConfigErrorCase& c : cases) {
    CliResult r = run_cli(dir, c.args);
    EXPECT_EQ(r.code, 2) << c.name << ": " << c.args << "\n" << r.err;
    if (c.expected != nullptr) {
      EXPECT_NE(r.err.find(c.expected), std::string::npos) << c.name << ": " << r.err;
      EXPECT_EQ(r.err.rfind("roundpipe: error: ", 0), 0u) << r.err;
    }
  }
}

TEST(CliTest, Plan_PrintsDevicesStagesAndMemory) {
  ScratchDir dir;
  dir.write("run.yaml", tiny_config("run"));
  CliResult r = run_cli(dir, "plan --svg plan.svg run.yaml run.devices=3");
  ASSERT_EQ(r.code, 0) << r.err;
  // Parameters of the preset: embeddings + lm_head 2 x 64 x 32; per layer q, o 32 x 32, k, v
  // 16 x 32 (2 KV heads of 8), gate/up/down 3 x 32 x 64, 2 norms x 32; final norm 32.
  const int64_t per_layer = 2 * 32 * 32 + 2 * 16 * 32 + 3 * 32 * 64 + 2 * 32;
  const int64_t params = 2 * 64 * 32 + 2 * per_layer + 32;
  EXPECT_NE(r.out.find(std::to_string(params) + " parameters"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("devices (3): cpu cpu cpu"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("layers: 4"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("fwd  layers [0, "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("bwd  layers ["), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("norm + lm_head"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("estimated host memory"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("estimated device memory"), std::string::npos) << r.out;
  EXPECT_FALSE(path_exists(dir.file("run/metrics.jsonl")));  // no training

  // The simulated timeline: one lane per device, one line per stage, and the SVG picture with one
  // rectangle per stage and microbatch (the config's run.num_microbatch: 2).
  EXPECT_NE(r.out.find("simulated timeline (size-based costs; one iteration = 100): 3 devices, 2 microbatches: "
                       "makespan 100.0, bubble "),
            std::string::npos)
      << r.out;
  for (const char* lane : {"device 0  |", "device 1  |", "device 2  |"}) {
    EXPECT_NE(r.out.find(lane), std::string::npos) << lane << "\n" << r.out;
  }
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.out, m, std::regex("stages \\(([0-9]+)\\)"))) << r.out;
  const int stages = std::stoi(m[1]);
  EXPECT_NE(r.out.find("  " + std::to_string(stages - 1) + "  stage " + std::to_string(stages - 1) + " (backward"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("timeline picture: plan.svg"), std::string::npos) << r.out;
  const std::string svg = read_file(dir.file("plan.svg"));
  std::string why;
  EXPECT_TRUE(tags_balanced(svg, &why)) << why;
  size_t rects = 0;
  for (size_t at = svg.find("class=\"microbatch\""); at != std::string::npos;
       at = svg.find("class=\"microbatch\"", at + 1)) {
    ++rects;
  }
  EXPECT_EQ(rects, static_cast<size_t>(stages) * 2);
}

TEST(CliTest, Validate_PrintsTheResolvedConfig) {
  ScratchDir dir;
  dir.write("run.yaml", tiny_config("run"));
  CliResult r = run_cli(dir, "validate run.yaml");
  ASSERT_EQ(r.code, 0) << r.err;
  LauncherConfig printed = parse_config(r.out);
  LauncherConfig expected = load_config(dir.file("run.yaml"));
  EXPECT_EQ(to_yaml(printed), to_yaml(expected));
  EXPECT_EQ(run_cli(dir, "train --help").code, 0);
}

}  // namespace
}  // namespace roundpipe::launcher::testing
