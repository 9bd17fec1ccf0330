// Attribute/item access, Python methods, operators and globals of the chat template engine;
// the filters and tests are in jinja_filters.cpp.
#include <utf8proc.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>

#include "roundpipe/models/detail/jinja_builtins.h"
#include "roundpipe/models/detail/jinja_strings.h"

namespace roundpipe::models::detail {
namespace {

[[noreturn]] void undefined_error(const Value& u) {
  throw JinjaError(u.string.empty() ? "undefined value used" : u.string);
}

[[noreturn]] void type_error(std::string_view what, const Value& a, const Value& b) {
  throw JinjaError("unsupported operand type(s) for " + std::string(what) + ": '" + type_name(a) + "' and '" +
                   type_name(b) + "'");
}

std::string object_name(const Value& v) {
  if (v.kind == Value::Kind::kNamespace) return "jinja2.utils.Namespace object";
  if (v.kind == Value::Kind::kNone) return "None";
  return "'" + type_name(v) + " object'";
}

Value missing_attribute(const Value& obj, const std::string& name) {
  return Value::undefined(object_name(obj) + " has no attribute '" + name + "'");
}

// Python's index normalization: -1 is the last; nullopt when out of range.
std::optional<size_t> normalize_index(int64_t index, size_t size) {
  const auto n = static_cast<int64_t>(size);
  if (index < 0) index += n;
  if (index < 0 || index >= n) return std::nullopt;
  return static_cast<size_t>(index);
}

int64_t slice_bound(const Value* v, int64_t fallback) {
  if (v == nullptr || v->is_none()) return fallback;
  if (!v->is_integral()) throw JinjaError("slice indices must be integers or None, not " + type_name(*v));
  return v->as_int();
}

// Python's slice.indices + the selected positions.
std::vector<size_t> slice_positions(size_t size, const Value* start_v, const Value* stop_v, const Value* step_v) {
  const int64_t step = slice_bound(step_v, 1);
  if (step == 0) throw JinjaError("slice step cannot be zero");
  const auto n = static_cast<int64_t>(size);
  const auto clamp = [&](const Value* v, int64_t fallback) {
    if (v == nullptr || v->is_none()) return fallback;
    int64_t i = slice_bound(v, fallback);
    if (i < 0) i += n;
    if (step > 0) return std::clamp<int64_t>(i, 0, n);
    return std::clamp<int64_t>(i, -1, n - 1);
  };
  const int64_t start = clamp(start_v, step > 0 ? 0 : n - 1);
  const int64_t stop = clamp(stop_v, step > 0 ? n : -1);
  std::vector<size_t> out;
  for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) out.push_back(static_cast<size_t>(i));
  return out;
}

// a op b for int64 with Python's result, or an error where Python's unbounded int would leave int64.
template <typename Op>
int64_t checked(Op op, int64_t a, int64_t b) {
  int64_t r = 0;
  if (op(a, b, &r)) throw JinjaError("integer overflow (Python integers are unbounded; this engine stops at int64)");
  return r;
}
bool add_overflow(int64_t a, int64_t b, int64_t* r) { return __builtin_add_overflow(a, b, r); }
bool sub_overflow(int64_t a, int64_t b, int64_t* r) { return __builtin_sub_overflow(a, b, r); }
bool mul_overflow(int64_t a, int64_t b, int64_t* r) { return __builtin_mul_overflow(a, b, r); }

int64_t floor_div(int64_t a, int64_t b) {
  if (b == 0) throw JinjaError("integer division or modulo by zero");
  if (a == std::numeric_limits<int64_t>::min() && b == -1) checked(sub_overflow, 0, a);
  int64_t q = a / b;
  if ((a % b != 0) && ((a < 0) != (b < 0))) --q;
  return q;
}

int64_t py_mod(int64_t a, int64_t b) {
  if (b == 0) throw JinjaError("integer division or modulo by zero");
  if (b == -1) return 0;
  int64_t r = a % b;
  if (r != 0 && ((r < 0) != (b < 0))) r += b;
  return r;
}

Value repeat(const Value& seq, int64_t times) {
  if (times <= 0) return seq.is_string() ? Value::from_string("") : Value::from_list({}, seq.kind == Value::Kind::kTuple);
  const size_t unit = seq.is_string() ? seq.string.size() : seq.list->size() * sizeof(Value);
  if (unit != 0 && static_cast<uint64_t>(times) > kMaxBuiltBytes / unit) {
    throw JinjaError("repetition result larger than " + std::to_string(kMaxBuiltBytes) + " bytes");
  }
  if (seq.is_string()) {
    std::string out;
    for (int64_t i = 0; i < times; ++i) out += seq.string;
    return Value::from_string(std::move(out));
  }
  ValueList out;
  for (int64_t i = 0; i < times; ++i) out.insert(out.end(), seq.list->begin(), seq.list->end());
  return Value::from_list(std::move(out), seq.kind == Value::Kind::kTuple);
}

// Methods of each type. Mutating ones are refused as jinja2's ImmutableSandboxedEnvironment does.
constexpr std::string_view kStringMethods[] = {
    "startswith", "endswith", "strip",  "lstrip",     "rstrip",  "split",   "rsplit",  "replace", "upper",
    "lower",      "title",    "capitalize", "find",   "rfind",   "count",   "join",    "isdigit", "isalpha",
    "isalnum",    "isspace",  "islower", "isupper",   "splitlines", "removeprefix", "removesuffix", "index"};
// Python str methods this engine does not implement: named in the error instead of "undefined".
constexpr std::string_view kUnsupportedStringMethods[] = {
    "format", "format_map", "encode", "center", "ljust", "rjust", "zfill", "expandtabs", "partition",
    "rpartition", "casefold", "swapcase", "translate", "maketrans", "isnumeric", "isdecimal", "isidentifier",
    "isprintable", "istitle", "isascii", "rindex", "rjust"};
constexpr std::string_view kDictMethods[] = {"items", "keys", "values", "get"};
constexpr std::string_view kListMethods[] = {"index", "count"};
constexpr std::string_view kMutatingMethods[] = {"append", "extend", "insert", "pop",    "remove", "sort",
                                                 "reverse", "clear", "update", "popitem", "setdefault", "add",
                                                 "discard"};
// Other attributes Python's dict and list have (jinja2 finds them before a key of that name).
constexpr std::string_view kUnsupportedContainerMethods[] = {"copy", "fromkeys"};

template <size_t N>
bool in_table(const std::string_view (&table)[N], std::string_view name) {
  return std::find(std::begin(table), std::end(table), name) != std::end(table);
}

const std::string& string_arg(const Value* v, std::string_view method) {
  if (v == nullptr || !v->is_string()) {
    throw JinjaError("str." + std::string(method) + "() takes a str argument" +
                     (v ? ", not " + type_name(*v) : std::string()));
  }
  return v->string;
}

std::optional<std::string> optional_chars(const Value* v, std::string_view method) {
  if (v == nullptr || v->is_none()) return std::nullopt;
  return string_arg(v, method);
}

int64_t int_arg(const Value* v, int64_t fallback, std::string_view method) {
  if (v == nullptr || v->is_none()) return fallback;
  if (!v->is_integral()) throw JinjaError(std::string(method) + "(): an integer argument is required, not " +
                                          type_name(*v));
  return v->as_int();
}

Value string_list(const std::vector<std::string>& parts) {
  ValueList out;
  out.reserve(parts.size());
  for (const auto& p : parts) out.push_back(Value::from_string(p));
  return Value::from_list(std::move(out));
}

// str.startswith / endswith (a prefix or a tuple of them, optional start/end).
bool affix_match(const std::string& s, CallArgs& args, bool prefix) {
  const Value* affix = args.get(0, "");
  const Value* start = args.get(1, "");
  const Value* end = args.get(2, "");
  std::string hay = s;
  if (start || end) {
    Value sliced = get_slice(Value::from_string(s), start, end, nullptr);
    hay = sliced.string;
  }
  const auto one = [&](const Value& a) {
    const std::string& x = string_arg(&a, prefix ? "startswith" : "endswith");
    return hay.size() >= x.size() && (prefix ? hay.compare(0, x.size(), x) == 0
                                             : hay.compare(hay.size() - x.size(), x.size(), x) == 0);
  };
  if (affix && affix->kind == Value::Kind::kTuple) {
    return std::any_of(affix->list->begin(), affix->list->end(), one);
  }
  if (affix == nullptr) throw JinjaError("startswith/endswith takes at least 1 argument");
  return one(*affix);
}

Value call_string_method(const std::string& s, std::string_view name, CallArgs& args) {
  const std::string method = "str." + std::string(name);
  Value result;
  if (name == "startswith" || name == "endswith") {
    result = Value::from_bool(affix_match(s, args, name == "startswith"));
  } else if (name == "strip" || name == "lstrip" || name == "rstrip") {
    const auto chars = optional_chars(args.get(0, "chars"), name);
    result = Value::from_string(py_strip(s, chars ? &*chars : nullptr, name != "rstrip", name != "lstrip"));
  } else if (name == "split" || name == "rsplit") {
    const auto sep = optional_chars(args.get(0, "sep"), name);
    const int64_t maxsplit = int_arg(args.get(1, "maxsplit"), -1, method);
    result = string_list(py_split(s, sep ? &*sep : nullptr, maxsplit, name == "rsplit"));
  } else if (name == "replace") {
    const std::string& old_s = string_arg(args.get(0, "old"), name);
    const std::string& new_s = string_arg(args.get(1, "new"), name);
    result = Value::from_string(py_replace(s, old_s, new_s, int_arg(args.get(2, "count"), -1, method)));
  } else if (name == "upper" || name == "lower") {
    result = Value::from_string(py_case(s, name == "upper"));
  } else if (name == "title") {
    result = Value::from_string(py_title(s));
  } else if (name == "capitalize") {
    result = Value::from_string(py_capitalize(s));
  } else if (name == "find" || name == "rfind" || name == "index") {
    const std::string& sub = string_arg(args.get(0, "sub"), name);
    const Value* start = args.get(1, "");
    const Value* end = args.get(2, "");
    const int64_t at = py_find(s, sub, start, end, name == "rfind");
    if (name == "index" && at < 0) throw JinjaError("str.index: substring not found");
    result = Value::from_int(at);
  } else if (name == "count") {
    const std::string& sub = string_arg(args.get(0, "sub"), name);
    result = Value::from_int(py_count(s, sub));
  } else if (name == "join") {
    const Value* items = args.get(0, "iterable");
    if (items == nullptr) throw JinjaError("str.join() takes exactly one argument");
    std::string out;
    bool first = true;
    for (const Value& item : iterate(*items)) {
      if (!item.is_string()) throw JinjaError("str.join(): expected str instance, " + type_name(item) + " found");
      if (!first) out += s;
      out += item.string;
      first = false;
    }
    result = Value::from_string(std::move(out));
  } else if (name == "splitlines") {
    if (truthy(args.get(0, "keepends") ? *args.get(0, "keepends") : Value::from_bool(false))) {
      throw JinjaError("str.splitlines(keepends=True) is not supported");
    }
    result = string_list(py_splitlines(s));
  } else if (name == "removeprefix" || name == "removesuffix") {
    const std::string& a = string_arg(args.get(0, "affix"), name);
    std::string out = s;
    if (name == "removeprefix" && s.compare(0, a.size(), a) == 0) out = s.substr(a.size());
    if (name == "removesuffix" && !a.empty() && s.size() >= a.size() && s.compare(s.size() - a.size(), a.size(), a) == 0) {
      out = s.substr(0, s.size() - a.size());
    }
    result = Value::from_string(std::move(out));
  } else {
    result = Value::from_bool(py_is(s, name));
  }
  args.check_all_used(method);
  return result;
}

Value call_dict_method(const ValueDict& d, std::string_view name, CallArgs& args) {
  Value result;
  if (name == "get") {
    const Value* key = args.get(0, "key");
    if (key == nullptr) throw JinjaError("dict.get expected at least 1 argument");
    const Value* fallback = args.get(1, "default");
    const Value* found = d.find(*key);
    result = found ? *found : fallback ? *fallback : Value::none();
  } else {
    ValueList out;
    for (const auto& [key, value] : d.items) {
      if (name == "items") {
        out.push_back(Value::from_list({key, value}, /*tuple=*/true));
      } else {
        out.push_back(name == "keys" ? key : value);
      }
    }
    result = Value::from_list(std::move(out));
  }
  args.check_all_used("dict." + std::string(name));
  return result;
}

Value call_list_method(const ValueList& list, std::string_view name, CallArgs& args) {
  const Value* item = args.get(0, "value");
  if (item == nullptr) throw JinjaError("list." + std::string(name) + "() takes exactly one argument");
  args.check_all_used("list." + std::string(name));
  if (name == "count") {
    return Value::from_int(std::count_if(list.begin(), list.end(), [&](const Value& v) { return equals(v, *item); }));
  }
  for (size_t i = 0; i < list.size(); ++i) {
    if (equals(list[i], *item)) return Value::from_int(static_cast<int64_t>(i));
  }
  throw JinjaError(repr(*item) + " is not in list");
}

}  // namespace

