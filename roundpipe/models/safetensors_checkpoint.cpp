// CheckpointReader and save_checkpoint: transformers-style checkpoint directories (one
// model.safetensors, or shards plus model.safetensors.index.json).
#include <c10/util/Exception.h>
#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <numeric>
#include <set>

#include "roundpipe/models/detail/safetensors_format.h"
#include "roundpipe/models/safetensors.h"

namespace roundpipe::models {
namespace {

using nlohmann::json;

constexpr const char* kSingleFile = "model.safetensors";
constexpr const char* kIndexFile = "model.safetensors.index.json";

std::string read_whole_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  TORCH_CHECK(fd >= 0, "cannot open '", path, "': ", detail::errno_text(errno));
  std::string text;
  char buffer[1 << 16];
  while (true) {
    const ssize_t got = ::read(fd, buffer, sizeof(buffer));
    if (got < 0 && errno == EINTR) {
      continue;
    }
    if (got <= 0) {
      const int err = errno;
      ::close(fd);
      TORCH_CHECK(got == 0, "reading '", path, "' failed: ", detail::errno_text(err));
      return text;
    }
    text.append(buffer, static_cast<size_t>(got));
  }
}

// A shard name from an index must stay inside the checkpoint directory.
bool is_safe_relative_path(const std::string& name) {
  if (name.empty() || name.front() == '/') {
    return false;
  }
  size_t start = 0;
  while (start <= name.size()) {
    const size_t slash = std::min(name.find('/', start), name.size());
    if (name.compare(start, slash - start, "..") == 0 && slash - start == 2) {
      return false;
    }
    start = slash + 1;
  }
  return true;
}

// "<prefix>-NNNNN-of-NNNNN.safetensors" (the shard names save_pretrained writes).
bool is_shard_name(const std::string& name, const std::string& prefix) {
  const std::string suffix = ".safetensors";
  if (name.size() < prefix.size() + suffix.size() || name.compare(0, prefix.size(), prefix) != 0 ||
      name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0) {
    return false;
  }
  const std::string middle = name.substr(prefix.size(), name.size() - prefix.size() - suffix.size());
  if (middle.size() < 15 || middle[0] != '-') {
    return false;
  }
  const size_t of = middle.find("-of-");
  if (of == std::string::npos || of < 6) {
    return false;
  }
  const std::string first = middle.substr(1, of - 1);
  const std::string second = middle.substr(of + 4);
  const auto digits = [](const std::string& s) {
    return s.size() >= 5 && s.find_first_not_of("0123456789") == std::string::npos;
  };
  return digits(first) && digits(second);
}

std::string shard_name(const std::string& prefix, size_t index, size_t count) {
  char text[64];
  std::snprintf(text, sizeof(text), "-%05zu-of-%05zu.safetensors", index + 1, count);
  return prefix + text;
}

void remove_if_exists(const std::string& path) {
  TORCH_CHECK(::unlink(path.c_str()) == 0 || errno == ENOENT, "cannot remove stale checkpoint file '", path,
              "': ", detail::errno_text(errno));
}

// Note [Sharding]'s split: indices into the tensor list, one vector per shard (at least one).
std::vector<std::vector<size_t>> split_into_shards(const std::vector<uint64_t>& sizes, const int64_t max_shard_bytes) {
  const auto limit = static_cast<uint64_t>(max_shard_bytes);
  std::vector<std::vector<size_t>> shards;
  std::vector<size_t> current;
  uint64_t current_bytes = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i] > limit) {
      shards.push_back({i});
      continue;
    }
    if (current_bytes + sizes[i] > limit) {
      shards.push_back(std::move(current));
      current.clear();
      current_bytes = 0;
    }
    current.push_back(i);
    current_bytes += sizes[i];
  }
  if (!current.empty() || shards.empty()) {
    shards.push_back(std::move(current));
  }
  return shards;
}

// Removes the shards of an earlier save that this one did not overwrite.
void remove_stale_shards(const std::string& dir, const std::string& prefix, const std::set<std::string>& written) {
  DIR* listing = ::opendir(dir.c_str());
  TORCH_CHECK(listing != nullptr, "cannot list checkpoint directory '", dir, "': ", detail::errno_text(errno));
  std::vector<std::string> stale;
  while (const dirent* entry = ::readdir(listing)) {
    const std::string name = entry->d_name;
    if (is_shard_name(name, prefix) && written.count(name) == 0) {
      stale.push_back(name);
    }
  }
  ::closedir(listing);
  for (const auto& name : stale) {
    remove_if_exists(detail::join_path(dir, name));
  }
}

}  // namespace

