// End-to-end tests of `roundpipe launch` (docs/launcher.md, "roundpipe launch"): the ranks get
// torchrun's variables (checked by `roundpipe env` against values computed here), output is
// prefixed per rank, a failing rank stops the others and is named, signals are forwarded, ranks
// that ignore SIGTERM are killed after the grace period, no rank outlives launch, and bad flags
// exit with code 2 naming the flag. Every wait is bounded.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <fcntl.h>
#include <functional>
#include <map>
#include <optional>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "cli_test_util.h"

namespace roundpipe::launcher::testing {
namespace {

using Clock = std::chrono::steady_clock;
using Seconds = std::chrono::duration<double>;
using Vars = std::map<std::string, std::string>;

// Splits relayed stdout ("[rank R]: NAME=value") into each rank's NAME=value lines.
std::map<int64_t, Vars> vars_by_rank(const std::string& out) {
  std::map<int64_t, Vars> result;
  std::istringstream lines(out);
  std::string line;
  const std::regex pattern(R"(^\[rank (\d+)\]: ([A-Z_]+)=(.*)$)");
  std::smatch m;
  while (std::getline(lines, line)) {
    if (std::regex_match(line, m, pattern)) result[std::stoll(m[1])][m[2]] = m[3];
  }
  return result;
}

// The pids of launch's "started ... rank R pid P, ..." line.
std::map<int64_t, pid_t> started_pids(const std::string& err) {
  std::map<int64_t, pid_t> pids;
  const std::string start = err.substr(0, err.find('\n'));
  const std::regex pattern(R"(rank (\d+) pid (\d+))");
  for (std::sregex_iterator it(start.begin(), start.end(), pattern), end; it != end; ++it) {
    pids[std::stoll((*it)[1])] = static_cast<pid_t>(std::stol((*it)[2]));
  }
  return pids;
}

void expect_gone(const std::map<int64_t, pid_t>& pids) {
  for (const auto& [rank, pid] : pids) {
    errno = 0;
    EXPECT_EQ(::kill(pid, 0), -1) << "rank " << rank << " (pid " << pid << ") outlived launch";
    EXPECT_EQ(errno, ESRCH) << "rank " << rank << " pid " << pid;
  }
}

// torchrun's variables for global rank `rank`, written out independently of launch.cpp.
Vars torchrun_vars(int64_t rank, int64_t local_rank, int64_t nproc, int64_t nnodes, int64_t node_rank,
                   const std::string& addr, const std::string& port, const std::string& run_id,
                   const std::string& omp) {
  const std::string world = std::to_string(nproc * nnodes);
  return {{"RANK", std::to_string(rank)},           {"WORLD_SIZE", world},
          {"LOCAL_RANK", std::to_string(local_rank)}, {"LOCAL_WORLD_SIZE", std::to_string(nproc)},
          {"GROUP_RANK", std::to_string(node_rank)},  {"GROUP_WORLD_SIZE", std::to_string(nnodes)},
          {"ROLE_RANK", std::to_string(rank)},       {"ROLE_WORLD_SIZE", world},
          {"ROLE_NAME", "default"},                  {"MASTER_ADDR", addr},
          {"MASTER_PORT", port},                     {"TORCHELASTIC_RESTART_COUNT", "0"},
          {"TORCHELASTIC_MAX_RESTARTS", "0"},        {"TORCHELASTIC_RUN_ID", run_id},
          {"OMP_NUM_THREADS", omp}};
}

// `roundpipe <args>` started in the background in `dir` (stdout, stderr into files).
class Background {
 public:
  Background(const ScratchDir& dir, const std::vector<std::string>& args)
      : out_(dir.file(".bg.out")), err_(dir.file(".bg.err")) {
    std::vector<std::string> words = {ROUNDPIPE_CLI_PATH};
    words.insert(words.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (std::string& w : words) argv.push_back(w.data());
    argv.push_back(nullptr);
    const std::string cwd = dir.path();
    pid_ = ::fork();
    if (pid_ == 0) {
      const int out = ::open(out_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      const int err = ::open(err_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      if (::chdir(cwd.c_str()) != 0 || out < 0 || err < 0) ::_exit(126);
      ::dup2(out, 1);
      ::dup2(err, 2);
      ::execv(argv[0], argv.data());
      ::_exit(127);
    }
    EXPECT_GT(pid_, 0) << "fork failed";
  }
  ~Background() {
    if (pid_ > 0 && !status_) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }

  pid_t pid() const { return pid_; }
  std::string out() const { return path_exists(out_) ? read_file(out_) : ""; }
  std::string err() const { return path_exists(err_) ? read_file(err_) : ""; }

  /// Polls `done` until it holds or `timeout` passes; false on timeout.
  static bool wait_until(const std::function<bool()>& done, Seconds timeout) {
    const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(timeout);
    while (!done()) {
      if (Clock::now() >= deadline) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return true;
  }

  /// The wait status once it exited within `timeout` (else nullopt, and it is killed at destruction).
  std::optional<int> wait_exit(Seconds timeout) {
    int status = 0;
    const bool exited = wait_until([&] { return ::waitpid(pid_, &status, WNOHANG) == pid_; }, timeout);
    if (exited) status_ = status;
    return status_;
  }

 private:
  std::string out_, err_;
  pid_t pid_ = -1;
  std::optional<int> status_;
};

TEST(LaunchTest, Env_EachRankGetsTorchrunVariables) {
  ScratchDir dir;
  CliResult r = run_cli(dir, "launch --nproc-per-node 2 --master-port 23456 --run-id job7 env",
                        "env -u OMP_NUM_THREADS TORCHELASTIC_USE_AGENT_STORE=1");
  ASSERT_EQ(r.code, 0) << r.err;
  const auto vars = vars_by_rank(r.out);
  ASSERT_EQ(vars.size(), 2u) << r.out;
  for (int64_t rank : {0, 1}) {
    // launch hosts no store: TORCHELASTIC_USE_AGENT_STORE of launch's environment is not passed on.
    EXPECT_EQ(vars.at(rank), torchrun_vars(rank, rank, 2, 1, 0, "127.0.0.1", "23456", "job7", "1")) << r.out;
    // comm::LaunchEnv in the rank reads the same.
    EXPECT_NE(r.out.find("[rank " + std::to_string(rank) + "]: launch_env: rank=" + std::to_string(rank) +
                         " world_size=2 local_rank=" + std::to_string(rank) + " master=127.0.0.1:23456\n"),
              std::string::npos)
        << r.out;
  }
  EXPECT_EQ(r.err.rfind("roundpipe launch: started 2 ranks (node 0 of 1, world size 2, master 127.0.0.1:23456): "
                        "rank 0 pid ",
                        0),
            0u)
      << r.err;
  EXPECT_EQ(started_pids(r.err).size(), 2u) << r.err;
  EXPECT_EQ(r.err.find("error"), std::string::npos) << r.err;
}

TEST(LaunchTest, Env_MultiNodeRanksKeepUserThreads) {
  ScratchDir dir;
  CliResult r = run_cli(dir, "launch --nproc-per-node 2 --nnodes 3 --node-rank 2 --master-addr 10.1.2.3 env",
                        "OMP_NUM_THREADS=3");
  ASSERT_EQ(r.code, 0) << r.err;
  const auto vars = vars_by_rank(r.out);
  ASSERT_EQ(vars.size(), 2u) << r.out;
  // Node 2 of 3 with 2 ranks each holds global ranks 4 and 5; the multi-node port is torchrun's 29500.
  EXPECT_EQ(vars.at(4), torchrun_vars(4, 0, 2, 3, 2, "10.1.2.3", "29500", "none", "3")) << r.out;
  EXPECT_EQ(vars.at(5), torchrun_vars(5, 1, 2, 3, 2, "10.1.2.3", "29500", "none", "3")) << r.out;
}

TEST(LaunchTest, NoPrefix_PassesOutputThroughWithAFreePort) {
  ScratchDir dir;
  CliResult r = run_cli(dir, "launch --nproc-per-node 2 --no-prefix env");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out.find("[rank"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("\nRANK=0\n"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("\nRANK=1\n"), std::string::npos) << r.out;
  // One free port picked for both ranks, the one launch reports.
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.err, m, std::regex(R"(master 127\.0\.0\.1:(\d+)\))"))) << r.err;
  const int port = std::stoi(m[1]);
  EXPECT_GT(port, 0);
  EXPECT_LT(port, 65536);
  const std::string line = "\nMASTER_PORT=" + std::to_string(port) + "\n";
  const size_t first = r.out.find(line);
  ASSERT_NE(first, std::string::npos) << r.out;
  EXPECT_NE(r.out.find(line, first + 1), std::string::npos) << r.out;
}

TEST(LaunchTest, Command_GetsItsArgumentsAndItsExitCodeIsPropagated) {
  ScratchDir dir;
  dir.write("run.yaml", tiny_config("run"));
  CliResult ok = run_cli(dir, "launch --nproc-per-node 2 validate run.yaml train.steps=3");
  ASSERT_EQ(ok.code, 0) << ok.err;
  for (const char* rank : {"[rank 0]: ", "[rank 1]: "}) {
    EXPECT_NE(ok.out.find(std::string(rank) + "  steps: 3\n"), std::string::npos) << ok.out;
  }
  // A configuration error in every rank: launch exits with the rank's code 2 and names it.
  CliResult bad = run_cli(dir, "launch --nproc-per-node 2 validate run.yaml optimizer.lrr=1");
  EXPECT_EQ(bad.code, 2) << bad.err;
  // The first rank to fail stops the other, which may not have printed its own error yet.
  EXPECT_TRUE(bad.err.find("[rank 0]: roundpipe: error: override 'optimizer.lrr=1'") != std::string::npos ||
              bad.err.find("[rank 1]: roundpipe: error: override 'optimizer.lrr=1'") != std::string::npos)
      << bad.err;
  EXPECT_TRUE(std::regex_search(last_line(bad.err),
                                std::regex(R"(^roundpipe: error: rank [01] \(local rank [01], pid \d+\) failed with )"
                                           R"(exit code 2; other ranks: rank [01] \()")))
      << bad.err;
}

TEST(LaunchTest, RankFailure_StopsTheOthersAndNamesTheRank) {
  ScratchDir dir;
  const auto start = Clock::now();
  // Rank 1 exits 3 at once; ranks 0 and 2 would sleep 2 minutes (the bound leaves room for slow
  // starts of the 4 processes on a loaded machine).
  CliResult r = run_cli(dir, "launch --nproc-per-node 3 env --test-fail-rank 1 --test-exit-code 3 --test-sleep 120");
  const double elapsed = Seconds(Clock::now() - start).count();
  EXPECT_EQ(r.code, 3) << r.err;
  EXPECT_LT(elapsed, 90.0) << "the other ranks were not stopped";
  const std::string last = last_line(r.err);
  EXPECT_TRUE(std::regex_search(last, std::regex(R"(^roundpipe: error: rank 1 \(local rank 1, pid \d+\) failed )"
                                                 R"(with exit code 3; other ranks: )")))
      << r.err;
  EXPECT_NE(last.find("rank 0 (signal SIGTERM, stopped by launch)"), std::string::npos) << r.err;
  EXPECT_NE(last.find("rank 2 (signal SIGTERM, stopped by launch)"), std::string::npos) << r.err;
  const auto pids = started_pids(r.err);
  EXPECT_EQ(pids.size(), 3u) << r.err;
  expect_gone(pids);
}

// Starts `launch_args`, waits until both ranks printed "ready", sends SIGTERM to launch; returns
// the seconds launch took to exit after it and checks the outcome.
double sigterm_launch(const std::vector<std::string>& launch_args, const std::string& expected_rank_end) {
  ScratchDir dir;
  Background launch(dir, launch_args);
  const bool ready = Background::wait_until(
      [&] {
        const std::string out = launch.out();
        return out.find("[rank 0]: ready") != std::string::npos && out.find("[rank 1]: ready") != std::string::npos;
      },
      Seconds(60));
  EXPECT_TRUE(ready) << launch.out() << launch.err();
  if (!ready) return -1;
  const auto pids = started_pids(launch.err());
  EXPECT_EQ(pids.size(), 2u) << launch.err();
  const auto start = Clock::now();
  ::kill(launch.pid(), SIGTERM);
  const std::optional<int> status = launch.wait_exit(Seconds(30));
  const double elapsed = Seconds(Clock::now() - start).count();
  EXPECT_TRUE(status.has_value()) << "launch did not exit within 30 s of SIGTERM\n" << launch.err();
  if (!status) return -1;
  EXPECT_TRUE(WIFEXITED(*status)) << *status;
  EXPECT_EQ(WEXITSTATUS(*status), 128 + SIGTERM) << launch.err();
  const std::string last = last_line(launch.err());
  EXPECT_EQ(last.rfind("roundpipe: error: launch received SIGTERM; ranks: ", 0), 0u) << launch.err();
  for (const char* rank : {"rank 0 (", "rank 1 ("}) {
    EXPECT_NE(last.find(rank + expected_rank_end), std::string::npos) << launch.err();
  }
  expect_gone(pids);
  return elapsed;
}

TEST(LaunchTest, Sigterm_IsForwardedAndNoRankOutlivesLaunch) {
  const double elapsed = sigterm_launch({"launch", "--nproc-per-node", "2", "env", "--test-sleep", "60"},
                                        "signal SIGTERM, stopped by launch)");
  EXPECT_GE(elapsed, 0.0);
  EXPECT_LT(elapsed, 5.0) << "the ranks should end on the forwarded SIGTERM, before the 5 s grace period";
}

TEST(LaunchTest, IgnoredSigterm_KilledAfterTheGracePeriod) {
  const double elapsed =
      sigterm_launch({"launch", "--nproc-per-node", "2", "--grace-period", "1", "env", "--test-ignore-sigterm",
                      "--test-sleep", "60"},
                     "signal SIGKILL, stopped by launch)");
  EXPECT_GE(elapsed, 1.0) << "SIGKILL came before the grace period";
  EXPECT_LT(elapsed, 10.0);
}

// A rank whose launch is SIGKILLed (no chance to forward anything) is killed by the kernel
// (PR_SET_PDEATHSIG). Its zombie is init's to reap, so a zombie counts as gone here.
TEST(LaunchTest, SigkilledLaunch_TakesItsRanksAlong) {
  ScratchDir dir;
  Background launch(dir, {"launch", "--nproc-per-node", "2", "env", "--test-sleep", "60"});
  ASSERT_TRUE(Background::wait_until([&] { return started_pids(launch.err()).size() == 2; }, Seconds(60)))
      << launch.err();
  const auto pids = started_pids(launch.err());
  ::kill(launch.pid(), SIGKILL);
  ASSERT_TRUE(launch.wait_exit(Seconds(30)).has_value());
  auto running = [](pid_t pid) {
    if (::kill(pid, 0) != 0) return false;
    const std::string stat = path_exists("/proc/" + std::to_string(pid) + "/stat")
                                 ? read_file("/proc/" + std::to_string(pid) + "/stat")
                                 : "";
    const size_t paren = stat.rfind(')');
    return paren != std::string::npos && stat.size() > paren + 2 && stat[paren + 2] != 'Z';
  };
  for (const auto& [rank, pid] : pids) {
    EXPECT_TRUE(Background::wait_until([&, pid = pid] { return !running(pid); }, Seconds(10)))
        << "rank " << rank << " (pid " << pid << ") outlived a SIGKILLed launch";
  }
}

struct BadLaunch {
  const char* args;
  const char* expected;
};

TEST(LaunchTest, BadArguments_ExitWithCode2NamingTheFlag) {
  ScratchDir dir;
  const std::vector<BadLaunch> cases = {
      {"launch --nproc-per-node 0 env", "--nproc-per-node=0 must be >= 1"},
      {"launch --nnodes 0 env", "--nnodes=0 must be >= 1"},
      {"launch --nnodes 2 --node-rank 2 --master-addr h env", "--node-rank=2 must be in [0, --nnodes=2)"},
      {"launch --node-rank -1 env", "--node-rank=-1"},
      {"launch --nnodes 2 env", "needs --master-addr"},
      {"launch --master-port 70000 env", "--master-port=70000 is not a TCP port"},
      {"launch --grace-period -1 env", "--grace-period=-1"},
      {"launch --nproc-per-node 2", "no command to run"},
      {"launch --nproc-per-node 2 trian run.yaml", "'trian' is not a command the ranks can run: one of train, "},
      {"launch launch env", "a rank cannot run `launch` itself"},
      {"launch --bogus 1 env", "unknown option '--bogus'"},
      {"launch --nproc-per-node two env", nullptr},  // CLI11's own message
  };
  for (const BadLaunch& c : cases) {
    CliResult r = run_cli(dir, c.args);
    EXPECT_EQ(r.code, 2) << c.args << "\n" << r.err;
    EXPECT_EQ(r.out, "") << c.args;
    if (c.expected != nullptr) {
      EXPECT_EQ(r.err.rfind("roundpipe: error: launch: ", 0), 0u) << c.args << "\n" << r.err;
      EXPECT_NE(r.err.find(c.expected), std::string::npos) << c.args << "\n" << r.err;
    }
  }
  EXPECT_EQ(run_cli(dir, "launch --help").code, 0);
}

}  // namespace
}  // namespace roundpipe::launcher::testing
