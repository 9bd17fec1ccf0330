// The BPE model of the tokenizer (roundpipe/models/tokenizer.h): vocabulary, merge ranks and the
// merge loop of Hugging Face `tokenizers` (models/bpe/word.rs, merge_all), over byte-level words.
#pragma once

#include <array>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace roundpipe::models::detail {

/// Byte-level BPE over a fixed vocabulary. Thread-safe: encode_word may run on many threads (the
/// word cache is guarded by cache_mutex_); everything else is immutable after construction.
class BytePairEncoder {
 public:
  /// `vocab`: token text (byte-level characters) -> id; `merges`: pairs in rank order. Throws
  /// std::invalid_argument naming the merge when a merge's parts or result are not in `vocab`.
  BytePairEncoder(std::unordered_map<std::string, int64_t> vocab,
                  const std::vector<std::pair<std::string, std::string>>& merges, bool ignore_merges);
  BytePairEncoder(const BytePairEncoder&) = delete;
  BytePairEncoder& operator=(const BytePairEncoder&) = delete;

  /// Appends the ids of one pre-token given as raw bytes (each byte is first written as its
  /// ByteLevel character). Bytes whose character is not in the vocabulary are dropped, as
  /// `tokenizers` does without an unk_token.
  void encode_word(std::string_view bytes, std::vector<int64_t>& out) const;

  /// Where each of `ids` (what encode_word appended for `bytes`, in order) lies in `bytes`:
  /// [first, last] byte indices, inclusive, appended to `spans`. As `tokenizers`' Word offsets:
  /// each token spans its own length in ByteLevel characters, counted on from the previous
  /// token's end, so a dropped byte shifts the tokens after it (what `tokenizers` reports too).
  void token_spans(std::string_view bytes, const int64_t* ids, size_t count,
                   std::vector<std::pair<size_t, size_t>>& spans) const;

  std::optional<int64_t> token_to_id(std::string_view token) const;
  const std::string* id_to_token(int64_t id) const;
  int64_t max_id() const { return max_id_; }
  /// True when all 256 byte characters are in the vocabulary (no byte can be dropped).
  bool covers_all_bytes() const;

 private:
  struct Merge {
    int32_t rank;
    int64_t new_id;
  };
  static uint64_t pair_key(int64_t left, int64_t right) {
    return (static_cast<uint64_t>(left) << 32) | static_cast<uint32_t>(right);
  }
  void merge_word(std::vector<int64_t>& symbols) const;

  std::unordered_map<std::string, int64_t> vocab_;
  std::unordered_map<int64_t, std::string> id_to_token_;
  std::unordered_map<uint64_t, Merge> merges_;
  std::array<int64_t, 256> byte_ids_{};  // -1: the byte's character is not in the vocabulary
  bool ignore_merges_;
  int64_t max_id_ = -1;

  static constexpr size_t kCacheCapacity = 1 << 16;
  mutable std::mutex cache_mutex_;
  mutable std::unordered_map<std::string, std::vector<int64_t>> cache_;  // guarded by cache_mutex_
};

}  // namespace roundpipe::models::detail
