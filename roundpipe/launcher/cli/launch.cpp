#include "roundpipe/launcher/cli/launch.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <optional>
#include <sstream>
#include <thread>

#include "comm/launch_env.h"
#include "roundpipe/launcher/config.h"

extern char** environ;

namespace roundpipe::launcher {
namespace {

using Clock = std::chrono::steady_clock;

constexpr int64_t kDefaultMasterPort = 29500;
// Signals launch forwards to every rank (torchrun handles the same four).
constexpr int kForwardedSignals[] = {SIGINT, SIGTERM, SIGHUP, SIGQUIT};
// After the last rank exited, output still buffered in the pipes (or held open by a process a rank
// left behind) is relayed for at most this long.
constexpr auto kDrainTimeout = std::chrono::seconds(1);
// A line longer than this without a newline is relayed in pieces.
constexpr size_t kMaxLineBytes = 64 * 1024;

std::string signal_name(int signo) {
  switch (signo) {
    case SIGINT: return "SIGINT";
    case SIGTERM: return "SIGTERM";
    case SIGHUP: return "SIGHUP";
    case SIGQUIT: return "SIGQUIT";
    case SIGKILL: return "SIGKILL";
    case SIGSEGV: return "SIGSEGV";
    case SIGABRT: return "SIGABRT";
    case SIGBUS: return "SIGBUS";
    case SIGFPE: return "SIGFPE";
    case SIGILL: return "SIGILL";
    case SIGPIPE: return "SIGPIPE";
    default: return "signal " + std::to_string(signo);
  }
}

// Note [Master port]: with one node nothing outside this machine needs to know the port, so by
// default launch asks the kernel for a free one (as torchrun --standalone does): two jobs on one
// machine, or parallel tests, never collide on 29500. The port is free when launch picks it; rank 0
// binds it a moment later (the window where another process could take it is that short). With
// several nodes every node must agree, so the default is torchrun's fixed 29500.
int64_t pick_free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) throw ConfigError("launch: cannot open a socket to pick a free --master-port: " +
                                std::string(std::strerror(errno)) + "; pass --master-port");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0;
  const int saved = errno;
  ::close(fd);
  if (!ok) throw ConfigError("launch: cannot pick a free --master-port: " + std::string(std::strerror(saved)) +
                             "; pass --master-port");
  return ntohs(addr.sin_port);
}

// write(2) until everything is out; errors (a closed stdout) are ignored: the ranks keep running.
void write_all(int fd, const char* data, size_t size) {
  while (size > 0) {
    const ssize_t n = ::write(fd, data, size);
    if (n < 0) {
      if (errno == EINTR) continue;
      return;
    }
    data += n;
    size -= static_cast<size_t>(n);
  }
}

// The write end of the self-pipe the signal handler reports to (Note [Launch supervision]).
int g_signal_pipe_write = -1;

extern "C" void on_signal(int signo) {
  const int saved = errno;
  const unsigned char byte = static_cast<unsigned char>(signo);
  [[maybe_unused]] const ssize_t n = ::write(g_signal_pipe_write, &byte, 1);
  errno = saved;
}

// One relayed output stream of a rank (its stdout or stderr).
struct Stream {
  int fd = -1;         // launch's read end; -1 once closed
  int target = -1;     // 1 or 2
  std::string buffer;  // bytes after the last newline
};

struct RankProcess {
  int64_t rank = 0;
  int64_t local_rank = 0;
  pid_t pid = -1;
  bool running = false;
  int status = 0;       // waitpid status once exited
  int signal_sent = 0;  // the first signal launch sent it, 0 if none
  Stream out, err;
};

std::string describe_exit(int status) {
  if (WIFEXITED(status)) return "exit code " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return "signal " + signal_name(WTERMSIG(status));
  return "status " + std::to_string(status);
}

bool failed(int status) { return !(WIFEXITED(status) && WEXITSTATUS(status) == 0); }

