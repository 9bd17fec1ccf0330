#include "comm/launch_env.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <map>

namespace roundpipe::comm {
namespace {

auto env_of(std::map<std::string, std::string> vars) {
  return [vars](const std::string& name) -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  };
}

TEST(LaunchEnvTest, NoVariables_IsSingleProcess) {
  auto env = LaunchEnv::from_env(env_of({}));
  EXPECT_EQ(env.rank, 0);
  EXPECT_EQ(env.world_size, 1);
  EXPECT_FALSE(env.distributed());
}

TEST(LaunchEnvTest, TorchrunVariables_AreParsed) {
  auto env = LaunchEnv::from_env(env_of(
      {{"RANK", "3"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "1"}, {"MASTER_ADDR", "node0"}, {"MASTER_PORT", "1234"}}));
  EXPECT_EQ(env.rank, 3);
  EXPECT_EQ(env.world_size, 4);
  EXPECT_EQ(env.local_rank, 1);
  EXPECT_EQ(env.master_addr, "node0");
  EXPECT_EQ(env.master_port, 1234);
  EXPECT_TRUE(env.distributed());
}

TEST(LaunchEnvTest, BadValues_NameTheVariable) {
  auto expect_error = [](std::map<std::string, std::string> vars, const std::string& needle) {
    try {
      LaunchEnv::from_env(env_of(vars));
      ADD_FAILURE() << "accepted, expected error with " << needle;
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what_without_backtrace()).find(needle), std::string::npos) << e.what_without_backtrace();
    }
  };
  expect_error({{"RANK", "x"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "a"}}, "RANK='x' is not an integer");
  expect_error({{"RANK", "2"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "a"}}, "RANK=2 must be in [0, WORLD_SIZE=2)");
  expect_error({{"RANK", "0"}}, "RANK and WORLD_SIZE must be set together");
  expect_error({{"RANK", "0"}, {"WORLD_SIZE", "2"}}, "MASTER_ADDR is not set");
  expect_error({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "a"}, {"MASTER_PORT", "70000"}},
               "MASTER_PORT=70000 is not a TCP port");
}

}  // namespace
}  // namespace roundpipe::comm
