#include "roundpipe/models/detail/tokenizer_text.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <utf8proc.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <unordered_map>

namespace roundpipe::models::detail {
namespace {

// Second-byte range of a lead byte (Unicode Table 3-7); {0, 0} for bytes that cannot lead.
struct LeadRule {
  size_t length;
  unsigned char low;
  unsigned char high;
};

LeadRule lead_rule(unsigned char b) {
  if (b < 0x80) return {1, 0, 0};
  if (b >= 0xC2 && b <= 0xDF) return {2, 0x80, 0xBF};
  if (b == 0xE0) return {3, 0xA0, 0xBF};
  if (b == 0xED) return {3, 0x80, 0x9F};
  if (b >= 0xE1 && b <= 0xEF) return {3, 0x80, 0xBF};
  if (b == 0xF0) return {4, 0x90, 0xBF};
  if (b >= 0xF1 && b <= 0xF3) return {4, 0x80, 0xBF};
  if (b == 0xF4) return {4, 0x80, 0x8F};
  return {0, 0, 0};
}

// Bytes of the longest valid prefix of a sequence starting at `pos` (== rule.length when whole).
size_t valid_prefix(std::string_view s, size_t pos, const LeadRule& rule) {
  size_t k = 1;
  for (; k < rule.length && pos + k < s.size(); ++k) {
    const auto c = static_cast<unsigned char>(s[pos + k]);
    const bool ok = k == 1 ? (c >= rule.low && c <= rule.high) : (c >= 0x80 && c <= 0xBF);
    if (!ok) break;
  }
  return k;
}

struct ByteTables {
  std::array<std::string, 256> chars;
  std::unordered_map<char32_t, int> bytes;
  ByteTables() {
    // GPT-2 encoder.py: printable Latin-1 bytes stand for themselves, the others for 256 + n.
    std::array<char32_t, 256> cp{};
    std::array<bool, 256> printable{};
    for (int b = 0; b < 256; ++b) {
      printable[b] = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    }
    char32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      cp[b] = printable[b] ? static_cast<char32_t>(b) : next++;
      append_utf8(chars[b], cp[b]);
      bytes[cp[b]] = b;
    }
  }
};

const ByteTables& byte_tables() {
  static const ByteTables kTables;
  return kTables;
}

// Oniguruma's \s is Unicode White_Space; PCRE2's UCP \s adds U+180E. Inside or outside a class,
// `\p{White_Space}` means the same in PCRE2 (10.40+ knows Boolean properties).
std::string oniguruma_to_pcre2(const std::string& pattern) {
  std::string out;
  out.reserve(pattern.size() + 32);
  for (size_t i = 0; i < pattern.size(); ++i) {
    if (pattern[i] == '\\' && i + 1 < pattern.size()) {
      const char c = pattern[i + 1];
      out += c == 's' ? "\\p{White_Space}" : c == 'S' ? "\\P{White_Space}" : std::string{'\\', c};
      ++i;
    } else {
      out += pattern[i];
    }
  }
  return out;
}

struct MatchDataDeleter {
  void operator()(pcre2_match_data* md) const { pcre2_match_data_free(md); }
};

}  // namespace

size_t invalid_utf8_at(std::string_view text) {
  for (size_t i = 0; i < text.size();) {
    const LeadRule rule = lead_rule(static_cast<unsigned char>(text[i]));
    if (rule.length == 0 || valid_prefix(text, i, rule) != rule.length) return i;
    i += rule.length;
  }
  return std::string_view::npos;
}

bool is_valid_utf8(std::string_view text) { return invalid_utf8_at(text) == std::string_view::npos; }

std::vector<char32_t> decode_utf8(std::string_view text) {
  std::vector<char32_t> out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size();) {
    utf8proc_int32_t cp = 0;
    const auto n = utf8proc_iterate(reinterpret_cast<const utf8proc_uint8_t*>(text.data() + i),
                                    static_cast<utf8proc_ssize_t>(text.size() - i), &cp);
    if (n <= 0) {
      out.push_back(0xFFFD);
      ++i;
    } else {
      out.push_back(static_cast<char32_t>(cp));
      i += static_cast<size_t>(n);
    }
  }
  return out;
}

void append_utf8(std::string& out, char32_t cp) {
  utf8proc_uint8_t buf[4];
  const auto n = utf8proc_encode_char(static_cast<utf8proc_int32_t>(cp), buf);
  out.append(reinterpret_cast<const char*>(buf), static_cast<size_t>(n));
}