// Note [Launch supervision]: launch is one thread around poll(2). The signal handlers only write
// the signal number into a self-pipe, so forwarding, reaping (SIGCHLD) and relaying output all
// happen in the loop. Each rank runs in its own process group: a Ctrl-C on the terminal reaches
// launch only (which forwards it once), and signals launch sends reach whatever the rank started.
// Each rank also gets PR_SET_PDEATHSIG=SIGKILL, so a launch killed by SIGKILL leaves no rank behind.
// When a rank fails (non-zero exit or a signal) and launch is not already stopping, launch sends
// SIGTERM to the others; when launch receives a signal it forwards that signal. Either way the
// ranks still running grace_period_s later get SIGKILL. Only ranks not yet reaped are signalled,
// so a recycled pid is never hit. The loop ends when every rank is reaped and its pipes are drained.
class Supervisor {
 public:
  Supervisor(const LaunchOptions& options, std::string argv0) : options_(options), argv0_(std::move(argv0)) {}

  int run() {
    install_signal_handlers();
    start_ranks();
    print_started();
    loop();
    restore_signal_handlers();
    return summarize();
  }

 private:
  void install_signal_handlers() {
    int fds[2];
    if (::pipe2(fds, O_CLOEXEC | O_NONBLOCK) != 0) throw std::runtime_error("launch: pipe2 failed");
    signal_read_ = fds[0];
    g_signal_pipe_write = fds[1];
    struct sigaction action {};
    action.sa_handler = on_signal;
    sigemptyset(&action.sa_mask);
    action.sa_flags = SA_RESTART;
    for (int signo : kForwardedSignals) ::sigaction(signo, &action, &saved_actions_[signo]);
    action.sa_flags = SA_RESTART | SA_NOCLDSTOP;
    ::sigaction(SIGCHLD, &action, &saved_actions_[SIGCHLD]);
    struct sigaction ignore {};
    ignore.sa_handler = SIG_IGN;
    ::sigaction(SIGPIPE, &ignore, &saved_actions_[SIGPIPE]);  // a closed stdout must not kill launch
  }

  void restore_signal_handlers() {
    for (int signo : {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGCHLD, SIGPIPE}) {
      ::sigaction(signo, &saved_actions_[signo], nullptr);
    }
    ::close(signal_read_);
    ::close(g_signal_pipe_write);
    g_signal_pipe_write = -1;
  }

