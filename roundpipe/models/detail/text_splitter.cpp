#include "roundpipe/models/detail/text_splitter.h"

namespace roundpipe::models::detail {

std::vector<ByteRange> split_ranges(std::string_view text, const SplitStep& step) {
  std::vector<std::pair<ByteRange, bool>> parts;
  size_t prev = 0;
  for (const auto& [start, end] : step.regex.find_all(text)) {
    if (prev != start) parts.push_back({{prev, start}, false});
    parts.push_back({{start, end}, true});
    prev = end;
  }
  if (prev != text.size()) parts.push_back({{prev, text.size()}, false});
  if (step.invert) {
    for (auto& part : parts) part.second = !part.second;
  }
  std::vector<ByteRange> out;
  bool previous_match = false;
  switch (step.behavior) {
    case SplitBehavior::kRemoved:
      for (const auto& [range, is_match] : parts) {
        if (!is_match) out.push_back(range);
      }
      break;
    case SplitBehavior::kIsolated:
      for (const auto& part : parts) out.push_back(part.first);
      break;
    case SplitBehavior::kMergedWithPrevious:
      for (const auto& [range, is_match] : parts) {
        if (is_match && !previous_match && !out.empty()) {
          out.back().second = range.second;
        } else {
          out.push_back(range);
        }
        previous_match = is_match;
      }
      break;
    case SplitBehavior::kMergedWithNext:
      for (auto it = parts.rbegin(); it != parts.rend(); ++it) {
        if (it->second && !previous_match && !out.empty()) {
          out.back().first = it->first.first;
        } else {
          out.push_back(it->first);
        }
        previous_match = it->second;
      }
      std::reverse(out.begin(), out.end());
      break;
    case SplitBehavior::kContiguous:
      for (const auto& [range, is_match] : parts) {
        if (is_match == previous_match && !out.empty()) {
          out.back().second = range.second;
        } else {
          out.push_back(range);
        }
        previous_match = is_match;
      }
      break;
  }
  out.erase(std::remove_if(out.begin(), out.end(), [](const ByteRange& r) { return r.first == r.second; }),
            out.end());
  return out;
}

void AddedTokenMatcher::add(std::string content, int64_t id) {
  const auto first = static_cast<unsigned char>(content[0]);
  auto& bucket = by_first_byte_[first];
  bucket.emplace_back(std::move(content), id);
  std::stable_sort(bucket.begin(), bucket.end(),
                   [](const auto& a, const auto& b) { return a.first.size() > b.first.size(); });
  empty_ = false;
}

}  // namespace roundpipe::models::detail
