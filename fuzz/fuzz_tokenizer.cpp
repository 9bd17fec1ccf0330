// libFuzzer target: models::Tokenizer (docs/models.md, "Tokenizer"). The first byte picks the part:
//   even: the input is a tokenizer.json. Loading must succeed or throw std::runtime_error (a
//         message naming the file and key); a tokenizer that loads encodes and decodes a fixed text.
//   odd:  the rest is text for a fixed byte-level tokenizer (GPT-2's byte alphabet, Qwen2's split
//         regex, a few merges, one special token, no normalizer). Text that is not UTF-8 must be
//         refused with std::invalid_argument; valid text must round-trip: decode(encode(x)) == x,
//         every id in range, and the special token's id exactly where its string occurs;
//         encode_with_offsets gives the same ids and offsets inside the text on character
//         boundaries, the special token's exactly its string. The same tokenizer with an NFC
//         normalizer checks the offsets through NFC (or the documented refusal).
// Checked against independent references: the UTF-8 rule (RFC 3629) and the byte alphabet are
// spelled here, not taken from the tokenizer's code.
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "fuzz/fuzz_file.h"
#include "roundpipe/models/tokenizer.h"

namespace {

using roundpipe::models::Tokenizer;

std::string utf8(uint32_t c) {
  std::string s;
  if (c < 0x80) {
    s += static_cast<char>(c);
  } else if (c < 0x800) {
    s += static_cast<char>(0xC0 | (c >> 6));
    s += static_cast<char>(0x80 | (c & 0x3F));
  } else {
    s += static_cast<char>(0xE0 | (c >> 12));
    s += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    s += static_cast<char>(0x80 | (c & 0x3F));
  }
  return s;
}

// RFC 3629: shortest forms only, no surrogates, at most U+10FFFF.
bool valid_utf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto b = static_cast<uint8_t>(s[i]);
    size_t n = 0;
    uint32_t c = 0;
    if (b < 0x80) {
      ++i;
      continue;
    } else if (b >= 0xC2 && b <= 0xDF) {
      n = 1, c = b & 0x1F;
    } else if (b >= 0xE0 && b <= 0xEF) {
      n = 2, c = b & 0x0F;
    } else if (b >= 0xF0 && b <= 0xF4) {
      n = 3, c = b & 0x07;
    } else {
      return false;
    }
    if (i + n >= s.size()) return false;
    for (size_t k = 1; k <= n; ++k) {
      const auto t = static_cast<uint8_t>(s[i + k]);
      if ((t & 0xC0) != 0x80) return false;
      c = (c << 6) | (t & 0x3F);
    }
    if ((n == 2 && c < 0x800) || (n == 3 && (c < 0x10000 || c > 0x10FFFF)) || (c >= 0xD800 && c <= 0xDFFF)) {
      return false;
    }
    i += n + 1;
  }
  return true;
}

// GPT-2's bytes_to_unicode: printable Latin-1 bytes map to themselves, the others to 256 + n.
std::string byte_level_json(bool nfc) {
  std::vector<uint32_t> chars(256);
  uint32_t next = 256;
  for (uint32_t b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    chars[b] = printable ? b : next++;
  }
  const auto quoted = [](const std::string& s) {
    std::string q = "\"";
    for (const char ch : s) q += (ch == '"' || ch == '\\') ? std::string("\\") + ch : std::string(1, ch);
    return q + "\"";
  };
  std::string vocab;
  int64_t id = 0;
  for (uint32_t b = 0; b < 256; ++b) vocab += quoted(utf8(chars[b])) + ": " + std::to_string(id++) + ", ";
  const std::string sp = utf8(chars[' ']);
  vocab += quoted(sp + "t") + ": 256, \"he\": 257, \"the\": 258, " + quoted(sp + "the") + ": 259";
  return R"({"added_tokens": [{"id": 260, "content": "<|im_start|>", "special": true, "single_word": false,
               "lstrip": false, "rstrip": false, "normalized": false}],
    "normalizer": )" + std::string(nfc ? R"({"type": "NFC"})" : "null") + R"(,
    "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
      {"type": "Split", "pattern": {"Regex": "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"},
       "behavior": "Isolated", "invert": false},
      {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false}]},
    "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false},
    "model": {"type": "BPE", "vocab": {)" +
         vocab + R"(}, "merges": [)" + quoted(sp + " t") + R"(, "h e", "t he", )" + quoted(sp + "t he") +
         R"(]}})";
}