ValueList iterate(const Value& v) {
  if (v.generator) {
    if (*v.generator == 2) throw JinjaError("unsupported: a generator used again after a partial read (first, in)");
    if (*v.generator == 1) return {};
    *v.generator = 1;
    return *v.list;
  }
  switch (v.kind) {
    case Value::Kind::kUndefined: return {};
    case Value::Kind::kList:
    case Value::Kind::kTuple: return *v.list;
    case Value::Kind::kDict: {
      ValueList keys;
      for (const auto& item : v.dict->items) keys.push_back(item.first);
      return keys;
    }
    case Value::Kind::kString: {
      ValueList chars;
      for (char32_t c : decode_utf8(v.string)) {
        std::string s;
        append_utf8(s, c);
        chars.push_back(Value::from_string(std::move(s)));
      }
      return chars;
    }
    default: throw JinjaError("'" + type_name(v) + "' object is not iterable");
  }
}

size_t length(const Value& v) {
  if (v.generator) throw JinjaError("object of type 'generator' has no len()");
  switch (v.kind) {
    case Value::Kind::kUndefined: return 0;
    case Value::Kind::kString: return code_point_count(v.string);
    case Value::Kind::kList:
    case Value::Kind::kTuple: return v.list->size();
    case Value::Kind::kDict: return v.dict->items.size();
    default: throw JinjaError("object of type '" + type_name(v) + "' has no len()");
  }
}