  // Everything the children need is built before fork: between fork and exec a child calls only
  // async-signal-safe functions (launch may share its address space with LibTorch's threads).
  void start_ranks() {
    std::vector<std::string> argv_strings = {argv0_};
    argv_strings.insert(argv_strings.end(), options_.command.begin(), options_.command.end());
    std::vector<char*> argv;
    for (std::string& s : argv_strings) argv.push_back(s.data());
    argv.push_back(nullptr);

    const int null_fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    const pid_t parent = ::getpid();
    sigset_t all, old_mask;
    sigfillset(&all);
    ranks_.resize(static_cast<size_t>(options_.nproc_per_node));
    for (int64_t local = 0; local < options_.nproc_per_node; ++local) {
      RankProcess& r = ranks_[static_cast<size_t>(local)];
      r.local_rank = local;
      r.rank = options_.node_rank * options_.nproc_per_node + local;
      std::vector<std::string> env_strings = child_environment(local);
      std::vector<char*> envp;
      for (std::string& s : env_strings) envp.push_back(s.data());
      envp.push_back(nullptr);
      int out_pipe[2] = {-1, -1}, err_pipe[2] = {-1, -1};
      if (options_.prefix_output && (::pipe2(out_pipe, O_CLOEXEC) != 0 || ::pipe2(err_pipe, O_CLOEXEC) != 0)) {
        const std::string reason = std::strerror(errno);
        for (int fd : {out_pipe[0], out_pipe[1], err_pipe[0], err_pipe[1]}) {
          if (fd >= 0) ::close(fd);
        }
        fail_start(local, null_fd, "cannot create the output pipes of local rank " + std::to_string(local) + ": " + reason);
      }
      // Blocked so that no handler of launch runs in the child before it resets them.
      ::sigprocmask(SIG_SETMASK, &all, &old_mask);
      const pid_t pid = ::fork();
      if (pid == 0) {
        for (int signo : {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGCHLD, SIGPIPE}) ::signal(signo, SIG_DFL);
        ::setpgid(0, 0);
        ::prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (::getppid() != parent) ::_exit(127);  // launch died before prctl
        if (null_fd >= 0) ::dup2(null_fd, 0);
        if (out_pipe[1] >= 0) ::dup2(out_pipe[1], 1);
        if (err_pipe[1] >= 0) ::dup2(err_pipe[1], 2);
        ::sigprocmask(SIG_SETMASK, &old_mask, nullptr);
        ::execve("/proc/self/exe", argv.data(), envp.data());
        static const char kMessage[] = "roundpipe launch: cannot execute /proc/self/exe\n";
        write_all(2, kMessage, sizeof(kMessage) - 1);
        ::_exit(127);
      }
      const int fork_errno = errno;
      ::sigprocmask(SIG_SETMASK, &old_mask, nullptr);
      if (options_.prefix_output) {
        ::close(out_pipe[1]);
        ::close(err_pipe[1]);
      }
      if (pid < 0) {
        if (options_.prefix_output) {
          ::close(out_pipe[0]);
          ::close(err_pipe[0]);
        }
        fail_start(local, null_fd, "fork of local rank " + std::to_string(local) + " failed: " + std::strerror(fork_errno));
      }
      ::setpgid(pid, pid);  // also here, so the group exists before launch signals it (errors: the child did it)
      r.pid = pid;
      r.running = true;
      r.out = Stream{out_pipe[0], 1, {}};
      r.err = Stream{err_pipe[0], 2, {}};
    }
    if (null_fd >= 0) ::close(null_fd);
  }

  // Stops the ranks started so far (local ranks below `local`), waits for them, then throws.
  [[noreturn]] void fail_start(int64_t local, int null_fd, const std::string& message) {
    if (null_fd >= 0) ::close(null_fd);
    ranks_.resize(static_cast<size_t>(local));
    stop(SIGTERM);
    loop();
    restore_signal_handlers();
    throw std::runtime_error("launch: " + message);
  }

