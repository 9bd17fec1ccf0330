// The loader's internal error: a ConfigError that remembers the key path it is about, so the
// loader can prefix the message with where that key was written (file:line:column or override).
#pragma once

#include <string>

#include "roundpipe/launcher/config.h"

namespace roundpipe::launcher::detail {

class KeyError : public ConfigError {
 public:
  KeyError(std::string path, const std::string& message) : ConfigError(message), path_(std::move(path)) {}
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

}  // namespace roundpipe::launcher::detail