bool has_method(const Value& obj, std::string_view name) {
  if (obj.generator) return false;
  switch (obj.kind) {
    case Value::Kind::kString: return in_table(kStringMethods, name) || in_table(kUnsupportedStringMethods, name);
    case Value::Kind::kDict:
      return in_table(kDictMethods, name) || in_table(kMutatingMethods, name) ||
             in_table(kUnsupportedContainerMethods, name);
    case Value::Kind::kList:
      return in_table(kListMethods, name) || in_table(kMutatingMethods, name) || name == "copy";
    case Value::Kind::kTuple: return in_table(kListMethods, name);
    default: return false;
  }
}

Value call_method(const Value& obj, std::string_view name, CallArgs& args) {
  if (in_table(kMutatingMethods, name)) {
    throw JinjaError("unsupported: " + type_name(obj) + "." + std::string(name) +
                     "() modifies a value (the sandbox transformers uses is immutable)");
  }
  if ((obj.is_string() && in_table(kUnsupportedStringMethods, name)) || in_table(kUnsupportedContainerMethods, name)) {
    throw JinjaError("unsupported method " + type_name(obj) + "." + std::string(name) + "()");
  }
  if (obj.is_string()) return call_string_method(obj.string, name, args);
  if (obj.is_mapping()) return call_dict_method(*obj.dict, name, args);
  return call_list_method(*obj.list, name, args);
}