  // launch's environment with the rank's variables replaced; TORCHELASTIC_USE_AGENT_STORE is
  // dropped because launch hosts no store (rank 0 does).
  std::vector<std::string> child_environment(int64_t local_rank) const {
    const auto vars = rank_environment(options_, local_rank);
    std::vector<std::string> env;
    for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
      const std::string entry(*e);
      const std::string name = entry.substr(0, entry.find('='));
      const bool replaced = name == "TORCHELASTIC_USE_AGENT_STORE" ||
                            std::any_of(vars.begin(), vars.end(), [&](const auto& v) { return v.first == name; });
      if (!replaced) env.push_back(entry);
    }
    for (const auto& [name, value] : vars) env.push_back(name + "=" + value);
    return env;
  }

  void print_started() const {
    std::ostringstream line;
    line << "roundpipe launch: started " << ranks_.size() << (ranks_.size() == 1 ? " rank" : " ranks")
         << " (node " << options_.node_rank << " of " << options_.nnodes << ", world size "
         << options_.nnodes * options_.nproc_per_node << ", master " << options_.master_addr << ":"
         << options_.master_port << "):";
    for (const RankProcess& r : ranks_) line << (r.local_rank == 0 ? " " : ", ") << "rank " << r.rank << " pid " << r.pid;
    line << "\n";
    const std::string text = line.str();
    write_all(2, text.data(), text.size());
  }

  bool any_running() const {
    return std::any_of(ranks_.begin(), ranks_.end(), [](const RankProcess& r) { return r.running; });
  }

  void signal_running(int signo) {
    for (RankProcess& r : ranks_) {
      if (!r.running) continue;
      if (::kill(-r.pid, signo) != 0) ::kill(r.pid, signo);
      if (r.signal_sent == 0) r.signal_sent = signo;
    }
  }

  // Sends `signo` to the running ranks and starts the grace period (once).
  void stop(int signo) {
    signal_running(signo);
    if (!kill_deadline_) kill_deadline_ = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                                             std::chrono::duration<double>(options_.grace_period_s));
  }

  void reap() {
    for (size_t i = 0; i < ranks_.size(); ++i) {
      RankProcess& r = ranks_[i];
      if (!r.running) continue;
      int status = 0;
      const pid_t done = ::waitpid(r.pid, &status, WNOHANG);
      if (done != r.pid) continue;
      r.running = false;
      r.status = status;
      if (failed(status) && !first_failure_ && !received_signal_) {
        first_failure_ = i;
        const std::string text = "roundpipe launch: rank " + std::to_string(r.rank) + " failed (" +
                                 describe_exit(status) + "); stopping the other ranks\n";
        write_all(2, text.data(), text.size());
        stop(SIGTERM);
      }
    }
  }

  void relay(Stream& s, const std::string& prefix, bool flush_all) {
    size_t begin = 0;
    while (true) {
      const size_t newline = s.buffer.find('\n', begin);
      if (newline == std::string::npos) break;
      const std::string line = prefix + s.buffer.substr(begin, newline + 1 - begin);
      write_all(s.target, line.data(), line.size());
      begin = newline + 1;
    }
    s.buffer.erase(0, begin);
    if (!s.buffer.empty() && (flush_all || s.buffer.size() >= kMaxLineBytes)) {
      const std::string line = prefix + s.buffer + "\n";
      write_all(s.target, line.data(), line.size());
      s.buffer.clear();
    }
  }

  void read_stream(Stream& s, const std::string& prefix) {
    char chunk[65536];
    const ssize_t n = ::read(s.fd, chunk, sizeof(chunk));
    if (n < 0 && errno == EINTR) return;
    if (n <= 0) {
      ::close(s.fd);
      s.fd = -1;
      relay(s, prefix, /*flush_all=*/true);
      return;
    }
    s.buffer.append(chunk, static_cast<size_t>(n));
    relay(s, prefix, /*flush_all=*/false);
  }

  void handle_signals() {
    unsigned char bytes[64];
    ssize_t n;
    while ((n = ::read(signal_read_, bytes, sizeof(bytes))) > 0) {
      for (ssize_t i = 0; i < n; ++i) {
        const int signo = bytes[i];
        if (signo == SIGCHLD) continue;  // reaped at the top of the loop
        if (!received_signal_) {
          received_signal_ = signo;
          const std::string text = "roundpipe launch: received " + signal_name(signo) + "; forwarding it to the ranks\n";
          write_all(2, text.data(), text.size());
        }
        stop(signo);
      }
    }
  }

  int poll_timeout_ms(Clock::time_point now) const {
    std::optional<Clock::time_point> wake;
    if (kill_deadline_ && !killed_) wake = *kill_deadline_;
    if (drain_deadline_) wake = wake ? std::min(*wake, *drain_deadline_) : *drain_deadline_;
    if (!wake) return -1;
    if (*wake <= now) return 0;
    return static_cast<int>(std::chrono::ceil<std::chrono::milliseconds>(*wake - now).count());
  }

  void loop() {
    while (true) {
      reap();
      const Clock::time_point now = Clock::now();
      if (kill_deadline_ && !killed_ && now >= *kill_deadline_ && any_running()) {
        signal_running(SIGKILL);
        killed_ = true;
      }
      std::vector<pollfd> fds = {{signal_read_, POLLIN, 0}};
      std::vector<std::pair<Stream*, const RankProcess*>> streams;
      for (RankProcess& r : ranks_) {
        for (Stream* s : {&r.out, &r.err}) {
          if (s->fd < 0) continue;
          fds.push_back({s->fd, POLLIN, 0});
          streams.emplace_back(s, &r);
        }
      }
      if (!any_running()) {
        if (streams.empty()) return;
        if (!drain_deadline_) drain_deadline_ = now + kDrainTimeout;
        if (now >= *drain_deadline_) {
          for (auto& [s, r] : streams) {
            ::close(s->fd);
            s->fd = -1;
            relay(*s, prefix_of(*r), /*flush_all=*/true);
          }
          return;
        }
      }
      const int ready = ::poll(fds.data(), fds.size(), poll_timeout_ms(now));
      if (ready < 0) continue;  // EINTR: a signal, whose byte is in the self-pipe
      if (fds[0].revents & POLLIN) handle_signals();
      for (size_t i = 1; i < fds.size(); ++i) {
        if (fds[i].revents & (POLLIN | POLLHUP | POLLERR)) {
          read_stream(*streams[i - 1].first, prefix_of(*streams[i - 1].second));
        }
      }
    }
  }

  static std::string prefix_of(const RankProcess& r) { return "[rank " + std::to_string(r.rank) + "]: "; }

  std::string describe_rank(const RankProcess& r) const {
    std::string text = "rank " + std::to_string(r.rank) + " (" + describe_exit(r.status);
    if (r.signal_sent != 0 && WIFSIGNALED(r.status)) text += ", stopped by launch";
    return text + ")";
  }

  int summarize() const {
    std::string others;
    auto list_others = [&](std::optional<size_t> skip) {
      for (size_t i = 0; i < ranks_.size(); ++i) {
        if (skip && i == *skip) continue;
        others += (others.empty() ? "" : ", ") + describe_rank(ranks_[i]);
      }
    };
    if (first_failure_) {
      const RankProcess& r = ranks_[*first_failure_];
      list_others(first_failure_);
      std::cerr << "roundpipe: error: rank " << r.rank << " (local rank " << r.local_rank << ", pid " << r.pid
                << ") failed with " << describe_exit(r.status) << (others.empty() ? "" : "; other ranks: ") << others
                << std::endl;
      return WIFEXITED(r.status) ? WEXITSTATUS(r.status) : 128 + WTERMSIG(r.status);
    }
    if (received_signal_) {
      list_others(std::nullopt);
      std::cerr << "roundpipe: error: launch received " << signal_name(received_signal_) << "; ranks: " << others
                << std::endl;
      return 128 + received_signal_;
    }
    return 0;
  }

  const LaunchOptions& options_;
  const std::string argv0_;
  std::vector<RankProcess> ranks_;
  int signal_read_ = -1;
  struct sigaction saved_actions_[NSIG] {};
  int received_signal_ = 0;             // the first signal launch received
  std::optional<size_t> first_failure_;  // index into ranks_
  std::optional<Clock::time_point> kill_deadline_;
  std::optional<Clock::time_point> drain_deadline_;
  bool killed_ = false;
};

}  // namespace

