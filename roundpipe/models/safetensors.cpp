// SafetensorsFile: mapping, header validation and zero-copy tensors.
#include "roundpipe/models/safetensors.h"

#include "roundpipe/models/detail/safetensors_format.h"
#include "roundpipe/models/detail/tokenizer_text.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <sstream>
#include <string_view>

namespace roundpipe::models {
namespace {

using nlohmann::json;

// Every validation error starts with the file, then the tensor when there is one.
#define ROUNDPIPE_SAFETENSORS_CHECK(cond, ...) TORCH_CHECK(cond, "safetensors file '", path, "': ", __VA_ARGS__)
#define ROUNDPIPE_SAFETENSORS_TENSOR_CHECK(cond, tensor, ...) \
  ROUNDPIPE_SAFETENSORS_CHECK(cond, "tensor '", tensor, "': ", __VA_ARGS__)

struct FdCloser {
  int fd;
  ~FdCloser() {
    if (fd >= 0) {
      ::close(fd);
    }
  }
};

struct DepthExceeded {};

// JSON of a header value for an error message, cut short when long.
std::string excerpt(const json& value) {
  std::string text = value.dump(-1, ' ', false, json::error_handler_t::replace);
  return text.size() > 80 ? text.substr(0, 80) + "..." : text;
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::ostringstream out;
  out << '[';
  for (size_t i = 0; i < shape.size(); ++i) {
    out << (i ? ", " : "") << shape[i];
  }
  out << ']';
  return out.str();
}

// A non-negative JSON integer (nlohmann stores "-0" as a signed integer).
bool as_unsigned(const json& value, uint64_t* out) {
  if (value.is_number_unsigned()) {
    *out = value.get<uint64_t>();
    return true;
  }
  if (value.is_number_integer() && value.get<int64_t>() >= 0) {
    *out = static_cast<uint64_t>(value.get<int64_t>());
    return true;
  }
  return false;
}

// The little-endian u64 at the start of the file: the header's length, bounded and inside the file.
uint64_t read_header_length(const std::string& path, const uint8_t* bytes, uint64_t file_bytes) {
  uint64_t header_bytes = 0;
  for (int i = 7; i >= 0; --i) {
    header_bytes = (header_bytes << 8) | bytes[i];  // little-endian u64
  }
  ROUNDPIPE_SAFETENSORS_CHECK(header_bytes <= detail::kMaxHeaderBytes, "header length ", header_bytes,
                              " exceeds the limit of ", detail::kMaxHeaderBytes,
                              " bytes (corrupt length field, or not a safetensors file)");
  ROUNDPIPE_SAFETENSORS_CHECK(header_bytes <= file_bytes - 8, "header length ", header_bytes,
                              " runs past the end of the file (", file_bytes, " bytes; the file is truncated)");
  return header_bytes;
}

// The header as a JSON object: UTF-8, valid JSON, nested at most kMaxHeaderDepth levels.
json parse_header(const std::string& path, std::string_view header) {
  const size_t bad_utf8 = detail::invalid_utf8_at(header);
  ROUNDPIPE_SAFETENSORS_CHECK(bad_utf8 == std::string_view::npos, "header is not valid UTF-8 (byte ", bad_utf8,
                              " of the header)");
  json root;
  try {
    root = json::parse(header.begin(), header.end(), [](int depth, json::parse_event_t event, json&) {
      if ((event == json::parse_event_t::object_start || event == json::parse_event_t::array_start) &&
          depth >= detail::kMaxHeaderDepth) {
        throw DepthExceeded{};
      }
      return true;
    });
  } catch (const json::exception& e) {
    ROUNDPIPE_SAFETENSORS_CHECK(false, "header is not valid JSON: ", e.what());
  } catch (const DepthExceeded&) {
    ROUNDPIPE_SAFETENSORS_CHECK(false, "header JSON nests deeper than ", detail::kMaxHeaderDepth, " levels");
  }
  ROUNDPIPE_SAFETENSORS_CHECK(root.is_object(), "header must be a JSON object, got ", root.type_name());
  return root;
}

// "__metadata__": null, or an object mapping strings to strings.
void read_metadata(const std::string& path, const json& entry, std::map<std::string, std::string>& metadata) {
  if (entry.is_null()) return;
  ROUNDPIPE_SAFETENSORS_CHECK(entry.is_object(), "\"__metadata__\" must be an object mapping strings to strings, got ",
                              entry.type_name());
  for (const auto& [key, value] : entry.items()) {
    ROUNDPIPE_SAFETENSORS_CHECK(value.is_string(), "\"__metadata__\" must map strings to strings, but key '", key,
                                "' holds ", value.type_name(), " ", excerpt(value));
    metadata.emplace(key, value.get<std::string>());
  }
}

// One tensor's header entry: exactly dtype, shape and data_offsets, each well-formed.
TensorInfo parse_tensor_entry(const std::string& path, const std::string& name, const json& entry) {
  ROUNDPIPE_SAFETENSORS_TENSOR_CHECK(entry.is_object(), name, "header entry must be a JSON object, got ",
                                     entry.type_name());
  ROUNDPIPE_SAFETENSORS_TENSOR_CHECK(
      entry.size() == 3 && entry.contains("dtype") && entry.contains("shape") && entry.contains("data_offsets"), name,
      "header entry must have exactly the keys dtype, shape, data_offsets; got ", excerpt(entry));
  const json& dtype = entry["dtype"];
  ROUNDPIPE_SAFETENSORS_TENSOR_CHECK(dtype.is_string(), name, "dtype must be a string, got ", excerpt(dtype));
  const detail::DtypeEntry* type = detail::dtype_by_name(dtype.get<std::string>());
  ROUNDPIPE_SAFETENSORS_TENSOR_CHECK(type != nullptr, name, "unknown dtype ", excerpt(dtype),
                                     " (supported: ", detail::supported_dtype_names(), ")");
  ROUNDPIPE_SAFETENSORS_TENSOR_CHECK(type->scalar != c10::ScalarType::Undefined, name, "dtype ", type->name,
                                     " is not supported by RoundPipe (supported: ", detail::supported_dtype_names(),
                                     ")");
  TensorInfo info;
  info.name = name;
  info.dtype = type->scalar;
  const json& shape = entry["shape"];
  ROUNDPIPE_SAFETENSORS_TENSOR_CHECK(shape.is_array(), name, "shape must be an array of non-negative integers, got ",
                                     excerpt(shape));
  for (const auto& dim : shape) {
    uint64_t size = 0;
    ROUNDPIPE_SAFETENSORS_TENSOR_CHECK(as_unsigned(dim, &size), name,
                                       "shape must be an array of non-negative integers, got ", excerpt(shape));
    ROUNDPIPE_SAFETENSORS_TENSOR_CHECK(size <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()), name,
                                       "shape dimension ", size, " does not fit in int64");
    info.shape.push_back(static_cast<int64_t>(size));
  }
  const json& offsets = entry["data_offsets"];
  ROUNDPIPE_SAFETENSORS_TENSOR_CHECK(offsets.is_array() && offsets.size() == 2 &&
                                         as_unsigned(offsets[0], &info.begin) && as_unsigned(offsets[1], &info.end),
                                     name, "data_offsets must be [begin, end] (two non-negative integers), got ",
                                     excerpt(offsets));
  ROUNDPIPE_SAFETENSORS_TENSOR_CHECK(info.begin <= info.end, name, "data_offsets [", info.begin, ", ", info.end,
                                     "] have begin > end");
  return info;
}

// Sorts the tensors by their offsets (the reference crate's order; ties, zero-size tensors, keep
// name order) and checks that they tile the data section from 0 with no gap or overlap, each
// exactly its shape's bytes. Returns the bytes they cover.
uint64_t check_tiling(const std::string& path, std::vector<TensorInfo>& tensors) {
  std::stable_sort(tensors.begin(), tensors.end(), [](const TensorInfo& a, const TensorInfo& b) {
    return std::make_pair(a.begin, a.end) < std::make_pair(b.begin, b.end);
  });
  uint64_t covered = 0;
  for (const TensorInfo& info : tensors) {
    ROUNDPIPE_SAFETENSORS_TENSOR_CHECK(
        info.begin == covered, info.name, "data_offsets [", info.begin, ", ", info.end, "] start at ", info.begin,
        " but the tensor before it ends at ", covered,
        " (tensors must tile the data section from offset 0 with no gap or overlap)");
    uint64_t numel = 1;
    uint64_t nonzero_numel = 1;  // torch must be able to count elements and strides in int64
    bool overflow = false;
    for (int64_t dim : info.shape) {
      overflow |= __builtin_mul_overflow(numel, static_cast<uint64_t>(dim), &numel);
      if (dim != 0) {
        overflow |= __builtin_mul_overflow(nonzero_numel, static_cast<uint64_t>(dim), &nonzero_numel);
      }
    }
    const uint64_t element_bytes = c10::elementSize(info.dtype);
    uint64_t nbytes = 0;
    overflow |= __builtin_mul_overflow(numel, element_bytes, &nbytes);
    overflow |= nonzero_numel > static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
    ROUNDPIPE_SAFETENSORS_TENSOR_CHECK(!overflow, info.name, "shape ", shape_text(info.shape),
                                       " overflows: its element count or byte size does not fit in 64 bits");
    ROUNDPIPE_SAFETENSORS_TENSOR_CHECK(nbytes == info.end - info.begin, info.name, "shape ", shape_text(info.shape),
                                       " of dtype ", detail::dtype_by_scalar(info.dtype)->name, " needs ", nbytes,
                                       " bytes but data_offsets [", info.begin, ", ", info.end, "] span ",
                                       info.end - info.begin, " bytes");
    covered = info.end;
  }
  return covered;
}

}  // namespace

