// jinja2's filters and tests for the chat template engine (one table each, name -> function), with
// transformers' tojson. Lazy filters (map, select, ...) return generators as jinja2 does.
#include <algorithm>
#include <charconv>
#include <cmath>
#include <limits>
#include <map>

#include "roundpipe/models/detail/jinja_builtins.h"
#include "roundpipe/models/detail/jinja_strings.h"

namespace roundpipe::models::detail {
namespace {

using FilterFn = Value (*)(const Value&, CallArgs&);
using TestFn = bool (*)(const Value&, CallArgs&);

const Value* arg(CallArgs& args, size_t index, std::string_view name) { return args.get(index, name); }

bool bool_arg(CallArgs& args, size_t index, std::string_view name, bool fallback) {
  const Value* v = args.get(index, name);
  return v ? truthy(*v) : fallback;
}

std::string str_arg(CallArgs& args, size_t index, std::string_view name, std::string_view filter) {
  const Value* v = args.get(index, name);
  if (v == nullptr) throw JinjaError(std::string(filter) + ": missing argument '" + std::string(name) + "'");
  return to_str(*v);
}

Value done(CallArgs& args, std::string_view filter, Value result) {
  args.check_all_used(filter);
  return result;
}

// jinja2's make_attrgetter: "a.b.0" looks up a, then b, then item 0 (items before attributes).
Value attribute_path(const Value& item, const Value& attribute) {
  if (attribute.is_integral()) return get_item(item, attribute);
  Value current = item;
  const std::string path = to_str(attribute);
  size_t begin = 0;
  while (true) {
    const size_t dot = path.find('.', begin);
    const std::string part = path.substr(begin, dot == std::string::npos ? std::string::npos : dot - begin);
    const bool digits = !part.empty() && std::all_of(part.begin(), part.end(), [](char c) { return c >= '0' && c <= '9'; });
    if (digits) {
      int64_t index = 0;
      const auto result = std::from_chars(part.data(), part.data() + part.size(), index);
      // An index beyond int64 is beyond any list too.
      current = get_item(current, Value::from_int(result.ec == std::errc() ? index : std::numeric_limits<int64_t>::max()));
    } else {
      current = get_item(current, Value::from_string(part));
    }
    if (dot == std::string::npos) return current;
    begin = dot + 1;
  }
}

// Sort/compare key: lower-cased strings unless case_sensitive (jinja2's ignore_case).
Value sort_key(const Value& v, bool case_sensitive, const Value* attribute) {
  Value key = attribute ? attribute_path(v, *attribute) : v;
  if (!case_sensitive && key.is_string()) key = Value::from_string(py_case(key.string, false));
  return key;
}

Value filter_trim(const Value& v, CallArgs& args) {
  const Value* chars = arg(args, 0, "chars");
  std::string set = chars && !chars->is_none() ? to_str(*chars) : std::string();
  return done(args, "trim", Value::from_string(py_strip(to_str(v), chars && !chars->is_none() ? &set : nullptr, true, true)));
}

Value filter_length(const Value& v, CallArgs& args) {
  return done(args, "length", Value::from_int(static_cast<int64_t>(length(v))));
}

Value filter_tojson(const Value& v, CallArgs& args) {
  DumpOptions o;
  o.ensure_ascii = bool_arg(args, 0, "ensure_ascii", false);
  const Value* indent = arg(args, 1, "indent");
  std::string unit;
  if (indent && !indent->is_none()) {
    if (indent->is_integral()) {
      unit = std::string(static_cast<size_t>(std::clamp<int64_t>(indent->as_int(), 0, 1000)), ' ');
    } else if (indent->is_string()) {
      unit = indent->string;
    } else {
      throw JinjaError("tojson: indent must be an int or a str, not " + type_name(*indent));
    }
    o.indent = &unit;
  }
  const Value* separators = arg(args, 2, "separators");
  o.item_separator = o.indent ? "," : ", ";
  o.key_separator = ": ";
  if (separators && !separators->is_none()) {
    if (!separators->is_sequence() || separators->list->size() != 2 || !(*separators->list)[0].is_string() ||
        !(*separators->list)[1].is_string()) {
      throw JinjaError("tojson: separators must be a pair of strings");
    }
    o.item_separator = (*separators->list)[0].string;
    o.key_separator = (*separators->list)[1].string;
  }
  o.sort_keys = bool_arg(args, 3, "sort_keys", false);
  return done(args, "tojson", Value::from_string(to_json(v, o)));
}

Value filter_string(const Value& v, CallArgs& args) { return done(args, "string", Value::from_string(to_str(v))); }
Value filter_safe(const Value& v, CallArgs& args) { return done(args, "safe", v.is_string() ? v : Value::from_string(to_str(v))); }
Value filter_lower(const Value& v, CallArgs& args) { return done(args, "lower", Value::from_string(py_case(to_str(v), false))); }
Value filter_upper(const Value& v, CallArgs& args) { return done(args, "upper", Value::from_string(py_case(to_str(v), true))); }
Value filter_capitalize(const Value& v, CallArgs& args) {
  return done(args, "capitalize", Value::from_string(py_capitalize(to_str(v))));
}

// jinja2's do_title: words start after '-', whitespace or an opening bracket.
Value filter_title(const Value& v, CallArgs& args) {
  const auto cps = decode_utf8(to_str(v));
  std::string out;
  bool word_start = true;
  for (char32_t c : cps) {
    const bool separator = c == U'-' || c == U'(' || c == U'{' || c == U'[' || c == U'<' || is_python_space(c);
    if (separator) {
      append_utf8(out, c);
      word_start = true;
    } else {
      std::string one;
      append_utf8(one, c);
      out += word_start ? py_case(one, true) : py_case(one, false);
      word_start = false;
    }
  }
  return done(args, "title", Value::from_string(std::move(out)));
}

Value filter_replace(const Value& v, CallArgs& args) {
  const std::string old_s = str_arg(args, 0, "old", "replace");
  const std::string new_s = str_arg(args, 1, "new", "replace");
  const Value* count = arg(args, 2, "count");
  const int64_t n = count && !count->is_none() ? count->as_int() : -1;
  return done(args, "replace", Value::from_string(py_replace(to_str(v), old_s, new_s, n)));
}

Value filter_join(const Value& v, CallArgs& args) {
  const Value* sep = arg(args, 0, "d");
  const Value* attribute = arg(args, 1, "attribute");
  const std::string d = sep ? to_str(*sep) : std::string();
  std::string out;
  bool first = true;
  for (const Value& item : iterate(v)) {
    if (!first) out += d;
    out += to_str(attribute ? attribute_path(item, *attribute) : item);
    if (out.size() > kMaxBuiltBytes) throw JinjaError("join: result too large");
    first = false;
  }
  return done(args, "join", Value::from_string(std::move(out)));
}

Value filter_default(const Value& v, CallArgs& args) {
  const Value* fallback = arg(args, 0, "default_value");
  const bool boolean = bool_arg(args, 1, "boolean", false);
  const bool use_default = v.is_undefined() || (boolean && !truthy(v));
  return done(args, "default", use_default ? (fallback ? *fallback : Value::from_string("")) : v);
}

Value filter_first(const Value& v, CallArgs& args) {
  args.check_all_used("first");
  ValueList items = iterate(v);
  if (v.generator && items.size() > 1) *v.generator = 2;
  return items.empty() ? Value::undefined("No first item, sequence was empty.") : items.front();
}

Value filter_last(const Value& v, CallArgs& args) {
  args.check_all_used("last");
  if (v.generator) throw JinjaError("'generator' object is not reversible");
  ValueList items = iterate(v);
  return items.empty() ? Value::undefined("No last item, sequence was empty.") : items.back();
}

Value filter_list(const Value& v, CallArgs& args) { return done(args, "list", Value::from_list(iterate(v))); }

Value filter_items(const Value& v, CallArgs& args) {
  args.check_all_used("items");
  if (v.is_undefined()) return Value::make_generator({});
  if (!v.is_mapping()) throw JinjaError("items: can only get item pairs from a mapping, not " + type_name(v));
  ValueList out;
  for (const auto& [key, value] : v.dict->items) out.push_back(Value::from_list({key, value}, /*tuple=*/true));
  return Value::make_generator(std::move(out));
}

// select/reject(test, args...) and selectattr/rejectattr(attribute, test, args...).
Value select_common(const Value& v, CallArgs& args, bool by_attribute, bool keep, std::string_view filter) {
  size_t next = 0;
  const Value* attribute = nullptr;
  if (by_attribute) {
    if (args.positional.empty()) throw JinjaError(std::string(filter) + ": missing attribute argument");
    attribute = &args.positional[next++];
  }
  std::string test;
  CallArgs test_args;
  if (next < args.positional.size()) {
    test = to_str(args.positional[next++]);
    test_args.positional.assign(args.positional.begin() + static_cast<std::ptrdiff_t>(next), args.positional.end());
  }
  test_args.keyword = args.keyword;
  ValueList out;
  if (!truthy(v)) return Value::make_generator({});  // jinja2: `if value:` before iterating
  for (const Value& item : iterate(v)) {
    const Value subject = attribute ? attribute_path(item, *attribute) : item;
    CallArgs per_item = test_args;
    const bool passed = test.empty() ? truthy(subject) : apply_test(test, subject, per_item);
    if (passed == keep) out.push_back(item);
  }
  return Value::make_generator(std::move(out));
}

Value filter_select(const Value& v, CallArgs& args) { return select_common(v, args, false, true, "select"); }
Value filter_reject(const Value& v, CallArgs& args) { return select_common(v, args, false, false, "reject"); }
Value filter_selectattr(const Value& v, CallArgs& args) { return select_common(v, args, true, true, "selectattr"); }
Value filter_rejectattr(const Value& v, CallArgs& args) { return select_common(v, args, true, false, "rejectattr"); }

Value filter_map(const Value& v, CallArgs& args) {
  ValueList out;
  const bool empty = !truthy(v);  // jinja2: `if value:` before iterating
  const Value none_list = Value::from_list({});
  const Value& items = empty ? none_list : v;
  if (const Value* attribute = args.get_keyword("attribute")) {
    const Value* fallback = args.get_keyword("default");
    args.check_all_used("map");
    for (const Value& item : iterate(items)) {
      Value x = attribute_path(item, *attribute);
      out.push_back(x.is_undefined() && fallback ? *fallback : x);
    }
    return Value::make_generator(std::move(out));
  }
  if (args.positional.empty()) throw JinjaError("map: a filter name or attribute= is required");
  const std::string filter = to_str(args.positional[0]);
  CallArgs rest;
  rest.positional.assign(args.positional.begin() + 1, args.positional.end());
  rest.keyword = args.keyword;
  for (const Value& item : iterate(items)) {
    CallArgs per_item = rest;
    out.push_back(apply_filter(filter, item, per_item));
  }
  return Value::make_generator(std::move(out));
}

Value filter_int(const Value& v, CallArgs& args) {
  const Value* fallback = arg(args, 0, "default");
  const Value* base = arg(args, 1, "base");
  args.check_all_used("int");
  if (base && !(base->is_integral() && base->as_int() == 10)) throw JinjaError("int: only base 10 is supported");
  if (v.is_undefined()) throw JinjaError(v.string.empty() ? "undefined value" : v.string);  // int(Undefined) raises
  const Value def = fallback ? *fallback : Value::from_int(0);
  // jinja2's do_int: int(value), else int(float(value)), else the default. int() of an infinite
  // float raises OverflowError, not caught in the first try (a float value) but caught in the
  // second (a string); NaN gives the default.
  const auto to_int = [&](double d, bool overflow_is_default) {
    if (std::isnan(d) || (!std::isfinite(d) && overflow_is_default)) return def;
    if (!std::isfinite(d)) throw JinjaError("cannot convert float infinity to integer");
    if (std::fabs(d) >= 9.2e18) throw JinjaError("integer beyond the supported range (int64)");
    return Value::from_int(static_cast<int64_t>(d));
  };
  if (v.is_integral()) return Value::from_int(v.as_int());
  if (v.kind == Value::Kind::kFloat) return to_int(v.number, false);
  if (v.is_string()) {
    if (const auto i = py_parse_int(v.string)) return Value::from_int(*i);
    if (const auto d = py_parse_float(v.string)) return to_int(*d, true);
  }
  return def;
}

Value filter_float(const Value& v, CallArgs& args) {
  const Value* fallback = arg(args, 0, "default");
  args.check_all_used("float");
  if (v.is_undefined()) throw JinjaError(v.string.empty() ? "undefined value" : v.string);  // float(Undefined) raises
  const Value def = fallback ? *fallback : Value::from_float(0.0);
  if (v.is_number()) return Value::from_float(v.as_float());
  if (v.is_string()) {
    if (const auto d = py_parse_float(v.string)) return Value::from_float(*d);
  }
  return def;
}

Value filter_abs(const Value& v, CallArgs& args) {
  args.check_all_used("abs");
  if (!v.is_number()) throw JinjaError("bad operand type for abs(): '" + type_name(v) + "'");
  if (v.kind == Value::Kind::kFloat) return Value::from_float(std::fabs(v.number));
  return v.as_int() < 0 ? unary_op("-", v) : Value::from_int(v.as_int());
}

Value filter_round(const Value& v, CallArgs& args) {
  const Value* precision_v = arg(args, 0, "precision");
  const Value* method_v = arg(args, 1, "method");
  args.check_all_used("round");
  if (!v.is_number()) throw JinjaError("round: a number is required, not " + type_name(v));
  const int64_t precision = precision_v ? precision_v->as_int() : 0;
  const std::string method = method_v ? to_str(*method_v) : "common";
  if (method == "common" && v.is_integral()) return Value::from_int(v.as_int());
  const double scale = std::pow(10.0, static_cast<double>(precision));
  const double x = v.as_float() * scale;
  double r = 0;
  if (method == "common") {
    r = std::nearbyint(x);  // banker's rounding, as Python's round()
  } else if (method == "ceil") {
    r = std::ceil(x);
  } else if (method == "floor") {
    r = std::floor(x);
  } else {
    throw JinjaError("round: method must be common, ceil or floor");
  }
  return Value::from_float(r / scale);
}

Value filter_unique(const Value& v, CallArgs& args) {
  const bool case_sensitive = bool_arg(args, 0, "case_sensitive", false);
  const Value* attribute = arg(args, 1, "attribute");
  args.check_all_used("unique");
  ValueList out;
  ValueList seen;
  for (const Value& item : iterate(v)) {
    const Value key = sort_key(item, case_sensitive, attribute);
    check_hashable(key);  // jinja2 keeps the seen keys in a set
    if (std::none_of(seen.begin(), seen.end(), [&](const Value& s) { return equals(s, key); })) {
      seen.push_back(key);
      out.push_back(item);
    }
  }
  return Value::make_generator(std::move(out));
}

Value filter_sort(const Value& v, CallArgs& args) {
  const bool reverse = bool_arg(args, 0, "reverse", false);
  const bool case_sensitive = bool_arg(args, 1, "case_sensitive", false);
  const Value* attribute = arg(args, 2, "attribute");
  args.check_all_used("sort");
  ValueList items = iterate(v);
  std::stable_sort(items.begin(), items.end(), [&](const Value& a, const Value& b) {
    const Value ka = sort_key(a, case_sensitive, attribute);
    const Value kb = sort_key(b, case_sensitive, attribute);
    return reverse ? less(kb, ka) : less(ka, kb);
  });
  return Value::from_list(std::move(items));
}

Value filter_dictsort(const Value& v, CallArgs& args) {
  const bool case_sensitive = bool_arg(args, 0, "case_sensitive", false);
  const Value* by = arg(args, 1, "by");
  const bool reverse = bool_arg(args, 2, "reverse", false);
  args.check_all_used("dictsort");
  if (!v.is_mapping()) throw JinjaError("dictsort: a dict is required, not " + type_name(v));
  const size_t pos = by && to_str(*by) == "value" ? 1 : 0;
  if (by && to_str(*by) != "key" && to_str(*by) != "value") throw JinjaError("dictsort: by must be key or value");
  ValueList items;
  for (const auto& [key, value] : v.dict->items) items.push_back(Value::from_list({key, value}, true));
  std::stable_sort(items.begin(), items.end(), [&](const Value& a, const Value& b) {
    const Value ka = sort_key((*a.list)[pos], case_sensitive, nullptr);
    const Value kb = sort_key((*b.list)[pos], case_sensitive, nullptr);
    return reverse ? less(kb, ka) : less(ka, kb);
  });
  return Value::from_list(std::move(items));
}

Value filter_reverse(const Value& v, CallArgs& args) {
  args.check_all_used("reverse");
  if (v.is_string()) {
    const Value step = Value::from_int(-1);
    return get_slice(v, nullptr, nullptr, &step);
  }
  if (v.generator) throw JinjaError("'generator' object is not reversible");
  ValueList items = iterate(v);
  std::reverse(items.begin(), items.end());
  return Value::make_generator(std::move(items));
}

Value min_max(const Value& v, CallArgs& args, bool want_max, std::string_view filter) {
  const bool case_sensitive = bool_arg(args, 0, "case_sensitive", false);
  const Value* attribute = arg(args, 1, "attribute");
  args.check_all_used(filter);
  const ValueList items = iterate(v);
  if (items.empty()) return Value::undefined("No aggregated item, sequence was empty.");
  size_t best = 0;
  for (size_t i = 1; i < items.size(); ++i) {
    const Value a = sort_key(items[i], case_sensitive, attribute);
    const Value b = sort_key(items[best], case_sensitive, attribute);
    if (want_max ? less(b, a) : less(a, b)) best = i;
  }
  return items[best];
}

Value filter_min(const Value& v, CallArgs& args) { return min_max(v, args, false, "min"); }
Value filter_max(const Value& v, CallArgs& args) { return min_max(v, args, true, "max"); }

Value filter_sum(const Value& v, CallArgs& args) {
  const Value* attribute = arg(args, 0, "attribute");
  const Value* start = arg(args, 1, "start");
  args.check_all_used("sum");
  Value total = start ? *start : Value::from_int(0);
  for (const Value& item : iterate(v)) total = binary_op("+", total, attribute ? attribute_path(item, *attribute) : item);
  return total;
}

// jinja2 3.1's do_indent.
Value filter_indent(const Value& v, CallArgs& args) {
  const Value* width = arg(args, 0, "width");
  const bool first = bool_arg(args, 1, "first", false);
  const bool blank = bool_arg(args, 2, "blank", false);
  args.check_all_used("indent");
  const std::string indention = width == nullptr ? "    "
                                : width->is_string() ? width->string
                                                     : std::string(static_cast<size_t>(std::clamp<int64_t>(width->as_int(), 0, 1000)), ' ');
  // jinja2 appends "\n" to the value first: anything but a string fails there.
  if (!v.is_string()) throw JinjaError("indent: a str is required, not " + type_name(v));
  const std::vector<std::string> lines = py_splitlines(v.string + "\n");
  std::string rv;
  if (blank) {
    for (size_t i = 0; i < lines.size(); ++i) rv += (i ? "\n" + indention : std::string()) + lines[i];
  } else {
    rv = lines.empty() ? std::string() : lines[0];
    for (size_t i = 1; i < lines.size(); ++i) rv += "\n" + (lines[i].empty() ? lines[i] : indention + lines[i]);
  }
  if (first) rv = indention + rv;
  return Value::from_string(std::move(rv));
}

Value filter_escape(const Value& v, CallArgs& args) {
  args.check_all_used("escape");
  std::string out;
  for (char c : to_str(v)) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&#34;"; break;
      case '\'': out += "&#39;"; break;
      default: out += c;
    }
  }
  return Value::from_string(std::move(out));
}