void resolve_launch_options(LaunchOptions& options, const std::vector<std::string>& subcommands) {
  auto bad = [](const std::string& message) { throw ConfigError("launch: " + message); };
  if (options.nproc_per_node < 1) {
    bad("--nproc-per-node=" + std::to_string(options.nproc_per_node) + " must be >= 1 (ranks on this node)");
  }
  if (options.nnodes < 1) bad("--nnodes=" + std::to_string(options.nnodes) + " must be >= 1");
  if (options.node_rank < 0 || options.node_rank >= options.nnodes) {
    bad("--node-rank=" + std::to_string(options.node_rank) + " must be in [0, --nnodes=" +
        std::to_string(options.nnodes) + ")");
  }
  if (options.master_addr.empty()) {
    if (options.nnodes > 1) {
      bad("--nnodes=" + std::to_string(options.nnodes) +
          " needs --master-addr: the address (reachable from every node) of the node with --node-rank=0");
    }
    options.master_addr = "127.0.0.1";
  }
  if (options.master_port < 0 || options.master_port > 65535) {
    bad("--master-port=" + std::to_string(options.master_port) + " is not a TCP port (1..65535; 0 = pick one)");
  }
  if (options.master_port == 0) options.master_port = options.nnodes == 1 ? pick_free_port() : kDefaultMasterPort;
  if (!std::isfinite(options.grace_period_s) || options.grace_period_s < 0) {
    std::ostringstream value;
    value << options.grace_period_s;
    bad("--grace-period=" + value.str() + " must be a number of seconds >= 0");
  }
  if (options.run_id.empty()) bad("--run-id must not be empty");
  std::string names;
  for (const std::string& s : subcommands) names += (names.empty() ? "" : ", ") + s;
  if (options.command.empty()) {
    bad("no command to run: roundpipe launch [OPTIONS] COMMAND [ARGS...], COMMAND one of " + names);
  }
  const std::string& command = options.command.front();
  if (command == "launch") bad("a rank cannot run `launch` itself: give the command the ranks run (" + names + ")");
  if (!command.empty() && command[0] == '-') {
    bad("unknown option '" + command + "' (see roundpipe launch --help), or a missing COMMAND before it");
  }
  if (std::find(subcommands.begin(), subcommands.end(), command) == subcommands.end()) {
    bad("'" + command + "' is not a command the ranks can run: one of " + names);
  }
}