Value get_attr(const Value& obj, const std::string& name) {
  if (obj.generator) return missing_attribute(obj, name);
  switch (obj.kind) {
    case Value::Kind::kUndefined: undefined_error(obj);
    case Value::Kind::kDict:
    case Value::Kind::kString:
    case Value::Kind::kList:
    case Value::Kind::kTuple:
      if (has_method(obj, name)) {
        return Value::from_callable([obj, name](CallArgs& args) { return call_method(obj, name, args); });
      }
      if (obj.is_mapping()) {
        if (const Value* v = obj.dict->find(std::string_view(name))) return *v;
      }
      return missing_attribute(obj, name);
    case Value::Kind::kNamespace:
      if (const Value* v = obj.dict->find(std::string_view(name))) return *v;
      return missing_attribute(obj, name);
    default: return missing_attribute(obj, name);
  }
}

Value get_item(const Value& obj, const Value& key) {
  if (obj.generator) return Value::undefined("'generator object' is not subscriptable");
  switch (obj.kind) {
    case Value::Kind::kUndefined: undefined_error(obj);
    case Value::Kind::kDict:
    case Value::Kind::kNamespace:
      check_hashable(key);
      if (const Value* v = obj.dict->find(key)) return *v;
      if (key.is_string()) return get_attr(obj, key.string);
      return Value::undefined(object_name(obj) + " has no element " + repr(key));
    case Value::Kind::kList:
    case Value::Kind::kTuple:
      if (key.is_integral()) {
        if (auto i = normalize_index(key.as_int(), obj.list->size())) return (*obj.list)[*i];
        return Value::undefined(object_name(obj) + " has no element " + repr(key));
      }
      if (key.is_string()) return get_attr(obj, key.string);
      return Value::undefined(object_name(obj) + " has no element " + repr(key));
    case Value::Kind::kString:
      if (key.is_integral()) {
        const auto cps = decode_utf8(obj.string);
        if (auto i = normalize_index(key.as_int(), cps.size())) {
          std::string s;
          append_utf8(s, cps[*i]);
          return Value::from_string(std::move(s));
        }
        return Value::undefined("'str object' has no element " + repr(key));
      }
      if (key.is_string()) return get_attr(obj, key.string);
      return Value::undefined("'str object' has no element " + repr(key));
    default: return Value::undefined(object_name(obj) + " has no element " + repr(key));
  }
}