CheckpointReader CheckpointReader::open(const std::string& dir) {
  CheckpointReader reader;
  reader.dir_ = dir;
  const std::string single = detail::join_path(dir, kSingleFile);
  const std::string index_path = detail::join_path(dir, kIndexFile);
  if (detail::is_regular_file(single)) {
    reader.files_.push_back(SafetensorsFile::open(single));
    reader.names_ = reader.files_[0]->names();
    for (const auto& name : reader.names_) {
      reader.where_.emplace(name, 0);
    }
    return reader;
  }
  TORCH_CHECK(detail::is_regular_file(index_path), "checkpoint directory '", dir, "' has neither '", single, "' nor '",
              index_path, "' (is it a Hugging Face checkpoint with safetensors weights?)");

  json index;
  try {
    index = json::parse(read_whole_file(index_path));
  } catch (const json::exception& e) {
    TORCH_CHECK(false, "checkpoint index '", index_path, "' is not valid JSON: ", e.what());
  }
  TORCH_CHECK(index.is_object() && index.contains("weight_map") && index["weight_map"].is_object(),
              "checkpoint index '", index_path, "' must be a JSON object with an object \"weight_map\"");
  std::map<std::string, std::vector<std::string>> by_file;  // sorted by file name
  for (const auto& [name, file] : index["weight_map"].items()) {
    TORCH_CHECK(file.is_string(), "checkpoint index '", index_path, "': weight_map['", name,
                "'] must be a file name string, got ", file.type_name());
    const std::string& file_name = file.get_ref<const std::string&>();
    TORCH_CHECK(is_safe_relative_path(file_name), "checkpoint index '", index_path, "': weight_map['", name, "'] = '",
                file_name, "' is not a relative path inside the checkpoint directory");
    by_file[file_name].push_back(name);
  }
  for (const auto& [file_name, tensor_names] : by_file) {
    const size_t slot = reader.files_.size();
    auto shard = SafetensorsFile::open(detail::join_path(dir, file_name));
    const std::set<std::string> wanted(tensor_names.begin(), tensor_names.end());
    for (const auto& name : tensor_names) {
      TORCH_CHECK(shard->contains(name), "checkpoint index '", index_path, "' maps tensor '", name, "' to '", file_name,
                  "', but that file has no such tensor");
      reader.where_.emplace(name, slot);
    }
    for (const auto& name : shard->names()) {
      if (wanted.count(name) != 0) {
        reader.names_.push_back(name);
      }
    }
    reader.files_.push_back(std::move(shard));
  }
  return reader;
}

std::vector<std::string> CheckpointReader::names() const { return names_; }

const SafetensorsFile& CheckpointReader::file_of(const std::string& name) const {
  const auto it = where_.find(name);
  TORCH_CHECK(it != where_.end(), "checkpoint '", dir_, "' has no tensor '", name, "' (it holds ", names_.size(),
              " tensors; list them with names())");
  return *files_[it->second];
}

const TensorInfo& CheckpointReader::info(const std::string& name) const { return file_of(name).info(name); }

at::Tensor CheckpointReader::get(const std::string& name) const { return file_of(name).get(name); }

at::Tensor CheckpointReader::get(const std::string& name, c10::ScalarType dtype) const {
  return file_of(name).get(name, dtype);
}

void CheckpointReader::release_pages(const std::string& name) const { file_of(name).release_pages(name); }

// Note [Sharding]: the split is huggingface_hub's split_state_dict_into_shards_factory (used by
// save_pretrained): walk the tensors in the given order; a tensor larger than the limit gets a shard
// of its own; otherwise a new shard starts when the tensor would push the current one past the
// limit. One shard is written as <prefix>.safetensors without an index.
void save_checkpoint(const std::string& dir, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                     const ShardOptions& options) {
  TORCH_CHECK(options.max_shard_bytes > 0, "ShardOptions::max_shard_bytes must be > 0, got ", options.max_shard_bytes);
  TORCH_CHECK(!options.prefix.empty() && options.prefix.find('/') == std::string::npos,
              "ShardOptions::prefix must be a non-empty file name without '/', got '", options.prefix, "'");
  const std::vector<uint64_t> sizes = detail::check_saveable(dir, tensors);

  if (::mkdir(dir.c_str(), 0755) != 0) {
    const int err = errno;
    struct stat st {};
    TORCH_CHECK(err == EEXIST && ::stat(dir.c_str(), &st) == 0 && S_ISDIR(st.st_mode),
                "cannot create checkpoint directory '", dir, "': ", detail::errno_text(err));
  }

  const std::vector<std::vector<size_t>> shards = split_into_shards(sizes, options.max_shard_bytes);
  const uint64_t total_bytes = std::accumulate(sizes.begin(), sizes.end(), uint64_t{0});

  const std::map<std::string, std::string> shard_metadata = {{"format", "pt"}};
  const std::string single = options.prefix + ".safetensors";
  const std::string index_name = options.prefix + ".safetensors.index.json";
  std::set<std::string> written;
  if (shards.size() == 1) {
    save_safetensors(detail::join_path(dir, single), tensors, shard_metadata);
    written.insert(single);
    remove_if_exists(detail::join_path(dir, index_name));
  } else {
    json weight_map = json::object();
    for (size_t s = 0; s < shards.size(); ++s) {
      const std::string name = shard_name(options.prefix, s, shards.size());
      std::vector<std::pair<std::string, at::Tensor>> shard;
      for (size_t i : shards[s]) {
        shard.push_back(tensors[i]);
        weight_map[tensors[i].first] = name;
      }
      save_safetensors(detail::join_path(dir, name), shard, shard_metadata);
      written.insert(name);
    }
    // Remove the single file before the index appears: readers prefer the single file.
    remove_if_exists(detail::join_path(dir, single));
    json index = {{"metadata", {{"total_size", total_bytes}}}, {"weight_map", std::move(weight_map)}};
    // transformers writes json.dumps(index, indent=2, sort_keys=True) + "\n" (ASCII-escaped).
    const std::string text = index.dump(2, ' ', true) + "\n";
    const std::string index_path = detail::join_path(dir, index_name);
    detail::write_file_atomically(index_path, [&](int fd, const std::string& tmp_path) {
      detail::write_all(fd, text.data(), text.size(), tmp_path);
    });
  }

  remove_stale_shards(dir, options.prefix, written);
}

}  // namespace roundpipe::models
