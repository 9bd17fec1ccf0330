// YAML helpers of the launcher's config loader: YAML 1.2 core-schema scalar resolution, YAML <->
// JSON conversion for the free model.config map, round-trip float formatting and key suggestions.
#pragma once

#include <yaml-cpp/yaml.h>

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace roundpipe::launcher::detail {

/// What a YAML scalar means under the YAML 1.2 core schema (quoted scalars are always strings).
struct ResolvedScalar {
  enum class Kind { kNull, kBool, kInt, kFloat, kString } kind = Kind::kNull;
  bool boolean = false;
  int64_t integer = 0;
  double real = 0.0;  ///< also set for kInt
  std::string text;   ///< the scalar as written
  bool int_overflow = false;  ///< an integer literal outside int64
};

/// Resolves a null or scalar node (callers check IsSequence / IsMap first).
ResolvedScalar resolve_scalar(const YAML::Node& node);

/// A short rendering of a node for messages: the scalar, or the node in flow style.
std::string show_node(const YAML::Node& node);

/// "a float", "a list", "a map", "a string", "null", ...: what a node is, for "expected X, got Y".
std::string describe_node_kind(const YAML::Node& node);

/// YAML -> JSON (scalars resolved as above; map keys become strings).
nlohmann::json yaml_to_json(const YAML::Node& node);

/// Emits a JSON value into `out` so that loading the YAML gives the same JSON back (strings that
/// would resolve as another type are quoted).
void emit_json(YAML::Emitter& out, const nlohmann::json& value);

/// The shortest decimal text that parses back to exactly `value`, always float-looking ("16.0",
/// "0.0003", "1e-08", ".inf", ".nan").
std::string format_double(double value);

/// Levenshtein distance.
int64_t edit_distance(const std::string& a, const std::string& b);

/// The candidate closest to `word` when it is a likely typo (edit distance <= max(1, len / 3)) or
/// a prefix of it (len >= 3), else "".
std::string closest_match(const std::string& word, const std::vector<std::string>& candidates);

}  // namespace roundpipe::launcher::detail