Value get_slice(const Value& obj, const Value* start, const Value* stop, const Value* step) {
  if (obj.is_undefined()) undefined_error(obj);
  if (obj.generator) return Value::undefined("'generator object' is not subscriptable");
  if (obj.is_string()) {
    const auto cps = decode_utf8(obj.string);
    std::string out;
    for (size_t i : slice_positions(cps.size(), start, stop, step)) append_utf8(out, cps[i]);
    return Value::from_string(std::move(out));
  }
  if (obj.is_sequence()) {
    ValueList out;
    for (size_t i : slice_positions(obj.list->size(), start, stop, step)) out.push_back((*obj.list)[i]);
    Value sliced = Value::from_list(std::move(out), obj.kind == Value::Kind::kTuple);
    sliced.range_object = obj.range_object;  // a slice of a range is a range
    return sliced;
  }
  return Value::undefined(object_name(obj) + " is not subscriptable with a slice");
}

Value binary_op(std::string_view op, const Value& a, const Value& b) {
  if (op == "~") {
    std::string out = to_str(a) + to_str(b);
    if (out.size() > kMaxBuiltBytes) throw JinjaError("string larger than " + std::to_string(kMaxBuiltBytes) + " bytes");
    return Value::from_string(std::move(out));
  }
  if (a.is_undefined()) undefined_error(a);
  if (b.is_undefined()) undefined_error(b);
  if (a.generator || b.generator || a.range_object || b.range_object) {
    throw JinjaError("unsupported operand type(s) for " + std::string(op) + ": generator or range");
  }
  const bool ints = a.is_integral() && b.is_integral();
  const bool numbers = a.is_number() && b.is_number();
  if (op == "+") {
    if (ints) return Value::from_int(checked(add_overflow, a.as_int(), b.as_int()));
    if (numbers) return Value::from_float(a.as_float() + b.as_float());
    if (a.is_string() && b.is_string()) {
      if (a.string.size() + b.string.size() > kMaxBuiltBytes) throw JinjaError("string too large");
      return Value::from_string(a.string + b.string);
    }
    if (a.is_sequence() && a.kind == b.kind) {
      ValueList out = *a.list;
      out.insert(out.end(), b.list->begin(), b.list->end());
      return Value::from_list(std::move(out), a.kind == Value::Kind::kTuple);
    }
    if (a.is_string() || b.is_string()) {
      throw JinjaError("can only concatenate str (not \"" + type_name(a.is_string() ? b : a) + "\") to str");
    }
    type_error("+", a, b);
  }
  if (op == "-") {
    if (ints) return Value::from_int(checked(sub_overflow, a.as_int(), b.as_int()));
    if (numbers) return Value::from_float(a.as_float() - b.as_float());
    type_error("-", a, b);
  }
  if (op == "*") {
    if (ints) return Value::from_int(checked(mul_overflow, a.as_int(), b.as_int()));
    if (numbers) return Value::from_float(a.as_float() * b.as_float());
    if ((a.is_string() || a.is_sequence()) && b.is_integral()) return repeat(a, b.as_int());
    if ((b.is_string() || b.is_sequence()) && a.is_integral()) return repeat(b, a.as_int());
    type_error("*", a, b);
  }
  if (op == "/") {
    if (!numbers) type_error("/", a, b);
    if (b.as_float() == 0) throw JinjaError("division by zero");
    return Value::from_float(a.as_float() / b.as_float());
  }
  if (op == "//") {
    if (ints) return Value::from_int(floor_div(a.as_int(), b.as_int()));
    if (!numbers) type_error("//", a, b);
    if (b.as_float() == 0) throw JinjaError("float floor division by zero");
    return Value::from_float(std::floor(a.as_float() / b.as_float()));
  }
  if (op == "%") {
    if (a.is_string()) throw JinjaError("unsupported: printf-style string formatting ('...' % value)");
    if (ints) return Value::from_int(py_mod(a.as_int(), b.as_int()));
    if (!numbers) type_error("%", a, b);
    if (b.as_float() == 0) throw JinjaError("float modulo by zero");
    double m = std::fmod(a.as_float(), b.as_float());
    if (m != 0 && ((m < 0) != (b.as_float() < 0))) m += b.as_float();
    return Value::from_float(m);
  }
  if (op == "**") {
    if (ints && b.as_int() >= 0) {  // exponentiation by squaring; int64 overflow is an error
      int64_t result = 1;
      int64_t base = a.as_int();
      for (int64_t e = b.as_int(); e > 0; e >>= 1) {
        if (e & 1) result = checked(mul_overflow, result, base);
        if (e > 1) base = checked(mul_overflow, base, base);
      }
      return Value::from_int(result);
    }
    if (!numbers) type_error("** or pow()", a, b);
    if (a.as_float() == 0 && b.as_float() < 0) throw JinjaError("0.0 cannot be raised to a negative power");
    if (a.as_float() < 0 && std::isfinite(b.as_float()) && b.as_float() != std::floor(b.as_float())) {
      throw JinjaError("unsupported: a negative number to a fractional power (a complex number in Python)");
    }
    return Value::from_float(std::pow(a.as_float(), b.as_float()));
  }
  throw JinjaError("unknown operator " + std::string(op));
}

