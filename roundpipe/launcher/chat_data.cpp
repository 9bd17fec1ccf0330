#include "roundpipe/launcher/chat_data.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <numeric>
#include <sstream>
#include <stdexcept>

#include "roundpipe/launcher/config.h"
#include "roundpipe/models/layers.h"

namespace roundpipe::launcher {
namespace {

using json = nlohmann::ordered_json;

constexpr const char* kLineExample =
    R"({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]})";

std::string with_commas(int64_t n) {
  std::string digits = std::to_string(n < 0 ? -n : n);
  std::string out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return n < 0 ? "-" + out : out;
}

[[noreturn]] void line_fail(const std::string& where, const std::string& what) {
  throw ConfigError(where + ": " + what);
}

// Checks one line's object and returns its messages; `where` is "PATH:LINE".
const json& checked_messages(const json& line, const std::string& where) {
  if (!line.is_object()) {
    line_fail(where, std::string("a JSON ") + line.type_name() + ", not an object: each line must be one " +
                         "conversation such as " + kLineExample);
  }
  auto it = line.find("messages");
  if (it == line.end()) {
    std::string keys;
    for (const auto& [key, value] : line.items()) keys += (keys.empty() ? "" : ", ") + key;
    line_fail(where, "no \"messages\" key (the object has: " + (keys.empty() ? std::string("nothing") : keys) +
                         "): each line must be {\"messages\": [...]}, e.g. " + kLineExample);
  }
  const json& messages = *it;
  if (!messages.is_array() || messages.empty()) {
    line_fail(where, std::string("\"messages\" must be a non-empty array of {\"role\", \"content\"} objects, got ") +
                         (messages.is_array() ? "an empty array" : std::string("a JSON ") + messages.type_name()));
  }
  for (size_t k = 0; k < messages.size(); ++k) {
    const json& m = messages[k];
    const std::string at = "messages[" + std::to_string(k) + "]";
    if (!m.is_object()) {
      line_fail(where, at + " is a JSON " + m.type_name() + ", not an object {\"role\": ..., \"content\": ...}");
    }
    auto role = m.find("role");
    if (role == m.end() || !role->is_string()) {
      line_fail(where, at + (role == m.end() ? " has no \"role\"" : " has a \"role\" that is not a string") +
                           ": give each message \"role\": \"system\", \"user\" or \"assistant\"");
    }
    const std::string& r = role->get_ref<const std::string&>();
    if (r != "system" && r != "user" && r != "assistant") {
      line_fail(where, at + " has the unknown role \"" + r +
                           "\": the roles are \"system\", \"user\" and \"assistant\" (rename it, or drop the message)");
    }
    auto content = m.find("content");
    if (content == m.end() || !content->is_string()) {
      line_fail(where, at +
                           (content == m.end() ? " has no \"content\""
                                               : std::string(" has a \"content\" that is a JSON ") +
                                                     content->type_name() + ", not a string") +
                           ": give each message its text as \"content\": \"...\"");
    }
  }
  return messages;
}

// Trained labels of a row: positions 1.. whose token is trained (position 0 is nobody's label).
int64_t trained_labels(const models::ChatTokens& row) {
  int64_t n = 0;
  for (size_t i = 1; i < row.trained.size(); ++i) n += row.trained[i] != 0;
  return n;
}

// Note [Chat packing]: with data.packing, each kept conversation (its first seq_len + 1 tokens)
// takes n - 1 input positions of a row (all its tokens but the last, which is only a label), and
// whole conversations are packed into rows of seq_len positions best-fit decreasing (TRL's `bfd`):
// longest first (ties in file order), each into the open row with the least room that still
// fits it, else a new row. The rows are made once; epochs shuffle the rows. Within a row each
// conversation keeps its own labels (never the next conversation's first token), its positions
// restart at 0 and its segment id is its index in the row, so the attention layers (docs/models.md,
// "Packed sequences") compute each conversation as if it were alone: the loss equals unpacked.
std::vector<std::vector<int64_t>> pack_best_fit_decreasing(const std::vector<int64_t>& lengths, int64_t capacity) {
  std::vector<int64_t> order(lengths.size());
  std::iota(order.begin(), order.end(), int64_t{0});
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return lengths[a] > lengths[b]; });
  std::vector<std::vector<int64_t>> packs;
  std::multimap<int64_t, size_t> room;  // room left -> pack
  for (int64_t i : order) {
    const int64_t n = lengths[static_cast<size_t>(i)];
    auto it = room.lower_bound(n);  // the least room that fits
    size_t pack = 0;
    int64_t left = 0;
    if (it == room.end()) {
      pack = packs.size();
      packs.emplace_back();
      left = capacity;
    } else {
      pack = it->second;
      left = it->first;
      room.erase(it);
    }
    packs[pack].push_back(i);
    if (left - n > 0) room.emplace(left - n, pack);
  }
  return packs;
}

}  // namespace

