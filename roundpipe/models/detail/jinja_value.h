// Values of the chat template engine (roundpipe/models/chat_template.h): the Python objects a
// Jinja2 template sees (None, bool, int, float, str, list, tuple, dict, jinja2's Undefined and
// namespace, callables), with Python's str()/repr(), truthiness, equality and ordering, and
// transformers' `tojson` (json.dumps). Plain C++, no LibTorch.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "roundpipe/models/detail/tokenizer_text.h"

namespace roundpipe::models::detail {

/// A template error without its location; the interpreter adds the template name and line.
struct JinjaError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// A template error at a line of the template (what() without the line).
struct LocatedError : JinjaError {
  LocatedError(int line_number, const std::string& what, bool from_raise_exception = false)
      : JinjaError(what), line(line_number), raised(from_raise_exception) {}
  int line;
  bool raised;  // the template called raise_exception(message)
};

/// Thrown by the template's raise_exception(message); located by the interpreter.
struct RaiseException : JinjaError {
  using JinjaError::JinjaError;
};

struct Value;
struct ValueDict;
struct CallArgs;
using ValueList = std::vector<Value>;
/// A function value: a global (range, namespace, ...), a bound method, a macro, loop.cycle.
using Callable = std::function<Value(CallArgs&)>;

/// One Jinja value. Lists, dicts and namespaces are shared (copying a Value copies a pointer):
/// lists and dicts are never changed after construction (the sandbox is immutable), a namespace is
/// changed only by `{% set ns.attr = ... %}`. Not thread-safe; one render owns its values.
struct Value {
  enum class Kind { kUndefined, kNone, kBool, kInt, kFloat, kString, kList, kTuple, kDict, kNamespace, kCallable };
  Kind kind = Kind::kUndefined;
  bool boolean = false;
  int64_t integer = 0;
  double number = 0;
  std::string string;  // kString; for kUndefined the name it stands for (for error messages)
  std::shared_ptr<const ValueList> list;  // kList, kTuple
  std::shared_ptr<ValueDict> dict;        // kDict, kNamespace
  std::shared_ptr<const Callable> callable;
  // Set on the kList results of jinja2's lazy filters (map, select, selectattr, reverse, ...):
  // Python generators, truthy even when empty, without len(), not printable, consumed by the first
  // iteration (see iterate()). 0: fresh, 1: consumed, 2: partly consumed (first, `in`).
  std::shared_ptr<int> generator;
  // Set on the kList result of range(): Python's range object, re-iterable and with len(), but
  // printed as "range(0, 3)" and not JSON-serializable; printing or dumping it is refused.
  bool range_object = false;

  static Value undefined(std::string hint = {});
  static Value none();
  static Value from_bool(bool b);
  static Value from_int(int64_t i);
  static Value from_float(double d);
  static Value from_string(std::string s);
  static Value from_list(ValueList items, bool tuple = false);
  static Value from_dict(ValueDict d);
  static Value make_namespace(ValueDict attrs);
  static Value from_callable(Callable fn);
  /// A Python generator yielding `items` once.
  static Value make_generator(ValueList items);

  bool is_undefined() const { return kind == Kind::kUndefined; }
  bool is_none() const { return kind == Kind::kNone; }
  bool is_string() const { return kind == Kind::kString; }
  bool is_sequence() const { return kind == Kind::kList || kind == Kind::kTuple; }
  bool is_mapping() const { return kind == Kind::kDict; }
  /// int, float or bool (Python's numbers.Number: bool is an int).
  bool is_number() const { return kind == Kind::kInt || kind == Kind::kFloat || kind == Kind::kBool; }
  bool is_integral() const { return kind == Kind::kInt || kind == Kind::kBool; }
  int64_t as_int() const { return kind == Kind::kBool ? int64_t{boolean} : integer; }
  double as_float() const { return kind == Kind::kFloat ? number : static_cast<double>(as_int()); }
};

/// A dict in insertion order (Python's dict). Keys are compared with Python equality.
struct ValueDict {
  std::vector<std::pair<Value, Value>> items;
  const Value* find(const Value& key) const;
  const Value* find(std::string_view key) const;
  void set(Value key, Value value);
};

/// Arguments of a call: positional, then keyword in the order written.
struct CallArgs {
  std::vector<Value> positional;
  std::vector<std::pair<std::string, Value>> keyword;

  /// Argument `index` (positional) or `name` (keyword); nullptr when not given. Marks it used.
  const Value* get(size_t index, std::string_view name);
  const Value* get_keyword(std::string_view name);
  /// Throws "FUNCTION: unexpected argument" when an argument was given that no get() asked for.
  void check_all_used(std::string_view function) const;

 private:
  size_t positional_used_ = 0;
  std::vector<bool> keyword_used_;
};

/// Python's type name of `v` ("str", "dict", "undefined", ...), for error messages.
std::string type_name(const Value& v);
/// Python's bool(v); Undefined is false.
bool truthy(const Value& v);
/// Python's str(v): strings as they are, Undefined as "", numbers and containers as repr.
/// Throws JinjaError for values Python would print with a memory address (functions).
std::string to_str(const Value& v);
/// Python's repr(v).
std::string repr(const Value& v);
/// Python's repr of a float (shortest round trip: 1.0, 0.1, 1e+20, 1e-05, inf, nan).
std::string float_repr(double d);
/// Python's `a == b` (1 == 1.0 == True; a list never equals a tuple; Undefined equals Undefined).
bool equals(const Value& a, const Value& b);
/// Python's `a < b` for numbers, strings, lists/tuples; throws JinjaError for other types.
bool less(const Value& a, const Value& b);

/// transformers' tojson: json.dumps(v, ensure_ascii, indent, separators, sort_keys). `indent` is
/// the indentation unit, or nullptr for one line; the separators default as json.dumps does.
struct DumpOptions {
  bool ensure_ascii = false;
  const std::string* indent = nullptr;
  std::string item_separator;
  std::string key_separator;
  bool sort_keys = false;
};
std::string to_json(const Value& v, const DumpOptions& options);

/// A JSON document (order kept) as a Value; integers beyond int64 are refused.
Value from_json(const nlohmann::ordered_json& j);

// UTF-8 helpers: Python strings index by code point (decode_utf8 and append_utf8 are the
// tokenizer's, tokenizer_text.h).
/// Number of code points (Python's len(str)).
size_t code_point_count(std::string_view s);
/// Python's str.isspace() for one code point.
bool is_python_space(char32_t c);

}  // namespace roundpipe::models::detail
