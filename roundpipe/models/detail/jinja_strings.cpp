#include "roundpipe/models/detail/jinja_strings.h"

#include <utf8proc.h>

#include <cctype>

#include <algorithm>
#include <charconv>
#include <limits>

#include "roundpipe/models/detail/jinja_builtins.h"

namespace roundpipe::models::detail {
namespace {

std::string encode(const std::vector<char32_t>& cps, size_t begin, size_t end) {
  std::string out;
  for (size_t i = begin; i < end; ++i) append_utf8(out, cps[i]);
  return out;
}

bool is_cased_letter(char32_t c) {
  const auto cat = utf8proc_category(static_cast<utf8proc_int32_t>(c));
  return cat == UTF8PROC_CATEGORY_LU || cat == UTF8PROC_CATEGORY_LL || cat == UTF8PROC_CATEGORY_LT;
}

char32_t to_upper(char32_t c) { return static_cast<char32_t>(utf8proc_toupper(static_cast<utf8proc_int32_t>(c))); }
char32_t to_lower(char32_t c) { return static_cast<char32_t>(utf8proc_tolower(static_cast<utf8proc_int32_t>(c))); }
char32_t to_title(char32_t c) { return static_cast<char32_t>(utf8proc_totitle(static_cast<utf8proc_int32_t>(c))); }

// Python's full case mappings (SpecialCasing.txt) where they differ from the simple ones utf8proc
// gives, for the characters of Latin text: ß -> SS, the ligatures, İ -> i̇.
struct SpecialCase {
  char32_t c;
  const char* upper;
  const char* title;
};
constexpr SpecialCase kSpecialCases[] = {
    {0x00DF, "SS", "Ss"},   {0xFB00, "FF", "Ff"},   {0xFB01, "FI", "Fi"},   {0xFB02, "FL", "Fl"},
    {0xFB03, "FFI", "Ffi"}, {0xFB04, "FFL", "Ffl"}, {0xFB05, "ST", "St"},   {0xFB06, "ST", "St"},
    {0x0149, "\xCA\xBCN", "\xCA\xBCN"}, {0x01F0, "J\xCC\x8C", "J\xCC\x8C"},
};

void append_upper(std::string& out, char32_t c, bool title) {
  for (const auto& special : kSpecialCases) {
    if (special.c == c) {
      out += title ? special.title : special.upper;
      return;
    }
  }
  append_utf8(out, title ? to_title(c) : to_upper(c));
}

// Python's lower(): İ -> i + combining dot; Σ -> ς at the end of a word (Final_Sigma).
void append_lower(std::string& out, const std::vector<char32_t>& cps, size_t i) {
  const char32_t c = cps[i];
  if (c == 0x0130) {
    out += "i\xCC\x87";
  } else if (c == 0x03A3) {
    const auto cased = [&](size_t k) {
      const auto cat = utf8proc_category(static_cast<utf8proc_int32_t>(cps[k]));
      return cat == UTF8PROC_CATEGORY_LU || cat == UTF8PROC_CATEGORY_LL || cat == UTF8PROC_CATEGORY_LT;
    };
    const bool final_sigma = i > 0 && cased(i - 1) && (i + 1 == cps.size() || !cased(i + 1));
    append_utf8(out, final_sigma ? 0x03C2 : 0x03C3);
  } else {
    append_utf8(out, to_lower(c));
  }
}

// Python's line boundaries (str.splitlines).
bool is_line_break(char32_t c) {
  return c == U'\n' || c == U'\r' || c == 0x0B || c == 0x0C || c == 0x1C || c == 0x1D || c == 0x1E || c == 0x85 ||
         c == 0x2028 || c == 0x2029;
}

// Byte offset of code point index `cp` in s (clamped to the end).
size_t byte_offset(std::string_view s, size_t cp) {
  size_t i = 0;
  for (size_t n = 0; i < s.size(); ++i) {
    if ((static_cast<unsigned char>(s[i]) & 0xC0) != 0x80) {
      if (n == cp) return i;
      ++n;
    }
  }
  return s.size();
}

}  // namespace

std::string py_strip(std::string_view s, const std::string* chars, bool left, bool right) {
  const auto cps = decode_utf8(s);
  std::vector<char32_t> set;
  if (chars) set = decode_utf8(*chars);
  const auto strip = [&](char32_t c) {
    return chars ? std::find(set.begin(), set.end(), c) != set.end() : is_python_space(c);
  };
  size_t begin = 0;
  size_t end = cps.size();
  while (left && begin < end && strip(cps[begin])) ++begin;
  while (right && end > begin && strip(cps[end - 1])) --end;
  return encode(cps, begin, end);
}

std::vector<std::string> py_split(std::string_view s, const std::string* sep, int64_t maxsplit, bool from_right) {
  std::vector<std::string> out;
  if (sep) {
    if (sep->empty()) throw JinjaError("empty separator");
    if (!from_right) {
      size_t pos = 0;
      while (maxsplit < 0 || static_cast<int64_t>(out.size()) < maxsplit) {
        const size_t at = s.find(*sep, pos);
        if (at == std::string_view::npos) break;
        out.emplace_back(s.substr(pos, at - pos));
        pos = at + sep->size();
      }
      out.emplace_back(s.substr(pos));
      return out;
    }
    size_t end = s.size();
    while (maxsplit < 0 || static_cast<int64_t>(out.size()) < maxsplit) {
      if (end < sep->size()) break;
      const size_t at = s.rfind(*sep, end - sep->size());
      if (at == std::string_view::npos) break;
      out.emplace_back(s.substr(at + sep->size(), end - at - sep->size()));
      end = at;
    }
    out.emplace_back(s.substr(0, end));
    std::reverse(out.begin(), out.end());
    return out;
  }
  const auto cps = decode_utf8(s);
  if (!from_right) {
    size_t i = 0;
    while (true) {
      while (i < cps.size() && is_python_space(cps[i])) ++i;
      if (i == cps.size()) break;
      if (maxsplit >= 0 && static_cast<int64_t>(out.size()) == maxsplit) {
        size_t end = cps.size();
        while (end > i && is_python_space(cps[end - 1])) --end;
        out.push_back(encode(cps, i, end));
        break;
      }
      size_t j = i;
      while (j < cps.size() && !is_python_space(cps[j])) ++j;
      out.push_back(encode(cps, i, j));
      i = j;
    }
    return out;
  }
  size_t i = cps.size();
  while (true) {
    while (i > 0 && is_python_space(cps[i - 1])) --i;
    if (i == 0) break;
    if (maxsplit >= 0 && static_cast<int64_t>(out.size()) == maxsplit) {
      size_t begin = 0;
      while (begin < i && is_python_space(cps[begin])) ++begin;
      out.push_back(encode(cps, begin, i));
      break;
    }
    size_t j = i;
    while (j > 0 && !is_python_space(cps[j - 1])) --j;
    out.push_back(encode(cps, j, i));
    i = j;
  }
  std::reverse(out.begin(), out.end());
  return out;
}

std::string py_replace(std::string_view s, std::string_view old_s, std::string_view new_s, int64_t count) {
  std::string out;
  if (old_s.empty()) {
    const auto cps = decode_utf8(s);
    int64_t done = 0;
    for (size_t i = 0; i <= cps.size(); ++i) {
      if (count < 0 || done < count) {
        out += new_s;
        ++done;
      }
      if (i < cps.size()) append_utf8(out, cps[i]);
      if (out.size() > kMaxBuiltBytes) throw JinjaError("replace: result too large");
    }
    return out;
  }
  size_t pos = 0;
  int64_t done = 0;
  while (count < 0 || done < count) {
    const size_t at = s.find(old_s, pos);
    if (at == std::string_view::npos) break;
    out += s.substr(pos, at - pos);
    out += new_s;
    if (out.size() > kMaxBuiltBytes) throw JinjaError("replace: result too large");
    pos = at + old_s.size();
    ++done;
  }
  out += s.substr(pos);
  return out;
}

std::string py_case(std::string_view s, bool upper) {
  std::string out;
  const auto cps = decode_utf8(s);
  for (size_t i = 0; i < cps.size(); ++i) {
    if (upper) {
      append_upper(out, cps[i], false);
    } else {
      append_lower(out, cps, i);
    }
  }
  return out;
}

std::string py_title(std::string_view s) {
  std::string out;
  bool previous_cased = false;
  const auto cps = decode_utf8(s);
  for (size_t i = 0; i < cps.size(); ++i) {
    const bool cased = is_cased_letter(cps[i]);
    if (!cased) {
      append_utf8(out, cps[i]);
    } else if (previous_cased) {
      append_lower(out, cps, i);
    } else {
      append_upper(out, cps[i], true);
    }
    previous_cased = cased;
  }
  return out;
}

std::string py_capitalize(std::string_view s) {
  std::string out;
  const auto cps = decode_utf8(s);
  for (size_t i = 0; i < cps.size(); ++i) {
    if (i == 0) {
      append_upper(out, cps[i], true);
    } else {
      append_lower(out, cps, i);
    }
  }
  return out;
}

int64_t py_find(std::string_view s, std::string_view sub, const Value* start, const Value* end, bool from_right) {
  const int64_t n = static_cast<int64_t>(code_point_count(s));
  const auto bound = [&](const Value* v, int64_t fallback) {
    if (v == nullptr || v->is_none()) return fallback;
    if (!v->is_integral()) throw JinjaError("slice indices must be integers or None");
    int64_t i = v->as_int();
    if (i < 0) i = std::max<int64_t>(0, i + n);
    return std::min(i, n);
  };
  const int64_t b = bound(start, 0);
  const int64_t e = bound(end, n);
  if (b > e) return -1;
  const size_t bb = byte_offset(s, static_cast<size_t>(b));
  const size_t eb = byte_offset(s, static_cast<size_t>(e));
  const std::string_view window = s.substr(bb, eb - bb);
  const size_t at = from_right ? window.rfind(sub) : window.find(sub);
  if (at == std::string_view::npos) return -1;
  return b + static_cast<int64_t>(code_point_count(window.substr(0, at)));
}

int64_t py_count(std::string_view s, std::string_view sub) {
  if (sub.empty()) return static_cast<int64_t>(code_point_count(s)) + 1;
  int64_t n = 0;
  for (size_t at = s.find(sub); at != std::string_view::npos; at = s.find(sub, at + sub.size())) ++n;
  return n;
}

std::vector<std::string> py_splitlines(std::string_view s) {
  const auto cps = decode_utf8(s);
  std::vector<std::string> out;
  size_t begin = 0;
  for (size_t i = 0; i < cps.size(); ++i) {
    if (!is_line_break(cps[i])) continue;
    out.push_back(encode(cps, begin, i));
    if (cps[i] == U'\r' && i + 1 < cps.size() && cps[i + 1] == U'\n') ++i;
    begin = i + 1;
  }
  if (begin < cps.size()) out.push_back(encode(cps, begin, cps.size()));
  return out;
}

namespace {

// The number text of py_parse_*: stripped, sign split off, '_' (only between two digits) removed;
// false when an underscore is misplaced.
bool number_text(std::string_view s, bool& negative, std::string& digits) {
  const std::string stripped = py_strip(s, nullptr, true, true);
  std::string_view t = stripped;
  negative = false;
  if (!t.empty() && (t[0] == '+' || t[0] == '-')) {
    negative = t[0] == '-';
    t.remove_prefix(1);
  }
  const auto is_digit = [](char c) { return c >= '0' && c <= '9'; };
  digits.clear();
  for (size_t i = 0; i < t.size(); ++i) {
    if (t[i] == '_') {
      if (i == 0 || i + 1 == t.size() || !is_digit(t[i - 1]) || !is_digit(t[i + 1])) return false;
      continue;
    }
    digits += t[i];
  }
  return true;
}

}  // namespace

std::optional<int64_t> py_parse_int(std::string_view s) {
  bool negative = false;
  std::string digits;
  if (!number_text(s, negative, digits) || digits.empty()) return std::nullopt;
  if (!std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; })) return std::nullopt;
  uint64_t magnitude = 0;
  const auto result = std::from_chars(digits.data(), digits.data() + digits.size(), magnitude);
  const uint64_t limit = negative ? uint64_t{1} << 63 : (uint64_t{1} << 63) - 1;
  if (result.ec == std::errc::result_out_of_range || magnitude > limit) {
    throw JinjaError("integer " + std::string(s) + " is beyond the supported range (int64)");
  }
  return negative ? static_cast<int64_t>(0 - magnitude) : static_cast<int64_t>(magnitude);
}

