// roundpipe::base logging, at the bottom of the module graph: one named logger per module that
// logs ("amp", "optim", "runtime", ...), backed by spdlog. This header deliberately does not
// include spdlog or fmt (LibTorch ships its own fmt; keeping spdlog in one translation unit avoids mixing
// the two), so it is safe to include anywhere.
#pragma once

#include <sstream>
#include <string>

namespace roundpipe {

enum class LogLevel { kTrace, kDebug, kInfo, kWarn, kError, kOff };

/// A handle to one module's logger. Thread-safety: all methods may be called from any thread.
/// Lifetime: handles returned by `Logger::get` live until process exit.
class Logger {
 public:
  /// The logger for `module`, created on first use with the process-wide level and pattern
  /// (`[time] [rank R] [module] [level] [tid] message`).
  static const Logger& get(const std::string& module);

  bool enabled(LogLevel level) const;
  void log(LogLevel level, const std::string& message) const;

 private:
  explicit Logger(void* impl) : impl_(impl) {}
  void* impl_;  // spdlog::logger*, owned by spdlog's registry
};

/// Sets the level of every RoundPipe logger (existing and future). The initial level comes from
/// the environment variable ROUNDPIPE_LOG_LEVEL (trace, debug, info, warn, error, off; default
/// info).
void set_log_level(LogLevel level);
/// Parses "trace" ... "off"; throws std::invalid_argument naming the accepted values otherwise.
LogLevel parse_log_level(const std::string& name);
/// Also writes every RoundPipe logger's lines (existing and future) to the file `path` (appended;
/// created if missing, with its parent directories), at the loggers' level, flushed after every
/// line. Throws std::runtime_error when it cannot be opened. Call it before logging starts on
/// other threads (it changes the loggers' sink lists).
void add_log_file(const std::string& path);
/// The level of the console (stderr) output alone; files added with add_log_file keep the loggers'
/// level. Default: trace (everything the loggers' level lets through).
void set_console_log_level(LogLevel level);
/// Sets the rank shown in every log line (distributed runs); -1 hides it. Default: $RANK or -1.
void set_log_rank(int rank);

namespace detail {
template <typename... Args>
std::string log_concat(const Args&... args) {
  std::ostringstream out;
  (out << ... << args);
  return out.str();
}
}  // namespace detail

}  // namespace roundpipe

/// ROUNDPIPE_LOG(logger, kInfo, "stage ", i, " took ", ms, " ms"): formats only when enabled.
#define ROUNDPIPE_LOG(logger, level, ...)                                             \
  do {                                                                               \
    const ::roundpipe::Logger& roundpipe_logger_ = (logger);                         \
    if (roundpipe_logger_.enabled(::roundpipe::LogLevel::level)) {                   \
      roundpipe_logger_.log(::roundpipe::LogLevel::level,                            \
                            ::roundpipe::detail::log_concat(__VA_ARGS__));           \
    }                                                                                \
  } while (false)
