// Helpers of the models tests: a scratch directory, whole-file reads/writes, and the skip rule for
// tests that need Python modules (tests/common/oracle_rule.h: skip locally, fail when CI=true). POSIX only (see Note [No
// std::filesystem here] in tests/common/python_oracle.cpp).
#pragma once

#include <gtest/gtest.h>

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "tests/common/oracle_rule.h"
#include "tests/common/test_config.h"

namespace roundpipe::testing {

inline void remove_tree(const std::string& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) {
    return;
  }
  if (S_ISDIR(st.st_mode)) {
    if (DIR* dir = ::opendir(path.c_str())) {
      std::vector<std::string> names;
      while (const dirent* entry = ::readdir(dir)) {
        const std::string name = entry->d_name;
        if (name != "." && name != "..") {
          names.push_back(name);
        }
      }
      ::closedir(dir);
      for (const auto& name : names) {
        remove_tree(path + "/" + name);
      }
    }
    ::rmdir(path.c_str());
  } else {
    ::unlink(path.c_str());
  }
}

/// A fresh directory under $TMPDIR (or /tmp), removed with its contents on destruction.
class ScratchDir {
 public:
  ScratchDir() {
    const char* tmp = std::getenv("TMPDIR");
    path_ = std::string(tmp && *tmp ? tmp : "/tmp") + "/roundpipe_models_XXXXXX";
    if (::mkdtemp(path_.data()) == nullptr) {
      throw std::runtime_error("cannot create a scratch directory " + path_);
    }
  }
  ~ScratchDir() { remove_tree(path_); }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;

  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

inline std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    throw std::runtime_error("cannot read " + path);
  }
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

inline void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) {
    throw std::runtime_error("cannot write " + path);
  }
}

/// Names in `dir` (without . and ..), sorted.
inline std::vector<std::string> list_dir(const std::string& dir) {
  std::vector<std::string> names;
  if (DIR* handle = ::opendir(dir.c_str())) {
    while (const dirent* entry = ::readdir(handle)) {
      const std::string name = entry->d_name;
      if (name != "." && name != "..") {
        names.push_back(name);
      }
    }
    ::closedir(handle);
  }
  std::sort(names.begin(), names.end());
  return names;
}

/// True when the oracle Python imports every module in `modules` (space-separated). Cached per
/// process (each check starts an interpreter).
inline bool python_has_modules(const std::string& modules) {
  static std::map<std::string, bool> cache;
  const auto cached = cache.find(modules);
  if (cached != cache.end()) {
    return cached->second;
  }
  const std::string python = ROUNDPIPE_TEST_PYTHON;
  if (python.empty()) {
    return cache[modules] = false;
  }
  std::string imports;
  for (size_t start = 0; start < modules.size();) {
    const size_t end = std::min(modules.find(' ', start), modules.size());
    imports += "import " + modules.substr(start, end - start) + ";";
    start = end + 1;
  }
  const std::string cmd = "\"" + python + "\" -c '" + imports + "' >/dev/null 2>&1";
  return cache[modules] = std::system(cmd.c_str()) == 0;
}

}  // namespace roundpipe::testing

/// Skips the test when the oracle Python lacks `modules` (fails instead when CI=true).
#define ROUNDPIPE_REQUIRE_PYTHON(modules)                                                                \
  do {                                                                                                   \
    if (!::roundpipe::testing::python_has_modules(modules)) {                                            \
      ROUNDPIPE_ORACLE_MISSING(std::string("the oracle Python cannot import ") + (modules) +             \
                               " (pip install -r requirements.txt)");                                    \
    }                                                                                                    \
  } while (false)
