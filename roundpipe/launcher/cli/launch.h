// `roundpipe launch`: starts the local ranks of a distributed job as child processes of this
// executable, each with torchrun's environment; relays their output, forwards signals, and stops
// every rank when one fails (docs/launcher.md, "roundpipe launch"). The ranks rendezvous by
// themselves (rank 0 hosts the TCPStore at MASTER_ADDR:MASTER_PORT); launch hosts no store.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

namespace roundpipe::launcher {

/// Options of `roundpipe launch`, named after torchrun's flags. Plain value type.
struct LaunchOptions {
  /// Ranks started on this node (torchrun --nproc-per-node), >= 1.
  int64_t nproc_per_node = 1;
  /// Nodes of the job (torchrun --nnodes), >= 1; every node runs `roundpipe launch` itself.
  int64_t nnodes = 1;
  /// This node's index in [0, nnodes) (torchrun --node-rank).
  int64_t node_rank = 0;
  /// Address of the node of rank 0. Empty: 127.0.0.1, allowed only when nnodes == 1.
  std::string master_addr;
  /// TCP port rank 0's store listens on. 0: a free port when nnodes == 1 (Note [Master port]),
  /// else 29500 (torchrun's default).
  int64_t master_port = 0;
  /// TORCHELASTIC_RUN_ID given to every rank (torchrun --rdzv-id; its default is "none").
  std::string run_id = "none";
  /// Seconds between the SIGTERM (or the forwarded signal) and the SIGKILL when stopping the ranks.
  double grace_period_s = 5.0;
  /// true: every output line of a rank is relayed as "[rank R]: line" (stdout to stdout, stderr to
  /// stderr); false: the ranks write to launch's stdout and stderr directly.
  bool prefix_output = true;
  /// The subcommand every rank runs, with its arguments: {"train", "run.yaml", "optimizer.lr=1e-4"}.
  std::vector<std::string> command;
};

/// Checks `options` and fills in the defaults of master_addr and master_port (a free port may be
/// picked here). `subcommands` are the names a rank may run. Throws ConfigError naming the flag,
/// its value and the fix.
void resolve_launch_options(LaunchOptions& options, const std::vector<std::string>& subcommands);

/// The variables local rank `local_rank` gets on top of launch's own environment, in a fixed
/// order: torchrun's RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE,
/// ROLE_RANK, ROLE_WORLD_SIZE, ROLE_NAME, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RESTART_COUNT,
/// TORCHELASTIC_MAX_RESTARTS, TORCHELASTIC_RUN_ID, and OMP_NUM_THREADS=1 when nproc_per_node > 1
/// and launch's environment has none (as torchrun). `options` must be resolved.
std::vector<std::pair<std::string, std::string>> rank_environment(const LaunchOptions& options,
                                                                   int64_t local_rank);

/// Runs `options.command` in nproc_per_node child processes of this executable (/proc/self/exe,
/// argv[0] = `argv0`) and supervises them until all have exited (Note [Launch supervision]).
/// Returns the exit code of `roundpipe launch`: 0 when every rank exited 0; else the first failed
/// rank's exit code (128 + signal number when a signal ended it), or 128 + the signal launch
/// received. Prints one "roundpipe launch: ..." line on stderr when the ranks start and a
/// "roundpipe: error: ..." line naming the failed rank at the end. `options` must be resolved.
int run_launch(const LaunchOptions& options, const std::string& argv0);

/// Test hooks of `roundpipe env` (hidden flags), applied after it printed: every rank but
/// `fail_rank` sleeps `sleep_s` seconds; `fail_rank` exits with `exit_code` at once.
struct EnvOptions {
  int64_t fail_rank = -1;
  int exit_code = 1;
  double sleep_s = 0;
  /// Ignore SIGTERM (to test launch's SIGKILL after the grace period).
  bool ignore_sigterm = false;
};

/// `roundpipe env`: prints what this process sees of a distributed launch: the comm::LaunchEnv
/// parsed from the environment (`launch_env: rank=R world_size=W local_rank=L master=ADDR:PORT`),
/// `pid=P`, then NAME=value for every torchrun variable that is set, and `ready` last. Returns the
/// exit code. Throws c10::Error when the variables are inconsistent.
int run_env(const EnvOptions& options, std::ostream& out);

}  // namespace roundpipe::launcher
