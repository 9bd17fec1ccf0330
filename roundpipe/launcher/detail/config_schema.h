// The schema of LauncherConfig: one table of keys (path, type, default, check, doc, binding to the
// struct field) and one list of cross-key rules. Loading, defaults, to_yaml and the generated
// reference (docs/config-reference.md) all read these two tables and nothing else.
#pragma once

#include <functional>
#include <limits>
#include <string>
#include <variant>
#include <vector>

#include "roundpipe/launcher/config.h"

namespace roundpipe::launcher::detail {

enum class KeyKind {
  kSection,     ///< a map of further keys (nullable: null/absent disables the whole section)
  kBool,
  kInt,
  kFloat,
  kString,
  kChoice,      ///< a string from `choices`
  kFloatPair,   ///< [a, b], each within `bounds`
  kStringList,  ///< [s, ...], length within `bounds`
  kDevices,     ///< auto | N | [device, ...]
  kFreeMap,     ///< any map, kept as JSON text
};

/// A numeric range (or list length range); the default is unbounded.
struct Bounds {
  double lo = -std::numeric_limits<double>::infinity();
  bool lo_open = false;
  double hi = std::numeric_limits<double>::infinity();
  bool hi_open = false;

  bool contains(double v) const;
  /// "> 0", ">= 1", "in [0, 1)", "" when unbounded.
  std::string describe() const;
};

/// The typed value of one key between YAML and the struct: null (unset / auto / disabled section),
/// bool (also: section present), int64, double, string (strings, choices, free map as JSON),
/// doubles (pair), strings (lists, devices).
using Value = std::variant<std::monostate, bool, int64_t, double, std::string, std::vector<double>,
                           std::vector<std::string>>;

struct KeySpec {
  std::string path;          ///< dotted, e.g. "optimizer.lr"
  KeyKind kind;
  std::string default_yaml;  ///< the default as YAML text ("null" = unset)
  std::string doc;
  bool nullable = false;
  Bounds bounds;
  std::vector<std::string> choices;
  /// Stores a type- and range-checked value (throws ConfigError for value-specific problems, e.g.
  /// a malformed device name, with `path` in the message). Empty for top-level sections.
  std::function<void(LauncherConfig&, const Value&)> set;
  std::function<Value(const LauncherConfig&)> get;

  /// "float", "int", "adamw | adam | sgd", "list of 2 floats", ... (for docs and messages).
  std::string type_name() const;
  /// The check in words ("> 0", "file must exist", ...), "" when none beyond the type.
  std::string check_text() const;
};

/// A cross-key rule: `check` throws ConfigError (naming the key paths and values) when violated.
struct Rule {
  std::string doc;  ///< the rule in words (for the reference)
  std::function<void(const LauncherConfig&)> check;
};

/// The key table, parents before children, in the order to_yaml prints them.
const std::vector<KeySpec>& config_schema();
/// The spec of `path`, or nullptr.
const KeySpec* find_key(const std::string& path);
/// The cross-key rules, applied after every key parsed.
const std::vector<Rule>& config_rules();

/// Throws ConfigError "<path> = <value>: <problem>".
[[noreturn]] void config_fail(const std::string& path, const std::string& value,
                              const std::string& problem);

}  // namespace roundpipe::launcher::detail
