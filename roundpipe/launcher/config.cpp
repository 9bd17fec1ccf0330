// Loading, overriding, validating and printing LauncherConfig; everything about individual keys
// comes from the schema table (detail/config_schema.cpp).
#include "roundpipe/launcher/config.h"

#include <c10/util/Exception.h>
#include <yaml-cpp/yaml.h>

#include <cmath>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "roundpipe/launcher/atomic_file.h"
#include "roundpipe/launcher/detail/config_error.h"
#include "roundpipe/launcher/detail/config_schema.h"
#include "roundpipe/launcher/detail/yaml_value.h"

namespace roundpipe::launcher {
namespace {

using detail::config_fail;
using detail::KeyKind;
using detail::KeySpec;
using detail::ResolvedScalar;
using detail::Value;

std::string parent_of(const std::string& path) {
  size_t dot = path.rfind('.');
  return dot == std::string::npos ? "" : path.substr(0, dot);
}

std::string last_of(const std::string& path) {
  size_t dot = path.rfind('.');
  return dot == std::string::npos ? path : path.substr(dot + 1);
}

std::vector<std::string> split_path(const std::string& path) {
  std::vector<std::string> parts;
  size_t start = 0;
  while (true) {
    size_t dot = path.find('.', start);
    parts.push_back(path.substr(start, dot - start));
    if (dot == std::string::npos) {
      return parts;
    }
    start = dot + 1;
  }
}

/// The free-map key (model.config) that `path` lies inside, if any.
const KeySpec* enclosing_free_map(const std::string& path) {
  for (std::string p = parent_of(path); !p.empty(); p = parent_of(p)) {
    const KeySpec* spec = detail::find_key(p);
    if (spec != nullptr && spec->kind == KeyKind::kFreeMap) {
      return spec;
    }
  }
  return nullptr;
}

/// Where keys were written, for error prefixes.
struct Context {
  std::string source;
  std::map<std::string, YAML::Mark> marks;       // key path -> its key's position in the file
  std::map<std::string, std::string> overrides;  // key path -> the override text
};

std::string location(const Context& ctx, const std::string& path) {
  for (std::string p = path; !p.empty(); p = parent_of(p)) {
    auto o = ctx.overrides.find(p);
    if (o != ctx.overrides.end()) {
      return "override '" + o->second + "': ";
    }
  }
  for (std::string p = path; !p.empty(); p = parent_of(p)) {
    // "run.devices[1]" is located at "run.devices".
    std::string key = p.substr(0, p.find('['));
    auto m = ctx.marks.find(key);
    if (m != ctx.marks.end()) {
      return ctx.source + ":" + std::to_string(m->second.line + 1) + ":" + std::to_string(m->second.column + 1) + ": ";
    }
  }
  return ctx.source + ": ";
}

[[noreturn]] void unknown_key(const std::string& path, const std::string& value) {
  const std::string parent = parent_of(path);
  const std::string name = last_of(path);
  std::vector<std::string> siblings;
  for (const KeySpec& spec : detail::config_schema()) {
    if (parent_of(spec.path) == parent) {
      siblings.push_back(last_of(spec.path));
    }
  }
  std::string suggestion = detail::closest_match(name, siblings);
  if (!suggestion.empty()) {
    suggestion = parent.empty() ? suggestion : parent + "." + suggestion;
  } else {
    // A key in the wrong section ("train.lr" for "optimizer.lr").
    for (const KeySpec& spec : detail::config_schema()) {
      if (last_of(spec.path) == name) {
        suggestion = spec.path;
        break;
      }
    }
  }
  std::string problem = "unknown key '" + path + "'";
  if (!suggestion.empty()) {
    problem += "; did you mean '" + suggestion + "'?";
  } else if (siblings.empty()) {
    problem += "; '" + parent + "' has no sub-keys";
  } else {
    problem += "; the keys of " + (parent.empty() ? std::string("the top level") : "'" + parent + "'") + " are:";
    for (size_t i = 0; i < siblings.size(); ++i) {
      problem += (i ? ", " : " ") + siblings[i];
    }
  }
  config_fail(path, value, problem);
}

/// Rejects unknown and duplicate keys under map `node` (at `prefix`); records key positions.
void check_keys(const YAML::Node& node, const std::string& prefix, Context* ctx) {
  std::set<std::string> seen;
  for (const auto& kv : node) {
    const std::string shown = detail::show_node(kv.second);
    if (!kv.first.IsScalar()) {
      config_fail(prefix.empty() ? "<top level>" : prefix, detail::show_node(kv.first), "keys must be plain names");
    }
    const std::string path = prefix.empty() ? kv.first.Scalar() : prefix + "." + kv.first.Scalar();
    const size_t dot = kv.first.Scalar().find('.');
    if (dot != std::string::npos) {
      // Otherwise `data.train_on: all` at the top level would match the schema's path and be
      // silently ignored (the loader reads nested maps only).
      const std::string outer = kv.first.Scalar().substr(0, dot), inner = kv.first.Scalar().substr(dot + 1);
      config_fail(path, shown,
                  "a key name cannot contain '.': nest it, `" + outer + ": {" + inner + ": " + shown +
                      "}` (dotted paths are for command-line overrides, " + path + "=" + shown + ")");
    }
    if (ctx != nullptr) {
      ctx->marks.emplace(path, kv.first.Mark());
    }
    if (!seen.insert(kv.first.Scalar()).second) {
      config_fail(path, shown, "the key appears twice; keep one");
    }
    const KeySpec* spec = detail::find_key(path);
    if (spec == nullptr) {
      unknown_key(path, shown);
    }
    if (spec->kind == KeyKind::kSection && kv.second.IsMap()) {
      check_keys(kv.second, path, ctx);
    }
  }
}

/// The node at dotted `path`, or nullopt when absent.
std::optional<YAML::Node> lookup(const YAML::Node& root, const std::string& path) {
  YAML::Node current = root;
  for (const std::string& part : split_path(path)) {
    if (!current.IsMap()) {
      return std::nullopt;
    }
    YAML::Node next = static_cast<const YAML::Node&>(current)[part];
    if (!next.IsDefined()) {
      return std::nullopt;
    }
    current.reset(next);
  }
  return current;
}

void apply_override(YAML::Node& root, const std::string& text, Context* ctx) {
  size_t eq = text.find('=');
  if (eq == std::string::npos || eq == 0) {
    throw ConfigError("override '" + text + "': write key=value with a dotted key, e.g. optimizer.lr=1e-3");
  }
  const std::string path = text.substr(0, eq);
  const std::string value_text = text.substr(eq + 1);
  ctx->overrides[path] = text;
  YAML::Node value;
  try {
    value = YAML::Load(value_text);
  } catch (const YAML::Exception& e) {
    config_fail(path, value_text, "the value is not valid YAML (" + e.msg + ")");
  }
  if (detail::find_key(path) == nullptr && enclosing_free_map(path) == nullptr) {
    unknown_key(path, value_text);
  }
  YAML::Node current = root;
  std::vector<std::string> parts = split_path(path);
  std::string walked;
  for (size_t i = 0; i + 1 < parts.size(); ++i) {
    walked += (i ? "." : "") + parts[i];
    YAML::Node child = current[parts[i]];
    if (!child.IsDefined() || child.IsNull()) {
      child = YAML::Node(YAML::NodeType::Map);
    } else if (!child.IsMap()) {
      config_fail(walked, detail::show_node(child), "not a map, so '" + path + "' cannot be set in it");
    }
    current.reset(child);
  }
  current[parts.back()] = value;
}

/// Parses `node` as the value of `spec`: type, range and choice checks. One object per value;
/// every failure is a ConfigError naming the key, the value and what was expected.
class ValueParser {
 public:
  ValueParser(const KeySpec& spec, const YAML::Node& node)
      : spec_(spec), node_(node), shown_(detail::show_node(node)) {}

