// Helpers of the launcher tests: a scratch directory and an assertion on ConfigError messages.
#pragma once

#include <gtest/gtest.h>
#include <stdlib.h>

#include <string>

#include "roundpipe/launcher/atomic_file.h"
#include "roundpipe/launcher/config.h"

namespace roundpipe::launcher::testing {

/// A fresh directory under $TMPDIR (or /tmp), deleted with everything in it on destruction.
class ScratchDir {
 public:
  ScratchDir() {
    const char* tmp = std::getenv("TMPDIR");
    std::string pattern = std::string(tmp != nullptr ? tmp : "/tmp") + "/launcher_test.XXXXXX";
    char* made = ::mkdtemp(pattern.data());
    EXPECT_NE(made, nullptr) << "mkdtemp failed for " << pattern;
    path_ = pattern;
  }
  ~ScratchDir() { remove_tree(path_); }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;

  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return join_path(path_, name); }
  /// Writes `contents` to `name` (may hold subdirectories, made as needed) and returns its path.
  std::string write(const std::string& name, const std::string& contents) const {
    std::string p = file(name);
    make_directories(parent_directory(p));
    write_file_atomically(p, contents);
    return p;
  }

 private:
  std::string path_;
};

}  // namespace roundpipe::launcher::testing

/// Expects `statement` to throw ConfigError whose message contains every one of the strings.
#define EXPECT_CONFIG_ERROR(statement, ...)                                                  \
  do {                                                                                       \
    try {                                                                                    \
      statement;                                                                             \
      ADD_FAILURE() << "expected a ConfigError from: " #statement;                          \
    } catch (const ::roundpipe::launcher::ConfigError& e) {                                  \
      for (const std::string& text : std::initializer_list<std::string>{__VA_ARGS__}) {      \
        EXPECT_NE(std::string(e.what()).find(text), std::string::npos)                       \
            << "message lacks '" << text << "': " << e.what();                               \
      }                                                                                      \
    }                                                                                        \
  } while (false)
