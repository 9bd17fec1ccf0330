// Chat conversations as training tokens: render with the model's chat template, tokenize with its
// tokenizer, and mark which tokens the loss trains on, as transformers does (the chat-data rule:
// docs/models.md, "Chat tokens"). Plain C++ (no LibTorch).
#pragma once

#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <vector>

#include "roundpipe/models/chat_template.h"
#include "roundpipe/models/tokenizer.h"

namespace roundpipe::models {

/// Which tokens of a conversation the loss trains on.
enum class ChatTrainOn {
  kAssistant,      ///< every assistant turn (the default of TRL / torchtune / LLaMA-Factory)
  kLastAssistant,  ///< the last assistant turn only
  kAll,            ///< every token
};

/// A tokenized conversation: `trained[i]` is 1 where token i's loss counts (as a label: the
/// training label of position i - 1 is ids[i] when trained[i], else ignored).
struct ChatTokens {
  std::vector<int64_t> ids;
  std::vector<uint8_t> trained;
};

/// Renders `messages` with `tmpl` (options: variables, clock; add_generation_prompt must be false),
/// tokenizes the text without special tokens (the template writes them, as apply_chat_template
/// does) and marks the trained tokens:
///  - a template with `{% generation %}` blocks: the tokens transformers'
///    `return_assistant_tokens_mask` marks (for each span, from the token holding its first byte
///    through the token holding its last);
///  - otherwise, for each assistant message i: the bytes from the end of
///    render(messages[:i], add_generation_prompt=true) — which must be a prefix of the whole
///    render — through the first eos_token after it (the content and its end-of-turn token),
///    mapped to tokens the same way.
/// Throws std::invalid_argument naming the message and the fix when the prefix rule cannot apply
/// (the prefix render is not a prefix; no eos_token after an assistant turn; a template without
/// an eos_token), and ChatTemplateError for template errors.
ChatTokens tokenize_chat(const ChatTemplate& tmpl, const Tokenizer& tokenizer, const nlohmann::ordered_json& messages,
                         ChatTrainOn train_on = ChatTrainOn::kAssistant, const ChatRenderOptions& options = {});

}  // namespace roundpipe::models
