// roundpipe::models: safetensors files and Hugging Face style checkpoint directories. A reader that
// memory-maps a file and validates its header up front (the checks of the reference Rust crate),
// zero-copy CPU tensors over the mapping, an atomic writer byte-compatible with Python's
// `safetensors`, and sharded checkpoints laid out like transformers' save_pretrained.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace roundpipe::models {

namespace detail {
struct FileMapping;
}  // namespace detail

/// One tensor's header entry. `begin`/`end` are byte offsets into the data section (the bytes after
/// the 8-byte length and the JSON header), `end - begin == numel(shape) * element_size(dtype)`.
struct TensorInfo {
  std::string name;
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  std::vector<int64_t> shape;
  uint64_t begin = 0;
  uint64_t end = 0;
};

/// A read-only, memory-mapped safetensors file (mmap PROT_READ, MAP_PRIVATE).
///
/// `open` validates the whole header before returning (docs/models.md, "safetensors files");
/// a malformed file throws c10::Error naming the file, the tensor and the rule, never crashes.
///
/// Dtypes: BOOL U8 I8 I16 U16 I32 U32 I64 U64 F16 BF16 F32 F64 C64 F8_E4M3 F8_E5M2 F8_E8M0
/// (U16/U32/U64 are torch's limited-support unsigned types). F4/F6_* are rejected by name.
///
/// Lifetime: tensors from `get` keep the mapping alive (their deleter holds a shared_ptr), so they
/// may outlive this object. Read-only: their memory is mapped without write permission, so writing
/// into them in place (`add_`, `copy_` into it, `optimizer.step()`) kills the process with SIGSEGV;
/// `clone()` first, or use `get(name, dtype)` with another dtype. Truncating the file on disk while
/// it is mapped makes later reads fault with SIGBUS (as for any mmap reader).
///
/// Thread-safety: immutable after `open`; every method may be called from any thread.
///
///   auto file = SafetensorsFile::open("model.safetensors");
///   at::Tensor w = file->get("lm_head.weight");                // zero-copy view, read-only
///   at::Tensor w32 = file->get("lm_head.weight", at::kFloat);  // converted copy
class SafetensorsFile {
 public:
  /// Maps `path` and validates the header; throws c10::Error on any violation or I/O error.
  static std::shared_ptr<SafetensorsFile> open(const std::string& path);

  const std::string& path() const { return path_; }
  /// Tensor names in data-offset order (the order of the bytes in the file).
  std::vector<std::string> names() const;
  bool contains(const std::string& name) const { return index_.count(name) != 0; }
  /// Header entry of `name`; throws c10::Error naming the file and the tensor if it is missing.
  const TensorInfo& info(const std::string& name) const;
  /// The optional "__metadata__" string map (empty when the file has none).
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  /// Size of the data section in bytes (the sum of all tensors' sizes).
  uint64_t data_bytes() const { return data_bytes_; }

  /// Contiguous CPU tensor over the mapping, no copy (read-only, see the class comment). Data whose
  /// address is not a multiple of the element size (possible only in files not written by
  /// safetensors' own writers) is returned as an aligned copy instead.
  at::Tensor get(const std::string& name) const;
  /// `get(name)` when `dtype` is the stored dtype, else a converted copy (`get(name).to(dtype)`).
  at::Tensor get(const std::string& name, c10::ScalarType dtype) const;

  /// Drops this process's resident pages of `name`'s bytes (madvise MADV_DONTNEED on the pages
  /// they span), e.g. once a loader has copied the tensor: the resident set shrinks by them and the
  /// page cache keeps them. Tensors from `get` stay valid: the mapping is private and never
  /// written, so a later read faults the same bytes back in from the file. See Note [Releasing
  /// mapped pages].
  void release_pages(const std::string& name) const;

 private:
  SafetensorsFile() = default;

  std::string path_;
  std::shared_ptr<detail::FileMapping> mapping_;
  uint64_t data_start_ = 0;  // offset of the data section in the file: 8 + header length
  uint64_t data_bytes_ = 0;
  std::vector<TensorInfo> tensors_;  // data-offset order
  std::unordered_map<std::string, size_t> index_;
  std::map<std::string, std::string> metadata_;
};

