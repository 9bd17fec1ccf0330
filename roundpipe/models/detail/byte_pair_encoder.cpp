#include "roundpipe/models/detail/byte_pair_encoder.h"

#include <limits>
#include <queue>
#include <stdexcept>

#include "roundpipe/models/detail/tokenizer_text.h"

namespace roundpipe::models::detail {

BytePairEncoder::BytePairEncoder(std::unordered_map<std::string, int64_t> vocab,
                                 const std::vector<std::pair<std::string, std::string>>& merges, bool ignore_merges)
    : vocab_(std::move(vocab)), ignore_merges_(ignore_merges) {
  for (const auto& [token, id] : vocab_) {
    if (id < 0 || id > std::numeric_limits<int32_t>::max()) {
      throw std::invalid_argument("vocab entry \"" + token + "\" has id " + std::to_string(id) +
                                  " outside [0, 2^31)");
    }
    id_to_token_.emplace(id, token);
    max_id_ = std::max(max_id_, id);
  }
  const auto& chars = byte_chars();
  for (size_t b = 0; b < 256; ++b) {
    const auto it = vocab_.find(chars[b]);
    byte_ids_[b] = it == vocab_.end() ? -1 : it->second;
  }
  merges_.reserve(merges.size());
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const auto& [left, right] = merges[rank];
    const auto l = vocab_.find(left);
    const auto r = vocab_.find(right);
    const auto merged = vocab_.find(left + right);
    if (l == vocab_.end() || r == vocab_.end() || merged == vocab_.end()) {
      throw std::invalid_argument("merge " + std::to_string(rank) + " (\"" + left + "\", \"" + right +
                                  "\"): a part or the merged token is not in the vocab");
    }
    // A repeated pair keeps its last rank, as `tokenizers`' map collected in file order does.
    merges_[pair_key(l->second, r->second)] = Merge{static_cast<int32_t>(rank), merged->second};
  }
}

bool BytePairEncoder::covers_all_bytes() const {
  for (const int64_t id : byte_ids_) {
    if (id < 0) return false;
  }
  return true;
}

std::optional<int64_t> BytePairEncoder::token_to_id(std::string_view token) const {
  const auto it = vocab_.find(std::string(token));
  return it == vocab_.end() ? std::nullopt : std::optional<int64_t>(it->second);
}

const std::string* BytePairEncoder::id_to_token(int64_t id) const {
  const auto it = id_to_token_.find(id);
  return it == id_to_token_.end() ? nullptr : &it->second;
}

void BytePairEncoder::encode_word(std::string_view bytes, std::vector<int64_t>& out) const {
  if (ignore_merges_) {
    std::string mapped;
    for (const char c : bytes) mapped += byte_chars()[static_cast<unsigned char>(c)];
    const auto it = vocab_.find(mapped);
    if (it != vocab_.end()) {
      out.push_back(it->second);
      return;
    }
  }
  const std::string key(bytes);
  {
    std::lock_guard<std::mutex> lock(cache_mutex_);
    const auto it = cache_.find(key);
    if (it != cache_.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  std::vector<int64_t> symbols;
  symbols.reserve(bytes.size());
  for (const char c : bytes) {
    const int64_t id = byte_ids_[static_cast<unsigned char>(c)];
    if (id >= 0) symbols.push_back(id);
  }
  merge_word(symbols);
  out.insert(out.end(), symbols.begin(), symbols.end());
  std::lock_guard<std::mutex> lock(cache_mutex_);
  if (cache_.size() >= kCacheCapacity) cache_.clear();
  cache_.emplace(key, std::move(symbols));
}

// Token lengths are counted in bytes of the ByteLevel characters (1 or 2 per raw byte), as
// `tokenizers`' Word symbols are, and mapped back to the raw byte whose character holds them.
void BytePairEncoder::token_spans(std::string_view bytes, const int64_t* ids, size_t count,
                                  std::vector<std::pair<size_t, size_t>>& spans) const {
  const auto& chars = byte_chars();
  size_t raw = 0;         // the raw byte whose character holds byte `char_start` onwards
  size_t char_start = 0;  // where raw's character starts among the ByteLevel bytes
  const auto raw_at = [&](size_t pos) {
    while (raw + 1 < bytes.size() && char_start + chars[static_cast<unsigned char>(bytes[raw])].size() <= pos) {
      char_start += chars[static_cast<unsigned char>(bytes[raw])].size();
      ++raw;
    }
    return raw;
  };
  size_t pos = 0;
  for (size_t i = 0; i < count; ++i) {
    // Lengths come from the token's text (`tokenizers` sums its symbols' lengths instead; the two
    // differ only where the vocab gives one id to two tokens, and then the first one read wins).
    const std::string* token = id_to_token(ids[i]);
    const size_t length = token == nullptr || token->empty() ? 1 : token->size();
    const size_t first = raw_at(pos);
    pos += length;
    spans.emplace_back(first, raw_at(pos - 1));
  }
}

// Note [BPE merge order]: `tokenizers`' Word::merge_all, step for step. A min-heap holds
// (rank, position) of every adjacent pair with a merge; the lowest rank wins, then the leftmost.
// An entry whose pair has changed since it was pushed is skipped unless the pair there now merges
// into the same token (the check compares the merged id only, as upstream does).
void BytePairEncoder::merge_word(std::vector<int64_t>& symbols) const {
  const int n = static_cast<int>(symbols.size());
  if (n < 2) return;
  std::vector<int> prev(n), next(n);
  std::vector<bool> removed(n, false);
  for (int i = 0; i < n; ++i) {
    prev[i] = i - 1;
    next[i] = i + 1 < n ? i + 1 : -1;
  }
  struct Entry {
    int32_t rank;
    int pos;
    int64_t new_id;
    bool operator>(const Entry& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> queue;
  const auto push_pair = [&](int pos) {
    const int right = next[pos];
    if (right < 0) return;
    const auto it = merges_.find(pair_key(symbols[pos], symbols[right]));
    if (it != merges_.end()) queue.push(Entry{it->second.rank, pos, it->second.new_id});
  };
  for (int i = 0; i + 1 < n; ++i) push_pair(i);
  while (!queue.empty()) {
    const Entry top = queue.top();
    queue.pop();
    if (removed[top.pos] || next[top.pos] < 0) continue;
    const int right = next[top.pos];
    const auto it = merges_.find(pair_key(symbols[top.pos], symbols[right]));
    if (it == merges_.end() || it->second.new_id != top.new_id) continue;
    symbols[top.pos] = top.new_id;
    removed[right] = true;
    next[top.pos] = next[right];
    if (next[right] >= 0) prev[next[right]] = top.pos;
    if (prev[top.pos] >= 0) push_pair(prev[top.pos]);
    push_pair(top.pos);
  }
  int out = 0;
  for (int i = 0; i < n; ++i) {
    if (!removed[i]) symbols[out++] = symbols[i];
  }
  symbols.resize(out);
}

}  // namespace roundpipe::models::detail
