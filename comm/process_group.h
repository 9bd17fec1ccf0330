// comm::ProcessGroup: the ranks of a data-parallel job and the collectives RoundPipe needs
// (all-reduce, broadcast, barrier), over the distributed engine LibTorch ships (c10d: TCPStore,
// ProcessGroupGloo, ProcessGroupNCCL). This header includes no c10d (or fmt) header, so it is
// safe in translation units that log through spdlog.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <torch/arg.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "comm/launch_env.h"

namespace roundpipe::comm {

enum class ReduceOp { kSum, kMax, kMin };

/// The collective library under a ProcessGroup. kAuto: nccl when ProcessGroupOptions::device is a
/// CUDA device, else gloo.
enum class Backend { kAuto, kGloo, kNccl };

/// "auto", "gloo", "nccl" (for messages and logs).
const char* backend_name(Backend backend);

/// Options of ProcessGroup::create.
struct ProcessGroupOptions {
  /// gloo (CPU), nccl (CUDA), or kAuto: nccl when `device` is a CUDA device, else gloo.
  TORCH_ARG(Backend, backend) = Backend::kAuto;
  /// Bounds the rendezvous and every collective: a rank that is gone, or never arrives, makes the
  /// others fail after at most this long (plus a few seconds to name the missing rank).
  TORCH_ARG(std::chrono::milliseconds, timeout) = std::chrono::minutes(10);
  /// Where this rank's collectives run: a CUDA device selects nccl (by default) and stages host
  /// tensors through it. Default: CPU.
  TORCH_ARG(c10::Device, device) = c10::Device(c10::kCPU);
  /// Seconds between the liveness beats each rank writes to the store (used to name a missing rank
  /// when a collective fails); 0 disables them.
  TORCH_ARG(double, heartbeat_seconds) = 1.0;
};

/// One collective in flight. Move-only; wait() once.
/// Lifetime: a pending Work refers to its ProcessGroup's internals; wait() for it (or drop it)
/// before the group is destroyed. (The runtime's gradient sync holds the group by shared_ptr,
/// declared before its buckets, so every bucket's Work goes first.)
class Work {
 public:
  Work() = default;
  explicit Work(std::function<void()> wait) : wait_(std::move(wait)) {}
  /// Blocks until the collective finished (at most the group's timeout) and its result is in the
  /// tensor; throws c10::Error naming the operation, this rank and, when it can tell, the rank
  /// that is missing.
  void wait() {
    if (wait_) {
      auto w = std::move(wait_);
      wait_ = nullptr;
      w();
    }
  }
  bool pending() const { return static_cast<bool>(wait_); }

 private:
  std::function<void()> wait_;
};

/// The ranks of one distributed job.
///
/// Thread-safety: collectives may be issued from any thread, but every rank must issue the same
/// collectives in the same order (as with torch.distributed). A one-rank group needs no network and
/// its collectives return at once.
class ProcessGroup : public std::enable_shared_from_this<ProcessGroup> {
 public:
  /// Rendezvous at env.master_addr:env.master_port (a TCPStore: rank 0 hosts it, or torchrun's
  /// agent when env.use_agent_store) and connects the backend. Throws c10::Error naming the ranks
  /// that did not arrive within options.timeout.
  static std::shared_ptr<ProcessGroup> create(const LaunchEnv& env, const ProcessGroupOptions& options = {});
  /// create(LaunchEnv::from_env(), options): the torchrun environment of this process.
  static std::shared_ptr<ProcessGroup> from_env(const ProcessGroupOptions& options = {});
  ~ProcessGroup();
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  int64_t rank() const;
  int64_t world_size() const;
  /// kGloo or kNccl; nullopt for a single rank (no backend is connected).
  std::optional<Backend> backend() const;
  std::chrono::milliseconds timeout() const;

  /// Reduces `tensor` (a contiguous CPU tensor) in place across ranks; asynchronous.
  Work all_reduce(const at::Tensor& tensor, ReduceOp op = ReduceOp::kSum);
  /// Copies rank `root`'s `tensor` (contiguous, CPU) into every rank's; asynchronous.
  Work broadcast(const at::Tensor& tensor, int64_t root = 0);
  /// Returns when every rank called it (or throws after the timeout naming the missing ranks).
  void barrier();

  /// A second group over the same ranks, with connections of its own: its collectives are ordered
  /// independently of this group's, so a thread may issue them while another thread issues this
  /// group's (the runtime's gradient all-reduces run beside the caller's own collectives). Every
  /// rank must call split() the same number of times, in the same order; no collective is needed.
  /// It shares this group's rendezvous store and liveness beats (this group must outlive it: it
  /// holds a reference).
  std::shared_ptr<ProcessGroup> split();

  struct Impl;

 private:
  explicit ProcessGroup(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace roundpipe::comm