const Tokenizer& byte_level() {
  static const Tokenizer tok = Tokenizer::from_json(byte_level_json(false), "fuzz byte-level tokenizer");
  return tok;
}

const Tokenizer& byte_level_nfc() {
  static const Tokenizer tok = Tokenizer::from_json(byte_level_json(true), "fuzz byte-level NFC tokenizer");
  return tok;
}

bool char_boundary(std::string_view text, int64_t pos) {
  return pos == static_cast<int64_t>(text.size()) || (static_cast<uint8_t>(text[pos]) & 0xC0) != 0x80;
}

// encode_with_offsets of valid UTF-8 `text` against encode's ids: one span per token, inside the
// text, on character boundaries; the special token's span is its string.
void check_offsets(std::string_view text, const std::vector<int64_t>& ids,
                   const Tokenizer::Encoding& enc) {
  ROUNDPIPE_FUZZ_CHECK(enc.ids == ids, "encode_with_offsets gives encode's ids");
  ROUNDPIPE_FUZZ_CHECK(enc.offsets.size() == ids.size(), "one offset pair per token");
  for (size_t i = 0; i < ids.size() && i < enc.offsets.size(); ++i) {
    const auto [begin, end] = enc.offsets[i];
    ROUNDPIPE_FUZZ_CHECK(begin >= 0 && begin <= end && end <= static_cast<int64_t>(text.size()),
                         "offsets lie inside the text");
    ROUNDPIPE_FUZZ_CHECK(char_boundary(text, begin) && char_boundary(text, end), "offsets on character boundaries");
    if (ids[i] == 260) {
      ROUNDPIPE_FUZZ_CHECK(text.substr(begin, end - begin) == "<|im_start|>", "the special token spans its string");
    }
  }
}

void fuzz_text(std::string_view text) {
  const Tokenizer& tok = byte_level();
  std::vector<int64_t> ids;
  try {
    ids = tok.encode(text);
  } catch (const std::invalid_argument&) {
    ROUNDPIPE_FUZZ_CHECK(!valid_utf8(text), "valid UTF-8 is encoded");
    return;
  }
  ROUNDPIPE_FUZZ_CHECK(valid_utf8(text), "text that is not UTF-8 is refused");
  size_t specials = 0;
  for (const int64_t id : ids) {
    ROUNDPIPE_FUZZ_CHECK(id >= 0 && id < tok.vocab_size(), "ids lie in the vocabulary");
    specials += id == 260;
  }
  size_t occurrences = 0;
  for (size_t at = text.find("<|im_start|>"); at != std::string_view::npos; at = text.find("<|im_start|>", at + 12)) {
    ++occurrences;
  }
  ROUNDPIPE_FUZZ_CHECK(specials == occurrences, "the special token is split out wherever its string occurs");
  ROUNDPIPE_FUZZ_CHECK(tok.decode(ids) == text, "decode(encode(x)) == x without a normalizer");
  check_offsets(text, ids, tok.encode_with_offsets(text));
  const Tokenizer& nfc = byte_level_nfc();
  const std::vector<int64_t> nfc_ids = nfc.encode(text);
  try {
    check_offsets(text, nfc_ids, nfc.encode_with_offsets(text));
  } catch (const std::runtime_error&) {
    // documented: a composition whose NFC alignment the tokenizer does not model is refused
  }
}

void fuzz_file(std::string_view json) {
  try {
    const Tokenizer tok = Tokenizer::from_json(json, "fuzz tokenizer.json");
    const std::string_view text = "Hello world, <|im_start|> 123 héllo he\xCC\x81llo \xF0\x9F\x98\x80";
    const std::vector<int64_t> ids = tok.encode(text);
    (void)tok.decode(ids);
    const Tokenizer::Encoding enc = tok.encode_with_offsets(text);
    ROUNDPIPE_FUZZ_CHECK(enc.ids == ids && enc.offsets.size() == ids.size(), "encode_with_offsets gives encode's ids");
    for (const auto& [begin, end] : enc.offsets) {
      ROUNDPIPE_FUZZ_CHECK(begin >= 0 && begin <= end && end <= static_cast<int64_t>(text.size()),
                           "offsets lie inside the text");
    }
  } catch (const std::runtime_error&) {
    // refused with a message (load) or a tokenizer that cannot encode this text
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string_view rest(reinterpret_cast<const char*>(data) + 1, size - 1);
  if (data[0] % 2 == 0) {
    fuzz_file(rest);
  } else {
    fuzz_text(rest);
  }
  return 0;
}
