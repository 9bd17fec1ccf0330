#include "roundpipe/models/tokenizer.h"

#include <nlohmann/json.hpp>
#include <utf8proc.h>

#include <algorithm>
#include <array>
#include <fstream>
#include <iterator>
#include <sstream>
#include <stdexcept>
#include <unordered_map>
#include <utility>

#include "roundpipe/models/detail/byte_pair_encoder.h"
#include "roundpipe/models/detail/tokenizer_text.h"

namespace roundpipe::models {
namespace {

using nlohmann::json;
using Range = std::pair<size_t, size_t>;

// The regex of `tokenizers`' ByteLevel pre-tokenizer with use_regex (GPT-2's).
constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

struct SplitStep {
  detail::Regex regex;
  SplitBehavior behavior;
  bool invert;
};

// `tokenizers`' NormalizedString::split (normalizer.rs): the pattern's matches and the gaps
// between them, flagged, inverted on request, then combined by `behavior`; empty pieces dropped.
std::vector<Range> split_ranges(std::string_view text, const SplitStep& step) {
  std::vector<std::pair<Range, bool>> parts;
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
  std::vector<Range> out;
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
  out.erase(std::remove_if(out.begin(), out.end(), [](const Range& r) { return r.first == r.second; }), out.end());
  return out;
}

// Added tokens matched leftmost-longest (the aho-corasick MatchKind of `tokenizers`).
class AddedTokenMatcher {
 public:
  void add(std::string content, int64_t id) {
    const auto first = static_cast<unsigned char>(content[0]);
    auto& bucket = by_first_byte_[first];
    bucket.emplace_back(std::move(content), id);
    std::stable_sort(bucket.begin(), bucket.end(),
                     [](const auto& a, const auto& b) { return a.first.size() > b.first.size(); });
    empty_ = false;
  }

  // Calls on_text(piece) for the text between matches and on_token(id) for each match, in order.
  template <typename OnText, typename OnToken>
  void split(std::string_view text, OnText&& on_text, OnToken&& on_token) const {
    size_t start = 0;
    for (size_t i = 0; !empty_ && i < text.size();) {
      const auto* match = longest_at(text, i);
      if (match == nullptr) {
        ++i;
        continue;
      }
      if (i > start) on_text(text.substr(start, i - start));
      on_token(match->second);
      i += match->first.size();
      start = i;
    }
    if (start < text.size()) on_text(text.substr(start));
  }

 private:
  const std::pair<std::string, int64_t>* longest_at(std::string_view text, size_t pos) const {
    for (const auto& candidate : by_first_byte_[static_cast<unsigned char>(text[pos])]) {
      if (text.compare(pos, candidate.first.size(), candidate.first) == 0) return &candidate;
    }
    return nullptr;
  }
  std::array<std::vector<std::pair<std::string, int64_t>>, 256> by_first_byte_;
  bool empty_ = true;
};

std::string shorten(const json& value) {
  std::string s = value.dump();
  return s.size() > 160 ? s.substr(0, 160) + "..." : s;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("Tokenizer: cannot open " + path);
  std::ostringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

}  // namespace

struct Tokenizer::Impl {
  std::string origin;
  std::unique_ptr<detail::BytePairEncoder> bpe;
  AddedTokenMatcher raw_added;         // added tokens with normalized = false
  AddedTokenMatcher normalized_added;  // normalized = true: matched after the normalizer
  std::unordered_map<int64_t, std::pair<std::string, bool>> added_by_id;  // id -> (content, special)
  std::unordered_map<std::string, int64_t> added_by_content;
  bool nfc = false;
  std::vector<SplitStep> splits;  // the pre-tokenizer before its final ByteLevel step
  bool add_prefix_space = false;
  std::optional<detail::Regex> byte_level_regex;
  std::vector<int64_t> prefix_ids;  // post-processor template around the sequence
  std::vector<int64_t> suffix_ids;
  int64_t vocab_size = 0;

  void load(const json& root);
  void pre_tokenize(size_t step, std::string_view piece, std::vector<int64_t>& ids) const;

