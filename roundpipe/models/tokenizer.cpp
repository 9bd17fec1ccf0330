#include "roundpipe/models/tokenizer.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <fstream>
#include <iterator>
#include <sstream>
#include <stdexcept>
#include <unordered_map>
#include <utility>

#include "roundpipe/models/detail/byte_pair_encoder.h"
#include "roundpipe/models/detail/text_splitter.h"
#include "roundpipe/models/detail/tokenizer_text.h"

namespace roundpipe::models {
namespace {

using nlohmann::json;
using detail::AddedTokenMatcher;
using detail::ByteRange;
using detail::SplitBehavior;
using detail::SplitStep;

// The regex of `tokenizers`' ByteLevel pre-tokenizer with use_regex (GPT-2's).
constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

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
  std::optional<SplitStep> byte_level_split;  // GPT-2's regex, where use_regex
  bool trim_offsets = false;  // a ByteLevel post-processor with trim_offsets (offsets only)
  bool trim_keeps_prefix_space = false;  // ... and add_prefix_space
  std::vector<int64_t> prefix_ids;  // post-processor template around the sequence
  std::vector<int64_t> suffix_ids;
  int64_t vocab_size = 0;

  void load(const json& root);
  // Appends the ids of `normalized` (one stretch between raw added tokens, normalized): its
  // normalized added tokens, then the pre-tokenizer and BPE on the rest. With `spans`, also each
  // token's [first, last] byte of `normalized` (inclusive). A template so that encode()'s copy
  // carries no offset code at all (it measured ~5% slower with a runtime check).
  template <bool kSpans>
  void encode_normalized(std::string_view normalized, std::vector<int64_t>& ids, std::vector<ByteRange>* spans) const;
  // The ByteLevel post-processor's trim_offsets (`tokenizers`' process_offsets) on `encoding`,
  // offsets in bytes of `text`.
  void trim(std::string_view text, Encoding& encoding) const;