// jinja2: len(re.findall(r"\w+", str(value))); \w is a letter, digit or underscore (Unicode).
Value filter_wordcount(const Value& v, CallArgs& args) {
  args.check_all_used("wordcount");
  int64_t words = 0;
  bool in_word = false;
  for (char32_t c : decode_utf8(to_str(v))) {
    std::string one;
    append_utf8(one, c);
    const bool word_char = c == U'_' || py_is(one, "isalnum");
    words += word_char && !in_word;
    in_word = word_char;
  }
  return Value::from_int(words);
}

// jinja2's do_batch: lists of `linecount` items, the last padded with fill_with when given.
Value filter_batch(const Value& v, CallArgs& args) {
  const Value* count = arg(args, 0, "linecount");
  const Value* fill = arg(args, 1, "fill_with");
  args.check_all_used("batch");
  if (count == nullptr || !count->is_integral()) throw JinjaError("batch: linecount must be an integer");
  const int64_t n = count->as_int();
  ValueList out;
  ValueList current;
  for (const Value& item : iterate(v)) {
    if (static_cast<int64_t>(current.size()) == n) {
      out.push_back(Value::from_list(std::move(current)));
      current.clear();
    }
    current.push_back(item);
  }
  if (!current.empty()) {
    if (fill && !fill->is_none()) {
      while (static_cast<int64_t>(current.size()) < n) current.push_back(*fill);
    }
    out.push_back(Value::from_list(std::move(current)));
  }
  return Value::make_generator(std::move(out));
}

