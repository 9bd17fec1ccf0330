// The torchrun-style launch environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT)
// that a distributed RoundPipe job reads to rendezvous. A process started without these variables
// is a single-process job (the one-rank fallback).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

namespace roundpipe::comm {

/// Where this process sits in a distributed job. Plain value type.
struct LaunchEnv {
  int64_t rank = 0;
  int64_t world_size = 1;
  int64_t local_rank = 0;
  /// LOCAL_WORLD_SIZE: ranks on this node (default 1).
  int64_t local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  int64_t master_port = 29500;
  /// TORCHELASTIC_USE_AGENT_STORE=1 (torchrun): the agent hosts the store at
  /// MASTER_ADDR:MASTER_PORT and every rank connects as a client; otherwise rank 0 hosts it.
  bool use_agent_store = false;
  /// TORCHELASTIC_RESTART_COUNT: torchrun's restart attempt, part of the store's key prefix.
  int64_t restart_count = 0;

  bool distributed() const { return world_size > 1; }

  /// Reads the variables through `getenv` (default: the process environment). Missing RANK and
  /// WORLD_SIZE mean a single-process job. Throws c10::Error naming the variable and its value
  /// when one is malformed or inconsistent (rank >= world size, port out of range, a distributed
  /// job without MASTER_ADDR).
  static LaunchEnv from_env(
      const std::function<std::optional<std::string>(const std::string&)>& getenv = {});
};

}  // namespace roundpipe::comm
