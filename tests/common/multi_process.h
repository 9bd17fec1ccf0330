// Runs one test of the current test binary as N ranks of a distributed job (separate processes with
// torchrun's environment on 127.0.0.1), for the data-parallel tests.
#pragma once

#include <chrono>
#include <map>
#include <string>
#include <vector>

namespace roundpipe::testing {

/// How one rank ended.
struct RankResult {
  int exit_code = -1;    // valid when !signaled && !timed_out
  int signal = 0;        // the signal that ended it, when signaled
  bool signaled = false;
  bool timed_out = false;  // killed by run_ranks after the timeout
  std::string output;    // stdout and stderr together
  bool passed() const { return !signaled && !timed_out && exit_code == 0; }
};

/// A free TCP port on 127.0.0.1 (bound then released: another process may take it in between).
int free_port();

/// Starts this binary once per rank in `ranks` (default: every rank of `world_size`) with
/// `--gtest_filter=<worker_test> --gtest_also_run_disabled_tests` and RANK, WORLD_SIZE,
/// LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT (a free port), plus `env`;
/// waits for all, killing every rank still running after `timeout`. Worker tests are named
/// DISABLED_* so that they only run this way.
std::vector<RankResult> run_ranks(const std::string& worker_test, int world_size,
                                  const std::map<std::string, std::string>& env = {},
                                  std::chrono::seconds timeout = std::chrono::seconds(120),
                                  const std::vector<int>& ranks = {});

/// Every rank's output, for failure messages.
std::string describe(const std::vector<RankResult>& results);

/// The GPU a rank of an NCCL test uses: LOCAL_RANK modulo the visible GPUs (NCCL refuses two ranks
/// of one communicator on one GPU: "Duplicate GPU detected").
int nccl_test_gpu();

/// Empty when an NCCL test of `world_size` ranks can run here (a GPU per rank), else why not, for
/// GTEST_SKIP. ROUNDPIPE_TEST_NCCL_SHARED_GPU=1 lets ranks share GPUs anyway.
std::string nccl_test_skip_reason(int world_size);

/// A fresh empty directory under $TMPDIR (not removed).
std::string make_temp_dir(const std::string& prefix);

}  // namespace roundpipe::testing