  Value parse() const {
    if (!node_ || node_.IsNull()) return parse_null();
    switch (spec_.kind) {
      case KeyKind::kSection:
        if (!node_.IsMap()) wrong_type();
        return true;
      case KeyKind::kBool: {
        ResolvedScalar r = node_.IsScalar() ? detail::resolve_scalar(node_) : ResolvedScalar{};
        if (r.kind != ResolvedScalar::Kind::kBool) wrong_type();
        return r.boolean;
      }
      case KeyKind::kInt: {
        ResolvedScalar r = number(node_, true);
        check_range(r.real, "the value");
        return r.integer;
      }
      case KeyKind::kFloat: {
        ResolvedScalar r = number(node_, false);
        check_range(r.real, "the value");
        return r.real;
      }
      case KeyKind::kString:
        if (!node_.IsScalar()) wrong_type();
        check_utf8(node_.Scalar());
        return node_.Scalar();
      case KeyKind::kChoice:
        return parse_choice();
      case KeyKind::kFloatPair:
        return parse_float_pair();
      case KeyKind::kStringList: {
        std::vector<std::string> values = scalar_list();
        for (const std::string& value : values) check_utf8(value);
        check_range(static_cast<double>(values.size()), "the length");
        return values;
      }
      case KeyKind::kDevices:
        return parse_devices();
      case KeyKind::kFreeMap:
        return parse_free_map();
    }
    TORCH_INTERNAL_ASSERT(false, "unhandled key kind of ", spec_.path);
  }

