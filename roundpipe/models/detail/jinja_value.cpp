#include "roundpipe/models/detail/jinja_value.h"

#include <utf8proc.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <limits>

namespace roundpipe::models::detail {
namespace {

// repr/tojson/== recurse into containers; a namespace may hold itself, so the depth is bounded.
constexpr int kMaxDepth = 200;

void check_depth(int depth) {
  if (depth > kMaxDepth) throw JinjaError("value nested deeper than " + std::to_string(kMaxDepth) + " levels");
}

// Python's str.isprintable() for one code point: not in Cc, Cf, Cs, Co, Cn, Zl, Zp, and no Zs
// other than the space.
bool is_printable(char32_t c) {
  if (c == U' ') return true;
  switch (utf8proc_category(static_cast<utf8proc_int32_t>(c))) {
    case UTF8PROC_CATEGORY_CC:
    case UTF8PROC_CATEGORY_CF:
    case UTF8PROC_CATEGORY_CS:
    case UTF8PROC_CATEGORY_CO:
    case UTF8PROC_CATEGORY_CN:
    case UTF8PROC_CATEGORY_ZL:
    case UTF8PROC_CATEGORY_ZP:
    case UTF8PROC_CATEGORY_ZS:
      return false;
    default:
      return true;
  }
}

std::string string_repr(std::string_view s) {
  const bool has_single = s.find('\'') != std::string_view::npos;
  const bool has_double = s.find('"') != std::string_view::npos;
  const char quote = has_single && !has_double ? '"' : '\'';
  std::string out(1, quote);
  char buf[16];
  for (char32_t c : decode_utf8(s)) {
    if (c == static_cast<char32_t>(quote) || c == U'\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c == U'\n') {
      out += "\\n";
    } else if (c == U'\r') {
      out += "\\r";
    } else if (c == U'\t') {
      out += "\\t";
    } else if (c < 0x7F ? c >= 0x20 : is_printable(c)) {
      append_utf8(out, c);
    } else {
      if (c < 0x100) {
        std::snprintf(buf, sizeof buf, "\\x%02x", static_cast<unsigned>(c));
      } else if (c < 0x10000) {
        std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(c));
      } else {
        std::snprintf(buf, sizeof buf, "\\U%08x", static_cast<unsigned>(c));
      }
      out += buf;
    }
  }
  out += quote;
  return out;
}

std::string repr_at(const Value& v, int depth);

std::string sequence_repr(const Value& v, int depth) {
  const bool tuple = v.kind == Value::Kind::kTuple;
  std::string out = tuple ? "(" : "[";
  for (size_t i = 0; i < v.list->size(); ++i) {
    if (i) out += ", ";
    out += repr_at((*v.list)[i], depth + 1);
  }
  if (tuple && v.list->size() == 1) out += ",";
  out += tuple ? ")" : "]";
  return out;
}

std::string dict_repr(const ValueDict& d, int depth) {
  std::string out = "{";
  for (size_t i = 0; i < d.items.size(); ++i) {
    if (i) out += ", ";
    out += repr_at(d.items[i].first, depth + 1) + ": " + repr_at(d.items[i].second, depth + 1);
  }
  return out + "}";
}

std::string repr_at(const Value& v, int depth) {
  check_depth(depth);
  if (v.generator) throw JinjaError("printing a generator (the result of map, select, reverse, ...) is not supported");
  if (v.range_object) throw JinjaError("printing a range object is not supported (add |list)");
  switch (v.kind) {
    case Value::Kind::kUndefined: return "";
    case Value::Kind::kNone: return "None";
    case Value::Kind::kBool: return v.boolean ? "True" : "False";
    case Value::Kind::kInt: return std::to_string(v.integer);
    case Value::Kind::kFloat: return float_repr(v.number);
    case Value::Kind::kString: return string_repr(v.string);
    case Value::Kind::kList:
    case Value::Kind::kTuple: return sequence_repr(v, depth);
    case Value::Kind::kDict: return dict_repr(*v.dict, depth);
    case Value::Kind::kNamespace: return "<Namespace " + dict_repr(*v.dict, depth) + ">";
    case Value::Kind::kCallable:
      throw JinjaError("printing a function is not supported (Python would print its memory address)");
  }
  return "";
}

bool equals_at(const Value& a, const Value& b, int depth) {
  check_depth(depth);
  using K = Value::Kind;
  if (a.generator || b.generator) return a.list == b.list;
  if (a.range_object != b.range_object) return false;
  if (a.is_number() && b.is_number()) {
    if (a.is_integral() && b.is_integral()) return a.as_int() == b.as_int();
    return a.as_float() == b.as_float();
  }
  if (a.kind != b.kind) return false;
  switch (a.kind) {
    case K::kUndefined:
    case K::kNone: return true;
    case K::kString: return a.string == b.string;
    case K::kList:
    case K::kTuple:
      if (a.list->size() != b.list->size()) return false;
      for (size_t i = 0; i < a.list->size(); ++i) {
        if (!equals_at((*a.list)[i], (*b.list)[i], depth + 1)) return false;
      }
      return true;
    case K::kDict:
      if (a.dict->items.size() != b.dict->items.size()) return false;
      for (const auto& [key, value] : a.dict->items) {
        const Value* other = b.dict->find(key);
        if (other == nullptr || !equals_at(value, *other, depth + 1)) return false;
      }
      return true;
    case K::kNamespace: return a.dict == b.dict;
    case K::kCallable: return a.callable == b.callable;
    default: return false;
  }
}

void json_string(std::string& out, std::string_view s, bool ensure_ascii) {
  out += '"';
  char buf[16];
  for (char32_t c : decode_utf8(s)) {
    switch (c) {
      case U'"': out += "\\\""; break;
      case U'\\': out += "\\\\"; break;
      case U'\n': out += "\\n"; break;
      case U'\r': out += "\\r"; break;
      case U'\t': out += "\\t"; break;
      case U'\b': out += "\\b"; break;
      case U'\f': out += "\\f"; break;
      default:
        if (c < 0x20 || (ensure_ascii && c > 0x7E)) {  // json.dumps: ensure_ascii keeps only ' '..'~'
          if (c >= 0x10000) {
            const char32_t v = c - 0x10000;
            std::snprintf(buf, sizeof buf, "\\u%04x\\u%04x", static_cast<unsigned>(0xD800 + (v >> 10)),
                          static_cast<unsigned>(0xDC00 + (v & 0x3FF)));
          } else {
            std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(c));
          }
          out += buf;
        } else {
          append_utf8(out, c);
        }
    }
  }
  out += '"';
}