/// Writes `tensors` (any device, any layout; undefined tensors and duplicate names are rejected)
/// and `metadata` as a safetensors file, byte for byte what Python's `safetensors.torch.save_file`
/// writes for the same dict (tensors ordered by dtype alignment descending then name; header padded
/// with spaces to a multiple of 8; metadata keys sorted). Non-contiguous tensors are made contiguous
/// and non-CPU tensors copied to the CPU, one tensor at a time.
///
/// Atomic: everything is validated first, then written to `path.tmp.<pid>`, fsync'ed, renamed over
/// `path` and the directory fsync'ed. On failure the temporary file is removed and a previous file
/// at `path` is left intact.
void save_safetensors(const std::string& path,
                      const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata = {});

/// A checkpoint directory as written by transformers' save_pretrained: `model.safetensors`, or
/// `model.safetensors.index.json` plus the shards its "weight_map" names. When both exist, the
/// single file wins (as in transformers). Every file is opened and validated by `open`; a name in
/// the index that its shard lacks is an error.
///
/// Thread-safety: immutable after `open`; every method may be called from any thread. Copies share
/// the underlying mappings.
///
///   auto ckpt = CheckpointReader::open("/models/llama-1b");
///   for (const auto& name : ckpt.names()) params[name].copy_(ckpt.get(name));
class CheckpointReader {
 public:
  /// Throws c10::Error if neither `dir/model.safetensors` nor `dir/model.safetensors.index.json`
  /// exists (naming both), or if any file is malformed.
  static CheckpointReader open(const std::string& dir);

  const std::string& dir() const { return dir_; }
  /// Names in storage order: shard by shard (in file-name order), data-offset order within a shard.
  std::vector<std::string> names() const;
  bool contains(const std::string& name) const { return where_.count(name) != 0; }
  const TensorInfo& info(const std::string& name) const;
  /// See SafetensorsFile::get (zero-copy, read-only).
  at::Tensor get(const std::string& name) const;
  at::Tensor get(const std::string& name, c10::ScalarType dtype) const;
  /// See SafetensorsFile::release_pages.
  void release_pages(const std::string& name) const;
  /// The files backing the checkpoint (one, or the shards in file-name order).
  const std::vector<std::shared_ptr<SafetensorsFile>>& files() const { return files_; }

 private:
  const SafetensorsFile& file_of(const std::string& name) const;

  std::string dir_;
  std::vector<std::shared_ptr<SafetensorsFile>> files_;
  std::unordered_map<std::string, size_t> where_;  // name -> index into files_
  std::vector<std::string> names_;
};

/// How `save_checkpoint` splits tensors into files.
struct ShardOptions {
  /// A shard is closed before the tensor that would push it past this many bytes of tensor data;
  /// a tensor larger than this gets a shard of its own (transformers' rule). > 0.
  int64_t max_shard_bytes = 5LL << 30;
  /// File-name prefix: `<prefix>.safetensors` or `<prefix>-00001-of-0000N.safetensors` and
  /// `<prefix>.safetensors.index.json`. CheckpointReader reads the prefix "model".
  std::string prefix = "model";
};

/// Writes `tensors` into `dir` (created if missing, parent must exist): `dir/<prefix>.safetensors`
/// when everything fits in one shard, else the shards plus `dir/<prefix>.safetensors.index.json`
/// ({"metadata": {"total_size": bytes}, "weight_map": {name: file}}, formatted like transformers'
/// save_pretrained). Each file is written atomically (see save_safetensors); the shards are written
/// before the index, then files of an earlier save with the same prefix that this save does not
/// reuse (the other layout's files, stale shards) are removed. Shards carry the metadata
/// {"format": "pt"} as save_pretrained writes it.
void save_checkpoint(const std::string& dir,
                     const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                     const ShardOptions& options = {});

}  // namespace roundpipe::models