 private:
  [[noreturn]] void wrong_type() const {
    config_fail(spec_.path, shown_,
                "wrong type: expected " + spec_.type_name() + ", got " + detail::describe_node_kind(node_));
  }

  // Found by fuzz/fuzz_config: a string with bytes that are not UTF-8 printed (to_yaml) as U+FFFD
  // in quotes, which read back as another string. YAML text is UTF-8; nlohmann::json's dump()
  // checks it (type_error 316).
  void check_utf8(const std::string& value) const {
    try {
      (void)nlohmann::json(value).dump();
    } catch (const nlohmann::json::type_error&) {
      config_fail(spec_.path, shown_, "not valid UTF-8; fix the file's encoding (YAML files are UTF-8)");
    }
  }

  void check_range(double v, const std::string& what) const {
    if (!spec_.bounds.contains(v)) {
      config_fail(spec_.path, shown_, "out of range: " + what + " must be " + spec_.bounds.describe());
    }
  }

  ResolvedScalar number(const YAML::Node& n, bool integral) const {
    if (!n.IsScalar()) wrong_type();
    ResolvedScalar r = detail::resolve_scalar(n);
    const bool ok = r.kind == ResolvedScalar::Kind::kInt || (!integral && r.kind == ResolvedScalar::Kind::kFloat);
    if (!ok) wrong_type();
    if (r.int_overflow) config_fail(spec_.path, shown_, "out of range: does not fit a 64-bit integer");
    if (!std::isfinite(r.real)) config_fail(spec_.path, shown_, "out of range: must be a finite number");
    return r;
  }

  // A sequence of scalars, as strings.
  std::vector<std::string> scalar_list() const {
    if (!node_.IsSequence()) wrong_type();
    std::vector<std::string> values;
    for (const YAML::Node& element : node_) {
      if (!element.IsScalar()) wrong_type();
      values.push_back(element.Scalar());
    }
    return values;
  }

  // A missing or null value: null where allowed, an empty section or map (all defaults).
  Value parse_null() const {
    if (spec_.nullable) return Value();
    if (spec_.kind == KeyKind::kSection) return true;
    if (spec_.kind == KeyKind::kFreeMap) return std::string("{}");
    wrong_type();
  }

  Value parse_choice() const {
    if (!node_.IsScalar()) wrong_type();
    const std::string& s = node_.Scalar();
    for (const std::string& choice : spec_.choices) {
      if (choice == s) return s;
    }
    std::string hint = detail::closest_match(s, spec_.choices);
    config_fail(
        spec_.path, shown_,
        "not a valid choice: expected " + spec_.type_name() + (hint.empty() ? "" : "; did you mean '" + hint + "'?"));
  }

  Value parse_float_pair() const {
    if (!node_.IsSequence()) wrong_type();
    if (node_.size() != 2) {
      config_fail(spec_.path, shown_, "wrong length: expected 2 numbers, got " + std::to_string(node_.size()));
    }
    std::vector<double> values;
    for (size_t i = 0; i < 2; ++i) {
      double v = number(node_[i], false).real;
      check_range(v, "element " + std::to_string(i) + " (" + detail::show_node(node_[i]) + ")");
      values.push_back(v);
    }
    return values;
  }

  // "auto" (null), a CPU worker count, or a list of devices.
  Value parse_devices() const {
    if (node_.IsScalar()) {
      if (node_.Scalar() == "auto") return Value();
      ResolvedScalar r = detail::resolve_scalar(node_);
      if (r.kind != ResolvedScalar::Kind::kInt) {
        config_fail(
            spec_.path, shown_,
            "wrong type: expected " + spec_.type_name() + " (auto, a CPU worker count, or e.g. [cuda:0, cuda:1])");
      }
      // An integer beyond 64 bits resolves to INT64_MAX / INT64_MIN: out of the bounds below.
      check_range(static_cast<double>(r.integer), "the count");
      return std::vector<std::string>(static_cast<size_t>(r.integer), "cpu");
    }
    std::vector<std::string> values = scalar_list();
    check_range(static_cast<double>(values.size()), "the number of devices");
    return values;
  }

