#include "roundpipe/models/detail/jinja_lexer.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <limits>

#include "roundpipe/models/detail/jinja_strings.h"
#include "roundpipe/models/detail/jinja_value.h"

namespace roundpipe::models::detail {
namespace {

[[noreturn]] void fail(int line, const std::string& what) {
  throw LocatedError(line, what);
}

// Length of the Python whitespace character (str.isspace, what `\s` matches in jinja2's lexer)
// at s[i], or 0.
size_t space_at(std::string_view s, size_t i) {
  const auto c = static_cast<unsigned char>(s[i]);
  if (c < 0x80) return is_python_space(c) ? 1 : 0;
  const size_t n = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : 2;
  if (i + n > s.size()) return 0;
  const auto cps = decode_utf8(s.substr(i, n));
  return cps.size() == 1 && is_python_space(cps[0]) ? n : 0;
}

// Python's str.rstrip(): trailing Unicode whitespace removed.
std::string_view rstrip_spaces(std::string_view s) {
  const auto cps = decode_utf8(s);
  size_t keep = cps.size();
  while (keep > 0 && is_python_space(cps[keep - 1])) --keep;
  size_t bytes = 0;
  for (size_t i = 0; i < keep; ++i) {
    std::string tmp;
    append_utf8(tmp, cps[i]);
    bytes += tmp.size();
  }
  return s.substr(0, bytes);
}

size_t skip_spaces(std::string_view s, size_t i) {
  while (i < s.size()) {
    const size_t n = space_at(s, i);
    if (n == 0) break;
    i += n;
  }
  return i;
}

bool all_spaces(std::string_view s) { return skip_spaces(s, 0) == s.size(); }

int count_newlines(std::string_view s) { return static_cast<int>(std::count(s.begin(), s.end(), '\n')); }

bool is_digit(char c) { return c >= '0' && c <= '9'; }
bool is_name_start(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }
bool is_name_char(char c) { return is_name_start(c) || is_digit(c); }

int hex_value(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// Python's "unicode-escape" decoding of a string literal's body (what jinja2 applies).
std::string unescape(std::string_view body, int line) {
  std::string out;
  for (size_t i = 0; i < body.size(); ++i) {
    const char c = body[i];
    if (c != '\\' || i + 1 == body.size()) {
      out += c;
      continue;
    }
    const char e = body[++i];
    switch (e) {
      case '\n': break;
      case '\\': out += '\\'; break;
      case '\'': out += '\''; break;
      case '"': out += '"'; break;
      case 'a': out += '\a'; break;
      case 'b': out += '\b'; break;
      case 'f': out += '\f'; break;
      case 'n': out += '\n'; break;
      case 'r': out += '\r'; break;
      case 't': out += '\t'; break;
      case 'v': out += '\v'; break;
      case 'x':
      case 'u':
      case 'U': {
        const size_t digits = e == 'x' ? 2 : e == 'u' ? 4 : 8;
        uint32_t value = 0;
        for (size_t k = 0; k < digits; ++k) {
          const int h = i + 1 + k < body.size() ? hex_value(body[i + 1 + k]) : -1;
          if (h < 0) fail(line, std::string("truncated \\") + e + " escape in a string literal");
          value = value * 16 + static_cast<uint32_t>(h);
        }
        i += digits;
        if (value > 0x10FFFF || (value >= 0xD800 && value <= 0xDFFF)) {
          fail(line, "string literal escape of a surrogate or beyond U+10FFFF is not supported");
        }
        append_utf8(out, value);
        break;
      }
      default:
        if (e >= '0' && e <= '7') {
          uint32_t value = static_cast<uint32_t>(e - '0');
          for (int k = 0; k < 2 && i + 1 < body.size() && body[i + 1] >= '0' && body[i + 1] <= '7'; ++k) {
            value = value * 8 + static_cast<uint32_t>(body[++i] - '0');
          }
          append_utf8(out, value);
        } else if (e == 'N' || static_cast<unsigned char>(e) >= 0x80) {
          fail(line, std::string("string literal escape \\") + e + " is not supported");
        } else {
          out += '\\';
          out += e;
        }
    }
  }
  return out;
}

class Lexer {
 public:
  explicit Lexer(std::string source) : src_(std::move(source)) {}

  std::vector<Token> run() {
    while (pos_ < src_.size()) {
      const size_t tag = next_tag(pos_);
      if (tag == std::string::npos) {
        emit(TokenType::kData, src_.substr(pos_), line_);
        line_ += count_newlines(std::string_view(src_).substr(pos_));
        break;
      }
      const char kind = src_[tag + 1];
      const char sign = tag + 2 < src_.size() && (src_[tag + 2] == '-' || src_[tag + 2] == '+') ? src_[tag + 2] : 0;
      const std::string_view text = std::string_view(src_).substr(pos_, tag - pos_);
      size_t raw_end = 0;
      const bool raw = kind == '%' && raw_begin(tag + 2 + (sign ? 1 : 0), raw_end);
      emit(TokenType::kData, std::string(whitespace_control(text, sign, kind != '{')), line_);
      line_ += count_newlines(text);
      pos_ = tag + 2 + (sign ? 1 : 0);
      if (raw) {
        lex_raw(raw_end);
      } else if (kind == '#') {
        lex_comment();
      } else {
        lex_tag(kind == '%');
      }
    }
    emit(TokenType::kEof, "", line_);
    return std::move(tokens_);
  }

 private:
  size_t next_tag(size_t from) const {
    for (size_t i = src_.find('{', from); i != std::string::npos && i + 1 < src_.size(); i = src_.find('{', i + 1)) {
      const char c = src_[i + 1];
      if (c == '{' || c == '%' || c == '#') return i;
    }
    return std::string::npos;
  }

  // jinja2's OptionalLStrip: `-` strips all whitespace before the tag; otherwise, for block and
  // comment tags without `+`, spaces and tabs from the start of the line (lstrip_blocks).
  std::string_view whitespace_control(std::string_view text, char sign, bool lstrip) const {
    if (sign == '-') return rstrip_spaces(text);
    if (sign == '+' || !lstrip) return text;
    const size_t nl = text.rfind('\n');
    const size_t l_pos = nl == std::string_view::npos ? 0 : nl + 1;
    if ((l_pos > 0 || line_starting_) && l_pos < text.size() && all_spaces(text.substr(l_pos))) {
      return text.substr(0, l_pos);
    }
    return text;
  }

  // `{% raw %}` (after `{%` and its sign at `at`): sets `end` past `%}` or `-%}\s*`.
  bool raw_begin(size_t at, size_t& end) const {
    size_t i = skip_spaces(src_, at);
    if (src_.compare(i, 3, "raw") != 0) return false;
    i = skip_spaces(src_, i + 3);
    if (src_.compare(i, 3, "-%}") == 0) {
      end = skip_spaces(src_, i + 3);
      return true;
    }
    if (src_.compare(i, 2, "%}") == 0) {
      end = i + 2;
      return true;
    }
    return false;
  }

  void lex_raw(size_t body_start) {
    line_ += count_newlines(std::string_view(src_).substr(pos_, body_start - pos_));
    line_starting_ = body_start > 0 && src_[body_start - 1] == '\n';
    for (size_t i = src_.find("{%", body_start); i != std::string::npos; i = src_.find("{%", i + 1)) {
      const char sign = i + 2 < src_.size() && (src_[i + 2] == '-' || src_[i + 2] == '+') ? src_[i + 2] : 0;
      size_t j = skip_spaces(src_, i + 2 + (sign ? 1 : 0));
      if (src_.compare(j, 6, "endraw") != 0) continue;
      j = skip_spaces(src_, j + 6);
      size_t end = 0;
      if (!block_end_at(j, end)) continue;
      const std::string_view body = std::string_view(src_).substr(body_start, i - body_start);
      emit(TokenType::kData, std::string(whitespace_control(body, sign, true)), line_);
      line_ += count_newlines(std::string_view(src_).substr(body_start, end - body_start));
      line_starting_ = src_[end - 1] == '\n';
      pos_ = end;
      return;
    }
    fail(line_, "missing end of raw directive ({% endraw %})");
  }

  // `+%}`, `-%}` and the whitespace after it, or `%}` and one newline (trim_blocks) at `at`.
  bool block_end_at(size_t at, size_t& end) const {
    if (src_.compare(at, 3, "+%}") == 0) {
      end = at + 3;
    } else if (src_.compare(at, 3, "-%}") == 0) {
      end = skip_spaces(src_, at + 3);
    } else if (src_.compare(at, 2, "%}") == 0) {
      end = at + 2 + (at + 2 < src_.size() && src_[at + 2] == '\n');
    } else {
      return false;
    }
    return true;
  }

  void lex_comment() {
    const size_t close = src_.find("#}", pos_);
    if (close == std::string::npos) fail(line_, "missing end of comment tag");
    size_t end = close + 2;
    const char sign = close > pos_ ? src_[close - 1] : 0;
    if (sign == '-') {
      end = skip_spaces(src_, end);
    } else if (sign != '+' && end < src_.size() && src_[end] == '\n') {
      ++end;
    }
    line_ += count_newlines(std::string_view(src_).substr(pos_, end - pos_));
    line_starting_ = src_[end - 1] == '\n';
    pos_ = end;
  }

  void lex_tag(bool block) {
    const int begin_line = line_;
    emit(block ? TokenType::kBlockBegin : TokenType::kVarBegin, "", line_);
    std::vector<char> brackets;
    while (true) {
      const size_t after_space = skip_spaces(src_, pos_);
      line_ += count_newlines(std::string_view(src_).substr(pos_, after_space - pos_));
      pos_ = after_space;
      if (pos_ >= src_.size()) fail(begin_line, std::string("unexpected end of template, expected '") +
                                                    (block ? "%}" : "}}") + "'");
      if (brackets.empty()) {
        size_t end = 0;
        if (block ? block_end_at(pos_, end) : var_end_at(pos_, end)) {
          emit(block ? TokenType::kBlockEnd : TokenType::kVarEnd, "", line_);
          line_ += count_newlines(std::string_view(src_).substr(pos_, end - pos_));
          line_starting_ = src_[end - 1] == '\n';
          pos_ = end;
          return;
        }
      }
      lex_expression_token(brackets);
    }
  }

  bool var_end_at(size_t at, size_t& end) const {
    if (src_.compare(at, 3, "-}}") == 0) {
      end = skip_spaces(src_, at + 3);
    } else if (src_.compare(at, 2, "}}") == 0) {
      end = at + 2;
    } else {
      return false;
    }
    return true;
  }

  void lex_expression_token(std::vector<char>& brackets) {
    const char c = src_[pos_];
    if (is_digit(c)) return lex_number();
    if (is_name_start(c)) {
      size_t end = pos_;
      while (end < src_.size() && is_name_char(src_[end])) ++end;
      emit(TokenType::kName, src_.substr(pos_, end - pos_), line_);
      pos_ = end;
      return;
    }
    if (c == '\'' || c == '"') return lex_string(c);
    static const char* const kOperators[] = {"//", "**", "==", "!=", "<=", ">=", "+", "-", "/", "*", "%", "~", "[",
                                             "]",  "(",  ")",  "{",  "}",  "<",  ">", "=", ".", ":", "|", ",", ";"};
    for (const char* op : kOperators) {
      const std::string_view o(op);
      if (src_.compare(pos_, o.size(), o) != 0) continue;
      if (o == "(" || o == "[" || o == "{") {
        brackets.push_back(o == "(" ? ')' : o == "[" ? ']' : '}');
      } else if (o == ")" || o == "]" || o == "}") {
        if (brackets.empty()) fail(line_, "unexpected '" + std::string(o) + "'");
        if (brackets.back() != o[0]) {
          fail(line_, "unexpected '" + std::string(o) + "', expected '" + std::string(1, brackets.back()) + "'");
        }
        brackets.pop_back();
      }
      emit(TokenType::kOperator, std::string(o), line_);
      pos_ += o.size();
      return;
    }
    fail(line_, "unexpected char " + repr(Value::from_string(std::string(1, c))) + " in a tag");
  }

  // jinja2's integer and float rules, decimal only (digits may be grouped with '_').
  void lex_number() {
    if (src_[pos_] == '0' && pos_ + 2 < src_.size()) {  // 0x.., 0o.., 0b.. (jinja2's integer_re)
      const char prefix = static_cast<char>(std::tolower(static_cast<unsigned char>(src_[pos_ + 1])));
      const int base = prefix == 'x' ? 16 : prefix == 'o' ? 8 : prefix == 'b' ? 2 : 0;
      const auto digit = [&](char c) {
        const int h = hex_value(c);
        return h >= 0 && h < base;
      };
      if (base != 0 && (digit(src_[pos_ + 2]) || (src_[pos_ + 2] == '_' && pos_ + 3 < src_.size() && digit(src_[pos_ + 3])))) {
        size_t end = pos_ + 2;
        std::string text;
        while (end < src_.size() && (digit(src_[end]) || (src_[end] == '_' && end + 1 < src_.size() && digit(src_[end + 1])))) {
          if (src_[end] != '_') text += src_[end];
          ++end;
        }
        errno = 0;
        const long long v = std::strtoll(text.c_str(), nullptr, base);
        if (errno == ERANGE) fail(line_, "integer literal is beyond the supported range (int64)");
        Token token{TokenType::kInt, src_.substr(pos_, end - pos_), line_};
        token.int_value = v;
        tokens_.push_back(std::move(token));
        pos_ = end;
        return;
      }
    }
    const auto digits = [&](size_t i) {
      const size_t start = i;
      while (i < src_.size() && (is_digit(src_[i]) || (src_[i] == '_' && i > start && i + 1 < src_.size() &&
                                                       is_digit(src_[i + 1])))) {
        ++i;
      }
      return i;
    };
    size_t end = digits(pos_);
    bool is_float = false;
    if (end + 1 < src_.size() && src_[end] == '.' && is_digit(src_[end + 1])) {
      end = digits(end + 1);
      is_float = true;
    }
    if (end < src_.size() && (src_[end] == 'e' || src_[end] == 'E')) {
      size_t e = end + 1;
      if (e < src_.size() && (src_[e] == '+' || src_[e] == '-')) ++e;
      if (e < src_.size() && is_digit(src_[e])) {
        end = digits(e);
        is_float = true;
      }
    }
    std::string text = src_.substr(pos_, end - pos_);
    text.erase(std::remove(text.begin(), text.end(), '_'), text.end());
    Token token{is_float ? TokenType::kFloat : TokenType::kInt, text, line_};
    if (is_float) {
      token.float_value = *py_parse_float(text);  // locale-independent, as Python
    } else {
      errno = 0;
      const long long v = std::strtoll(text.c_str(), nullptr, 10);
      if (errno == ERANGE) fail(line_, "integer literal " + text + " is beyond the supported range (int64)");
      token.int_value = v;
    }
    tokens_.push_back(std::move(token));
    pos_ = end;
  }

  void lex_string(char quote) {
    size_t i = pos_ + 1;
    while (i < src_.size() && src_[i] != quote) i += src_[i] == '\\' ? 2 : 1;
    if (i >= src_.size()) fail(line_, "unterminated string literal");
    const std::string_view body = std::string_view(src_).substr(pos_ + 1, i - pos_ - 1);
    emit(TokenType::kString, unescape(body, line_), line_);
    line_ += count_newlines(body);
    pos_ = i + 1;
  }

  void emit(TokenType type, std::string text, int line) {
    if (type == TokenType::kData && text.empty()) return;
    tokens_.push_back(Token{type, std::move(text), line});
  }

  std::string src_;
  size_t pos_ = 0;
  int line_ = 1;
  bool line_starting_ = true;
  std::vector<Token> tokens_;
};

}  // namespace

std::vector<Token> lex_template(std::string_view source) {
  // jinja2: every \r\n and \r becomes \n, and one trailing newline is dropped (keep_trailing_newline).
  std::string text;
  text.reserve(source.size());
  for (size_t i = 0; i < source.size(); ++i) {
    if (source[i] == '\r') {
      text += '\n';
      if (i + 1 < source.size() && source[i + 1] == '\n') ++i;
    } else {
      text += source[i];
    }
  }
  if (!text.empty() && text.back() == '\n') text.pop_back();
  return Lexer(std::move(text)).run();
}

}  // namespace roundpipe::models::detail