Value unary_op(std::string_view op, const Value& v) {
  if (op == "not") return Value::from_bool(!truthy(v));
  if (v.is_undefined()) undefined_error(v);
  if (!v.is_number()) throw JinjaError("bad operand type for unary " + std::string(op) + ": '" + type_name(v) + "'");
  if (op == "+") return v.kind == Value::Kind::kBool ? Value::from_int(v.as_int()) : v;
  if (v.kind == Value::Kind::kFloat) return Value::from_float(-v.number);
  return Value::from_int(checked(sub_overflow, 0, v.as_int()));
}

bool contains(const Value& container, const Value& item) {
  if (container.generator) {
    const ValueList items = iterate(container);
    *container.generator = 2;
    return std::any_of(items.begin(), items.end(), [&](const Value& v) { return equals(v, item); });
  }
  switch (container.kind) {
    case Value::Kind::kUndefined: return false;
    case Value::Kind::kString:
      if (!item.is_string()) {
        throw JinjaError("'in <string>' requires string as left operand, not " + type_name(item));
      }
      return container.string.find(item.string) != std::string::npos;
    case Value::Kind::kList:
    case Value::Kind::kTuple:
      return std::any_of(container.list->begin(), container.list->end(),
                         [&](const Value& v) { return equals(v, item); });
    case Value::Kind::kDict:
      check_hashable(item);
      return container.dict->find(item) != nullptr;
    default: throw JinjaError("argument of type '" + type_name(container) + "' is not iterable");
  }
}

