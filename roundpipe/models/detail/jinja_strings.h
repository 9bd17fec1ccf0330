// Python's str methods on UTF-8 strings for the chat template engine (indices and lengths in code
// points, whitespace as str.isspace, case mapping through utf8proc's simple mappings).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "roundpipe/models/detail/jinja_value.h"

namespace roundpipe::models::detail {

/// str.strip/lstrip/rstrip: `chars` null strips whitespace.
std::string py_strip(std::string_view s, const std::string* chars, bool left, bool right);
/// str.split / str.rsplit: `sep` null splits on whitespace runs; maxsplit < 0 means no limit.
std::vector<std::string> py_split(std::string_view s, const std::string* sep, int64_t maxsplit, bool from_right);
/// str.replace (count < 0: all; an empty `old` inserts between characters as Python does).
std::string py_replace(std::string_view s, std::string_view old_s, std::string_view new_s, int64_t count);
/// str.upper / str.lower.
std::string py_case(std::string_view s, bool upper);
/// str.title (a cased letter after an uncased character starts a word).
std::string py_title(std::string_view s);
/// str.capitalize.
std::string py_capitalize(std::string_view s);
/// str.find / str.rfind with optional start/end (code point indices); -1 when absent.
int64_t py_find(std::string_view s, std::string_view sub, const Value* start, const Value* end, bool from_right);
/// str.count (non-overlapping).
int64_t py_count(std::string_view s, std::string_view sub);
/// str.splitlines() without keepends.
std::vector<std::string> py_splitlines(std::string_view s);
/// Python's int(s) for a str: whitespace around, one sign, '_' between digits. nullopt where
/// Python raises ValueError; JinjaError beyond int64 (Python's ints are unbounded).
std::optional<int64_t> py_parse_int(std::string_view s);
/// Python's float(s) for a str (also inf, infinity, nan in any case); nullopt for ValueError.
/// Locale-independent, as Python.
std::optional<double> py_parse_float(std::string_view s);

/// str.isdigit / isalpha / isalnum / isspace / islower / isupper.
bool py_is(std::string_view s, std::string_view predicate);

}  // namespace roundpipe::models::detail
