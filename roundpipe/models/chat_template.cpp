#include "roundpipe/models/chat_template.h"

#include <nlohmann/json.hpp>

#include <fstream>
#include <iterator>
#include <utility>

#include "roundpipe/models/detail/jinja_interpreter.h"
#include "roundpipe/models/detail/jinja_parser.h"
#include "roundpipe/models/detail/tokenizer_text.h"

namespace roundpipe::models {
namespace {

using nlohmann::ordered_json;

// transformers' SPECIAL_TOKENS_ATTRIBUTES: the special tokens apply_chat_template passes.
constexpr const char* kSpecialTokenNames[] = {"bos_token", "eos_token", "unk_token", "sep_token",
                                              "pad_token", "cls_token", "mask_token"};

// transformers' _REASONING_FIELDS, in order of preference.
constexpr const char* kReasoningFields[] = {"reasoning_content", "thinking", "reasoning"};

bool read_file_if_exists(const std::string& path, std::string& text) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return false;
  text.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  return true;
}

detail::Template parse(const std::string& source, const std::string& name) {
  if (!detail::is_valid_utf8(source)) throw ChatTemplateError(name, 0, "the template is not valid UTF-8", false);
  try {
    return detail::parse_template(source);
  } catch (const detail::LocatedError& e) {
    throw ChatTemplateError(name, e.line, e.what(), e.raised);
  } catch (const detail::JinjaError& e) {
    throw ChatTemplateError(name, 0, e.what(), false);
  }
}

// One message as transformers hands it to the template: None-valued keys dropped
// (apply_chat_template), then reasoning aliased (_alias_reasoning_fields:
// {"thinking": r, **message, "reasoning_content": r}).
detail::Value prepare_message(const ordered_json& message, size_t index) {
  if (!message.is_object()) {
    throw std::invalid_argument("messages[" + std::to_string(index) + "] is not a JSON object");
  }
  ordered_json m = ordered_json::object();
  for (const auto& [key, value] : message.items()) {
    if (!value.is_null()) m[key] = value;
  }
  const ordered_json* reasoning = nullptr;
  for (const char* field : kReasoningFields) {
    if (m.contains(field)) {
      reasoning = &m[field];
      break;
    }
  }
  if (reasoning != nullptr) {
    const ordered_json r = *reasoning;
    ordered_json aliased = ordered_json::object();
    aliased["thinking"] = r;
    for (const auto& [key, value] : m.items()) aliased[key] = key == "thinking" ? r : value;
    aliased["reasoning_content"] = r;
    m = std::move(aliased);
  }
  return detail::from_json(m);
}

}  // namespace

ChatTemplateError::ChatTemplateError(std::string template_name, int line, std::string message, bool raised_by_template)
    : std::runtime_error("chat template '" + template_name + "'" +
                         (line > 0 ? " line " + std::to_string(line) : std::string()) + ": " + message),
      template_name_(std::move(template_name)),
      line_(line),
      message_(std::move(message)),
      raised_(raised_by_template) {}

struct ChatTemplate::Impl {
  std::string name;
  std::string source;
  detail::Template tmpl;
  // tokenizer_config.json's named "tool_use" template, used when tools are given (transformers'
  // get_chat_template); null when there is none.
  std::shared_ptr<const Impl> tool_use;
  ordered_json special_tokens = ordered_json::object();
  std::string eos_token;
};

ChatTemplate::ChatTemplate(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}
ChatTemplate::~ChatTemplate() = default;
ChatTemplate::ChatTemplate(const ChatTemplate&) = default;
ChatTemplate& ChatTemplate::operator=(const ChatTemplate&) = default;
ChatTemplate::ChatTemplate(ChatTemplate&&) noexcept = default;
ChatTemplate& ChatTemplate::operator=(ChatTemplate&&) noexcept = default;

ChatTemplate ChatTemplate::from_string(const std::string& source, const std::string& name,
                                       const ordered_json* special_tokens) {
  auto impl = std::make_shared<Impl>();
  impl->name = name;
  impl->source = source;
  impl->tmpl = parse(source, name);
  if (special_tokens != nullptr) {
    if (!special_tokens->is_object()) throw std::invalid_argument("special_tokens must be a JSON object");
    impl->special_tokens = *special_tokens;
    if (special_tokens->contains("eos_token") && (*special_tokens)["eos_token"].is_string()) {
      impl->eos_token = (*special_tokens)["eos_token"].get<std::string>();
    }
  }
  return ChatTemplate(std::move(impl));
}