std::string json_float(double d) {
  if (std::isnan(d)) return "NaN";
  if (std::isinf(d)) return d > 0 ? "Infinity" : "-Infinity";
  return float_repr(d);
}

// json.dumps turns dict keys into strings this way (other key types are a TypeError).
std::string json_key(const Value& key) {
  switch (key.kind) {
    case Value::Kind::kString: return key.string;
    case Value::Kind::kBool: return key.boolean ? "true" : "false";
    case Value::Kind::kInt: return std::to_string(key.integer);
    case Value::Kind::kFloat: return json_float(key.number);
    case Value::Kind::kNone: return "null";
    default: throw JinjaError("tojson: keys must be str, int, float, bool or None, not " + type_name(key));
  }
}

void dump_at(std::string& out, const Value& v, const DumpOptions& o, int depth) {
  check_depth(depth);
  if (v.generator) throw JinjaError("tojson: Object of type generator is not JSON serializable");
  if (v.range_object) throw JinjaError("tojson: Object of type range is not JSON serializable");
  const auto newline = [&](int level) {
    out += '\n';
    for (int i = 0; i < level; ++i) out += *o.indent;
  };
  switch (v.kind) {
    case Value::Kind::kNone: out += "null"; return;
    case Value::Kind::kBool: out += v.boolean ? "true" : "false"; return;
    case Value::Kind::kInt: out += std::to_string(v.integer); return;
    case Value::Kind::kFloat: out += json_float(v.number); return;
    case Value::Kind::kString: json_string(out, v.string, o.ensure_ascii); return;
    case Value::Kind::kList:
    case Value::Kind::kTuple: {
      if (v.list->empty()) {
        out += "[]";
        return;
      }
      out += '[';
      for (size_t i = 0; i < v.list->size(); ++i) {
        if (i) out += o.item_separator;
        if (o.indent) newline(depth + 1);
        dump_at(out, (*v.list)[i], o, depth + 1);
      }
      if (o.indent) newline(depth);
      out += ']';
      return;
    }
    case Value::Kind::kDict: {
      if (v.dict->items.empty()) {
        out += "{}";
        return;
      }
      std::vector<std::pair<std::string, const Value*>> items;
      for (const auto& [key, value] : v.dict->items) items.emplace_back(json_key(key), &value);
      if (o.sort_keys) {
        for (const auto& [key, value] : v.dict->items) {
          if (!key.is_string()) throw JinjaError("tojson(sort_keys=true): keys must all be strings");
        }
        std::stable_sort(items.begin(), items.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
      }
      out += '{';
      for (size_t i = 0; i < items.size(); ++i) {
        if (i) out += o.item_separator;
        if (o.indent) newline(depth + 1);
        json_string(out, items[i].first, o.ensure_ascii);
        out += o.key_separator;
        dump_at(out, *items[i].second, o, depth + 1);
      }
      if (o.indent) newline(depth);
      out += '}';
      return;
    }
    default: throw JinjaError("tojson: Object of type " + type_name(v) + " is not JSON serializable");
  }
}

}  // namespace

