// The only translation unit that includes spdlog (see logging.h).
#include "base/logging.h"

#include <spdlog/sinks/basic_file_sink.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <atomic>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <vector>

namespace roundpipe {
namespace {

spdlog::level::level_enum to_spdlog(LogLevel level) {
  switch (level) {
    case LogLevel::kTrace: return spdlog::level::trace;
    case LogLevel::kDebug: return spdlog::level::debug;
    case LogLevel::kInfo: return spdlog::level::info;
    case LogLevel::kWarn: return spdlog::level::warn;
    case LogLevel::kError: return spdlog::level::err;
    case LogLevel::kOff: return spdlog::level::off;
  }
  return spdlog::level::info;
}

std::string pattern_for(int rank) {
  std::string rank_part = rank >= 0 ? "[rank " + std::to_string(rank) + "] " : "";
  return "[%Y-%m-%d %H:%M:%S.%e] " + rank_part + "[%n] [%l] [tid %t] %v";
}

// Registry of RoundPipe's loggers. Guarded by `mutex`; Logger handles stay valid forever.
struct Registry {
  std::mutex mutex;
  struct Entry {
    std::unique_ptr<Logger> handle;
    spdlog::logger* impl;  // owned by this registry (never freed: loggers live until exit)
  };
  std::map<std::string, Entry> loggers;
  std::shared_ptr<spdlog::sinks::sink> sink = std::make_shared<spdlog::sinks::stderr_color_sink_mt>();
  std::vector<std::shared_ptr<spdlog::sinks::sink>> file_sinks;  // add_log_file
  LogLevel level = LogLevel::kInfo;
  int rank = -1;

  Registry() {
    if (const char* env = std::getenv("ROUNDPIPE_LOG_LEVEL")) {
      level = parse_log_level(env);
    }
    if (const char* env = std::getenv("RANK")) {
      rank = std::atoi(env);
    }
  }
};

Registry& registry() {
  static Registry* instance = new Registry();  // leaked: loggers outlive static destructors
  return *instance;
}

}  // namespace

LogLevel parse_log_level(const std::string& name) {
  static const std::map<std::string, LogLevel> kNames = {
      {"trace", LogLevel::kTrace}, {"debug", LogLevel::kDebug}, {"info", LogLevel::kInfo},
      {"warn", LogLevel::kWarn},   {"error", LogLevel::kError}, {"off", LogLevel::kOff}};
  auto it = kNames.find(name);
  if (it == kNames.end()) {
    throw std::invalid_argument("unknown log level '" + name +
                                "': use one of trace, debug, info, warn, error, off");
  }
  return it->second;
}

const Logger& Logger::get(const std::string& module) {
  Registry& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mutex);
  auto it = reg.loggers.find(module);
  if (it != reg.loggers.end()) {
    return *it->second.handle;
  }
  auto* impl = new spdlog::logger("roundpipe." + module, reg.sink);  // owned by this registry
  for (const auto& file : reg.file_sinks) {
    impl->sinks().push_back(file);
    impl->flush_on(spdlog::level::trace);  // a log file is complete up to a crash
  }
  impl->set_level(to_spdlog(reg.level));
  impl->set_pattern(pattern_for(reg.rank));
  auto inserted = reg.loggers.emplace(module, Registry::Entry{std::unique_ptr<Logger>(new Logger(impl)), impl});
  return *inserted.first->second.handle;
}

bool Logger::enabled(LogLevel level) const {
  return static_cast<spdlog::logger*>(impl_)->should_log(to_spdlog(level));
}

void Logger::log(LogLevel level, const std::string& message) const {
  static_cast<spdlog::logger*>(impl_)->log(to_spdlog(level), message);
}

void set_log_level(LogLevel level) {
  Registry& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mutex);
  reg.level = level;
  for (auto& [name, entry] : reg.loggers) {
    entry.impl->set_level(to_spdlog(level));
  }
}

void add_log_file(const std::string& path) {
  std::shared_ptr<spdlog::sinks::sink> file;
  try {
    file = std::make_shared<spdlog::sinks::basic_file_sink_mt>(path, /*truncate=*/false);
  } catch (const spdlog::spdlog_ex& e) {
    throw std::runtime_error("cannot open the log file '" + path + "': " + e.what());
  }
  Registry& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mutex);
  file->set_pattern(pattern_for(reg.rank));
  reg.file_sinks.push_back(file);
  for (auto& [name, entry] : reg.loggers) {
    entry.impl->sinks().push_back(file);
    entry.impl->flush_on(spdlog::level::trace);
  }
}

void set_console_log_level(LogLevel level) {
  registry().sink->set_level(to_spdlog(level));
}

void set_log_rank(int rank) {
  Registry& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mutex);
  reg.rank = rank;
  for (auto& [name, entry] : reg.loggers) {
    entry.impl->set_pattern(pattern_for(rank));
  }
}

}  // namespace roundpipe
