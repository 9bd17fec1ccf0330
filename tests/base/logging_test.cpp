#include "base/logging.h"

#include <gtest/gtest.h>

#include <stdexcept>

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

}  // namespace
}  // namespace roundpipe