Value Value::undefined(std::string hint) {
  Value v;
  v.string = std::move(hint);
  return v;
}
Value Value::none() {
  Value v;
  v.kind = Kind::kNone;
  return v;
}
Value Value::from_bool(bool b) {
  Value v;
  v.kind = Kind::kBool;
  v.boolean = b;
  return v;
}
Value Value::from_int(int64_t i) {
  Value v;
  v.kind = Kind::kInt;
  v.integer = i;
  return v;
}
Value Value::from_float(double d) {
  Value v;
  v.kind = Kind::kFloat;
  v.number = d;
  return v;
}
Value Value::from_string(std::string s) {
  Value v;
  v.kind = Kind::kString;
  v.string = std::move(s);
  return v;
}
Value Value::from_list(ValueList items, bool tuple) {
  Value v;
  v.kind = tuple ? Kind::kTuple : Kind::kList;
  v.list = std::make_shared<const ValueList>(std::move(items));
  return v;
}
Value Value::from_dict(ValueDict d) {
  Value v;
  v.kind = Kind::kDict;
  v.dict = std::make_shared<ValueDict>(std::move(d));
  return v;
}
Value Value::make_namespace(ValueDict attrs) {
  Value v = from_dict(std::move(attrs));
  v.kind = Kind::kNamespace;
  return v;
}
Value Value::make_generator(ValueList items) {
  Value v = from_list(std::move(items));
  v.generator = std::make_shared<int>(0);
  return v;
}
Value Value::from_callable(Callable fn) {
  Value v;
  v.kind = Kind::kCallable;
  v.callable = std::make_shared<const Callable>(std::move(fn));
  return v;
}

const Value* ValueDict::find(const Value& key) const {
  for (const auto& item : items) {
    if (equals(item.first, key)) return &item.second;
  }
  return nullptr;
}

const Value* ValueDict::find(std::string_view key) const {
  for (const auto& item : items) {
    if (item.first.is_string() && item.first.string == key) return &item.second;
  }
  return nullptr;
}

void ValueDict::set(Value key, Value value) {
  for (auto& item : items) {
    if (equals(item.first, key)) {
      item.second = std::move(value);
      return;
    }
  }
  items.emplace_back(std::move(key), std::move(value));
}

const Value* CallArgs::get(size_t index, std::string_view name) {
  if (index < positional.size()) {
    positional_used_ = std::max(positional_used_, index + 1);
    return &positional[index];
  }
  return get_keyword(name);
}

const Value* CallArgs::get_keyword(std::string_view name) {
  keyword_used_.resize(keyword.size(), false);
  for (size_t i = 0; i < keyword.size(); ++i) {
    if (keyword[i].first == name) {
      keyword_used_[i] = true;
      return &keyword[i].second;
    }
  }
  return nullptr;
}

void CallArgs::check_all_used(std::string_view function) const {
  if (positional_used_ < positional.size()) {
    throw JinjaError(std::string(function) + ": too many positional arguments (" + std::to_string(positional.size()) +
                     ")");
  }
  for (size_t i = 0; i < keyword.size(); ++i) {
    if (i >= keyword_used_.size() || !keyword_used_[i]) {
      throw JinjaError(std::string(function) + ": unexpected keyword argument '" + keyword[i].first + "'");
    }
  }
}

std::string type_name(const Value& v) {
  switch (v.kind) {
    case Value::Kind::kUndefined: return "undefined";
    case Value::Kind::kNone: return "NoneType";
    case Value::Kind::kBool: return "bool";
    case Value::Kind::kInt: return "int";
    case Value::Kind::kFloat: return "float";
    case Value::Kind::kString: return "str";
    case Value::Kind::kList: return "list";
    case Value::Kind::kTuple: return "tuple";
    case Value::Kind::kDict: return "dict";
    case Value::Kind::kNamespace: return "Namespace";
    case Value::Kind::kCallable: return "function";
  }
  return "?";
}

bool truthy(const Value& v) {
  if (v.generator) return true;
  switch (v.kind) {
    case Value::Kind::kUndefined:
    case Value::Kind::kNone: return false;
    case Value::Kind::kBool: return v.boolean;
    case Value::Kind::kInt: return v.integer != 0;
    case Value::Kind::kFloat: return v.number != 0;
    case Value::Kind::kString: return !v.string.empty();
    case Value::Kind::kList:
    case Value::Kind::kTuple: return !v.list->empty();
    case Value::Kind::kDict: return !v.dict->items.empty();
    default: return true;
  }
}

