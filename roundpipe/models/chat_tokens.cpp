#include "roundpipe/models/chat_tokens.h"

#include <nlohmann/json.hpp>
#include <regex>
#include <stdexcept>
#include <string>
#include <utility>

namespace roundpipe::models {
namespace {

using Span = std::pair<size_t, size_t>;  // bytes [begin, end) of the rendered text

// transformers' char_to_token: the first token whose offsets hold byte `b`, or -1.
int64_t token_at(const Tokenizer::Encoding& enc, size_t b) {
  for (size_t i = 0; i < enc.offsets.size(); ++i) {
    const auto [begin, end] = enc.offsets[i];
    if (static_cast<size_t>(begin) <= b && b < static_cast<size_t>(end)) return static_cast<int64_t>(i);
  }
  return -1;
}

// Marks the tokens of `span` as transformers marks a generation span: from the token holding its
// first byte through the token holding its last (to the end when that has none; nothing, and no
// later span either, when the first has none: its `break`).
bool mark_span(const Tokenizer::Encoding& enc, Span span, std::vector<uint8_t>& trained) {
  if (span.second <= span.first) return true;
  const int64_t first = token_at(enc, span.first);
  if (first < 0) return false;
  const int64_t last = token_at(enc, span.second - 1);
  // (transformers writes `end_token + 1 if end_token else len(input_ids)`: a last token of index
  // 0 also runs to the end; kept for equality.)
  const int64_t stop = last > 0 ? last + 1 : static_cast<int64_t>(trained.size());
  for (int64_t t = first; t < stop; ++t) trained[static_cast<size_t>(t)] = 1;
  return true;
}

bool has_generation_blocks(const std::string& source) {
  static const std::regex kTag(R"(\{%-?\s*generation\s*-?%\})");
  return std::regex_search(source, kTag);
}

// The prefix rule's spans (see tokenize_chat).
std::vector<Span> assistant_spans(const ChatTemplate& tmpl, const nlohmann::ordered_json& messages,
                                  const std::string& text, const ChatRenderOptions& options) {
  const std::string& eos = tmpl.eos_token();
  std::vector<Span> spans;
  for (size_t i = 0; i < messages.size(); ++i) {
    const auto& message = messages[i];
    if (!message.is_object() || message.value("role", "") != "assistant") continue;
    if (eos.empty()) {
      throw std::invalid_argument("chat template '" + tmpl.name() +
                                  "' has no eos_token (tokenizer_config.json) and "
                                  "no {% generation %} blocks: the end of an assistant turn is unknown; set "
                                  "eos_token, or train on every token");
    }
    ChatRenderOptions prefix_options = options;
    prefix_options.add_generation_prompt = true;
    const nlohmann::ordered_json before(messages.begin(), messages.begin() + static_cast<std::ptrdiff_t>(i));
    const std::string prefix = tmpl.render(before, prefix_options).text;
    if (text.compare(0, prefix.size(), prefix) != 0) {
      throw std::invalid_argument("chat template '" + tmpl.name() + "': messages[" + std::to_string(i) +
                                  "] (assistant): rendering the messages before it with add_generation_prompt "
                                  "does not give a prefix of the whole conversation, so its trained tokens are "
                                  "unknown; use a template with {% generation %} blocks, or train on every token");
    }
    const size_t end = text.find(eos, prefix.size());
    if (end == std::string::npos) {
      throw std::invalid_argument("chat template '" + tmpl.name() + "': messages[" + std::to_string(i) +
                                  "] (assistant): no eos_token '" + eos +
                                  "' after its content, so the end of the turn is unknown; check eos_token in "
                                  "tokenizer_config.json");
    }
    spans.emplace_back(prefix.size(), end + eos.size());
  }
  return spans;
}

}  // namespace

ChatTokens tokenize_chat(const ChatTemplate& tmpl, const Tokenizer& tokenizer, const nlohmann::ordered_json& messages,
                         ChatTrainOn train_on, const ChatRenderOptions& options) {
  if (options.add_generation_prompt) {
    throw std::invalid_argument(
        "tokenize_chat: add_generation_prompt must be false (a training example ends "
        "with its last turn)");
  }
  const RenderedChat rendered = tmpl.render(messages, options);
  Tokenizer::Encoding enc = tokenizer.encode_with_offsets(rendered.text, /*add_special_tokens=*/false);
  ChatTokens out;
  out.ids = std::move(enc.ids);
  out.trained.assign(out.ids.size(), train_on == ChatTrainOn::kAll ? 1 : 0);
  if (train_on == ChatTrainOn::kAll) return out;
  std::vector<Span> spans = has_generation_blocks(tmpl.source())
                                ? rendered.generation_spans
                                : assistant_spans(tmpl, messages, rendered.text, options);
  if (train_on == ChatTrainOn::kLastAssistant && spans.size() > 1) spans.erase(spans.begin(), spans.end() - 1);
  for (const Span& span : spans) {
    if (!mark_span(enc, span, out.trained)) break;
  }
  return out;
}

}  // namespace roundpipe::models
