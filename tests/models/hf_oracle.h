// Helpers of the model tests: tiny random transformers models written to a scratch directory by
// the Python oracle, and the skip rule for tests that need transformers (skip locally, fail when
// CI=true).
#pragma once

#include <ATen/core/Tensor.h>
#include <gtest/gtest.h>

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

#include "tests/common/python_oracle.h"
#include "tests/common/test_config.h"

namespace roundpipe::testing {

/// A fresh directory under $TMPDIR (or /tmp), removed with its contents on destruction.
class ModelScratchDir {
 public:
  ModelScratchDir() {
    const char* tmp = std::getenv("TMPDIR");
    path_ = std::string(tmp && *tmp ? tmp : "/tmp") + "/roundpipe_hf_XXXXXX";
    if (::mkdtemp(path_.data()) == nullptr) throw std::runtime_error("cannot create a scratch directory " + path_);
  }
  ~ModelScratchDir() { remove(path_); }
  ModelScratchDir(const ModelScratchDir&) = delete;
  ModelScratchDir& operator=(const ModelScratchDir&) = delete;
  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  static void remove(const std::string& path) {
    struct stat st {};
    if (::lstat(path.c_str(), &st) != 0) return;
    if (S_ISDIR(st.st_mode)) {
      std::vector<std::string> names;
      if (DIR* dir = ::opendir(path.c_str())) {
        while (const dirent* entry = ::readdir(dir)) {
          const std::string name = entry->d_name;
          if (name != "." && name != "..") names.push_back(name);
        }
        ::closedir(dir);
      }
      for (const auto& name : names) remove(path + "/" + name);
      ::rmdir(path.c_str());
    } else {
      ::unlink(path.c_str());
    }
  }
  std::string path_;
};

/// True when the oracle Python imports transformers (checked once).
inline bool transformers_available() {
  static const bool available = [] {
    if (!python_oracle_available()) return false;
    const std::string cmd =
        std::string("\"") + ROUNDPIPE_TEST_PYTHON + "\" -c 'import transformers, safetensors' >/dev/null 2>&1";
    return std::system(cmd.c_str()) == 0;
  }();
  return available;
}

inline bool running_in_ci() {
  const char* ci = std::getenv("CI");
  return ci != nullptr && std::string(ci) == "true";
}

}  // namespace roundpipe::testing

/// Skips the test when transformers is missing, except under CI=true where that is a failure.
#define ROUNDPIPE_REQUIRE_TRANSFORMERS()                                                            \
  do {                                                                                              \
    if (!::roundpipe::testing::transformers_available()) {                                          \
      if (::roundpipe::testing::running_in_ci()) FAIL() << "CI=true but Python lacks transformers"; \
      GTEST_SKIP() << "the oracle Python lacks transformers (pip install -r requirements.txt)";     \
    }                                                                                               \
  } while (false)