 private:
  [[noreturn]] void refuse(const std::string& key, const json& value, const std::string& supported) const {
    throw std::runtime_error(origin + ": " + key + " = " + shorten(value) + " is not supported (" + supported +
                             "; docs/models.md, \"Tokenizer\")");
  }
  // A token id: a JSON integer in [0, 2^31) (tokenizers keeps ids as u32; no vocabulary comes
  // near). A float or an out-of-range integer is refused here: converting one would be undefined
  // behaviour (found by fuzz_tokenizer).
  int64_t token_id(const json& value, const std::string& key) const {
    constexpr int64_t kMaxId = 2147483647;
    if (!value.is_number_integer()) refuse(key, value, "an integer token id");
    const bool in_range = value.is_number_unsigned() ? value.get<uint64_t>() <= static_cast<uint64_t>(kMaxId)
                                                     : value.get<int64_t>() >= 0 && value.get<int64_t>() <= kMaxId;
    if (!in_range) refuse(key, value, "a token id in [0, 2147483647]");
    return value.get<int64_t>();
  }
  const json& at(const json& object, const std::string& name, const std::string& key) const {
    if (!object.is_object() || !object.contains(name)) {
      throw std::runtime_error(origin + ": missing key " + key + (key.empty() ? "" : ".") + name);
    }
    return object.at(name);
  }
  void load_model(const json& model);
  void load_added_tokens(const json& tokens);
  void load_normalizer(const json& normalizer, const std::string& key);
  void load_pre_tokenizer(const json& pre, const std::string& key, bool last);
  void load_post_processor(const json& post, const std::string& key);
};

void Tokenizer::Impl::load(const json& root) {
  if (!root.is_object()) refuse("(top level)", root, "a JSON object");
  for (const char* unsupported : {"truncation", "padding"}) {
    if (root.contains(unsupported) && !root.at(unsupported).is_null()) {
      refuse(unsupported, root.at(unsupported), "only null: encode returns every token");
    }
  }
  load_model(at(root, "model", ""));
  load_normalizer(root.value("normalizer", json()), "normalizer");
  load_added_tokens(root.value("added_tokens", json::array()));
  const json& pre = root.value("pre_tokenizer", json());
  if (pre.is_null()) refuse("pre_tokenizer", pre, "byte-level BPE needs a ByteLevel pre-tokenizer");
  load_pre_tokenizer(pre, "pre_tokenizer", true);
  load_post_processor(root.value("post_processor", json()), "post_processor");
  const json& decoder = root.value("decoder", json());
  if (!decoder.is_object() || decoder.value("type", "") != "ByteLevel") {
    refuse("decoder", decoder, "supported: ByteLevel");
  }
}

void Tokenizer::Impl::load_model(const json& model) {
  const std::string type = at(model, "type", "model").get<std::string>();
  if (type != "BPE") refuse("model.type", type, "supported: BPE");
  const json dropout = model.value("dropout", json());
  if (!dropout.is_null() && dropout.get<double>() != 0.0) refuse("model.dropout", dropout, "only null or 0");
  if (model.value("byte_fallback", false)) refuse("model.byte_fallback", true, "only false (byte-level BPE)");
  for (const char* affix : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    const json value = model.value(affix, json());
    if (!value.is_null() && !value.get<std::string>().empty()) {
      refuse(std::string("model.") + affix, value, "only null or \"\"");
    }
  }
  std::unordered_map<std::string, int64_t> vocab;
  for (const auto& [token, id] : at(model, "vocab", "model").items()) {
    vocab.emplace(token, token_id(id, "model.vocab[" + shorten(token) + "]"));
  }
  std::vector<std::pair<std::string, std::string>> merges;
  const json& merge_list = at(model, "merges", "model");
  merges.reserve(merge_list.size());
  for (size_t i = 0; i < merge_list.size(); ++i) {
    const json& m = merge_list[i];
    if (m.is_string()) {
      const std::string s = m.get<std::string>();
      const size_t space = s.find(' ');
      if (space == std::string::npos || s.find(' ', space + 1) != std::string::npos) {
        refuse("model.merges[" + std::to_string(i) + "]", m, "\"left right\" with exactly one space");
      }
      merges.emplace_back(s.substr(0, space), s.substr(space + 1));
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      merges.emplace_back(m[0].get<std::string>(), m[1].get<std::string>());
    } else {
      refuse("model.merges[" + std::to_string(i) + "]", m, "a \"left right\" string or a [left, right] pair");
    }
  }
  try {
    bpe = std::make_unique<detail::BytePairEncoder>(std::move(vocab), merges, model.value("ignore_merges", false));
  } catch (const std::invalid_argument& e) {
    throw std::runtime_error(origin + ": model: " + e.what());
  }
  vocab_size = bpe->max_id() + 1;
  const json unk = model.value("unk_token", json());
  if (!unk.is_null() && !bpe->covers_all_bytes()) {
    refuse("model.unk_token", unk, "an unk_token only where the vocab holds all 256 byte characters");
  }
}

void Tokenizer::Impl::load_added_tokens(const json& tokens) {
  for (size_t i = 0; i < tokens.size(); ++i) {
    const json& t = tokens[i];
    const std::string key = "added_tokens[" + std::to_string(i) + "]";
    for (const char* flag : {"lstrip", "rstrip", "single_word"}) {
      if (t.value(flag, false)) refuse(key + "." + flag, true, "only false");
    }
    const std::string content = at(t, "content", key).get<std::string>();
    const int64_t id = token_id(at(t, "id", key), key + ".id");
    if (content.empty()) refuse(key + ".content", content, "a non-empty string");
    added_by_id[id] = {content, t.value("special", false)};
    added_by_content[content] = id;
    vocab_size = std::max(vocab_size, id + 1);
    // As AddedVocabulary::refresh_added_tokens: special or not, `normalized` picks the pass.
    if (t.value("normalized", false)) {
      normalized_added.add(nfc ? detail::nfc(content) : content, id);
    } else {
      raw_added.add(content, id);
    }
  }
}

void Tokenizer::Impl::load_normalizer(const json& normalizer, const std::string& key) {
  if (normalizer.is_null()) return;
  const std::string type = at(normalizer, "type", key).get<std::string>();
  if (type == "NFC") {
    nfc = true;
  } else if (type == "Sequence") {
    const json& list = at(normalizer, "normalizers", key);
    for (size_t i = 0; i < list.size(); ++i) load_normalizer(list[i], key + ".normalizers[" + std::to_string(i) + "]");
  } else {
    refuse(key + ".type", type, "supported: null, NFC, Sequence of those");
  }
}

void Tokenizer::Impl::load_pre_tokenizer(const json& pre, const std::string& key, bool last) {
  const std::string type = at(pre, "type", key).get<std::string>();
  if (type == "Sequence") {
    const json& list = at(pre, "pretokenizers", key);
    if (list.empty()) refuse(key + ".pretokenizers", list, "a non-empty list ending with ByteLevel");
    for (size_t i = 0; i < list.size(); ++i) {
      load_pre_tokenizer(list[i], key + ".pretokenizers[" + std::to_string(i) + "]", last && i + 1 == list.size());
    }
    return;
  }
  if (type == "ByteLevel") {
    if (!last) refuse(key + ".type", type, "ByteLevel only as the last pre-tokenizer");
    add_prefix_space = pre.value("add_prefix_space", false);
    if (pre.value("use_regex", true)) byte_level_regex.emplace(kGpt2Pattern, detail::Regex::Syntax::kOniguruma);
    return;
  }
  if (last) refuse(key + ".type", type, "the pre-tokenizer must end with ByteLevel");
  if (type == "Digits") {
    const auto behavior = pre.value("individual_digits", false) ? SplitBehavior::kIsolated : SplitBehavior::kContiguous;
    splits.push_back({detail::Regex(R"(\p{N})", detail::Regex::Syntax::kOniguruma), behavior, false});
  } else if (type == "Split") {
    const json& pattern = at(pre, "pattern", key);
    const std::string behavior_name = at(pre, "behavior", key).get<std::string>();
    static const std::unordered_map<std::string, SplitBehavior> kBehaviors = {
        {"Removed", SplitBehavior::kRemoved},
        {"Isolated", SplitBehavior::kIsolated},
        {"MergedWithPrevious", SplitBehavior::kMergedWithPrevious},
        {"MergedWithNext", SplitBehavior::kMergedWithNext},
        {"Contiguous", SplitBehavior::kContiguous}};
    const auto behavior = kBehaviors.find(behavior_name);
    if (behavior == kBehaviors.end()) {
      refuse(key + ".behavior", behavior_name, "Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous");
    }
    std::optional<detail::Regex> regex;
    try {
      if (pattern.contains("Regex")) {
        regex.emplace(pattern.at("Regex").get<std::string>(), detail::Regex::Syntax::kOniguruma);
      } else if (pattern.contains("String") && !pattern.at("String").get<std::string>().empty()) {
        regex.emplace(pattern.at("String").get<std::string>(), detail::Regex::Syntax::kLiteral);
      } else {
        refuse(key + ".pattern", pattern, "{\"Regex\": ...} or a non-empty {\"String\": ...}");
      }
    } catch (const std::runtime_error& e) {
      if (std::string(e.what()).rfind(origin, 0) == 0) throw;
      throw std::runtime_error(origin + ": " + key + ".pattern: " + e.what());
    }
    splits.push_back({std::move(*regex), behavior->second, pre.value("invert", false)});
  } else {
    refuse(key + ".type", type, "supported: ByteLevel, Split, Digits, Sequence");
  }
}

void Tokenizer::Impl::load_post_processor(const json& post, const std::string& key) {
  if (post.is_null()) return;
  const std::string type = at(post, "type", key).get<std::string>();
  if (type == "ByteLevel") return;  // offsets only: ids unchanged
  if (type == "Sequence") {
    const json& list = at(post, "processors", key);
    for (size_t i = 0; i < list.size(); ++i) load_post_processor(list[i], key + ".processors[" + std::to_string(i) + "]");
    return;
  }
  if (type != "TemplateProcessing") refuse(key + ".type", type, "supported: null, ByteLevel, TemplateProcessing, Sequence");
  if (!prefix_ids.empty() || !suffix_ids.empty()) refuse(key, post, "one TemplateProcessing");
  const json& specials = post.value("special_tokens", json::object());
  bool after_sequence = false;
  const json& single = at(post, "single", key);
  for (size_t i = 0; i < single.size(); ++i) {
    const json& piece = single[i];
    const std::string piece_key = key + ".single[" + std::to_string(i) + "]";
    if (piece.contains("Sequence")) {
      if (after_sequence || piece.at("Sequence").value("id", "") != "A") refuse(piece_key, piece, "one Sequence A");
      after_sequence = true;
    } else if (piece.contains("SpecialToken")) {
      const std::string name = at(piece.at("SpecialToken"), "id", piece_key + ".SpecialToken").get<std::string>();
      const json& ids = at(at(specials, name, key + ".special_tokens"), "ids", key + ".special_tokens." + name);
      if (!ids.is_array()) refuse(key + ".special_tokens." + name + ".ids", ids, "a list of token ids");
      for (const json& id : ids) {
        (after_sequence ? suffix_ids : prefix_ids).push_back(token_id(id, key + ".special_tokens." + name + ".ids"));
      }
    } else {
      refuse(piece_key, piece, "Sequence or SpecialToken");
    }
  }
}

void Tokenizer::Impl::pre_tokenize(size_t step, std::string_view piece, std::vector<int64_t>& ids) const {
  if (step < splits.size()) {
    for (const auto& [start, end] : split_ranges(piece, splits[step])) {
      pre_tokenize(step + 1, piece.substr(start, end - start), ids);
    }
    return;
  }
  // ByteLevel: the prefix space goes on every piece it receives (pre_tokenizers/byte_level.rs).
  std::string prefixed;
  if (add_prefix_space && piece[0] != ' ') {
    prefixed = " " + std::string(piece);
    piece = prefixed;
  }
  if (!byte_level_regex) {
    bpe->encode_word(piece, ids);
    return;
  }
  for (const auto& [start, end] : split_ranges(piece, SplitStep{*byte_level_regex, SplitBehavior::kIsolated, false})) {
    bpe->encode_word(piece.substr(start, end - start), ids);
  }
}

Tokenizer Tokenizer::from_file(const std::string& tokenizer_json_path) {
  return from_json(read_file(tokenizer_json_path), tokenizer_json_path);
}

Tokenizer Tokenizer::from_json(std::string_view json_text, const std::string& origin) {
  auto impl = std::make_shared<Impl>();
  impl->origin = origin;
  json root;
  try {
    root = json::parse(json_text.begin(), json_text.end());
  } catch (const json::exception& e) {
    throw std::runtime_error(origin + ": not valid JSON (" + e.what() + ")");
  }
  try {
    impl->load(root);
  } catch (const json::exception& e) {
    throw std::runtime_error(origin + ": unexpected JSON type (" + e.what() + ")");
  }
  return Tokenizer(std::move(impl));
}

std::vector<int64_t> Tokenizer::encode(std::string_view text, bool add_special_tokens) const {
  if (!detail::is_valid_utf8(text)) throw std::invalid_argument("Tokenizer::encode: text is not valid UTF-8");
  const Impl& impl = *impl_;
  std::vector<int64_t> ids;
  if (add_special_tokens) ids = impl.prefix_ids;
  const auto push_id = [&ids](int64_t id) { ids.push_back(id); };
  impl.raw_added.split(
      text,
      [&](std::string_view piece) {
        const std::string normalized = impl.nfc ? detail::nfc(piece) : std::string(piece);
        impl.normalized_added.split(
            normalized, [&](std::string_view rest) { impl.pre_tokenize(0, rest, ids); }, push_id);
      },
      push_id);
  if (add_special_tokens) ids.insert(ids.end(), impl.suffix_ids.begin(), impl.suffix_ids.end());
  return ids;
}

std::string Tokenizer::decode(const std::vector<int64_t>& ids, bool skip_special_tokens) const {
  std::string bytes;
  for (const int64_t id : ids) {
    std::string_view token;
    const auto added = impl_->added_by_id.find(id);
    if (added != impl_->added_by_id.end()) {
      if (skip_special_tokens && added->second.second) continue;
      token = added->second.first;
    } else if (const std::string* t = impl_->bpe->id_to_token(id)) {
      token = *t;
    } else {
      continue;
    }
    // ByteLevel decoder: a token all of whose characters are byte characters becomes those bytes,
    // any other token (e.g. an added "<think>" with no byte form) its own UTF-8.
    std::string token_bytes;
    bool all_mapped = true;
    for (size_t i = 0; i < token.size() && all_mapped;) {
      utf8proc_int32_t cp = 0;
      const auto n = utf8proc_iterate(reinterpret_cast<const utf8proc_uint8_t*>(token.data() + i),
                                      static_cast<utf8proc_ssize_t>(token.size() - i), &cp);
      const int byte = n > 0 ? detail::char_to_byte(static_cast<char32_t>(cp)) : -1;
      all_mapped = byte >= 0;
      token_bytes += static_cast<char>(byte);
      i += n > 0 ? static_cast<size_t>(n) : 1;
    }
    bytes += all_mapped ? token_bytes : std::string(token);
  }
  return detail::utf8_lossy(bytes);
}

std::optional<int64_t> Tokenizer::token_to_id(std::string_view token) const {
  const auto added = impl_->added_by_content.find(std::string(token));
  if (added != impl_->added_by_content.end()) return added->second;
  return impl_->bpe->token_to_id(token);
}

std::optional<std::string> Tokenizer::id_to_token(int64_t id) const {
  const auto added = impl_->added_by_id.find(id);
  if (added != impl_->added_by_id.end()) return added->second.first;
  const std::string* token = impl_->bpe->id_to_token(id);
  return token ? std::optional<std::string>(*token) : std::nullopt;
}

int64_t Tokenizer::vocab_size() const { return impl_->vocab_size; }

Tokenizer::Tokenizer(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::~Tokenizer() = default;
Tokenizer::Tokenizer(const Tokenizer&) = default;
Tokenizer& Tokenizer::operator=(const Tokenizer&) = default;
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;

}  // namespace roundpipe::models