// Note [Header validation]: `open` applies the checks of the reference crate
// (SafeTensors::read_metadata + Metadata::validate) before any tensor is handed out, so that `get`
// can trust every offset: the length field is bounded and inside the file, the header is UTF-8 JSON
// of the expected shape, tensors tile the data section exactly (sorted by offsets, contiguous from
// 0, no gap or overlap, each exactly numel * element size bytes with overflow checks, the last one
// ending at the end of the file). On top of the crate we reject entries with keys other than
// dtype/shape/data_offsets, dimensions or element counts beyond int64 (torch's limit), and JSON
// nested deeper than kMaxHeaderDepth.
std::shared_ptr<SafetensorsFile> SafetensorsFile::open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  ROUNDPIPE_SAFETENSORS_CHECK(fd >= 0, "cannot open: ", detail::errno_text(errno));
  FdCloser closer{fd};
  struct stat st {};
  ROUNDPIPE_SAFETENSORS_CHECK(::fstat(fd, &st) == 0, "fstat failed: ", detail::errno_text(errno));
  ROUNDPIPE_SAFETENSORS_CHECK(S_ISREG(st.st_mode), "not a regular file");
  const auto file_bytes = static_cast<uint64_t>(st.st_size);
  ROUNDPIPE_SAFETENSORS_CHECK(file_bytes >= 8, "file is ", file_bytes,
                              " bytes, smaller than the 8-byte header length field (truncated, or not a "
                              "safetensors file)");

  std::shared_ptr<SafetensorsFile> file(new SafetensorsFile());
  file->path_ = path;
  file->mapping_ = std::make_shared<detail::FileMapping>(path, static_cast<size_t>(file_bytes), fd);
  const uint8_t* bytes = file->mapping_->data;
  const uint64_t header_bytes = read_header_length(path, bytes, file_bytes);
  const json root =
      parse_header(path, std::string_view(reinterpret_cast<const char*>(bytes + 8), static_cast<size_t>(header_bytes)));

  std::vector<TensorInfo> tensors;
  tensors.reserve(root.size());
  for (const auto& [name, entry] : root.items()) {
    if (name == "__metadata__") {
      read_metadata(path, entry, file->metadata_);
    } else {
      tensors.push_back(parse_tensor_entry(path, name, entry));
    }
  }
  const uint64_t covered = check_tiling(path, tensors);
  const uint64_t data_bytes = file_bytes - 8 - header_bytes;
  ROUNDPIPE_SAFETENSORS_CHECK(covered == data_bytes, "the tensors cover ", covered,
                              " bytes but the data section holds ", data_bytes, " (file of ", file_bytes,
                              " bytes = 8 + header ", header_bytes,
                              " + data); the file is truncated or has trailing bytes");

  file->data_start_ = 8 + header_bytes;
  file->data_bytes_ = data_bytes;
  file->tensors_ = std::move(tensors);
  for (size_t i = 0; i < file->tensors_.size(); ++i) {
    file->index_.emplace(file->tensors_[i].name, i);
  }
  return file;
}

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> names;
  names.reserve(tensors_.size());
  for (const auto& info : tensors_) {
    names.push_back(info.name);
  }
  return names;
}

