#include "tests/common/multi_process.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <torch/cuda.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <thread>

namespace roundpipe::testing {

int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) throw std::runtime_error("free_port: socket() failed");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    ::close(fd);
    throw std::runtime_error("free_port: bind() failed");
  }
  const int port = ntohs(addr.sin_port);
  ::close(fd);
  return port;
}

std::string make_temp_dir(const std::string& prefix) {
  const char* tmp = std::getenv("TMPDIR");
  std::string pattern = std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/" + prefix + "XXXXXX";
  if (::mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp failed for " + pattern);
  return pattern;
}

std::vector<RankResult> run_ranks(const std::string& worker_test, int world_size,
                                  const std::map<std::string, std::string>& env, std::chrono::seconds timeout,
                                  const std::vector<int>& ranks) {
  std::vector<int> which = ranks;
  if (which.empty()) {
    for (int r = 0; r < world_size; ++r) which.push_back(r);
  }
  const std::string port = std::to_string(free_port());
  const std::string dir = make_temp_dir("roundpipe-ranks-");
  char self[4096];
  const ssize_t n = ::readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n <= 0) throw std::runtime_error("run_ranks: cannot read /proc/self/exe");
  self[n] = '\0';
  const std::string filter = "--gtest_filter=" + worker_test;

  std::vector<pid_t> pids;
  std::vector<std::string> logs;
  for (int r : which) {
    logs.push_back(dir + "/rank" + std::to_string(r) + ".log");
    const pid_t pid = ::fork();
    if (pid < 0) throw std::runtime_error("run_ranks: fork failed");
    if (pid == 0) {
      const int out = ::open(logs.back().c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      if (out >= 0) {
        ::dup2(out, 1);
        ::dup2(out, 2);
      }
      ::setenv("RANK", std::to_string(r).c_str(), 1);
      ::setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
      ::setenv("WORLD_SIZE", std::to_string(world_size).c_str(), 1);
      ::setenv("LOCAL_WORLD_SIZE", std::to_string(world_size).c_str(), 1);
      ::setenv("MASTER_ADDR", "127.0.0.1", 1);
      ::setenv("MASTER_PORT", port.c_str(), 1);
      ::setenv("OMP_NUM_THREADS", "1", 0);
      ::unsetenv("GTEST_TOTAL_SHARDS");  // the worker test must run whatever shard ctest gave the parent
      ::unsetenv("GTEST_SHARD_INDEX");
      ::unsetenv("GTEST_OUTPUT");
      for (const auto& [k, v] : env) ::setenv(k.c_str(), v.c_str(), 1);
      ::execl(self, self, filter.c_str(), "--gtest_also_run_disabled_tests", static_cast<char*>(nullptr));
      ::_exit(127);
    }
    pids.push_back(pid);
  }

  std::vector<RankResult> results(pids.size());
  std::vector<bool> done(pids.size(), false);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  size_t remaining = pids.size();
  while (remaining > 0) {
    for (size_t k = 0; k < pids.size(); ++k) {
      if (done[k]) continue;
      int status = 0;
      if (::waitpid(pids[k], &status, WNOHANG) == pids[k]) {
        done[k] = true;
        --remaining;
        if (WIFSIGNALED(status)) {
          results[k].signaled = true;
          results[k].signal = WTERMSIG(status);
        } else {
          results[k].exit_code = WEXITSTATUS(status);
        }
      }
    }
    if (remaining == 0) break;
    if (std::chrono::steady_clock::now() > deadline) {
      for (size_t k = 0; k < pids.size(); ++k) {
        if (done[k]) continue;
        ::kill(pids[k], SIGKILL);
        ::waitpid(pids[k], nullptr, 0);
        results[k].timed_out = true;
        done[k] = true;
      }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  for (size_t k = 0; k < pids.size(); ++k) {
    std::ifstream in(logs[k]);
    std::stringstream text;
    text << in.rdbuf();
    results[k].output = text.str();
  }
  return results;
}

std::string describe(const std::vector<RankResult>& results) {
  std::ostringstream out;
  for (size_t k = 0; k < results.size(); ++k) {
    const auto& r = results[k];
    out << "---- rank #" << k << ": "
        << (r.timed_out ? "timed out" : r.signaled ? "signal " + std::to_string(r.signal)
                                                    : "exit " + std::to_string(r.exit_code))
        << "\n"
        << r.output << "\n";
  }
  return out.str();
}

int nccl_test_gpu() {
  const char* local_rank = std::getenv("LOCAL_RANK");
  const auto gpus = static_cast<int>(torch::cuda::device_count());
  return gpus == 0 || local_rank == nullptr ? 0 : std::atoi(local_rank) % gpus;
}

std::string nccl_test_skip_reason(int world_size) {
  const auto gpus = static_cast<int>(torch::cuda::device_count());
  if (gpus >= world_size || std::getenv("ROUNDPIPE_TEST_NCCL_SHARED_GPU") != nullptr) return "";
  return "NCCL needs a GPU per rank: " + std::to_string(world_size) + " ranks, " + std::to_string(gpus) +
         " GPU(s) visible (ROUNDPIPE_TEST_NCCL_SHARED_GPU=1 lets ranks share them)";
}

}  // namespace roundpipe::testing
