// SIGKILL at random points of a `roundpipe train` run (docs/reliability.md): during training and
// during checkpoint writes (the staging directory is polled for and the process killed while it
// exists). After every kill each published checkpoint, `latest` included, is complete (every file
// present and readable) and its weights are bitwise equal to the uninterrupted run's checkpoint of
// the same step (optimizer.pt is not compared byte for byte: LibTorch archives carry a random
// serialization id); the run resumed from `latest`
// (or restarted when none was published yet) finishes with weights and metrics bitwise equal to
// the uninterrupted run's.
#include <dirent.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <torch/serialize/input-archive.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <iostream>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "roundpipe/launcher/atomic_file.h"
#include "roundpipe/launcher/metrics.h"
#include "roundpipe/models/safetensors.h"
#include "tests/launcher/cli_test_util.h"
#include "tests/reliability/reliability_util.h"

namespace roundpipe::launcher::testing {
namespace {

constexpr unsigned kTestSeconds = 240;
constexpr auto kRunTimeout = std::chrono::seconds(60);
constexpr int64_t kSteps = 8;
constexpr uint32_t kSeed = 20261123;  // the kill points; printed with each kill

using Clock = std::chrono::steady_clock;

const char* kArgs =
    " train.steps=8 checkpoint.every=2 checkpoint.keep=100 eval.every=0 amp.scaler=true amp.growth_interval=3"
    " train.clip_grad_norm=0.5";

// `roundpipe train run.yaml <kArgs> [--resume]` in `dir`, output appended to dir/cli.log.
pid_t spawn_train(const ScratchDir& dir, bool resume) {
  std::vector<std::string> words = {ROUNDPIPE_CLI_PATH, "train", "run.yaml"};
  std::string rest = kArgs;
  for (size_t begin = 0; (begin = rest.find_first_not_of(' ', begin)) != std::string::npos;) {
    const size_t end = rest.find(' ', begin);
    words.push_back(rest.substr(begin, end == std::string::npos ? std::string::npos : end - begin));
    begin = end == std::string::npos ? rest.size() : end;
  }
  if (resume) words.push_back("--resume");
  std::vector<char*> argv;
  for (auto& w : words) argv.push_back(w.data());
  argv.push_back(nullptr);
  const std::string log = dir.file("cli.log");
  const pid_t pid = ::fork();
  if (pid == 0) {  // async-signal-safe calls only until exec
    if (::chdir(dir.path().c_str()) != 0) ::_exit(126);
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (fd < 0 || ::dup2(fd, 1) < 0 || ::dup2(fd, 2) < 0) ::_exit(126);
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  return pid;
}

// The exit status once the child exited, or nullopt while it runs.
std::optional<int> poll_exit(pid_t pid) {
  int status = 0;
  const pid_t got = ::waitpid(pid, &status, WNOHANG);
  if (got == 0) return std::nullopt;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
}

int wait_exit(pid_t pid) {
  const auto deadline = Clock::now() + kRunTimeout;
  while (Clock::now() < deadline) {
    if (auto code = poll_exit(pid)) return *code;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  ::kill(pid, SIGKILL);
  ::waitpid(pid, nullptr, 0);
  ADD_FAILURE() << "roundpipe train did not finish within " << kRunTimeout.count() << " s";
  return -1;
}

bool has_staging_entry(const std::string& dir) {
  DIR* handle = ::opendir(dir.c_str());
  if (handle == nullptr) return false;
  bool found = false;
  while (dirent* entry = ::readdir(handle)) found = found || std::strncmp(entry->d_name, ".tmp", 4) == 0;
  ::closedir(handle);
  return found;
}

void expect_same_checkpoint(const std::string& ours, const std::string& theirs, const std::string& when) {
  for (const char* f : {"config.json", "model.safetensors", "optimizer.pt", "trainer_state.pt", "config.yaml"}) {
    ASSERT_TRUE(is_regular_file(join_path(ours, f))) << when << ": " << ours << " lacks " << f;
  }
  auto a = models::CheckpointReader::open(ours);
  auto b = models::CheckpointReader::open(theirs);
  ASSERT_EQ(a.names(), b.names()) << when;
  for (const std::string& name : a.names()) {
    EXPECT_TRUE(a.get(name).equal(b.get(name))) << when << ": " << name << " differs in " << ours;
  }
  torch::serialize::InputArchive optimizer;
  optimizer.load_from(join_path(ours, "optimizer.pt"));  // readable (throws on a torn archive)
  torch::serialize::InputArchive archive;
  archive.load_from(join_path(ours, "trainer_state.pt"));
  at::Tensor step;
  archive.read("step", step);
  EXPECT_EQ(step_dir_name(step.item<int64_t>()), ours.substr(ours.rfind('/') + 1)) << when;
}

// Every published checkpoint of the interrupted run is complete and equal to the straight run's.
void check_checkpoints(const std::string& run, const std::string& straight, const std::string& when) {
  const std::string parent = join_path(run, "checkpoints");
  for (int64_t step : list_step_dirs(parent)) {
    expect_same_checkpoint(join_path(parent, step_dir_name(step)),
                           join_path(join_path(straight, "checkpoints"), step_dir_name(step)), when);
  }
  if (auto latest = read_symlink(join_path(parent, "latest"))) {
    EXPECT_TRUE(is_regular_file(join_path(join_path(parent, *latest), "trainer_state.pt")))
        << when << ": latest -> " << *latest;
  }
}

TEST(LauncherKillTest, SigkillDuringTrainingAndCheckpointWrites_ResumeIsBitwiseEqual) {
  roundpipe::testing::Watchdog watchdog(kTestSeconds);
  ScratchDir straight_dir, dir;
  straight_dir.write("run.yaml", tiny_config("run"));
  dir.write("run.yaml", tiny_config("run"));
  const auto t0 = Clock::now();
  ASSERT_EQ(wait_exit(spawn_train(straight_dir, false)), 0) << read_file(straight_dir.file("cli.log"));
  const auto straight_ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count();
  const std::string straight = straight_dir.file("run");
  ASSERT_EQ(list_step_dirs(join_path(straight, "checkpoints")).size(), static_cast<size_t>(kSteps / 2));

  std::mt19937 rng(kSeed);
  const std::string run = dir.file("run");
  const std::string checkpoints = join_path(run, "checkpoints");
  int kills = 0, kills_in_write = 0;
  bool finished = false;
  for (int attempt = 0; attempt < 6 && !finished; ++attempt) {
    const std::optional<std::string> latest = read_symlink(join_path(checkpoints, "latest"));
    const int64_t resume_step = latest ? parse_step_dir_name(*latest).value_or(0) : 0;
    const pid_t pid = spawn_train(dir, latest.has_value());
    // Even attempts: a random time into what is left of the run; odd: during a checkpoint write
    // (the first one seen in attempt 1, else one of the next three still to come).
    const bool in_write = attempt % 2 == 1;
    // At most half the time the straight run took for the steps left: a run that happens to be
    // faster than the straight one (a loaded machine slowed that one) is still killed.
    const int64_t left_ms = std::max<int64_t>(200, straight_ms * (kSteps - resume_step) / kSteps);
    const auto delay = std::chrono::milliseconds(std::uniform_int_distribution<int64_t>(0, left_ms / 2)(rng));
    const int writes_left = static_cast<int>((kSteps - resume_step) / 2);
    int skip_writes =
        attempt == 1 ? 0 : std::uniform_int_distribution<int>(0, std::max(0, std::min(2, writes_left - 1)))(rng);
    const auto start = Clock::now();
    bool was_writing = false, write_seen = false;
    std::optional<int> code;
    while (!(code = poll_exit(pid))) {
      if (Clock::now() - start > kRunTimeout) break;
      if (in_write) {
        const bool writing = has_staging_entry(checkpoints);
        if (writing && !was_writing && skip_writes-- == 0) {
          write_seen = true;
          break;
        }
        was_writing = writing;
        std::this_thread::sleep_for(std::chrono::microseconds(100));
      } else {
        if (Clock::now() - start >= delay) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    }
    if (code) {  // finished before the kill point
      ASSERT_EQ(*code, 0) << read_file(dir.file("cli.log"));
      finished = true;
      break;
    }
    const bool resume = latest.has_value();
    ::kill(pid, SIGKILL);
    ::waitpid(pid, nullptr, 0);
    ++kills;
    kills_in_write += write_seen ? 1 : 0;
    const std::string when = "after kill " + std::to_string(kills) + " (" +
                             (in_write ? "checkpoint write" : std::to_string(delay.count()) + " ms into the run") +
                             ", resume " + (resume ? "yes" : "no") + ")";
    std::cout << "[kill] " << when << "; latest -> "
              << read_symlink(join_path(checkpoints, "latest")).value_or("(none)") << "\n";
    check_checkpoints(run, straight, when);
    if (::testing::Test::HasFailure()) return;
  }
  if (!finished) {
    const bool resume = read_symlink(join_path(checkpoints, "latest")).has_value();
    ASSERT_EQ(wait_exit(spawn_train(dir, resume)), 0) << read_file(dir.file("cli.log"));
  }
  EXPECT_GE(kills, 3);
  EXPECT_GE(kills_in_write, 1);
  check_checkpoints(run, straight, "at the end");
  expect_same_checkpoint(join_path(checkpoints, step_dir_name(kSteps)),
                         join_path(join_path(straight, "checkpoints"), step_dir_name(kSteps)), "final");
  EXPECT_EQ(read_symlink(join_path(checkpoints, "latest")), std::optional<std::string>(step_dir_name(kSteps)));
  // The metrics: every step once, with the straight run's values (times and throughput aside).
  MetricsLog ours = read_metrics(join_path(run, "metrics.jsonl"));
  MetricsLog theirs = read_metrics(join_path(straight, "metrics.jsonl"));
  ASSERT_EQ(ours.train.size(), theirs.train.size());
  for (size_t i = 0; i < ours.train.size(); ++i) {
    EXPECT_EQ(ours.train[i].step, theirs.train[i].step);
    EXPECT_EQ(ours.train[i].loss, theirs.train[i].loss) << "step " << theirs.train[i].step;
    EXPECT_EQ(ours.train[i].lr, theirs.train[i].lr) << "step " << theirs.train[i].step;
    EXPECT_EQ(ours.train[i].tokens, theirs.train[i].tokens) << "step " << theirs.train[i].step;
    EXPECT_EQ(ours.train[i].scale, theirs.train[i].scale) << "step " << theirs.train[i].step;
  }
  std::cout << "[kill] " << kills << " kills (" << kills_in_write << " as a checkpoint staging directory appeared); straight run "
            << straight_ms << " ms\n";
}

}  // namespace
}  // namespace roundpipe::launcher::testing