const TensorInfo& SafetensorsFile::info(const std::string& name) const {
  const auto it = index_.find(name);
  TORCH_CHECK(it != index_.end(), "safetensors file '", path_, "' has no tensor '", name, "' (it holds ",
              tensors_.size(), " tensors; list them with names())");
  return tensors_[it->second];
}

// Note [Zero-copy get]: the tensor's storage points into the read-only mapping and its deleter
// holds a reference to the mapping, so the bytes stay mapped as long as any tensor (or view of one)
// is alive, even after the SafetensorsFile is gone. Files written by safetensors place every tensor
// at an offset that is a multiple of its element size (sorted by alignment, header padded to 8);
// other files could misalign data, and we copy those rather than hand kernels a misaligned pointer.
at::Tensor SafetensorsFile::get(const std::string& name) const {
  const TensorInfo& ti = info(name);
  const auto options = at::TensorOptions().dtype(ti.dtype).device(c10::kCPU);
  if (ti.end == ti.begin) {
    return at::empty(ti.shape, options);
  }
  const uint8_t* data = mapping_->data + data_start_ + ti.begin;
  const size_t element_bytes = c10::elementSize(ti.dtype);
  if (reinterpret_cast<uintptr_t>(data) % element_bytes != 0) {
    at::Tensor copy = at::empty(ti.shape, options);
    std::memcpy(copy.data_ptr(), data, ti.end - ti.begin);
    return copy;
  }
  std::shared_ptr<detail::FileMapping> keep_alive = mapping_;
  return at::for_blob(const_cast<uint8_t*>(data), ti.shape)
      .options(options)
      .deleter([keep_alive = std::move(keep_alive)](void*) {})
      .make_tensor();
}

