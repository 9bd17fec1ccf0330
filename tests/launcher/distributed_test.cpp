// `roundpipe train` as a data-parallel job: started by `roundpipe launch --nproc-per-node 2` and by
// `torchrun --no-python`, with train.batch_size 4 per rank, it must export the same weights as one
// process with batch_size 8 (the same global batches; docs/distributed.md).
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "chat_test_util.h"
#include "cli_test_util.h"
#include "roundpipe/launcher/metrics.h"
#include "roundpipe/models/pretrained.h"
#include "roundpipe/models/safetensors.h"
#include "tests/common/multi_process.h"
#include "tests/common/oracle_rule.h"
#include "tests/common/tensor_compare.h"
#include "tests/common/test_config.h"

namespace roundpipe::launcher::testing {
namespace {

// The exported weights of `dir`/<run>/checkpoints/latest, exported to `dir`/<run>-export.
std::map<std::string, at::Tensor> export_weights(const ScratchDir& dir, const std::string& run) {
  CliResult exported = run_cli(dir, "export " + run + "/checkpoints/latest " + run + "-export");
  EXPECT_EQ(exported.code, 0) << exported.err;
  std::map<std::string, at::Tensor> out;
  auto ckpt = models::CheckpointReader::open(dir.file(run + "-export"));
  for (const auto& name : ckpt.names()) out[name] = ckpt.get(name).clone();
  return out;
}

void expect_same_weights(const std::map<std::string, at::Tensor>& a, const std::map<std::string, at::Tensor>& b,
                         const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (const auto& [name, t] : a) {
    ASSERT_TRUE(b.count(name)) << what << ": " << name;
    // float32 rounding of differently grouped sums (microbatches of 2 rows per rank vs 4 rows),
    // through 6 AdamW steps.
    EXPECT_LE(roundpipe::testing::max_abs_diff(t, b.at(name)), 2e-5) << what << ": " << name;
  }
}

TEST(DistributedCliTest, LaunchAndTorchrun_ExportTheSameWeightsAsOneProcessWithTwiceTheBatch) {
  ScratchDir dir;
  dir.write("tiny.yaml", tiny_config("one"));
  CliResult one = run_cli(dir, "train tiny.yaml train.batch_size=8");
  ASSERT_EQ(one.code, 0) << one.err;
  const auto reference = export_weights(dir, "one");

  CliResult launched = run_cli(dir, "launch --nproc-per-node 2 train tiny.yaml out_dir=launched");
  ASSERT_EQ(launched.code, 0) << launched.out << launched.err;
  EXPECT_NE(launched.out.find("(2 ranks)"), std::string::npos) << launched.out;
  EXPECT_TRUE(path_exists(dir.file("launched/train.rank1.log")));
  EXPECT_FALSE(path_exists(dir.file("launched/metrics.rank1.jsonl")));
  expect_same_weights(reference, export_weights(dir, "launched"), "roundpipe launch");
  // The logged loss is the global batch's: the same as the one-process run's.
  const std::string m1 = read_file(dir.file("one/metrics.jsonl")), m2 = read_file(dir.file("launched/metrics.jsonl"));
  EXPECT_EQ(std::count(m1.begin(), m1.end(), '\n'), std::count(m2.begin(), m2.end(), '\n'));

  const std::string torchrun = std::string(ROUNDPIPE_TEST_PYTHON).substr(0, std::string(ROUNDPIPE_TEST_PYTHON).rfind('/')) +
                               "/torchrun";
  if (!path_exists(torchrun)) {
    ROUNDPIPE_ORACLE_MISSING("torchrun not found at " + torchrun + " (run scripts/setup.sh)");
  }
  const std::string port = std::to_string(roundpipe::testing::free_port());
  const std::string cmd = "cd '" + dir.path() + "' && '" + torchrun + "' --no-python --nproc-per-node=2 --master-port=" +
                          port + " '" + ROUNDPIPE_CLI_PATH + "' train tiny.yaml out_dir=torchrun > torchrun.out 2>&1";
  const int status = std::system(cmd.c_str());
  ASSERT_EQ(status, 0) << read_file(dir.file("torchrun.out"));
  expect_same_weights(reference, export_weights(dir, "torchrun"), "torchrun --no-python");
}

// Chat data (rows of different lengths, padded per global batch): the step's loss is divided by
// the trained labels of the whole global batch (Note [Loss normalization]), so 2 ranks of 2 rows
// train as 1 process of 4 rows. A per-rank mean would weigh the ranks' conversations differently.
TEST(DistributedCliTest, ChatData_TwoRanksTrainAsOneProcessWithTwiceTheBatch) {
  ScratchDir dir;
  const std::string model = write_byte_chat_model(dir, "model");
  at::manual_seed(5);
  const models::Pretrained random = models::build(models::parse_model_config(read_file(model + "/config.json")));
  models::save_pretrained(random.model, random.config, model);
  std::string jsonl;
  for (int i = 0; i < 8; ++i) {
    jsonl += chat_line({{"user", "question " + std::to_string(i) + std::string(static_cast<size_t>(i * 3), '?')},
                        {"assistant", std::string(static_cast<size_t>(1 + (i * 5) % 7), static_cast<char>('a' + i))}});
  }
  dir.write("chat.jsonl", jsonl);
  dir.write("chat.yaml", "out_dir: one\nmodel: {pretrained: " + model + "}\n"
                         "data: {train: chat.jsonl, format: chat, seq_len: 64}\n"
                         "optimizer: {name: sgd, lr: 0.5}\n"
                         "train: {steps: 3, batch_size: 2, seed: 3}\n"
                         "run: {devices: 1, num_microbatch: 1, step_mode: sync}\nlog: {every: 1}\n");
  CliResult one = run_cli(dir, "train chat.yaml train.batch_size=4");
  ASSERT_EQ(one.code, 0) << one.err;
  const auto reference = export_weights(dir, "one");
  CliResult launched = run_cli(dir, "launch --nproc-per-node 2 train chat.yaml out_dir=launched");
  ASSERT_EQ(launched.code, 0) << launched.out << launched.err;
  expect_same_weights(reference, export_weights(dir, "launched"), "chat data, 2 ranks");
  MetricsLog l1 = read_metrics(dir.file("one/metrics.jsonl")), l2 = read_metrics(dir.file("launched/metrics.jsonl"));
  ASSERT_EQ(l1.train.size(), 3u);
  ASSERT_EQ(l2.train.size(), 3u);
  for (size_t k = 0; k < 3; ++k) EXPECT_NEAR(l1.train[k].loss, l2.train[k].loss, 1e-5) << "step " << k + 1;
  const auto initial = models::CheckpointReader::open(model);
  double moved = 0.0;
  for (const auto& [name, t] : reference) moved = std::max(moved, roundpipe::testing::max_abs_diff(t, initial.get(name)));
  EXPECT_GT(moved, 1e-3) << "training did not move the weights: the comparison would be empty";
}

TEST(DistributedCliTest, ResumeWithAnotherWorldSize_FailsNamingBoth) {
  ScratchDir dir;
  dir.write("tiny.yaml", tiny_config("run"));
  CliResult one = run_cli(dir, "train tiny.yaml train.steps=2");
  ASSERT_EQ(one.code, 0) << one.err;
  CliResult resumed = run_cli(dir, "launch --nproc-per-node 2 train tiny.yaml train.steps=4 --resume");
  EXPECT_NE(resumed.code, 0);
  EXPECT_NE(resumed.err.find("written by a job of 1 rank(s), this job has 2"), std::string::npos) << resumed.err;
}

}  // namespace
}  // namespace roundpipe::launcher::testing