ChatDataset ChatDataset::load(const std::string& path, const models::ChatTemplate& chat_template,
                              const models::Tokenizer& tokenizer, const ChatDataOptions& options) {
  if (options.seq_len < 1) throw ConfigError("data.seq_len: must be >= 1 for chat data");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ConfigError(path + ": cannot open the chat file; check data.train / data.valid");
  ChatDataset data;
  data.path_ = path;
  data.options_ = options;
  ChatDataStats& stats = data.stats_;
  const int64_t keep = options.seq_len + 1;
  std::string line;
  int64_t line_number = 0;
  while (std::getline(in, line)) {
    ++line_number;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.find_first_not_of(" \t") == std::string::npos) continue;
    const std::string where = path + ":" + std::to_string(line_number);
    json parsed;
    try {
      parsed = json::parse(line);
    } catch (const json::parse_error& e) {
      line_fail(where, std::string("not valid JSON (") + e.what() + "): each line must be one JSON object such as " +
                           kLineExample);
    }
    const json& messages = checked_messages(parsed, where);
    ++stats.lines;
    models::ChatTokens row;
    try {
      row = models::tokenize_chat(chat_template, tokenizer, messages, options.train_on);
    } catch (const models::ChatTemplateError& e) {
      line_fail(where, std::string(e.raised_by_template() ? "the chat template refused this conversation: "
                                                          : "rendering this conversation failed: ") +
                           e.what());
    } catch (const std::exception& e) {
      line_fail(where, e.what());
    }
    if (trained_labels(row) == 0) {
      ++stats.dropped_untrained;
      continue;
    }
    const int64_t length = static_cast<int64_t>(row.ids.size());
    if (length > keep) {
      stats.tokens_cut += length - keep;
      row.ids.resize(static_cast<size_t>(keep));
      row.trained.resize(static_cast<size_t>(keep));
      if (trained_labels(row) == 0) {
        ++stats.dropped_truncated;
        continue;
      }
      ++stats.truncated;
    }
    stats.tokens += static_cast<int64_t>(row.ids.size());
    stats.trained_tokens += trained_labels(row);
    data.rows_.push_back(std::move(row));
  }
  if (in.bad()) throw ConfigError(path + ": reading the chat file failed");
  stats.conversations = static_cast<int64_t>(data.rows_.size());
  if (stats.lines == 0) {
    throw ConfigError(path + ": no conversations (the file is empty or blank): write one JSON object a line, e.g. " +
                      kLineExample);
  }
  if (stats.conversations == 0) {
    throw ConfigError(path + ": none of its " + with_commas(stats.lines) + " conversations has a token to train (" +
                      with_commas(stats.dropped_untrained) + " without one, " + with_commas(stats.dropped_truncated) +
                      " with all of them past data.seq_len + 1 = " + std::to_string(keep) +
                      " tokens): raise data.seq_len, or set data.train_on: all");
  }
  if (options.packing) {
    std::vector<int64_t> lengths;
    lengths.reserve(data.rows_.size());
    for (const auto& row : data.rows_) lengths.push_back(static_cast<int64_t>(row.ids.size()) - 1);
    data.packs_ = pack_best_fit_decreasing(lengths, options.seq_len);
    stats.packed_rows = static_cast<int64_t>(data.packs_.size());
  }
  return data;
}

std::string ChatDataset::describe() const {
  std::string text = "chat file '" + path_ + "' (" + with_commas(stats_.conversations) + " conversations, " +
                     with_commas(stats_.tokens) + " tokens, " + with_commas(stats_.trained_tokens) + " trained";
  const int64_t dropped = stats_.dropped_untrained + stats_.dropped_truncated;
  if (stats_.truncated > 0 || dropped > 0) {
    text += "; " + with_commas(stats_.truncated) +
            " truncated to data.seq_len + 1 = " + std::to_string(options_.seq_len + 1) + " tokens (" +
            with_commas(stats_.tokens_cut) + " tokens cut), " + with_commas(dropped) + " dropped with nothing to train";
    if (stats_.dropped_truncated > 0) text += " (" + with_commas(stats_.dropped_truncated) + " of them by truncation)";
  }
  if (options_.packing) {
    const int64_t inputs = stats_.tokens - stats_.conversations;
    const double fill = 100.0 * static_cast<double>(inputs) /
                        static_cast<double>(std::max<int64_t>(1, stats_.packed_rows * options_.seq_len));
    std::ostringstream f;
    f.precision(1);
    f << std::fixed << fill;
    text += "; packed into " + with_commas(stats_.packed_rows) + " rows of " + std::to_string(options_.seq_len) +
            " positions, " + f.str() + "% filled";
  }
  return text + ")";
}