  Value parse_free_map() const {
    if (!node_.IsMap()) wrong_type();
    try {
      return detail::yaml_to_json(node_).dump();
    } catch (const nlohmann::json::type_error& e) {
      // Found by fuzz/fuzz_config: dump() refuses text that is not UTF-8 (error 316).
      config_fail(spec_.path, shown_,
                  std::string("a key or string is not valid UTF-8 (this map is passed on as JSON, "
                              "which must be UTF-8; ") +
                      e.what() + "); fix the file's encoding");
    }
  }

  const KeySpec& spec_;
  const YAML::Node& node_;
  const std::string shown_;
};

const YAML::Node& default_node(const KeySpec& spec) {
  static std::map<std::string, YAML::Node> cache = [] {
    std::map<std::string, YAML::Node> m;
    for (const KeySpec& s : detail::config_schema()) {
      m[s.path] = YAML::Load(s.default_yaml);
    }
    return m;
  }();
  return cache.at(spec.path);
}

/// Sets every key of `config` from `root` (absent keys: defaults), in schema order.
void apply_keys(const YAML::Node& root, LauncherConfig& config) {
  std::set<std::string> disabled;  // nullable sections that are null
  for (const KeySpec& spec : detail::config_schema()) {
    bool skip = false;
    for (std::string p = parent_of(spec.path); !p.empty(); p = parent_of(p)) {
      skip = skip || disabled.count(p) > 0;
    }
    if (skip) {
      continue;
    }
    std::optional<YAML::Node> node = lookup(root, spec.path);
    Value value = ValueParser(spec, node ? *node : default_node(spec)).parse();
    if (spec.kind == KeyKind::kSection && std::holds_alternative<std::monostate>(value)) {
      disabled.insert(spec.path);
    }
    if (spec.set) {
      spec.set(config, value);
    }
  }
}

void emit_value(YAML::Emitter& out, const KeySpec& spec, const Value& value) {
  if (std::holds_alternative<std::monostate>(value)) {
    if (spec.kind == KeyKind::kDevices) {
      out << "auto";
    } else {
      out << YAML::Null;  // the string "null" would be quoted
    }
    return;
  }
  switch (spec.kind) {
    case KeyKind::kBool:
      out << (std::get<bool>(value) ? "true" : "false");
      break;
    case KeyKind::kInt:
      out << std::to_string(std::get<int64_t>(value));
      break;
    case KeyKind::kFloat:
      out << detail::format_double(std::get<double>(value));
      break;
    case KeyKind::kString:
    case KeyKind::kChoice:
      detail::emit_json(out, std::get<std::string>(value));
      break;
    case KeyKind::kFloatPair:
      out << YAML::Flow << YAML::BeginSeq;
      for (double v : std::get<std::vector<double>>(value)) {
        out << detail::format_double(v);
      }
      out << YAML::EndSeq;
      break;
    case KeyKind::kStringList:
    case KeyKind::kDevices:
      out << YAML::Flow << YAML::BeginSeq;
      for (const std::string& s : std::get<std::vector<std::string>>(value)) {
        detail::emit_json(out, s);
      }
      out << YAML::EndSeq;
      break;
    case KeyKind::kFreeMap: {
      nlohmann::json object = nlohmann::json::parse(std::get<std::string>(value));
      if (object.empty()) {
        out << YAML::Flow << YAML::BeginMap << YAML::EndMap;
      } else {
        detail::emit_json(out, object);
      }
      break;
    }
    case KeyKind::kSection:
      break;
  }
}

void emit_section(YAML::Emitter& out, const LauncherConfig& config, const std::string& prefix) {
  for (const KeySpec& spec : detail::config_schema()) {
    if (parent_of(spec.path) != prefix) {
      continue;
    }
    out << YAML::Key << last_of(spec.path) << YAML::Value;
    if (spec.kind == KeyKind::kSection) {
      if (spec.get && std::holds_alternative<std::monostate>(spec.get(config))) {
        out << YAML::Null;
        continue;
      }
      out << YAML::BeginMap;
      emit_section(out, config, spec.path);
      out << YAML::EndMap;
    } else {
      emit_value(out, spec, spec.get(config));
    }
  }
}

}  // namespace

LauncherConfig::LauncherConfig() { apply_keys(YAML::Node(YAML::NodeType::Map), *this); }

LauncherConfig parse_config(const std::string& yaml_text, const std::vector<std::string>& overrides,
                            const std::string& source) {
  Context ctx;
  ctx.source = source;
  try {
    YAML::Node root;
    try {
      root = YAML::Load(yaml_text);
    } catch (const YAML::Exception& e) {
      throw ConfigError(source + ":" + std::to_string(e.mark.line + 1) + ":" + std::to_string(e.mark.column + 1) +
                        ": YAML syntax error: " + e.msg);
    }
    if (!root || root.IsNull()) {
      root = YAML::Node(YAML::NodeType::Map);
    }
    if (!root.IsMap()) {
      throw ConfigError(source + ": the top level must be a map of sections (model:, data:, ...), got " +
                        detail::describe_node_kind(root));
    }
    check_keys(root, "", &ctx);
    for (const std::string& text : overrides) {
      apply_override(root, text, &ctx);
    }
    check_keys(root, "", nullptr);
    LauncherConfig config;
    apply_keys(root, config);
    for (const detail::Rule& rule : detail::config_rules()) {
      rule.check(config);
    }
    return config;
  } catch (const detail::KeyError& e) {
    throw ConfigError(location(ctx, e.path()) + e.what());
  }
}

LauncherConfig load_config(const std::string& path, const std::vector<std::string>& overrides) {
  if (!is_regular_file(path)) {
    throw ConfigError("config file '" + path + "' not found; check the path (configs/default.yaml " + "is an example)");
  }
  std::string text;
  try {
    text = read_file(path);
  } catch (const c10::Error& e) {
    throw ConfigError("config file '" + path + "' cannot be read: " + e.msg());
  }
  return parse_config(text, overrides, path);
}

std::string to_yaml(const LauncherConfig& config) {
  YAML::Emitter out;
  out.SetNullFormat(YAML::LowerNull);
  out << YAML::BeginMap;
  emit_section(out, config, "");
  out << YAML::EndMap;
  return std::string(out.c_str()) + "\n";
}

std::string resolved_model_config_json(const LauncherConfig& config) {
  nlohmann::json overrides = nlohmann::json::parse(config.model.config_json);
  if (config.model.pretrained.empty()) {
    return overrides.dump();
  }
  const std::string file = join_path(config.model.pretrained, "config.json");
  nlohmann::json base;
  try {
    base = nlohmann::json::parse(read_file(file));
  } catch (const nlohmann::json::exception& e) {
    config_fail("model.pretrained", "'" + config.model.pretrained + "'",
                file + " is not valid JSON (" + e.what() + ")");
  } catch (const c10::Error&) {
    config_fail("model.pretrained", "'" + config.model.pretrained + "'", file + " cannot be read");
  }
  if (!base.is_object()) {
    config_fail("model.pretrained", "'" + config.model.pretrained + "'", file + " is not a JSON object");
  }
  base.update(overrides);
  return base.dump();
}

std::optional<int64_t> data_vocab_size(const LauncherConfig& config) {
  switch (config.data.format) {
    case DataFormat::kBytes:
      return 256;
    case DataFormat::kTokens:
    case DataFormat::kChat:  // the tokenizer's, checked against the model when the data is opened
      return std::nullopt;
    case DataFormat::kSynthetic:
      break;
  }
  if (config.data.vocab_size) {
    return config.data.vocab_size;
  }
  nlohmann::json model = nlohmann::json::parse(resolved_model_config_json(config));
  auto it = model.find("vocab_size");
  if (it != model.end() && it->is_number_integer()) {
    return it->get<int64_t>();
  }
  return std::nullopt;
}

const char* data_format_name(DataFormat format) {
  switch (format) {
    case DataFormat::kTokens:
      return "tokens";
    case DataFormat::kBytes:
      return "bytes";
    case DataFormat::kSynthetic:
      return "synthetic";
    case DataFormat::kChat:
      return "chat";
  }
  return "?";
}

const char* train_on_name(models::ChatTrainOn train_on) {
  switch (train_on) {
    case models::ChatTrainOn::kAssistant:
      return "assistant";
    case models::ChatTrainOn::kLastAssistant:
      return "last_assistant";
    case models::ChatTrainOn::kAll:
      return "all";
  }
  return "?";
}

const char* optimizer_name(OptimizerName name) {
  switch (name) {
    case OptimizerName::kAdamW:
      return "adamw";
    case OptimizerName::kAdam:
      return "adam";
    case OptimizerName::kSgd:
      return "sgd";
    case OptimizerName::kLion:
      return "lion";
    case OptimizerName::kAdafactor:
      return "adafactor";
  }
  return "?";
}

const char* state_dtype_name(OptimizerStateDtype dtype) {
  return dtype == OptimizerStateDtype::kInt8 ? "int8" : "float32";
}

const char* recompute_name(RecomputeGrain grain) { return grain == RecomputeGrain::kStage ? "stage" : "layer"; }

const char* step_mode_name(StepMode mode) { return mode == StepMode::kAsync ? "async" : "sync"; }

}  // namespace roundpipe::launcher