const std::map<std::string, FilterFn, std::less<>>& filters() {
  static const std::map<std::string, FilterFn, std::less<>> kTable = {
      {"abs", filter_abs},         {"batch", filter_batch},           {"capitalize", filter_capitalize}, {"count", filter_length},
      {"d", filter_default},       {"default", filter_default},       {"dictsort", filter_dictsort},
      {"e", filter_escape},        {"escape", filter_escape},         {"first", filter_first},
      {"float", filter_float},     {"indent", filter_indent},         {"int", filter_int},
      {"items", filter_items},     {"join", filter_join},             {"last", filter_last},
      {"length", filter_length},   {"list", filter_list},             {"lower", filter_lower},
      {"map", filter_map},         {"max", filter_max},               {"min", filter_min},
      {"reject", filter_reject},   {"rejectattr", filter_rejectattr}, {"replace", filter_replace},
      {"reverse", filter_reverse}, {"round", filter_round},           {"safe", filter_safe},
      {"select", filter_select},   {"selectattr", filter_selectattr}, {"sort", filter_sort},
      {"string", filter_string},   {"sum", filter_sum},               {"title", filter_title},
      {"tojson", filter_tojson},   {"trim", filter_trim},             {"unique", filter_unique},
      {"upper", filter_upper},     {"wordcount", filter_wordcount},
  };
  return kTable;
}