 private:
  template <bool kSpans>
  void pre_tokenize(size_t step, std::string_view normalized, ByteRange piece, std::vector<int64_t>& ids,
                    std::vector<ByteRange>* spans) const;
  std::string_view token_text(int64_t id) const;

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
    if (pre.value("use_regex", true)) {
      byte_level_split.emplace(
          SplitStep{detail::Regex(kGpt2Pattern, detail::Regex::Syntax::kOniguruma), SplitBehavior::kIsolated, false});
    }
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
  if (type == "ByteLevel") {  // offsets only: ids unchanged
    trim_offsets = post.value("trim_offsets", true);
    trim_keeps_prefix_space = post.value("add_prefix_space", true);
    return;
  }
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

template <bool kSpans>
void Tokenizer::Impl::encode_normalized(std::string_view normalized, std::vector<int64_t>& ids,
                                        std::vector<ByteRange>* spans) const {
  normalized_added.split(
      normalized, [&](size_t begin, size_t end) { pre_tokenize<kSpans>(0, normalized, {begin, end}, ids, spans); },
      [&](int64_t id, size_t begin, size_t end) {
        ids.push_back(id);
        if constexpr (kSpans) spans->emplace_back(begin, end - 1);
      });
}

template <bool kSpans>
void Tokenizer::Impl::pre_tokenize(size_t step, std::string_view normalized, ByteRange piece,
                                   std::vector<int64_t>& ids, std::vector<ByteRange>* spans) const {
  std::string_view text = normalized.substr(piece.first, piece.second - piece.first);
  if (step < splits.size()) {
    for (const auto& [start, end] : split_ranges(text, splits[step])) {
      pre_tokenize<kSpans>(step + 1, normalized, {piece.first + start, piece.first + end}, ids, spans);
    }
    return;
  }
  // ByteLevel: the prefix space goes on every piece it receives (pre_tokenizers/byte_level.rs)
  // and aligns to the piece's first character, as NormalizedString::prepend does.
  std::string prefixed;
  const bool prefix = add_prefix_space && text[0] != ' ';
  if (prefix) {
    prefixed = " " + std::string(text);
    text = prefixed;
  }
  const auto encode_word = [&](size_t begin, size_t end) {
    const std::string_view word = text.substr(begin, end - begin);
    if constexpr (!kSpans) {
      bpe->encode_word(word, ids);
    } else {
      const size_t first_id = ids.size();
      bpe->encode_word(word, ids);
      const size_t first_span = spans->size();
      bpe->token_spans(word, ids.data() + first_id, ids.size() - first_id, *spans);
      // Byte `pos` of `text` comes from this byte of `normalized` (the added space from the first).
      const auto source = [&](size_t pos) { return piece.first + (prefix && pos > 0 ? pos - 1 : pos); };
      for (size_t i = first_span; i < spans->size(); ++i) {
        (*spans)[i] = {source(begin + (*spans)[i].first), source(begin + (*spans)[i].second)};
      }
    }
  };
  if (!byte_level_split) {
    encode_word(0, text.size());
    return;
  }
  for (const auto& [start, end] : split_ranges(text, *byte_level_split)) encode_word(start, end);
}

std::string_view Tokenizer::Impl::token_text(int64_t id) const {
  const auto added = added_by_id.find(id);
  if (added != added_by_id.end()) return added->second.first;
  const std::string* token = bpe->id_to_token(id);
  return token == nullptr ? std::string_view() : std::string_view(*token);
}

namespace {

// Rust's char::is_whitespace (Unicode White_Space), which process_offsets uses.
bool is_white_space(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

bool is_continuation(char c) { return (static_cast<unsigned char>(c) & 0xC0) == 0x80; }

}  // namespace

// `tokenizers` trims in characters (the Python binding's offsets); here the same characters are
// stepped over in bytes of the original text, so the results are those offsets in bytes.
void Tokenizer::Impl::trim(std::string_view text, Encoding& encoding) const {
  constexpr char32_t kSpaceChar = 0x120;  // "Ġ", the ByteLevel character of ' '
  for (size_t i = 0; i < encoding.ids.size(); ++i) {
    const std::vector<char32_t> chars = detail::decode_utf8(token_text(encoding.ids[i]));
    const auto trimmable = [](char32_t c) { return c == kSpaceChar || is_white_space(c); };
    size_t leading = 0;
    while (leading < chars.size() && trimmable(chars[leading])) ++leading;
    size_t trailing = 0;
    while (trailing < chars.size() && trimmable(chars[chars.size() - 1 - trailing])) ++trailing;
    auto& [begin, end] = encoding.offsets[i];
    if (leading > 0) {
      const bool is_first = i == 0 || begin == 0;
      if (is_first && trim_keeps_prefix_space && leading == 1) leading = 0;
      auto pos = static_cast<size_t>(begin);
      for (size_t k = 0; k < leading && pos < static_cast<size_t>(end); ++k) {
        do ++pos; while (pos < text.size() && is_continuation(text[pos]));
      }
      begin = static_cast<int64_t>(std::min(pos, static_cast<size_t>(end)));
    }
    if (trailing > 0) {
      auto pos = static_cast<size_t>(end);
      size_t stepped = 0;
      for (; stepped < trailing && pos > 0; ++stepped) {
        do --pos; while (pos > 0 && is_continuation(text[pos]));
      }
      if (stepped == trailing) end = std::max(static_cast<int64_t>(pos), begin);
    }
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
  impl.raw_added.split(
      text,
      [&](size_t begin, size_t end) {
        const std::string_view piece = text.substr(begin, end - begin);
        if (impl.nfc) {
          impl.encode_normalized<false>(detail::nfc(piece), ids, nullptr);
        } else {
          impl.encode_normalized<false>(piece, ids, nullptr);
        }
      },
      [&](int64_t id, size_t, size_t) { ids.push_back(id); });
  if (add_special_tokens) ids.insert(ids.end(), impl.suffix_ids.begin(), impl.suffix_ids.end());
  return ids;
}

// Note [Token offsets]: `tokenizers` tracks, for every byte of the normalized text, the original
// range it came from (NormalizedString alignments); a token's offsets are the range of its first
// byte's start to its last byte's end. Here the same table is built per stretch between raw added
// tokens (identity without a normalizer or where NFC changes nothing, detail::nfc_aligned
// otherwise), the pre-tokenizer and BPE report each token's first and last normalized byte, and
// the table maps them back. ByteLevel characters of one UTF-8 character all align to the whole
// character, so a token holding part of one (an emoji split in two) spans all of it.
Tokenizer::Encoding Tokenizer::encode_with_offsets(std::string_view text, bool add_special_tokens) const {
  if (!detail::is_valid_utf8(text)) {
    throw std::invalid_argument("Tokenizer::encode_with_offsets: text is not valid UTF-8");
  }
  const Impl& impl = *impl_;
  Encoding encoding;
  std::vector<ByteRange> spans;
  detail::Alignments alignments;
  impl.raw_added.split(
      text,
      [&](size_t begin, size_t end) {
        const std::string_view piece = text.substr(begin, end - begin);
        std::string normalized;
        if (impl.nfc) {
          normalized = detail::nfc_aligned(piece, alignments);
        } else {
          normalized = std::string(piece);
          alignments = detail::identity_alignments(piece);
        }
        spans.clear();
        impl.encode_normalized<true>(normalized, encoding.ids, &spans);
        for (const auto& [first, last] : spans) {
          encoding.offsets.emplace_back(static_cast<int64_t>(begin + alignments[first].first),
                                        static_cast<int64_t>(begin + alignments[last].second));
        }
      },
      [&](int64_t id, size_t begin, size_t end) {
        encoding.ids.push_back(id);
        encoding.offsets.emplace_back(static_cast<int64_t>(begin), static_cast<int64_t>(end));
      });
  if (impl.trim_offsets) impl.trim(text, encoding);
  if (add_special_tokens) {
    encoding.ids.insert(encoding.ids.begin(), impl.prefix_ids.begin(), impl.prefix_ids.end());
    encoding.offsets.insert(encoding.offsets.begin(), impl.prefix_ids.size(), {0, 0});
    encoding.ids.insert(encoding.ids.end(), impl.suffix_ids.begin(), impl.suffix_ids.end());
    encoding.offsets.insert(encoding.offsets.end(), impl.suffix_ids.size(), {0, 0});
  }
  return encoding;
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
    // (A byte that is not UTF-8 decodes to U+FFFD, which is no byte character.)
    std::string token_bytes;
    bool all_mapped = true;
    for (const char32_t c : detail::decode_utf8(token)) {
      const int byte = detail::char_to_byte(c);
      all_mapped = byte >= 0;
      if (!all_mapped) break;
      token_bytes += static_cast<char>(byte);
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
