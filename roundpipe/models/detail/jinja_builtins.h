// Built-ins of the chat template engine (roundpipe/models/chat_template.h): attribute and item
// access with jinja2's sandbox rules, Python's str/dict/list methods, jinja2's filters and tests
// (tojson as transformers overrides it), and the globals range/namespace/dict. Each name outside
// the supported set throws JinjaError naming it; nothing is silently approximated.
#pragma once

#include <string>
#include <string_view>

#include "roundpipe/models/detail/jinja_value.h"

namespace roundpipe::models::detail {

/// Limits that keep a hostile template from exhausting memory: the largest string or list a
/// single operation may build.
inline constexpr size_t kMaxBuiltBytes = size_t{64} << 20;
inline constexpr size_t kMaxRange = 100000;  // jinja2's sandbox MAX_RANGE

/// Python's iteration of `v` (Undefined iterates as empty; dict -> keys; str -> characters).
ValueList iterate(const Value& v);
/// Python's len(v); Undefined has length 0.
size_t length(const Value& v);

/// jinja2's getattr: `obj.name` (methods first, then items); Undefined when missing.
Value get_attr(const Value& obj, const std::string& name);
/// jinja2's getitem: `obj[key]` (items first); Undefined when missing.
Value get_item(const Value& obj, const Value& key);
/// `obj[start:stop:step]` on str, list or tuple; null bounds are omitted ones.
Value get_slice(const Value& obj, const Value* start, const Value* stop, const Value* step);

/// True when `obj.name(...)` is a Python method this engine implements.
bool has_method(const Value& obj, std::string_view name);
Value call_method(const Value& obj, std::string_view name, CallArgs& args);

/// True when a filter / test of that name is implemented (the parser refuses the others, as
/// jinja2 refuses unknown ones when it compiles).
bool has_filter(std::string_view name);
bool has_test(std::string_view name);
/// Throws "unhashable type" for values Python cannot use as a dict key or set member.
void check_hashable(const Value& v);

/// Hooks the filters that call other filters or tests (map, select, ...) use.
Value apply_filter(std::string_view name, const Value& value, CallArgs& args);
bool apply_test(std::string_view name, const Value& value, CallArgs& args);

/// The operators of jinja2 expressions with Python semantics.
Value binary_op(std::string_view op, const Value& left, const Value& right);
Value unary_op(std::string_view op, const Value& operand);
bool contains(const Value& container, const Value& item);

/// Globals: range(...), namespace(...), dict(...).
Value global_range(CallArgs& args);
Value global_namespace(CallArgs& args);
Value global_dict(CallArgs& args);

}  // namespace roundpipe::models::detail
