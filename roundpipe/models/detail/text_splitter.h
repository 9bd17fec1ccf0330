// Splitting steps of the tokenizer (roundpipe/models/tokenizer.h): the pre-tokenizer's regex splits
// with their behaviours (`tokenizers`' NormalizedString::split) and the added-token matcher that
// runs before them. Both work on byte ranges of the text, which is what offsets are built from.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "roundpipe/models/detail/tokenizer_text.h"

namespace roundpipe::models::detail {

using ByteRange = std::pair<size_t, size_t>;  // [begin, end) in bytes

enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

/// One Split (or Digits) pre-tokenizer. Immutable; shared by the threads that encode.
struct SplitStep {
  Regex regex;
  SplitBehavior behavior;
  bool invert;
};

/// `tokenizers`' NormalizedString::split (normalizer.rs): the pattern's matches and the gaps
/// between them, flagged, inverted on request, then combined by `behavior`; empty pieces dropped.
/// Returns [begin, end) byte ranges of `text`, in order.
std::vector<ByteRange> split_ranges(std::string_view text, const SplitStep& step);

/// Added tokens matched leftmost-longest (the aho-corasick MatchKind of `tokenizers`). Filled by
/// add() while loading, then immutable: split() may run on many threads.
class AddedTokenMatcher {
 public:
  void add(std::string content, int64_t id);

  /// Calls on_text(begin, end) for each non-empty stretch of `text` between matches and
  /// on_token(id, begin, end) for each match, in text order; positions are bytes of `text`.
  template <typename OnText, typename OnToken>
  void split(std::string_view text, OnText&& on_text, OnToken&& on_token) const {
    size_t start = 0;
    for (size_t i = 0; !empty_ && i < text.size();) {
      const auto* match = longest_at(text, i);
      if (match == nullptr) {
        ++i;
        continue;
      }
      if (i > start) on_text(start, i);
      on_token(match->second, i, i + match->first.size());
      i += match->first.size();
      start = i;
    }
    if (start < text.size()) on_text(start, text.size());
  }

 private:
  const std::pair<std::string, int64_t>* longest_at(std::string_view text, size_t pos) const {
    for (const auto& candidate : by_first_byte_[static_cast<unsigned char>(text[pos])]) {
      if (text.compare(pos, candidate.first.size(), candidate.first) == 0) return &candidate;
    }
    return nullptr;
  }
  // Per first byte, the candidates longest first.
  std::array<std::vector<std::pair<std::string, int64_t>>, 256> by_first_byte_;
  bool empty_ = true;
};

}  // namespace roundpipe::models::detail
