#include "base/logging.h"

#include <gtest/gtest.h>

#include <stdlib.h>
#include <unistd.h>

#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>

namespace roundpipe {
namespace {

TEST(LoggingTest, Levels_GateFormatting) {
  const Logger& log = Logger::get("test");
  EXPECT_EQ(&log, &Logger::get("test"));  // one logger per module
  int formatted = 0;
  auto count = [&] { return ++formatted; };
  set_log_level(LogLevel::kWarn);
  ROUNDPIPE_LOG(log, kDebug, "not formatted ", count());
  EXPECT_EQ(formatted, 0);
  EXPECT_FALSE(log.enabled(LogLevel::kInfo));
  set_log_level(LogLevel::kTrace);
  EXPECT_TRUE(log.enabled(LogLevel::kDebug));
  ROUNDPIPE_LOG(log, kTrace, "formatted ", count());
  EXPECT_EQ(formatted, 1);
  set_log_level(LogLevel::kInfo);
}

TEST(LoggingTest, ParseLogLevel_RejectsUnknownNames) {
  EXPECT_EQ(parse_log_level("debug"), LogLevel::kDebug);
  EXPECT_THROW(parse_log_level("verbose"), std::invalid_argument);
}

TEST(LoggingTest, AddLogFile_ReceivesExistingAndNewLoggersWhileConsoleIsQuiet) {
  char path[] = "/tmp/roundpipe_log_test.XXXXXX";
  const int fd = ::mkstemp(path);
  ASSERT_GE(fd, 0);
  ::close(fd);
  const Logger& existing = Logger::get("test");
  add_log_file(path);
  set_console_log_level(LogLevel::kOff);
  ROUNDPIPE_LOG(existing, kInfo, "from the existing logger");
  ROUNDPIPE_LOG(Logger::get("created_after_the_file"), kWarn, "from a new logger");
  set_console_log_level(LogLevel::kTrace);
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  ::unlink(path);
  EXPECT_NE(text.str().find("[roundpipe.test] [info]"), std::string::npos) << text.str();
  EXPECT_NE(text.str().find("from the existing logger"), std::string::npos) << text.str();
  EXPECT_NE(text.str().find("[roundpipe.created_after_the_file] [warning]"), std::string::npos) << text.str();
  EXPECT_THROW(add_log_file("/dev/null/y.log"), std::runtime_error);
}

}  // namespace
}  // namespace roundpipe