const Value& test_arg(CallArgs& args, std::string_view test) {
  const Value* v = args.get(0, "other");
  if (v == nullptr) throw JinjaError("test '" + std::string(test) + "' takes one argument");
  args.check_all_used(test);
  return *v;
}

bool no_args(CallArgs& args, std::string_view test) {
  args.check_all_used(test);
  return true;
}

const std::map<std::string, TestFn, std::less<>>& tests() {
  static const std::map<std::string, TestFn, std::less<>> kTable = {
      {"defined", [](const Value& v, CallArgs& a) { return no_args(a, "defined") && !v.is_undefined(); }},
      {"undefined", [](const Value& v, CallArgs& a) { return no_args(a, "undefined") && v.is_undefined(); }},
      {"none", [](const Value& v, CallArgs& a) { return no_args(a, "none") && v.is_none(); }},
      {"boolean", [](const Value& v, CallArgs& a) { return no_args(a, "boolean") && v.kind == Value::Kind::kBool; }},
      {"true", [](const Value& v, CallArgs& a) { return no_args(a, "true") && v.kind == Value::Kind::kBool && v.boolean; }},
      {"false", [](const Value& v, CallArgs& a) { return no_args(a, "false") && v.kind == Value::Kind::kBool && !v.boolean; }},
      {"integer", [](const Value& v, CallArgs& a) { return no_args(a, "integer") && v.kind == Value::Kind::kInt; }},
      {"float", [](const Value& v, CallArgs& a) { return no_args(a, "float") && v.kind == Value::Kind::kFloat; }},
      {"number", [](const Value& v, CallArgs& a) { return no_args(a, "number") && v.is_number(); }},
      {"string", [](const Value& v, CallArgs& a) { return no_args(a, "string") && v.is_string(); }},
      {"mapping", [](const Value& v, CallArgs& a) { return no_args(a, "mapping") && v.is_mapping(); }},
      {"callable", [](const Value& v, CallArgs& a) { return no_args(a, "callable") && v.kind == Value::Kind::kCallable; }},
      {"iterable",
       [](const Value& v, CallArgs& a) {
         return no_args(a, "iterable") && (v.is_string() || v.is_sequence() || v.is_mapping() || v.is_undefined());
       }},
      {"sequence",
       [](const Value& v, CallArgs& a) {
         return no_args(a, "sequence") && !v.generator && (v.is_string() || v.is_sequence() || v.is_mapping() || v.is_undefined());
       }},
      {"sameas",
       [](const Value& v, CallArgs& a) {
         const Value& o = test_arg(a, "sameas");
         if (v.kind != o.kind) return false;
         switch (v.kind) {
           case Value::Kind::kNone:
           case Value::Kind::kUndefined: return true;
           case Value::Kind::kBool: return v.boolean == o.boolean;
           case Value::Kind::kList:
           case Value::Kind::kTuple: return v.list == o.list;
           case Value::Kind::kDict:
           case Value::Kind::kNamespace: return v.dict == o.dict;
           default: throw JinjaError("unsupported: 'sameas' on " + type_name(v) + " (identity of a Python object)");
         }
       }},
      {"in", [](const Value& v, CallArgs& a) { return contains(test_arg(a, "in"), v); }},
      {"eq", [](const Value& v, CallArgs& a) { return equals(v, test_arg(a, "eq")); }},
      {"equalto", [](const Value& v, CallArgs& a) { return equals(v, test_arg(a, "equalto")); }},
      {"==", [](const Value& v, CallArgs& a) { return equals(v, test_arg(a, "==")); }},
      {"ne", [](const Value& v, CallArgs& a) { return !equals(v, test_arg(a, "ne")); }},
      {"!=", [](const Value& v, CallArgs& a) { return !equals(v, test_arg(a, "!=")); }},
      {"lt", [](const Value& v, CallArgs& a) { return less(v, test_arg(a, "lt")); }},
      {"lessthan", [](const Value& v, CallArgs& a) { return less(v, test_arg(a, "lessthan")); }},
      {"<", [](const Value& v, CallArgs& a) { return less(v, test_arg(a, "<")); }},
      {"gt", [](const Value& v, CallArgs& a) { return less(test_arg(a, "gt"), v); }},
      {"greaterthan", [](const Value& v, CallArgs& a) { return less(test_arg(a, "greaterthan"), v); }},
      {">", [](const Value& v, CallArgs& a) { return less(test_arg(a, ">"), v); }},
      {"le", [](const Value& v, CallArgs& a) { return !less(test_arg(a, "le"), v); }},
      {"<=", [](const Value& v, CallArgs& a) { return !less(test_arg(a, "<="), v); }},
      {"ge", [](const Value& v, CallArgs& a) { return !less(v, test_arg(a, "ge")); }},
      {">=", [](const Value& v, CallArgs& a) { return !less(v, test_arg(a, ">=")); }},
      {"odd", [](const Value& v, CallArgs& a) { return no_args(a, "odd") && equals(binary_op("%", v, Value::from_int(2)), Value::from_int(1)); }},
      {"even", [](const Value& v, CallArgs& a) { return no_args(a, "even") && equals(binary_op("%", v, Value::from_int(2)), Value::from_int(0)); }},
      {"divisibleby",
       [](const Value& v, CallArgs& a) { return equals(binary_op("%", v, test_arg(a, "divisibleby")), Value::from_int(0)); }},
      {"lower", [](const Value& v, CallArgs& a) { return no_args(a, "lower") && py_is(to_str(v), "islower"); }},
      {"upper", [](const Value& v, CallArgs& a) { return no_args(a, "upper") && py_is(to_str(v), "isupper"); }},
      {"escaped", [](const Value&, CallArgs& a) { return !no_args(a, "escaped"); }},
      {"filter", [](const Value& v, CallArgs& a) { return no_args(a, "filter") && filters().count(to_str(v)) != 0; }},
      {"test", [](const Value& v, CallArgs& a) { return no_args(a, "test") && tests().count(to_str(v)) != 0; }},
  };
  return kTable;
}

}  // namespace

bool has_filter(std::string_view name) { return filters().count(name) != 0; }
bool has_test(std::string_view name) { return tests().count(name) != 0; }

Value apply_filter(std::string_view name, const Value& value, CallArgs& args) {
  const auto& table = filters();
  const auto it = table.find(name);
  if (it == table.end()) throw JinjaError("unsupported filter '" + std::string(name) + "'");
  return it->second(value, args);
}

bool apply_test(std::string_view name, const Value& value, CallArgs& args) {
  const auto& table = tests();
  const auto it = table.find(name);
  if (it == table.end()) throw JinjaError("unsupported test '" + std::string(name) + "'");
  return it->second(value, args);
}

}  // namespace roundpipe::models::detail
