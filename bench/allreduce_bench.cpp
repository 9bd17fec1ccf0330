// Data-parallel communication benchmark: (1) all-reduce bandwidth of comm::ProcessGroup for the
// bucket sizes RoundPipe uses (Gloo on loopback here; NCCL when run with --nccl on a GPU machine),
// next to the memcpy bandwidth of this machine measured in the same run (the loopback's physical
// limit is a memory copy); (2) a 2-rank RoundPipe training run: how much of the gradient
// communication forward_backward still waits for after its backward (the rest is hidden behind
// the backward and the async step), and the iteration time against the same model without a
// process group, with the iterations overlapping (the all-reduces behind the next forward) and
// without.
//
// Usage: allreduce_bench [--ranks N] [--nccl]   (starts N ranks of itself on 127.0.0.1)
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "comm/process_group.h"
#include "roundpipe/roundpipe.h"

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// Starts `ranks` copies of this binary with torchrun's variables; returns the worst exit code.
int launch_ranks(int ranks, char** argv) {
  const std::string port = std::to_string(29000 + (::getpid() % 1000));
  std::vector<pid_t> pids;
  for (int r = 0; r < ranks; ++r) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::setenv("RANK", std::to_string(r).c_str(), 1);
      ::setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
      ::setenv("WORLD_SIZE", std::to_string(ranks).c_str(), 1);
      ::setenv("LOCAL_WORLD_SIZE", std::to_string(ranks).c_str(), 1);
      ::setenv("MASTER_ADDR", "127.0.0.1", 1);
      ::setenv("MASTER_PORT", port.c_str(), 1);
      if (r != 0) {
        const int null = ::open("/dev/null", O_WRONLY);
        ::dup2(null, 1);
      }
      ::execv("/proc/self/exe", argv);
      ::_exit(127);
    }
    pids.push_back(pid);
  }
  int worst = 0;
  for (pid_t pid : pids) {
    int status = 0;
    ::waitpid(pid, &status, 0);
    const int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    worst = std::max(worst, code);
  }
  return worst;
}

// Mean seconds per call of `fn` over at least `min_seconds` (and 3 calls), after one warm-up.
template <class Fn>
double time_per_call(Fn fn, double min_seconds, roundpipe::comm::ProcessGroup& group) {
  fn();
  group.barrier();
  int calls = 0;
  const auto start = Clock::now();
  do {
    fn();
    ++calls;
    // Every rank must make the same number of calls: rank 0 decides whether to go on.
    auto more = torch::full({1}, seconds_since(start) < min_seconds || calls < 3 ? 1 : 0, torch::kInt);
    group.broadcast(more, 0).wait();
    if (more.item<int>() == 0) break;
  } while (true);
  return seconds_since(start) / calls;
}

void bandwidth_table(roundpipe::comm::ProcessGroup& group) {
  const bool lead = group.rank() == 0;
  const double n = static_cast<double>(group.world_size());
  if (lead) {
    std::printf("\n## all-reduce, %lld ranks, %s (float32, in place)\n\n", static_cast<long long>(group.world_size()),
                group.backend() ? roundpipe::comm::backend_name(*group.backend()) : "no backend");
    std::printf("| bucket | time/op | algbw GB/s | busbw GB/s | memcpy GB/s (same size) | busbw / memcpy |\n");
    std::printf("|---:|---:|---:|---:|---:|---:|\n");
  }
  for (int64_t mib : {1, 4, 25, 100}) {
    const int64_t numel = mib * (1 << 20) / 4;
    auto t = torch::ones({numel});
    const double op = time_per_call([&] { group.all_reduce(t).wait(); }, 2.0, group);
    auto src = torch::ones({numel}), dst = torch::empty({numel});
    const double copy = time_per_call([&] { dst.copy_(src); }, 0.5, group);
    const double bytes = static_cast<double>(numel) * 4.0;
    const double algbw = bytes / op / 1e9;
    const double busbw = algbw * 2.0 * (n - 1.0) / n;  // nccl-tests' convention for all-reduce
    const double memcpy = bytes / copy / 1e9;
    if (lead) {
      std::printf("| %lld MiB | %.2f ms | %.2f | %.2f | %.2f | %.2f |\n", static_cast<long long>(mib), op * 1e3, algbw,
                  busbw, memcpy, busbw / memcpy);
    }
  }
}

