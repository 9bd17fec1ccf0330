#include "roundpipe/launcher/detail/yaml_value.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <regex>

namespace roundpipe::launcher::detail {
namespace {

const std::regex& int_pattern() {
  static const std::regex pattern("[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+");
  return pattern;
}

const std::regex& float_pattern() {
  static const std::regex pattern(
      "[-+]?(\\.[0-9]+|[0-9]+(\\.[0-9]*)?)([eE][-+]?[0-9]+)?|[-+]?\\.(inf|Inf|INF)|\\.(nan|NaN|NAN)");
  return pattern;
}

}  // namespace

ResolvedScalar resolve_scalar(const YAML::Node& node) {
  using Kind = ResolvedScalar::Kind;
  ResolvedScalar r;
  if (!node || node.IsNull()) {
    r.kind = Kind::kNull;
    return r;
  }
  r.text = node.Scalar();
  if (node.Tag() == "!") {  // quoted: always a string
    r.kind = Kind::kString;
    return r;
  }
  const std::string& s = r.text;
  if (s == "true" || s == "True" || s == "TRUE" || s == "false" || s == "False" || s == "FALSE") {
    r.kind = Kind::kBool;
    r.boolean = s[0] == 't' || s[0] == 'T';
    return r;
  }
  if (std::regex_match(s, int_pattern())) {
    r.kind = Kind::kInt;
    int base = 10;
    std::string digits = s;
    if (s.rfind("0o", 0) == 0) {
      base = 8;
      digits = s.substr(2);
    } else if (s.rfind("0x", 0) == 0) {
      base = 16;
      digits = s.substr(2);
    }
    errno = 0;
    long long value = std::strtoll(digits.c_str(), nullptr, base);
    r.int_overflow = errno == ERANGE;
    r.integer = value;
    r.real = static_cast<double>(value);
    return r;
  }
  if (std::regex_match(s, float_pattern())) {
    r.kind = Kind::kFloat;
    std::string lower = s;
    std::transform(lower.begin(), lower.end(), lower.begin(), ::tolower);
    if (lower.find(".nan") != std::string::npos) {
      r.real = std::numeric_limits<double>::quiet_NaN();
    } else if (lower.find(".inf") != std::string::npos) {
      r.real = s[0] == '-' ? -HUGE_VAL : HUGE_VAL;
    } else {
      r.real = std::strtod(s.c_str(), nullptr);
    }
    return r;
  }
  r.kind = Kind::kString;
  return r;
}

std::string show_node(const YAML::Node& node) {
  if (!node || node.IsNull()) {
    return "null";
  }
  if (node.IsScalar()) {
    return node.Tag() == "!" ? "'" + node.Scalar() + "'" : node.Scalar();
  }
  YAML::Emitter out;
  out << YAML::Flow << node;
  return out.c_str();
}

std::string describe_node_kind(const YAML::Node& node) {
  if (!node || node.IsNull()) {
    return "null";
  }
  if (node.IsSequence()) {
    return "a list";
  }
  if (node.IsMap()) {
    return "a map";
  }
  switch (resolve_scalar(node).kind) {
    case ResolvedScalar::Kind::kBool:
      return "a boolean";
    case ResolvedScalar::Kind::kInt:
      return "an integer";
    case ResolvedScalar::Kind::kFloat:
      return "a float";
    default:
      return "a string";
  }
}

nlohmann::json yaml_to_json(const YAML::Node& node) {
  if (!node || node.IsNull()) {
    return nullptr;
  }
  if (node.IsSequence()) {
    nlohmann::json array = nlohmann::json::array();
    for (const YAML::Node& element : node) {
      array.push_back(yaml_to_json(element));
    }
    return array;
  }
  if (node.IsMap()) {
    nlohmann::json object = nlohmann::json::object();
    for (const auto& kv : node) {
      object[kv.first.Scalar()] = yaml_to_json(kv.second);
    }
    return object;
  }
  ResolvedScalar r = resolve_scalar(node);
  switch (r.kind) {
    case ResolvedScalar::Kind::kBool:
      return r.boolean;
    case ResolvedScalar::Kind::kInt:
      if (r.int_overflow) {
        return r.text;
      }
      return r.integer;
    case ResolvedScalar::Kind::kFloat:
      return r.real;
    case ResolvedScalar::Kind::kNull:
      return nullptr;
    default:
      return r.text;
  }
}

namespace {

// A string is written plain only when it reads back as the same string. YAML::Load of the bare
// string is not enough: a control character survives it but not its place in a document
// ("k: 511 \r\n" reads back "511", the "\r\n" being one line break), so any control character
// is escaped in double quotes too.
bool needs_quotes(const std::string& s) {
  if (s.empty()) {
    return true;
  }
  if (std::any_of(s.begin(), s.end(), [](char c) {
        auto u = static_cast<unsigned char>(c);
        return u < 0x20 || u == 0x7f;
      })) {
    return true;
  }
  try {
    YAML::Node reparsed = YAML::Load(s);
    return !reparsed.IsScalar() || resolve_scalar(reparsed).kind != ResolvedScalar::Kind::kString ||
           reparsed.Scalar() != s;
  } catch (const YAML::Exception&) {
    return true;
  }
}

void emit_string(YAML::Emitter& out, const std::string& s) {
  if (needs_quotes(s)) {
    out << YAML::DoubleQuoted << s;
  } else {
    out << s;
  }
}

}  // namespace

void emit_json(YAML::Emitter& out, const nlohmann::json& value) {
  if (value.is_null()) {
    out << YAML::Null;
  } else if (value.is_boolean()) {
    out << (value.get<bool>() ? "true" : "false");
  } else if (value.is_number_integer()) {
    out << (value.is_number_unsigned() ? std::to_string(value.get<uint64_t>()) : std::to_string(value.get<int64_t>()));
  } else if (value.is_number_float()) {
    out << format_double(value.get<double>());
  } else if (value.is_string()) {
    emit_string(out, value.get_ref<const std::string&>());
  } else if (value.is_array()) {
    out << YAML::Flow << YAML::BeginSeq;
    for (const auto& element : value) {
      emit_json(out, element);
    }
    out << YAML::EndSeq;
  } else if (value.is_object()) {
    out << YAML::BeginMap;
    for (const auto& [key, element] : value.items()) {
      out << YAML::Key;
      emit_string(out, key);
      out << YAML::Value;
      emit_json(out, element);
    }
    out << YAML::EndMap;
  }
}

std::string format_double(double value) {
  if (std::isnan(value)) {
    return ".nan";
  }
  if (std::isinf(value)) {
    return value > 0 ? ".inf" : "-.inf";
  }
  char buffer[64];
  for (int precision = 1; precision <= 17; ++precision) {
    std::snprintf(buffer, sizeof(buffer), "%.*g", precision, value);
    if (std::strtod(buffer, nullptr) == value) {
      break;
    }
  }
  std::string text = buffer;
  if (text.find_first_of("eE") != std::string::npos && value == std::floor(value) && std::fabs(value) < 1e15) {
    // The shortest round trip of a whole number may be "6e+02": write 600.0 as people do.
    std::snprintf(buffer, sizeof(buffer), "%.0f", value);
    text = buffer;
  }
  if (text.find_first_of(".eE") == std::string::npos) {
    text += ".0";
  }
  return text;
}

int64_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<int64_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) {
    row[j] = static_cast<int64_t>(j);
  }
  for (size_t i = 1; i <= a.size(); ++i) {
    int64_t diagonal = row[0];
    row[0] = static_cast<int64_t>(i);
    for (size_t j = 1; j <= b.size(); ++j) {
      int64_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

std::string closest_match(const std::string& word, const std::vector<std::string>& candidates) {
  std::string best;
  int64_t best_distance = std::numeric_limits<int64_t>::max();
  for (const std::string& candidate : candidates) {
    int64_t d = edit_distance(word, candidate);
    if (d < best_distance) {
      best_distance = d;
      best = candidate;
    }
  }
  // A typo changes a few characters; beyond a third of the word it is a different word.
  const int64_t limit = std::max<int64_t>(1, static_cast<int64_t>(word.size()) / 3);
  if (best_distance <= limit) {
    return best;
  }
  // A shortened name ("warmup" for "warmup_steps").
  if (word.size() >= 3) {
    for (const std::string& candidate : candidates) {
      if (candidate.rfind(word, 0) == 0) {
        return candidate;
      }
    }
  }
  return "";
}

}  // namespace roundpipe::launcher::detail
