#include "fuzz/fuzz_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <map>

namespace roundpipe::fuzz {
namespace {

std::string scratch_dir() {
  struct stat st {};
  if (::stat("/dev/shm", &st) == 0 && S_ISDIR(st.st_mode) && ::access("/dev/shm", W_OK) == 0) {
    return "/dev/shm";
  }
  const char* tmp = std::getenv("TMPDIR");
  return tmp != nullptr && *tmp != '\0' ? tmp : "/tmp";
}

// Removes the scratch files when the fuzzer exits normally (a crash leaves them for inspection).
struct ScratchFiles {
  std::map<std::string, std::string> paths;  // tag -> path
  ~ScratchFiles() {
    for (const auto& entry : paths) ::unlink(entry.second.c_str());
  }
};

ScratchFiles& scratch() {
  static ScratchFiles files;
  return files;
}

}  // namespace

std::string write_input(const std::string& tag, const uint8_t* data, size_t size) {
  auto& path = scratch().paths[tag];
  if (path.empty()) {
    path = scratch_dir() + "/roundpipe-fuzz-" + tag + "-" + std::to_string(::getpid());
  }
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) {
    std::fprintf(stderr, "fuzz: cannot create %s: %s\n", path.c_str(), std::strerror(errno));
    std::abort();
  }
  size_t done = 0;
  while (done < size) {
    const ssize_t n = ::write(fd, data + done, size - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      std::fprintf(stderr, "fuzz: cannot write %s: %s\n", path.c_str(), std::strerror(errno));
      std::abort();
    }
    done += static_cast<size_t>(n);
  }
  ::close(fd);
  return path;
}

}  // namespace roundpipe::fuzz
