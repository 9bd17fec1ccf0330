// `roundpipe train` as a data-parallel job: started by `roundpipe launch --nproc-per-node 2` and by
// `torchrun --no-python`, with train.batch_size 4 per rank, it must export the same weights as one
// process with batch_size 8 (the same global batches; docs/distributed.md).
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "cli_test_util.h"
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