// A model with enough gradient bytes for several 25 MiB buckets.
torch::nn::Sequential make_model() {
  torch::manual_seed(0);
  torch::nn::Sequential net;
  for (int l = 0; l < 12; ++l) {
    net->push_back(torch::nn::Linear(1024, 1024));
    net->push_back(torch::nn::Tanh());
  }
  return net;
}

void overlap_run(const std::shared_ptr<roundpipe::comm::ProcessGroup>& group, bool with_group, bool overlap) {
  using namespace roundpipe;
  RoundPipe model(make_model(), RoundPipeOptions()
                                    .devices({c10::kCPU, c10::kCPU})
                                    .process_group(with_group ? group : nullptr)
                                    .measure_layer_times(false)
                                    .overlap_backward(overlap));
  auto opt = [&] {
    OptimizerCtx ctx;
    return torch::optim::SGD(model.parameters(), 1e-3);
  }();
  auto x = torch::randn({32, 1024}), y = torch::randn({32, 1024});
  const LossFn loss = [](const torch::Tensor& out, const torch::Tensor& t) { return torch::mse_loss(out, t); };
  auto iteration = [&] {
    model.forward_backward({x}, y, loss);
    model.step([&] {
      opt.step();
      opt.zero_grad();
    });
  };
  const auto before = model.data_parallel_stats();
  const double per_iter = time_per_call(iteration, 5.0, *group);
  model.synchronize();
  const auto after = model.data_parallel_stats();
  // The same bytes all-reduced alone, in 25 MiB pieces, as the time the communication takes
  // (every rank takes part).
  auto t = torch::ones({25 << 18});
  const double op = time_per_call([&] { group->all_reduce(t).wait(); }, 1.0, *group);
  if (group->rank() != 0) return;
  if (!with_group) {
    std::printf("| no process group | %.1f ms | - | - | - | - |\n", per_iter * 1e3);
    return;
  }
  const double runs = static_cast<double>(after.runs - before.runs);
  const double bytes = static_cast<double>(after.bytes - before.bytes) / runs;
  const double wait_ms = (after.wait_ms - before.wait_ms) / runs;
  const double comm_ms = op * 1e3 * bytes / static_cast<double>(t.nbytes());
  std::printf("| %lld ranks%s | %.1f ms | %.1f MiB in %.1f buckets | %.0f of %.0f | %.1f ms | %.0f%% |\n",
              static_cast<long long>(group->world_size()),
              overlap ? "" : ", iterations not overlapped (overlap_backward off)", per_iter * 1e3, bytes / (1 << 20),
              static_cast<double>(after.buckets - before.buckets) / runs,
              static_cast<double>(after.overlapped_runs - before.overlapped_runs), runs, wait_ms,
              100.0 * std::max(0.0, 1.0 - wait_ms / comm_ms));
}

}  // namespace

int main(int argc, char** argv) {
  int ranks = 2;
  bool nccl = false;
  for (int k = 1; k < argc; ++k) {
    if (std::strcmp(argv[k], "--ranks") == 0 && k + 1 < argc) ranks = std::atoi(argv[++k]);
    if (std::strcmp(argv[k], "--nccl") == 0) nccl = true;
  }
  if (std::getenv("RANK") == nullptr) return launch_ranks(ranks, argv);
  torch::set_num_threads(1);
  roundpipe::comm::ProcessGroupOptions options;
  if (nccl) options.device(c10::Device(c10::kCUDA, 0));
  auto group = roundpipe::comm::ProcessGroup::from_env(options);
  bandwidth_table(*group);
  if (group->rank() == 0) {
    std::printf("\n## 2-rank training, 12 x Linear(1024, 1024), 2 CPU devices per rank, batch 32 per rank\n\n");
    std::printf(
        "| run | time/iteration | gradients per iteration | calls overlapped | waited after backward | hidden |\n");
    std::printf("|---|---:|---:|---:|---:|---:|\n");
  }
  overlap_run(group, false, true);
  overlap_run(group, true, false);
  overlap_run(group, true, true);
  return 0;
}