void check_hashable(const Value& v) {
  if (v.kind == Value::Kind::kList || v.kind == Value::Kind::kDict) {
    throw JinjaError("unhashable type: '" + type_name(v) + "'");
  }
  if (v.kind == Value::Kind::kTuple) {
    for (const Value& item : *v.list) check_hashable(item);
  }
}

Value global_range(CallArgs& args) {
  const Value* a = args.get(0, "");
  const Value* b = args.get(1, "");
  const Value* c = args.get(2, "");
  args.check_all_used("range");
  if (a == nullptr) throw JinjaError("range expected at least 1 argument, got 0");
  for (const Value* v : {a, b, c}) {
    if (v && !v->is_integral()) throw JinjaError("range(): '" + type_name(*v) + "' object cannot be interpreted as an integer");
  }
  const int64_t start = b ? a->as_int() : 0;
  const int64_t stop = b ? b->as_int() : a->as_int();
  const int64_t step = c ? c->as_int() : 1;
  if (step == 0) throw JinjaError("range() arg 3 must not be zero");
  ValueList out;
  for (int64_t i = start; step > 0 ? i < stop : i > stop;) {
    if (out.size() >= kMaxRange) throw JinjaError("range too big, maximum size for range is " + std::to_string(kMaxRange));
    out.push_back(Value::from_int(i));
    if (__builtin_add_overflow(i, step, &i)) break;
  }
  Value range = Value::from_list(std::move(out));
  range.range_object = true;
  return range;
}

Value global_dict(CallArgs& args) {
  ValueDict d;
  if (!args.positional.empty()) {
    const Value& source = args.positional[0];
    if (args.positional.size() > 1) throw JinjaError("dict expected at most 1 argument");
    if (source.is_mapping()) {
      d = *source.dict;
    } else {
      for (const Value& pair : iterate(source)) {
        if (!pair.is_sequence() || pair.list->size() != 2) throw JinjaError("dict(): sequence elements must be pairs");
        d.set((*pair.list)[0], (*pair.list)[1]);
      }
    }
  }
  for (const auto& [name, value] : args.keyword) d.set(Value::from_string(name), value);
  return Value::from_dict(std::move(d));
}

Value global_namespace(CallArgs& args) {
  Value d = global_dict(args);
  for (const auto& [key, value] : d.dict->items) {
    if (key.is_string() && !key.string.empty() && key.string[0] == '_') {
      throw JinjaError("Chat templates cannot store underscore-prefixed attributes on a namespace, but got '" +
                       key.string + "'");
    }
  }
  return Value::make_namespace(std::move(*d.dict));
}

}  // namespace roundpipe::models::detail
