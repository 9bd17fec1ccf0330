#include "roundpipe/models/detail/safetensors_format.h"

#include <c10/util/Exception.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string_view>

namespace roundpipe::models::detail {
namespace {

// Note [Dtype order]: safetensors' writer sorts tensors by dtype descending, comparing the
// position of the dtype in the crate's `Dtype` enum (declared "in increasing alignment order"),
// then by name. `rank` is that position, so files we write match the Python package's byte for
// byte. The sub-byte and unsupported dtypes stay in the table so that their names are recognized
// (and rejected by name) and the ranks keep their places.
constexpr DtypeEntry kDtypes[] = {
    {"BOOL", c10::ScalarType::Bool, 1, 0},
    {"F4", c10::ScalarType::Undefined, 0, 1},
    {"F6_E2M3", c10::ScalarType::Undefined, 0, 2},
    {"F6_E3M2", c10::ScalarType::Undefined, 0, 3},
    {"U8", c10::ScalarType::Byte, 1, 4},
    {"I8", c10::ScalarType::Char, 1, 5},
    {"F8_E5M2", c10::ScalarType::Float8_e5m2, 1, 6},
    {"F8_E4M3", c10::ScalarType::Float8_e4m3fn, 1, 7},
    {"F8_E8M0", c10::ScalarType::Float8_e8m0fnu, 1, 8},
    {"I16", c10::ScalarType::Short, 2, 9},
    {"U16", c10::ScalarType::UInt16, 2, 10},
    {"F16", c10::ScalarType::Half, 2, 11},
    {"BF16", c10::ScalarType::BFloat16, 2, 12},
    {"I32", c10::ScalarType::Int, 4, 13},
    {"U32", c10::ScalarType::UInt32, 4, 14},
    {"F32", c10::ScalarType::Float, 4, 15},
    {"C64", c10::ScalarType::ComplexFloat, 8, 16},
    {"F64", c10::ScalarType::Double, 8, 17},
    {"I64", c10::ScalarType::Long, 8, 18},
    {"U64", c10::ScalarType::UInt64, 8, 19},
};

std::string parent_dir(const std::string& path) {
  const auto slash = path.find_last_of('/');
  if (slash == std::string::npos) {
    return ".";
  }
  return slash == 0 ? "/" : path.substr(0, slash);
}

}  // namespace

const DtypeEntry* dtype_by_name(const std::string& name) {
  for (const auto& entry : kDtypes) {
    if (name == entry.name) {
      return &entry;
    }
  }
  return nullptr;
}

const DtypeEntry* dtype_by_scalar(c10::ScalarType scalar) {
  for (const auto& entry : kDtypes) {
    if (entry.scalar == scalar && scalar != c10::ScalarType::Undefined) {
      return &entry;
    }
  }
  return nullptr;
}

std::string supported_dtype_names() {
  std::string names;
  for (const auto& entry : kDtypes) {
    if (entry.scalar != c10::ScalarType::Undefined) {
      names += names.empty() ? "" : ", ";
      names += entry.name;
    }
  }
  return names;
}

FileMapping::FileMapping(const std::string& path, size_t size, int fd) {
  TORCH_INTERNAL_ASSERT(size > 0);
  void* addr = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  TORCH_CHECK(addr != MAP_FAILED, "safetensors file '", path, "': mmap of ", size, " bytes failed: ",
              errno_text(errno));
  data = static_cast<const uint8_t*>(addr);
  bytes = size;
}

FileMapping::~FileMapping() {
  if (data != nullptr) {
    ::munmap(const_cast<uint8_t*>(data), bytes);
  }
}

std::string errno_text(int err) {
  char buffer[256];
  // GNU strerror_r: returns a pointer to the message (maybe not `buffer`).
  const char* text = ::strerror_r(err, buffer, sizeof(buffer));
  return std::string(text) + " (errno " + std::to_string(err) + ")";
}

void write_all(int fd, const void* data, size_t bytes, const std::string& path) {
  const auto* cursor = static_cast<const uint8_t*>(data);
  while (bytes > 0) {
    // Linux writes at most 0x7ffff000 bytes per call; ask for at most 1 GiB at a time.
    const size_t chunk = bytes < (size_t{1} << 30) ? bytes : (size_t{1} << 30);
    const ssize_t written = ::write(fd, cursor, chunk);
    if (written < 0) {
      if (errno == EINTR) {
        continue;
      }
      TORCH_CHECK(false, "writing '", path, "' failed: ", errno_text(errno),
                  " (check free disk space, quotas and file-size limits)");
    }
    TORCH_CHECK(written > 0, "writing '", path, "' failed: write() returned 0");
    cursor += written;
    bytes -= static_cast<size_t>(written);
  }
}

void write_file_atomically(const std::string& path,
                           const std::function<void(int fd, const std::string& tmp_path)>& write) {
  const std::string tmp_path = path + ".tmp." + std::to_string(::getpid());
  int fd = ::open(tmp_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  TORCH_CHECK(fd >= 0, "cannot create '", tmp_path, "' (to write '", path, "'): ", errno_text(errno),
              "; check that the directory exists and is writable");
  try {
    write(fd, tmp_path);
    TORCH_CHECK(::fsync(fd) == 0, "fsync of '", tmp_path, "' failed: ", errno_text(errno));
    const int rc = ::close(fd);
    fd = -1;
    TORCH_CHECK(rc == 0, "close of '", tmp_path, "' failed: ", errno_text(errno));
    TORCH_CHECK(::rename(tmp_path.c_str(), path.c_str()) == 0, "renaming '", tmp_path, "' to '", path,
                "' failed: ", errno_text(errno));
  } catch (...) {
    if (fd >= 0) {
      ::close(fd);
    }
    ::unlink(tmp_path.c_str());
    throw;
  }
  // The rename is durable only once the directory entry is on disk.
  const std::string dir = parent_dir(path);
  const int dir_fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  TORCH_CHECK(dir_fd >= 0, "wrote '", path, "' but cannot open its directory '", dir,
              "' to fsync it: ", errno_text(errno));
  const int rc = ::fsync(dir_fd);
  const int err = errno;
  ::close(dir_fd);
  TORCH_CHECK(rc == 0, "wrote '", path, "' but fsync of its directory '", dir, "' failed: ", errno_text(err));
}

std::string join_path(const std::string& dir, const std::string& name) {
  if (dir.empty()) {
    return name;
  }
  return dir.back() == '/' ? dir + name : dir + "/" + name;
}

bool is_regular_file(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

}  // namespace roundpipe::models::detail
