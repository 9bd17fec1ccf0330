// Internals of the safetensors reader/writer: the dtype table, the read-only file mapping and the
// POSIX helpers for atomic writes. Not installed.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace roundpipe::models::detail {

/// Longest header the reader accepts (the reference crate's MAX_HEADER_SIZE).
constexpr uint64_t kMaxHeaderBytes = 100'000'000;
/// Deepest JSON nesting the reader accepts; a valid header nests 3 deep ({ { [ ).
constexpr int kMaxHeaderDepth = 16;

struct DtypeEntry {
  const char* name;        // safetensors spelling, e.g. "BF16"
  c10::ScalarType scalar;  // Undefined: a safetensors dtype RoundPipe does not support
  uint64_t bytes;          // element size (0 for the sub-byte dtypes)
  int rank;                // position in the crate's Dtype enum; the writer sorts by it, descending
};

/// The entry for a safetensors dtype name, nullptr for a name safetensors does not define.
const DtypeEntry* dtype_by_name(const std::string& name);
/// The entry for a torch dtype, nullptr when safetensors cannot store it.
const DtypeEntry* dtype_by_scalar(c10::ScalarType scalar);
/// "BOOL, U8, ..." (the supported names), for error messages.
std::string supported_dtype_names();

/// Checks that `tensors` can be saved (defined, strided, a safetensors dtype, unique names other
/// than "__metadata__", valid UTF-8) and returns each one's size in bytes. `target` names the file
/// or directory in error messages.
std::vector<uint64_t> check_saveable(const std::string& target,
                                     const std::vector<std::pair<std::string, at::Tensor>>& tensors);

/// A whole file mapped PROT_READ/MAP_PRIVATE; unmapped when the last owner lets go.
struct FileMapping {
  FileMapping(const std::string& path, size_t bytes, int fd);
  ~FileMapping();
  FileMapping(const FileMapping&) = delete;
  FileMapping& operator=(const FileMapping&) = delete;

  const uint8_t* data = nullptr;
  size_t bytes = 0;
};

/// strerror_r text for `err`.
std::string errno_text(int err);

/// Writes `bytes` bytes to `fd`, retrying short writes and EINTR; throws c10::Error naming `path`.
void write_all(int fd, const void* data, size_t bytes, const std::string& path);

/// Creates `path.tmp.<pid>`, lets `write(fd, tmp_path)` fill it, fsyncs it, renames it over `path`
/// and fsyncs the directory. On any exception the temporary file is closed and removed, and the
/// error rethrown (a previous file at `path` is untouched).
void write_file_atomically(const std::string& path,
                           const std::function<void(int fd, const std::string& tmp_path)>& write);

/// "dir/name" (no separator doubled).
std::string join_path(const std::string& dir, const std::string& name);
/// True when `path` exists and is a regular file (following links).
bool is_regular_file(const std::string& path);

}  // namespace roundpipe::models::detail
