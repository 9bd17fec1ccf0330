#include "roundpipe/launcher/atomic_file.h"

#include <c10/util/Exception.h>
#include <dirent.h>
#include <fcntl.h>
#include <ftw.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>

namespace roundpipe::launcher {

int write_fully(int fd, const char* data, size_t size) {
  while (size > 0) {
    const ssize_t n = ::write(fd, data, size);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return n < 0 ? errno : EIO;
    data += n;
    size -= static_cast<size_t>(n);
  }
  return 0;
}

namespace {

detail::FailureHook& failure_hook() {
  static detail::FailureHook hook;
  return hook;
}

void hook_point(std::string_view point) {
  if (failure_hook()) {
    failure_hook()(point);
  }
}

std::string errno_text(int err) { return std::strerror(err); }

/// A unique temporary name beside `path`: "<dir>/<prefix><base>.<pid>.<n>".
std::string temp_sibling(const std::string& path, const char* prefix) {
  static std::atomic<uint64_t> counter{0};
  std::string dir = parent_directory(path);
  std::string base = path.substr(path.find_last_of('/') == std::string::npos ? 0 : path.find_last_of('/') + 1);
  return join_path(
      dir, std::string(prefix) + base + "." + std::to_string(::getpid()) + "." + std::to_string(counter.fetch_add(1)));
}

/// Closes fd on scope exit.
struct FdGuard {
  int fd;
  ~FdGuard() {
    if (fd >= 0) {
      ::close(fd);
    }
  }
};

void write_all(int fd, const char* data, size_t size, const std::string& path) {
  const int error = write_fully(fd, data, size);
  TORCH_CHECK(error == 0, "write to '", path, "' failed: ", errno_text(error),
              " (disk full or the file system is read-only?)");
}

int remove_entry(const char* path, const struct stat*, int type, struct FTW*) {
  int rc = (type == FTW_DP || type == FTW_D) ? ::rmdir(path) : ::unlink(path);
  return rc == 0 || errno == ENOENT ? 0 : -1;
}

bool starts_with(std::string_view s, std::string_view prefix) { return s.substr(0, prefix.size()) == prefix; }

}  // namespace

namespace detail {
void set_failure_hook(FailureHook hook) { failure_hook() = std::move(hook); }
}  // namespace detail

std::string parent_directory(const std::string& path) {
  size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) {
    return ".";
  }
  return slash == 0 ? "/" : path.substr(0, slash);
}

std::string join_path(const std::string& dir, const std::string& name) {
  if (dir.empty()) {
    return name;
  }
  return dir.back() == '/' ? dir + name : dir + "/" + name;
}

bool path_exists(const std::string& path) {
  struct stat st;
  return ::lstat(path.c_str(), &st) == 0;
}