std::string utf8_lossy(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  for (size_t i = 0; i < bytes.size();) {
    const LeadRule rule = lead_rule(static_cast<unsigned char>(bytes[i]));
    const size_t valid = rule.length == 0 ? 0 : valid_prefix(bytes, i, rule);
    if (rule.length != 0 && valid == rule.length) {
      out.append(bytes.substr(i, valid));
      i += valid;
    } else {
      out += "\xEF\xBF\xBD";
      i += valid == 0 ? 1 : valid;
    }
  }
  return out;
}

size_t utf8_sequence_length(unsigned char lead) {
  const size_t n = lead_rule(lead).length;
  return n == 0 ? 1 : n;
}

std::string nfc(std::string_view text) {
  bool ascii = true;
  for (const char c : text) {
    ascii = ascii && static_cast<unsigned char>(c) < 0x80;
  }
  if (ascii) return std::string(text);
  utf8proc_uint8_t* result = nullptr;
  const utf8proc_ssize_t n =
      utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(text.data()), static_cast<utf8proc_ssize_t>(text.size()),
                   &result, static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE));
  if (n < 0) {
    throw std::invalid_argument(std::string("NFC normalization failed: ") + utf8proc_errmsg(n));
  }
  std::string out(reinterpret_cast<const char*>(result), static_cast<size_t>(n));
  std::free(result);
  return out;
}

Alignments identity_alignments(std::string_view text) {
  Alignments alignments;
  alignments.reserve(text.size());
  for (size_t i = 0; i < text.size();) {
    const size_t n = std::min(utf8_sequence_length(static_cast<unsigned char>(text[i])), text.size() - i);
    alignments.insert(alignments.end(), n, {i, i + n});
    i += n;
  }
  return alignments;
}

// Note [NFC alignments]: `tokenizers` normalizes with the crate unicode-normalization-alignments,
// which yields (char, change) pairs that NormalizedString::transform turns into alignments. We
// replay that on top of utf8proc, one code point at a time, and check the result against nfc():
//  1. Canonical decomposition. Each original character gives its decomposition; the first code
//     point carries weight 1 (it stands for the original character), the others weight 0.
//  2. Canonical ordering: a stable sort by combining class of each run of non-starters; the
//     weights travel with their code points.
//  3. Canonical composition (UAX #15 D117): a code point that composes into the last starter is
//     removed and its weight added to the starter's.
//  4. transform: walking the original characters in order, an output code point of weight w >= 1
//     takes the next w original characters and aligns to the first of them; one of weight 0
//     aligns to the last original character taken so far.
// So "e" U+0301 -> U+00E9 aligns to the "e" alone, U+0958 -> U+0915 U+093C both to U+0958, and
// after a reordering a mark can align to another mark's bytes - all as `tokenizers` reports
// (tests/models/tokenizer_test.cpp checks random mark sequences against it).
std::string nfc_aligned(std::string_view text, Alignments& alignments) {
  std::string composed = nfc(text);
  if (composed == text) {
    alignments = identity_alignments(text);
    return composed;
  }
  struct Unit {
    utf8proc_int32_t cp;
    int ccc;
    int weight;
  };
  std::vector<Unit> units;
  std::vector<std::pair<size_t, size_t>> sources;  // each original character's byte range
  for (size_t i = 0; i < text.size();) {
    utf8proc_int32_t cp = 0;
    const auto n = utf8proc_iterate(reinterpret_cast<const utf8proc_uint8_t*>(text.data() + i),
                                    static_cast<utf8proc_ssize_t>(text.size() - i), &cp);
    if (n <= 0) throw std::invalid_argument("nfc_aligned: text is not valid UTF-8");
    sources.emplace_back(i, i + static_cast<size_t>(n));
    i += static_cast<size_t>(n);
    utf8proc_int32_t parts[32];
    int boundclass = UTF8PROC_BOUNDCLASS_START;
    const auto count = utf8proc_decompose_char(cp, parts, 32, UTF8PROC_DECOMPOSE, &boundclass);
    if (count <= 0 || count > 32) throw std::runtime_error("nfc_aligned: cannot decompose U+" + std::to_string(cp));
    for (utf8proc_ssize_t k = 0; k < count; ++k) {
      units.push_back({parts[k], utf8proc_get_property(parts[k])->combining_class, k == 0 ? 1 : 0});
    }
  }
  for (size_t i = 1; i < units.size(); ++i) {
    for (size_t k = i; k > 0 && units[k].ccc != 0 && units[k - 1].ccc > units[k].ccc; --k) {
      std::swap(units[k], units[k - 1]);
    }
  }
  std::vector<Unit> out;
  size_t starter = SIZE_MAX;
  for (const Unit& unit : units) {
    if (starter != SIZE_MAX) {
      const bool adjacent = out.size() == starter + 1;
      if (adjacent || (out.back().ccc != 0 && out.back().ccc < unit.ccc)) {
        utf8proc_int32_t pair[2] = {out[starter].cp, unit.cp};
        constexpr auto kCompose = static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE);
        if (utf8proc_normalize_utf32(pair, 2, kCompose) == 1) {
          out[starter].cp = pair[0];
          out[starter].ccc = utf8proc_get_property(pair[0])->combining_class;
          out[starter].weight += unit.weight;
          continue;
        }
      }
    }
    if (unit.ccc == 0) starter = out.size();
    out.push_back(unit);
  }
  std::string replayed;
  alignments.clear();
  alignments.reserve(composed.size());
  size_t taken = 0;
  for (const Unit& unit : out) {
    std::pair<size_t, size_t> align{0, 0};
    if (unit.weight > 0) {
      align = sources.at(taken);
      taken += static_cast<size_t>(unit.weight);
    } else if (taken > 0) {
      align = sources[taken - 1];
    }
    const size_t before = replayed.size();
    append_utf8(replayed, static_cast<char32_t>(unit.cp));
    alignments.insert(alignments.end(), replayed.size() - before, align);
  }
  if (replayed != composed || taken != sources.size()) {
    throw std::runtime_error(
        "Tokenizer: cannot align NFC offsets for this text (its composition is not one the offset tracking models; "
        "encode() works, encode_with_offsets() does not; docs/models.md, \"Tokenizer\")");
  }
  return composed;
}