std::optional<double> py_parse_float(std::string_view s) {
  bool negative = false;
  std::string digits;
  if (!number_text(s, negative, digits) || digits.empty()) return std::nullopt;
  std::string lower = digits;
  std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char c) { return std::tolower(c); });
  double value = 0;
  if (lower == "inf" || lower == "infinity") {
    value = std::numeric_limits<double>::infinity();
  } else if (lower == "nan") {
    value = std::numeric_limits<double>::quiet_NaN();
  } else {
    const bool decimal = std::all_of(lower.begin(), lower.end(), [](char c) {
      return (c >= '0' && c <= '9') || c == '.' || c == 'e' || c == '+' || c == '-';
    });
    if (!decimal) return std::nullopt;
    const auto result = std::from_chars(lower.data(), lower.data() + lower.size(), value);
    if (result.ptr != lower.data() + lower.size()) return std::nullopt;
    if (result.ec == std::errc::result_out_of_range) {  // Python: overflow -> inf, underflow -> 0
      value = lower.find("e-") != std::string::npos ? 0.0 : std::numeric_limits<double>::infinity();
    } else if (result.ec != std::errc()) {
      return std::nullopt;
    }
  }
  return negative ? -value : value;
}

bool py_is(std::string_view s, std::string_view predicate) {
  const auto cps = decode_utf8(s);
  if (cps.empty()) return false;
  const auto category = [](char32_t c) { return utf8proc_category(static_cast<utf8proc_int32_t>(c)); };
  const auto alpha = [&](char32_t c) {
    const auto cat = category(c);
    return cat >= UTF8PROC_CATEGORY_LU && cat <= UTF8PROC_CATEGORY_LO;
  };
  const auto digit = [&](char32_t c) { return category(c) == UTF8PROC_CATEGORY_ND; };
  if (predicate == "isdigit") return std::all_of(cps.begin(), cps.end(), digit);
  if (predicate == "isalpha") return std::all_of(cps.begin(), cps.end(), alpha);
  if (predicate == "isalnum") return std::all_of(cps.begin(), cps.end(), [&](char32_t c) { return alpha(c) || digit(c); });
  if (predicate == "isspace") return std::all_of(cps.begin(), cps.end(), is_python_space);
  bool any_cased = false;
  for (char32_t c : cps) {
    if (!is_cased_letter(c)) continue;
    any_cased = true;
    const bool lower = to_upper(c) != c || category(c) == UTF8PROC_CATEGORY_LL;
    if ((predicate == "islower") != lower) return false;
  }
  if (predicate == "islower" || predicate == "isupper") return any_cased;
  throw JinjaError("unsupported method str." + std::string(predicate));
}

}  // namespace roundpipe::models::detail