at::Tensor SafetensorsFile::get(const std::string& name, c10::ScalarType dtype) const {
  at::Tensor stored = get(name);
  return stored.scalar_type() == dtype ? stored : stored.to(dtype);
}

// Note [Releasing mapped pages]: pages of a file mapping that a process has read count in its
// resident set (and in ru_maxrss) until unmapped, so a loader copying a whole checkpoint out of
// its mappings peaks at model + checkpoint bytes (docs/models.md, "Loading speed and memory").
// MADV_DONTNEED on a private, read-only file mapping only unmaps the pages from this process: the
// page cache keeps them and the next access reads the same bytes from it again (private copies
// exist only for written pages, and the mapping is PROT_READ). The range is widened to whole pages,
// which may drop neighbouring tensors' pages too: harmless for the same reason.
void SafetensorsFile::release_pages(const std::string& name) const {
  const TensorInfo& ti = info(name);
  if (ti.end == ti.begin) return;
  static const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t first = reinterpret_cast<uintptr_t>(mapping_->data + data_start_ + ti.begin) & ~(page - 1);
  const uintptr_t last = reinterpret_cast<uintptr_t>(mapping_->data + data_start_ + ti.end);
  const uintptr_t map_end = reinterpret_cast<uintptr_t>(mapping_->data) + mapping_->bytes;
  const uintptr_t end = std::min((last + page - 1) & ~(page - 1), (map_end + page - 1) & ~(page - 1));
  // Advisory: a failure leaves the pages resident, nothing else.
  (void)::madvise(reinterpret_cast<void*>(first), end - first, MADV_DONTNEED);
}

}  // namespace roundpipe::models
