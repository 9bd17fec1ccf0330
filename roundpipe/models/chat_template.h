// Chat templates of roundpipe::models: renders a model directory's Jinja chat template
// (`chat_template.jinja`, else tokenizer_config.json's `chat_template`) exactly as transformers'
// `apply_chat_template(..., tokenize=False)`, with the `{% generation %}` spans of
// `return_assistant_tokens_mask`. Plain C++ (no LibTorch; nlohmann/json for the messages). The
// Jinja subset, and what fails instead of rendering differently: docs/models.md, "Chat templates".
#pragma once

#include <nlohmann/json_fwd.hpp>

#include <cstddef>
#include <ctime>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace roundpipe::models {

/// A template that does not parse, uses a construct outside the supported subset, or fails while
/// rendering (an undefined value used, raise_exception(...)). what() is
/// "chat template 'NAME' line N: MESSAGE".
class ChatTemplateError : public std::runtime_error {
 public:
  ChatTemplateError(std::string template_name, int line, std::string message, bool raised_by_template);
  const std::string& template_name() const { return template_name_; }
  /// 1-based line of the template the error is at (0: not tied to a line).
  int line() const { return line_; }
  /// The message without the template name and line.
  const std::string& message() const { return message_; }
  /// True when the template itself called raise_exception(message) (e.g. roles not alternating).
  bool raised_by_template() const { return raised_; }

 private:
  std::string template_name_;
  int line_;
  std::string message_;
  bool raised_;
};

struct ChatRenderOptions {
  /// transformers' add_generation_prompt: end with the header of an assistant turn.
  bool add_generation_prompt = false;
  /// More template variables: a JSON object, e.g. {"tools": [...], "enable_thinking": false,
  /// "date_string": "26 Jul 2024"}; they override the special tokens of the same name, as
  /// apply_chat_template's kwargs do. nullptr: none. Not owned; read during render() only.
  const nlohmann::ordered_json* variables = nullptr;
  /// The time strftime_now(...) formats (as local time); nullopt: now, as transformers does.
  std::optional<std::time_t> now;
};

struct RenderedChat {
  std::string text;
  /// Byte ranges [begin, end) of `text` rendered inside `{% generation %}...{% endgeneration %}`,
  /// in order (transformers' generation indices, which count characters, in UTF-8 bytes).
  std::vector<std::pair<size_t, size_t>> generation_spans;
};

/// A parsed chat template plus the special tokens it is rendered with. Immutable after
/// construction: render() may be called from any number of threads at once. Copies share the
/// parsed template.
///
///   auto tmpl = ChatTemplate::from_model_dir("/models/SmolLM2-135M-Instruct");
///   auto messages = nlohmann::ordered_json::parse(R"([{"role": "user", "content": "Hi"}])");
///   ChatRenderOptions opts;
///   opts.add_generation_prompt = true;
///   std::string prompt = tmpl.render(messages, opts).text;
class ChatTemplate {
 public:
  /// Reads `dir`/chat_template.jinja, else `dir`/tokenizer_config.json's "chat_template" (a string,
  /// or a list of {"name", "template"} of which "default" is taken), and the special tokens of
  /// tokenizer_config.json (bos_token, eos_token, unk_token, sep_token, pad_token, cls_token,
  /// mask_token: strings or {"content": ...}) as transformers passes them to the template.
  /// Throws std::runtime_error naming the file when there is no template or a file is malformed,
  /// ChatTemplateError when the template does not parse.
  static ChatTemplate from_model_dir(const std::string& dir);
  /// A template from its text; `name` identifies it in errors. `special_tokens` is a JSON object
  /// of template variables such as {"bos_token": "<s>", "eos_token": "</s>"} (nullptr: none).
  static ChatTemplate from_string(const std::string& source, const std::string& name,
                                  const nlohmann::ordered_json* special_tokens = nullptr);

  /// Renders `messages` (a JSON array of message objects) as transformers 5.x does: None-valued
  /// keys of each message dropped, `reasoning_content`/`thinking` aliased from one another (and
  /// from `reasoning`), then the template with messages, tools/documents (from
  /// options.variables, default None), add_generation_prompt, the special tokens and the
  /// variables. Throws ChatTemplateError (name and line) for every template error and
  /// std::invalid_argument when `messages` is not an array of objects.
  RenderedChat render(const nlohmann::ordered_json& messages, const ChatRenderOptions& options = {}) const;

  /// The template's name (errors use it) and its source text.
  const std::string& name() const;
  const std::string& source() const;
  /// The eos_token string of tokenizer_config.json ("" when none).
  const std::string& eos_token() const;

  ~ChatTemplate();
  ChatTemplate(const ChatTemplate&);
  ChatTemplate& operator=(const ChatTemplate&);
  ChatTemplate(ChatTemplate&&) noexcept;
  ChatTemplate& operator=(ChatTemplate&&) noexcept;

 private:
  struct Impl;
  explicit ChatTemplate(std::shared_ptr<const Impl> impl);
  std::shared_ptr<const Impl> impl_;
};

}  // namespace roundpipe::models