std::vector<std::pair<std::string, std::string>> rank_environment(const LaunchOptions& options, int64_t local_rank) {
  const int64_t world_size = options.nnodes * options.nproc_per_node;
  const std::string rank = std::to_string(options.node_rank * options.nproc_per_node + local_rank);
  std::vector<std::pair<std::string, std::string>> vars = {
      {"RANK", rank},
      {"WORLD_SIZE", std::to_string(world_size)},
      {"LOCAL_RANK", std::to_string(local_rank)},
      {"LOCAL_WORLD_SIZE", std::to_string(options.nproc_per_node)},
      {"GROUP_RANK", std::to_string(options.node_rank)},
      {"GROUP_WORLD_SIZE", std::to_string(options.nnodes)},
      {"ROLE_RANK", rank},
      {"ROLE_WORLD_SIZE", std::to_string(world_size)},
      {"ROLE_NAME", "default"},
      {"MASTER_ADDR", options.master_addr},
      {"MASTER_PORT", std::to_string(options.master_port)},
      {"TORCHELASTIC_RESTART_COUNT", "0"},
      {"TORCHELASTIC_MAX_RESTARTS", "0"},
      {"TORCHELASTIC_RUN_ID", options.run_id},
  };
  if (options.nproc_per_node > 1 && std::getenv("OMP_NUM_THREADS") == nullptr) vars.emplace_back("OMP_NUM_THREADS", "1");
  return vars;
}

int run_launch(const LaunchOptions& options, const std::string& argv0) {
  Supervisor supervisor(options, argv0);
  return supervisor.run();
}

int run_env(const EnvOptions& options, std::ostream& out) {
  const comm::LaunchEnv env = comm::LaunchEnv::from_env();
  out << "launch_env: rank=" << env.rank << " world_size=" << env.world_size << " local_rank=" << env.local_rank
      << " master=" << env.master_addr << ":" << env.master_port << "\n";
  out << "pid=" << ::getpid() << "\n";
  for (const char* name : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                           "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
                           "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
                           "TORCHELASTIC_USE_AGENT_STORE", "OMP_NUM_THREADS"}) {
    if (const char* value = std::getenv(name)) out << name << "=" << value << "\n";
  }
  if (options.ignore_sigterm) ::signal(SIGTERM, SIG_IGN);
  out << "ready" << std::endl;
  if (env.rank == options.fail_rank) return options.exit_code;
  if (options.sleep_s > 0) {
    std::this_thread::sleep_for(std::chrono::duration<double>(options.sleep_s));
  }
  return 0;
}

}  // namespace roundpipe::launcher