bool is_directory(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

bool is_regular_file(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

void fsync_directory(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  TORCH_CHECK(fd >= 0, "cannot open directory '", path, "' to fsync it: ", errno_text(errno));
  FdGuard guard{fd};
  // Some file systems (e.g. certain network mounts) refuse fsync on directories; the rename is
  // then as durable as that file system makes it.
  if (::fsync(fd) != 0) {
    TORCH_CHECK(errno == EINVAL || errno == EROFS, "fsync of directory '", path, "' failed: ", errno_text(errno));
  }
}

void make_directories(const std::string& path) {
  TORCH_CHECK(!path.empty(), "make_directories: empty path");
  size_t pos = 0;
  while (pos != std::string::npos) {
    pos = path.find('/', pos + 1);
    std::string part = path.substr(0, pos);
    if (part.empty() || part == "." || part == "..") {
      continue;
    }
    if (::mkdir(part.c_str(), 0755) != 0 && errno != EEXIST) {
      TORCH_CHECK(false, "cannot create directory '", part, "' (for '", path, "'): ", errno_text(errno));
    }
  }
  TORCH_CHECK(is_directory(path), "'", path, "' exists but is not a directory");
}

void remove_tree(const std::string& path) {
  if (!path_exists(path)) {
    return;
  }
  TORCH_CHECK(::nftw(path.c_str(), remove_entry, 16, FTW_DEPTH | FTW_PHYS) == 0, "cannot delete '", path,
              "': ", errno_text(errno));
}

std::string read_file(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  TORCH_CHECK(fd >= 0, "cannot open '", path, "': ", errno_text(errno));
  FdGuard guard{fd};
  std::string out;
  char buffer[1 << 16];
  while (true) {
    ssize_t n = ::read(fd, buffer, sizeof(buffer));
    if (n < 0 && errno == EINTR) {
      continue;
    }
    TORCH_CHECK(n >= 0, "read of '", path, "' failed: ", errno_text(errno));
    if (n == 0) {
      return out;
    }
    out.append(buffer, static_cast<size_t>(n));
  }
}

void write_file_atomically(const std::string& path, std::string_view contents) {
  std::string tmp = temp_sibling(path, ".tmp.");
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  TORCH_CHECK(fd >= 0, "cannot create '", tmp, "' (to write '", path, "'): ", errno_text(errno),
              "; check that the directory exists and is writable");
  try {
    {
      FdGuard guard{fd};
      write_all(fd, contents.data(), contents.size(), tmp);
      TORCH_CHECK(::fsync(fd) == 0, "fsync of '", tmp, "' failed: ", errno_text(errno));
    }
    hook_point("write_file:before_rename");
    TORCH_CHECK(::rename(tmp.c_str(), path.c_str()) == 0, "cannot rename '", tmp, "' to '", path,
                "': ", errno_text(errno));
  } catch (...) {
    ::unlink(tmp.c_str());
    throw;
  }
  fsync_directory(parent_directory(path));
}

std::string make_staging_directory(const std::string& final_dir) {
  std::string tmp = temp_sibling(final_dir, ".tmp-");
  TORCH_CHECK(::mkdir(tmp.c_str(), 0755) == 0, "cannot create staging directory '", tmp, "': ", errno_text(errno),
              "; check that '", parent_directory(final_dir), "' exists and is writable");
  return tmp;
}

void publish_directory(const std::string& tmp_dir, const std::string& final_dir) {
  TORCH_CHECK(is_directory(tmp_dir), "publish_directory: '", tmp_dir, "' is not a directory");
  TORCH_CHECK(parent_directory(tmp_dir) == parent_directory(final_dir), "publish_directory: '", tmp_dir, "' and '",
              final_dir, "' must share a parent directory (rename is atomic only ", "within one file system)");
  fsync_directory(tmp_dir);
  hook_point("publish_directory:before_rename");
  std::string parent = parent_directory(final_dir);
  if (!path_exists(final_dir)) {
    TORCH_CHECK(::rename(tmp_dir.c_str(), final_dir.c_str()) == 0, "cannot rename '", tmp_dir, "' to '", final_dir,
                "': ", errno_text(errno));
    fsync_directory(parent);
    return;
  }
  // Swap in one step; the old contents end up under tmp_dir's name and are deleted.
  if (::renameat2(AT_FDCWD, tmp_dir.c_str(), AT_FDCWD, final_dir.c_str(), RENAME_EXCHANGE) == 0) {
    fsync_directory(parent);
    remove_tree(tmp_dir);
    return;
  }
  TORCH_CHECK(errno == EINVAL || errno == ENOSYS || errno == ENOTSUP, "cannot exchange '", tmp_dir, "' with '",
              final_dir, "': ", errno_text(errno));
  // No RENAME_EXCHANGE on this file system: move the old directory aside first. A crash between
  // the two renames leaves the old one under ".tmp-*" (see remove_stale_temporaries).
  std::string aside = temp_sibling(final_dir, ".tmp-old-");
  TORCH_CHECK(::rename(final_dir.c_str(), aside.c_str()) == 0, "cannot move '", final_dir,
              "' aside: ", errno_text(errno));
  if (::rename(tmp_dir.c_str(), final_dir.c_str()) != 0) {
    int err = errno;
    ::rename(aside.c_str(), final_dir.c_str());
    TORCH_CHECK(false, "cannot rename '", tmp_dir, "' to '", final_dir, "': ", errno_text(err));
  }
  fsync_directory(parent);
  remove_tree(aside);
}

void update_symlink_atomically(const std::string& link, const std::string& target) {
  struct stat st;
  if (::lstat(link.c_str(), &st) == 0) {
    TORCH_CHECK(S_ISLNK(st.st_mode), "'", link, "' exists and is not a symlink; move it away so ",
                "it can point at the latest checkpoint");
  }
  std::string tmp = temp_sibling(link, ".tmp.");
  TORCH_CHECK(::symlink(target.c_str(), tmp.c_str()) == 0, "cannot create symlink '", tmp, "': ", errno_text(errno));
  try {
    hook_point("symlink:before_rename");
    TORCH_CHECK(::rename(tmp.c_str(), link.c_str()) == 0, "cannot rename '", tmp, "' to '", link,
                "': ", errno_text(errno));
  } catch (...) {
    ::unlink(tmp.c_str());
    throw;
  }
  fsync_directory(parent_directory(link));
}

std::optional<std::string> read_symlink(const std::string& link) {
  std::string buffer(4096, '\0');
  ssize_t n = ::readlink(link.c_str(), buffer.data(), buffer.size());
  if (n < 0) {
    return std::nullopt;
  }
  buffer.resize(static_cast<size_t>(n));
  return buffer;
}

std::string step_dir_name(int64_t step) {
  TORCH_CHECK(step >= 0, "step_dir_name: step must be >= 0, got ", step);
  char buffer[32];
  std::snprintf(buffer, sizeof(buffer), "step-%06lld", static_cast<long long>(step));
  return buffer;
}

std::optional<int64_t> parse_step_dir_name(std::string_view name) {
  constexpr std::string_view kPrefix = "step-";
  if (!starts_with(name, kPrefix) || name.size() == kPrefix.size() || name.size() > kPrefix.size() + 18) {
    return std::nullopt;
  }
  int64_t step = 0;
  for (char c : name.substr(kPrefix.size())) {
    if (c < '0' || c > '9') {
      return std::nullopt;
    }
    step = step * 10 + (c - '0');
  }
  return step;
}

namespace {
/// Names of the entries of `dir` (without "." and ".."); empty when it does not exist.
std::vector<std::string> list_directory(const std::string& dir) {
  std::vector<std::string> names;
  DIR* handle = ::opendir(dir.c_str());
  if (handle == nullptr) {
    TORCH_CHECK(errno == ENOENT, "cannot list directory '", dir, "': ", errno_text(errno));
    return names;
  }
  while (struct dirent* entry = ::readdir(handle)) {
    std::string name = entry->d_name;
    if (name != "." && name != "..") {
      names.push_back(std::move(name));
    }
  }
  ::closedir(handle);
  std::sort(names.begin(), names.end());
  return names;
}
}  // namespace

std::vector<int64_t> list_step_dirs(const std::string& parent) {
  std::vector<int64_t> steps;
  for (const std::string& name : list_directory(parent)) {
    std::optional<int64_t> step = parse_step_dir_name(name);
    struct stat st;
    if (step && ::lstat(join_path(parent, name).c_str(), &st) == 0 && S_ISDIR(st.st_mode)) {
      steps.push_back(*step);
    }
  }
  std::sort(steps.begin(), steps.end());
  return steps;
}

std::vector<std::string> prune_step_dirs(const std::string& parent, int64_t keep) {
  TORCH_CHECK(keep >= 1, "prune_step_dirs: keep must be >= 1, got ", keep);
  std::vector<int64_t> steps = list_step_dirs(parent);
  std::optional<std::string> latest = read_symlink(join_path(parent, "latest"));
  std::optional<int64_t> protected_step;
  if (latest) {
    size_t slash = latest->find_last_of('/');
    protected_step = parse_step_dir_name(slash == std::string::npos ? std::string_view(*latest)
                                                                    : std::string_view(*latest).substr(slash + 1));
  }
  std::vector<std::string> removed;
  int64_t excess = static_cast<int64_t>(steps.size()) - keep;
  for (int64_t i = 0; i < excess; ++i) {
    if (protected_step && steps[i] == *protected_step) {
      continue;
    }
    std::string path = join_path(parent, step_dir_name(steps[i]));
    remove_tree(path);
    removed.push_back(path);
  }
  if (!removed.empty()) {
    fsync_directory(parent);
  }
  return removed;
}

std::vector<std::string> remove_stale_temporaries(const std::string& parent) {
  std::vector<std::string> removed;
  for (const std::string& name : list_directory(parent)) {
    if (starts_with(name, ".tmp.") || starts_with(name, ".tmp-")) {
      std::string path = join_path(parent, name);
      remove_tree(path);
      removed.push_back(path);
    }
  }
  return removed;
}

}  // namespace roundpipe::launcher
