#include "comm/launch_env.h"

#include <c10/util/Exception.h>

#include <cerrno>
#include <cstdlib>

namespace roundpipe::comm {
namespace {

std::optional<std::string> process_getenv(const std::string& name) {
  const char* value = std::getenv(name.c_str());
  if (value == nullptr) return std::nullopt;
  return std::string(value);
}

int64_t parse_int(const std::string& name, const std::string& value) {
  errno = 0;
  char* end = nullptr;
  const long long parsed = std::strtoll(value.c_str(), &end, 10);
  TORCH_CHECK(!value.empty() && end != nullptr && *end == '\0' && errno == 0, "environment variable ",
              name, "='", value, "' is not an integer");
  return parsed;
}

}  // namespace

LaunchEnv LaunchEnv::from_env(const std::function<std::optional<std::string>(const std::string&)>& getenv) {
  auto get = getenv ? getenv : process_getenv;
  LaunchEnv env;
  const auto rank = get("RANK");
  const auto world_size = get("WORLD_SIZE");
  TORCH_CHECK(rank.has_value() == world_size.has_value(), "RANK and WORLD_SIZE must be set together (",
              rank ? "RANK" : "WORLD_SIZE", " is set, the other is not): launch with torchrun-style ",
              "variables or set neither for a single-process job");
  if (!rank) return env;
  env.rank = parse_int("RANK", *rank);
  env.world_size = parse_int("WORLD_SIZE", *world_size);
  TORCH_CHECK(env.world_size >= 1, "WORLD_SIZE=", env.world_size, " must be >= 1");
  TORCH_CHECK(env.rank >= 0 && env.rank < env.world_size, "RANK=", env.rank, " must be in [0, WORLD_SIZE=",
              env.world_size, ")");
  if (auto local = get("LOCAL_RANK")) {
    env.local_rank = parse_int("LOCAL_RANK", *local);
    TORCH_CHECK(env.local_rank >= 0, "LOCAL_RANK=", env.local_rank, " must be >= 0");
  }
  if (auto local_world = get("LOCAL_WORLD_SIZE")) {
    env.local_world_size = parse_int("LOCAL_WORLD_SIZE", *local_world);
    TORCH_CHECK(env.local_world_size >= 1, "LOCAL_WORLD_SIZE=", env.local_world_size, " must be >= 1");
  }
  if (auto agent = get("TORCHELASTIC_USE_AGENT_STORE")) {
    TORCH_CHECK(*agent == "True" || *agent == "False" || *agent == "1" || *agent == "0" || *agent == "true" ||
                    *agent == "false",
                "TORCHELASTIC_USE_AGENT_STORE='", *agent, "' must be True or False");
    env.use_agent_store = *agent == "True" || *agent == "1" || *agent == "true";
  }
  if (auto restarts = get("TORCHELASTIC_RESTART_COUNT")) {
    env.restart_count = parse_int("TORCHELASTIC_RESTART_COUNT", *restarts);
    TORCH_CHECK(env.restart_count >= 0, "TORCHELASTIC_RESTART_COUNT=", env.restart_count, " must be >= 0");
  }
  auto addr = get("MASTER_ADDR");
  TORCH_CHECK(addr || env.world_size == 1, "MASTER_ADDR is not set but WORLD_SIZE=", env.world_size,
              ": set MASTER_ADDR to the address of rank 0");
  if (addr) {
    TORCH_CHECK(!addr->empty(), "MASTER_ADDR is set but empty: set it to the address of rank 0");
    env.master_addr = *addr;
  }
  if (auto port = get("MASTER_PORT")) {
    env.master_port = parse_int("MASTER_PORT", *port);
    TORCH_CHECK(env.master_port > 0 && env.master_port < 65536, "MASTER_PORT=", env.master_port,
                " is not a TCP port (1..65535)");
  }
  return env;
}

}  // namespace roundpipe::comm