const std::array<std::string, 256>& byte_chars() { return byte_tables().chars; }

int char_to_byte(char32_t code_point) {
  const auto& bytes = byte_tables().bytes;
  const auto it = bytes.find(code_point);
  return it == bytes.end() ? -1 : it->second;
}

Regex::Regex(const std::string& pattern, Syntax syntax) {
  const std::string source = syntax == Syntax::kOniguruma ? oniguruma_to_pcre2(pattern) : pattern;
  // PCRE2_LITERAL refuses PCRE2_UCP (nothing to classify in a literal).
  const uint32_t options = PCRE2_UTF | PCRE2_NO_UTF_CHECK | (syntax == Syntax::kLiteral ? PCRE2_LITERAL : PCRE2_UCP);
  int error = 0;
  PCRE2_SIZE offset = 0;
  pcre2_code* code =
      pcre2_compile(reinterpret_cast<PCRE2_SPTR>(source.data()), source.size(), options, &error, &offset, nullptr);
  if (code == nullptr) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(error, message, sizeof(message));
    throw std::runtime_error("regex " + pattern + " does not compile (PCRE2: " +
                             reinterpret_cast<const char*>(message) + " at offset " + std::to_string(offset) + ")");
  }
  // JIT is an optimisation only: without it (unsupported CPU) pcre2_match interprets.
  pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);
  code_ = std::shared_ptr<void>(code, [](void* c) { pcre2_code_free(static_cast<pcre2_code*>(c)); });
}

std::vector<std::pair<size_t, size_t>> Regex::find_all(std::string_view text) const {
  // One match block per thread: only ovector[0..1] is read, so one pair suffices for any pattern.
  thread_local std::unique_ptr<pcre2_match_data, MatchDataDeleter> match_data(pcre2_match_data_create(1, nullptr));
  auto* code = static_cast<const pcre2_code*>(code_.get());
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  std::vector<std::pair<size_t, size_t>> matches;
  size_t pos = 0;
  while (pos <= text.size()) {
    const int rc = pcre2_match(code, subject, text.size(), pos, PCRE2_NO_UTF_CHECK, match_data.get(), nullptr);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) {
      PCRE2_UCHAR message[256];
      pcre2_get_error_message(rc, message, sizeof(message));
      throw std::runtime_error(std::string("regex match failed (PCRE2: ") + reinterpret_cast<const char*>(message) +
                               ")");
    }
    const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(match_data.get());
    const size_t start = ovector[0];
    const size_t end = ovector[1];
    if (end > start) {
      matches.emplace_back(start, end);
      pos = end;
    } else {
      if (start >= text.size()) break;
      pos = start + utf8_sequence_length(static_cast<unsigned char>(text[start]));
    }
  }
  return matches;
}

}  // namespace roundpipe::models::detail