Batch ChatDataset::make_batch(const std::vector<int64_t>& indices) const {
  TORCH_CHECK(!indices.empty(), "ChatDataset::make_batch: no rows requested");
  // [row] the conversations of each row: one, or a pack (Note [Chat packing]).
  std::vector<std::vector<int64_t>> convs;
  int64_t width = 1;
  for (int64_t i : indices) {
    TORCH_CHECK(i >= 0 && i < size(), "ChatDataset::make_batch: row ", i, " is outside [0, ", size(), ")");
    convs.push_back(options_.packing ? packs_[static_cast<size_t>(i)] : std::vector<int64_t>{i});
    int64_t used = 0;
    for (int64_t c : convs.back()) used += static_cast<int64_t>(rows_[static_cast<size_t>(c)].ids.size()) - 1;
    width = std::max(width, used);
  }
  const int64_t rows = static_cast<int64_t>(indices.size());
  at::Tensor inputs = at::full({rows, width}, options_.pad_id, at::kLong);
  at::Tensor labels = at::full({rows, width}, kIgnoreLabel, at::kLong);
  at::Tensor positions, segments;
  int64_t* pos = nullptr;
  int64_t* seg = nullptr;
  if (options_.packing) {
    positions = at::empty({rows, width}, at::kLong);
    segments = at::empty({rows, width}, at::kLong);
    pos = positions.data_ptr<int64_t>();
    seg = segments.data_ptr<int64_t>();
  }
  int64_t* in = inputs.data_ptr<int64_t>();
  int64_t* lab = labels.data_ptr<int64_t>();
  int64_t tokens = 0;
  for (int64_t r = 0; r < rows; ++r) {
    int64_t at = 0;
    int64_t segment = 0;
    for (int64_t c : convs[static_cast<size_t>(r)]) {
      const models::ChatTokens& row = rows_[static_cast<size_t>(c)];
      const int64_t n = static_cast<int64_t>(row.ids.size()) - 1;  // inputs: all but the last token
      for (int64_t t = 0; t < n; ++t) {
        const int64_t k = r * width + at + t;
        in[k] = row.ids[static_cast<size_t>(t)];
        if (row.trained[static_cast<size_t>(t + 1)] != 0) lab[k] = row.ids[static_cast<size_t>(t + 1)];
        if (pos != nullptr) {
          pos[k] = t;
          seg[k] = segment;
        }
      }
      at += n;
      ++segment;
    }
    tokens += at;
    for (int64_t t = at; pos != nullptr && t < width; ++t) {  // padding: a segment of its own
      pos[r * width + t] = t - at;
      seg[r * width + t] = segment;
    }
  }
  Batch batch{inputs, labels, tokens};
  if (options_.packing) batch.side_inputs = {{models::kPositionIds, positions}, {models::kSegmentIds, segments}};
  return batch;
}

ChatSampler::ChatSampler(const ChatDataset& data, int64_t batch_rows, uint64_t seed)
    : data_(data), batch_rows_(batch_rows), seed_(seed) {
  TORCH_CHECK(batch_rows >= 1, "ChatSampler: batch_rows must be >= 1, got ", batch_rows);
  TORCH_CHECK(data.size() >= 1, "ChatSampler: the chat data has no conversations");
}

int64_t ChatSampler::index_of(uint64_t n) {
  const uint64_t size = static_cast<uint64_t>(data_.size());
  const auto epoch = static_cast<int64_t>(n / size);
  if (epoch != cached_epoch_) {
    permutation_.resize(size);
    std::iota(permutation_.begin(), permutation_.end(), int64_t{0});
    SplitMix64 rng(seed_ ^ (static_cast<uint64_t>(epoch) * 0xD1B54A32D192ED03ULL));
    for (uint64_t i = size - 1; i > 0; --i) std::swap(permutation_[i], permutation_[rng.uniform(i + 1)]);
    cached_epoch_ = epoch;
  }
  return permutation_[n % size];
}

Batch ChatSampler::next() {
  std::vector<int64_t> indices(static_cast<size_t>(batch_rows_));
  for (int64_t& index : indices) index = index_of(drawn_++);
  return data_.make_batch(indices);
}

ChatEvalBatches::ChatEvalBatches(const ChatDataset& data, int64_t batch_rows, int64_t max_batches)
    : data_(data), batch_rows_(batch_rows), end_(data.size()) {
  TORCH_CHECK(batch_rows >= 1, "ChatEvalBatches: batch_rows must be >= 1, got ", batch_rows);
  if (max_batches > 0) end_ = std::min(end_, max_batches * batch_rows);
}

std::optional<Batch> ChatEvalBatches::next() {
  if (next_ >= end_) return std::nullopt;
  std::vector<int64_t> indices;
  for (int64_t i = next_; i < std::min(end_, next_ + batch_rows_); ++i) indices.push_back(i);
  next_ += static_cast<int64_t>(indices.size());
  return data_.make_batch(indices);
}

}  // namespace roundpipe::launcher