std::string to_str(const Value& v) {
  if (v.kind == Value::Kind::kString) return v.string;
  return repr_at(v, 0);
}

std::string repr(const Value& v) { return repr_at(v, 0); }

std::string float_repr(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
  char buf[64];
  const auto result = std::to_chars(buf, buf + sizeof buf, d, std::chars_format::scientific);
  const std::string sci(buf, result.ptr);
  // sci = [-]D[.DDD]e[+-]XX: the shortest digits that round-trip, as Python's repr picks.
  const size_t e = sci.find('e');
  const bool negative = sci[0] == '-';
  std::string digits;
  for (size_t i = negative ? 1 : 0; i < e; ++i) {
    if (sci[i] != '.') digits += sci[i];
  }
  const int exponent = std::stoi(sci.substr(e + 1));
  const int decpt = exponent + 1;  // position of the decimal point after the first digit
  std::string out = negative ? "-" : "";
  if (decpt <= -4 || decpt > 16) {
    out += digits[0];
    if (digits.size() > 1) out += "." + digits.substr(1);
    char ebuf[16];
    std::snprintf(ebuf, sizeof ebuf, "e%c%02d", exponent < 0 ? '-' : '+', std::abs(exponent));
    return out + ebuf;
  }
  if (decpt <= 0) return out + "0." + std::string(static_cast<size_t>(-decpt), '0') + digits;
  if (static_cast<size_t>(decpt) >= digits.size()) {
    return out + digits + std::string(static_cast<size_t>(decpt) - digits.size(), '0') + ".0";
  }
  return out + digits.substr(0, static_cast<size_t>(decpt)) + "." + digits.substr(static_cast<size_t>(decpt));
}

bool equals(const Value& a, const Value& b) { return equals_at(a, b, 0); }

bool less(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.is_integral() && b.is_integral()) return a.as_int() < b.as_int();
    return a.as_float() < b.as_float();
  }
  if (a.is_string() && b.is_string()) return a.string < b.string;  // UTF-8 order is code point order
  if (a.kind == b.kind && a.is_sequence()) {
    const auto& x = *a.list;
    const auto& y = *b.list;
    for (size_t i = 0; i < x.size() && i < y.size(); ++i) {
      if (!equals(x[i], y[i])) return less(x[i], y[i]);
    }
    return x.size() < y.size();
  }
  throw JinjaError("'<' not supported between instances of '" + type_name(a) + "' and '" + type_name(b) + "'");
}

std::string to_json(const Value& v, const DumpOptions& options) {
  std::string out;
  dump_at(out, v, options, 0);
  return out;
}

Value from_json(const nlohmann::ordered_json& j) {
  switch (j.type()) {
    case nlohmann::ordered_json::value_t::null: return Value::none();
    case nlohmann::ordered_json::value_t::boolean: return Value::from_bool(j.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer: return Value::from_int(j.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_unsigned: {
      const auto u = j.get<uint64_t>();
      if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        throw JinjaError("integer " + std::to_string(u) + " is beyond the supported range (int64)");
      }
      return Value::from_int(static_cast<int64_t>(u));
    }
    case nlohmann::ordered_json::value_t::number_float: return Value::from_float(j.get<double>());
    case nlohmann::ordered_json::value_t::string: return Value::from_string(j.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
      ValueList items;
      items.reserve(j.size());
      for (const auto& item : j) items.push_back(from_json(item));
      return Value::from_list(std::move(items));
    }
    case nlohmann::ordered_json::value_t::object: {
      ValueDict d;
      for (const auto& [key, value] : j.items()) d.items.emplace_back(Value::from_string(key), from_json(value));
      return Value::from_dict(std::move(d));
    }
    default: throw JinjaError("binary JSON values are not supported");
  }
}

size_t code_point_count(std::string_view s) {
  size_t n = 0;
  for (char ch : s) n += (static_cast<unsigned char>(ch) & 0xC0) != 0x80;
  return n;
}

bool is_python_space(char32_t c) {
  if (c <= 0x20) return c == 0x20 || (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x1F);
  switch (c) {
    case 0x85: case 0xA0: case 0x1680: case 0x2028: case 0x2029: case 0x202F: case 0x205F: case 0x3000:
      return true;
    default:
      return c >= 0x2000 && c <= 0x200A;
  }
}

}  // namespace roundpipe::models::detail
