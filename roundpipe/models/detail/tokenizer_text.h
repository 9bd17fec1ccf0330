// Text primitives of the tokenizer (roundpipe/models/tokenizer.h): UTF-8 checks and decoding
// (also the chat template's and the safetensors reader's: one validator, one decoder), GPT-2's
// byte <-> character table of the ByteLevel pre-tokenizer and decoder, NFC (utf8proc) and a
// PCRE2 regex with Oniguruma's `\s` (the engine of Hugging Face `tokenizers`). No LibTorch.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace roundpipe::models::detail {

/// Offset of the first byte of `text` that does not start a well-formed UTF-8 sequence (RFC 3629:
/// no surrogates, no overlong forms, <= U+10FFFF), or std::string_view::npos when there is none.
size_t invalid_utf8_at(std::string_view text);

/// True when `text` is well-formed UTF-8 (invalid_utf8_at(text) == npos).
bool is_valid_utf8(std::string_view text);

/// The code points of `text`; a byte that does not start a well-formed sequence decodes to one
/// U+FFFD and decoding resumes at the next byte (so lengths stay finite). The chat template
/// indexes strings by these (Python's str), the tokenizer trims offsets by them.
std::vector<char32_t> decode_utf8(std::string_view text);

/// Appends code point `cp` to `out`, UTF-8 encoded.
void append_utf8(std::string& out, char32_t cp);

/// `bytes` as UTF-8 with each ill-formed subsequence replaced by one U+FFFD (the rule of Rust's
/// String::from_utf8_lossy, which `tokenizers`' ByteLevel decoder uses).
std::string utf8_lossy(std::string_view bytes);

/// Length in bytes of the UTF-8 sequence led by `lead` (1 for a stray continuation byte).
size_t utf8_sequence_length(unsigned char lead);

/// NFC of valid UTF-8 `text` (utf8proc). ASCII text is returned unchanged without a copy's work.
std::string nfc(std::string_view text);

/// Original [begin, end) byte range that each byte of a normalized text comes from.
using Alignments = std::vector<std::pair<size_t, size_t>>;

/// Alignments of `text` unchanged: every byte maps to the whole character it belongs to.
Alignments identity_alignments(std::string_view text);

/// nfc(text), with the alignments `tokenizers` gives its NFC normalizer (Note [NFC alignments]
/// in tokenizer_text.cpp): one entry per byte of the result, in bytes of `text`. Throws
/// std::runtime_error when the composition it replays differs from utf8proc's NFC (a Unicode
/// case it does not model), rather than return wrong alignments.
std::string nfc_aligned(std::string_view text, Alignments& alignments);

/// GPT-2's bytes_to_unicode: byte b is written as the character byte_chars()[b] (UTF-8).
const std::array<std::string, 256>& byte_chars();

/// The inverse of byte_chars() for a code point, or -1 when no byte is written as `code_point`.
int char_to_byte(char32_t code_point);

/// A compiled PCRE2 pattern (UTF, Unicode properties) shared by copies; matching is thread-safe.
class Regex {
 public:
  enum class Syntax { kOniguruma, kLiteral };
  /// Throws std::runtime_error with PCRE2's message and offset when `pattern` does not compile.
  /// kOniguruma: `\s`/`\S` mean Unicode White_Space as in Oniguruma (PCRE2's own `\s` also
  /// takes U+180E); the rest of the syntax the tokenizers' patterns use is common to both.
  Regex(const std::string& pattern, Syntax syntax);

  /// [start, end) byte ranges of the successive leftmost non-empty matches in valid UTF-8 `text`
  /// (after an empty match the search resumes one character later, as Oniguruma's find_iter).
  std::vector<std::pair<size_t, size_t>> find_all(std::string_view text) const;

 private:
  std::shared_ptr<void> code_;  // pcre2_code_8, freed by pcre2_code_free_8
};

}  // namespace roundpipe::models::detail
