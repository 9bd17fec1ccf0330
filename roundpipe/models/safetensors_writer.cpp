// save_safetensors: the header exactly as the reference crate serializes it, then the tensor bytes,
// written atomically.
#include "roundpipe/models/detail/safetensors_format.h"
#include "roundpipe/models/detail/tokenizer_text.h"
#include "roundpipe/models/safetensors.h"

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <numeric>
#include <set>
#include <string_view>

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "safetensors stores little-endian data; the writer copies host memory as is");

namespace roundpipe::models {
namespace detail {

std::vector<uint64_t> check_saveable(const std::string& target,
                                     const std::vector<std::pair<std::string, at::Tensor>>& tensors) {
  std::vector<uint64_t> sizes;
  sizes.reserve(tensors.size());
  std::set<std::string_view> seen;
  for (const auto& [name, tensor] : tensors) {
    TORCH_CHECK(tensor.defined(), "saving '", target, "': tensor '", name, "' is undefined");
    TORCH_CHECK(tensor.layout() == c10::kStrided, "saving '", target, "': tensor '", name, "' has layout ",
                tensor.layout(), "; only dense (strided) tensors can be saved, call to_dense() first");
    TORCH_CHECK(dtype_by_scalar(tensor.scalar_type()) != nullptr, "saving '", target, "': tensor '", name,
                "' has dtype ", tensor.scalar_type(), ", which safetensors cannot store (supported: ",
                supported_dtype_names(), ")");
    TORCH_CHECK(name != "__metadata__", "saving '", target,
                "': \"__metadata__\" is reserved for the metadata map and cannot name a tensor");
    TORCH_CHECK(invalid_utf8_at(name) == std::string_view::npos, "saving '", target, "': tensor name '", name,
                "' is not valid UTF-8");
    TORCH_CHECK(seen.insert(name).second, "saving '", target, "': tensor name '", name,
                "' appears twice; names must be unique");
    sizes.push_back(static_cast<uint64_t>(tensor.numel()) * tensor.element_size());
  }
  return sizes;
}

}  // namespace detail

namespace {

// serde_json's escaping of a string (as nlohmann's with ensure_ascii=false: ", \, \b \f \n \r \t and
// \u00xx for other control characters; everything else, UTF-8 included, verbatim).
std::string json_string(const std::string& text) {
  return nlohmann::json(text).dump(-1, ' ', false, nlohmann::json::error_handler_t::strict);
}

}  // namespace

void save_safetensors(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  const std::vector<uint64_t> sizes = detail::check_saveable(path, tensors);
  for (const auto& [key, value] : metadata) {
    TORCH_CHECK(detail::invalid_utf8_at(key) == std::string_view::npos &&
                    detail::invalid_utf8_at(value) == std::string_view::npos,
                "saving '", path, "': metadata entry '", key, "' is not valid UTF-8");
  }

  // Note [Dtype order] in detail/safetensors_format.cpp: dtype rank descending, then name.
  std::vector<size_t> order(tensors.size());
  std::iota(order.begin(), order.end(), 0);
  const auto rank = [&](size_t i) { return detail::dtype_by_scalar(tensors[i].second.scalar_type())->rank; };
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    if (rank(a) != rank(b)) {
      return rank(a) > rank(b);
    }
    return tensors[a].first < tensors[b].first;
  });

  std::string header = "{";
  if (!metadata.empty()) {
    header += "\"__metadata__\":{";
    bool first = true;
    for (const auto& [key, value] : metadata) {
      header += (first ? "" : ",") + json_string(key) + ":" + json_string(value);
      first = false;
    }
    header += "}";
  }
  uint64_t offset = 0;
  for (size_t i : order) {
    const at::Tensor& tensor = tensors[i].second;
    header += header.size() > 1 ? "," : "";
    header += json_string(tensors[i].first) + ":{\"dtype\":\"" +
              detail::dtype_by_scalar(tensor.scalar_type())->name + "\",\"shape\":[";
    for (int64_t d = 0; d < tensor.dim(); ++d) {
      header += (d ? "," : "") + std::to_string(tensor.size(d));
    }
    header += "],\"data_offsets\":[" + std::to_string(offset) + "," + std::to_string(offset + sizes[i]) + "]}";
    offset += sizes[i];
  }
  header += "}";
  header.append((8 - header.size() % 8) % 8, ' ');  // the data section starts 8-aligned
  TORCH_CHECK(header.size() <= detail::kMaxHeaderBytes, "saving '", path, "': the header would be ", header.size(),
              " bytes, over safetensors' limit of ", detail::kMaxHeaderBytes,
              " (too many tensors or too much metadata for one file; shard with save_checkpoint)");

  detail::write_file_atomically(path, [&](int fd, const std::string& tmp_path) {
    uint8_t length[8];
    for (int b = 0; b < 8; ++b) {
      length[b] = static_cast<uint8_t>(static_cast<uint64_t>(header.size()) >> (8 * b));
    }
    detail::write_all(fd, length, sizeof(length), tmp_path);
    detail::write_all(fd, header.data(), header.size(), tmp_path);
    for (size_t i : order) {
      if (sizes[i] == 0) {
        continue;
      }
      // One tensor at a time on the host: a GPU model needs one tensor's worth of host memory.
      const at::Tensor host = tensors[i].second.to(c10::kCPU).resolve_conj().resolve_neg().contiguous();
      detail::write_all(fd, host.const_data_ptr(), sizes[i], tmp_path);
    }
  });
}

}  // namespace roundpipe::models