ChatTemplate ChatTemplate::from_model_dir(const std::string& dir) {
  const std::string config_path = dir + "/tokenizer_config.json";
  ordered_json config = ordered_json::object();
  std::string text;
  if (read_file_if_exists(config_path, text)) {
    try {
      config = ordered_json::parse(text);
    } catch (const ordered_json::parse_error& e) {
      throw std::runtime_error(config_path + ": not valid JSON: " + e.what());
    }
    if (!config.is_object()) throw std::runtime_error(config_path + ": not a JSON object");
  }
  ordered_json special = ordered_json::object();
  for (const char* key : kSpecialTokenNames) {
    if (!config.contains(key) || config[key].is_null()) continue;
    const ordered_json& token = config[key];
    if (token.is_string()) {
      special[key] = token;
    } else if (token.is_object() && token.contains("content") && token["content"].is_string()) {
      special[key] = token["content"];
    } else {
      throw std::runtime_error(config_path + ": " + key + " = " + token.dump() +
                               " is not supported (a string or {\"content\": string})");
    }
  }
  const std::string jinja_path = dir + "/chat_template.jinja";
  std::string source;
  std::string name = jinja_path;
  std::string tool_use_source;
  if (!read_file_if_exists(jinja_path, source)) {
    name = config_path + " chat_template";
    if (!config.contains("chat_template")) {
      throw std::runtime_error("no chat template in " + dir + ": neither chat_template.jinja nor a \"chat_template\" in " +
                               "tokenizer_config.json");
    }
    const ordered_json& t = config["chat_template"];
    if (t.is_string()) {
      source = t.get<std::string>();
    } else if (t.is_array()) {
      bool found = false;
      for (const auto& entry : t) {
        if (!entry.is_object() || !entry.contains("name") || !entry.contains("template") ||
            !entry["name"].is_string() || !entry["template"].is_string()) {
          throw std::runtime_error(config_path + ": chat_template entries must be {\"name\": str, \"template\": str}");
        }
        if (entry["name"] == "default") {
          source = entry["template"].get<std::string>();
          found = true;
        } else if (entry["name"] == "tool_use") {
          tool_use_source = entry["template"].get<std::string>();
        }
      }
      if (!found) throw std::runtime_error(config_path + ": chat_template lists no template named \"default\"");
      name = config_path + " chat_template \"default\"";
    } else {
      throw std::runtime_error(config_path + ": chat_template must be a string or a list of named templates");
    }
  }
  ChatTemplate result = from_string(source, name, &special);
  if (!tool_use_source.empty()) {
    // result.impl_ was made just above and is not shared yet.
    std::const_pointer_cast<Impl>(result.impl_)->tool_use =
        from_string(tool_use_source, config_path + " chat_template \"tool_use\"", &special).impl_;
  }
  return result;
}

RenderedChat ChatTemplate::render(const ordered_json& messages, const ChatRenderOptions& options) const {
  if (!messages.is_array()) throw std::invalid_argument("messages must be a JSON array of message objects");
  if (options.variables != nullptr && !options.variables->is_object()) {
    throw std::invalid_argument("ChatRenderOptions::variables must be a JSON object");
  }
  const bool has_tools = options.variables && options.variables->contains("tools") &&
                         !(*options.variables)["tools"].is_null();
  const Impl& impl = has_tools && impl_->tool_use ? *impl_->tool_use : *impl_;
  detail::ValueDict vars;
  try {
    detail::ValueList converted;
    for (size_t i = 0; i < messages.size(); ++i) converted.push_back(prepare_message(messages[i], i));
    vars.set(detail::Value::from_string("messages"), detail::Value::from_list(std::move(converted)));
    vars.set(detail::Value::from_string("tools"), detail::Value::none());
    vars.set(detail::Value::from_string("documents"), detail::Value::none());
    vars.set(detail::Value::from_string("add_generation_prompt"), detail::Value::from_bool(options.add_generation_prompt));
    for (const auto& [key, value] : impl.special_tokens.items()) {
      vars.set(detail::Value::from_string(key), detail::from_json(value));
    }
    if (options.variables) {
      for (const auto& [key, value] : options.variables->items()) {
        if (key == "messages" || key == "add_generation_prompt") {
          throw std::invalid_argument("ChatRenderOptions::variables must not set \"" + key + "\"");
        }
        vars.set(detail::Value::from_string(key), detail::from_json(value));
      }
    }
  } catch (const detail::JinjaError& e) {
    throw std::invalid_argument(std::string("messages or variables: ") + e.what());
  }
  detail::RenderInput input;
  input.variables = &vars;
  input.now = options.now;
  try {
    detail::RenderOutput out = detail::render_template(impl.tmpl, input);
    return RenderedChat{std::move(out.text), std::move(out.generation_spans)};
  } catch (const detail::LocatedError& e) {
    throw ChatTemplateError(impl.name, e.line, e.what(), e.raised);
  } catch (const detail::JinjaError& e) {
    throw ChatTemplateError(impl.name, 0, e.what(), false);
  }
}

const std::string& ChatTemplate::name() const { return impl_->name; }
const std::string& ChatTemplate::source() const { return impl_->source; }
const std::string& ChatTemplate::eos_token() const { return impl_->eos_token; }

}  // namespace roundpipe::models
