// A model directory for chat-data tests that need no Python: a byte-level tokenizer.json (the 256
// byte tokens of GPT-2's alphabet, no merges, plus <|im_start|> = 256 and <|im_end|> = 257), a
// ChatML chat template, tokenizer_config.json (eos_token <|im_end|>) and a tiny Llama config.json
// (vocab 258). No weights: enough for everything that happens before a model loads.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "launcher_test_util.h"

namespace roundpipe::launcher::testing {

inline std::string utf8_of(uint32_t cp) {
  std::string out;
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return out;
}

/// tokenizer.json of the byte-level tokenizer above: token id of byte b is b.
inline std::string byte_chat_tokenizer_json() {
  std::string vocab;
  uint32_t next = 256;
  for (uint32_t b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    std::string text = utf8_of(printable ? b : next++);
    if (text == "\"" || text == "\\") text = "\\" + text;
    vocab += (b == 0 ? "\"" : ", \"") + text + "\": " + std::to_string(b);
  }
  auto added = [](int id, const char* content) {
    return std::string(R"({"id": )") + std::to_string(id) + R"(, "content": ")" + content +
           R"(", "special": true, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false})";
  };
  return R"({"added_tokens": [)" + added(256, "<|im_start|>") + ", " + added(257, "<|im_end|>") +
         R"(], "normalizer": null,
    "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "use_regex": true},
    "post_processor": null, "decoder": {"type": "ByteLevel"},
    "model": {"type": "BPE", "vocab": {)" + vocab + R"(}, "merges": []}})";
}

/// ChatML, as Qwen2.5's template without its default system prompt.
inline const char* byte_chat_template() {
  return "{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
}

/// Writes the directory's files into `dir` (made as needed); returns `dir`.
inline std::string write_byte_chat_model(const ScratchDir& scratch, const std::string& name) {
  scratch.write(name + "/tokenizer.json", byte_chat_tokenizer_json());
  scratch.write(name + "/chat_template.jinja", byte_chat_template());
  scratch.write(name + "/tokenizer_config.json", R"({"eos_token": "<|im_end|>"})");
  scratch.write(name + "/config.json",
                R"({"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 258,
  "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
  "num_key_value_heads": 1, "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "tie_word_embeddings": false})");
  return scratch.file(name);
}

/// One JSONL line: {"messages": [{"role": r0, "content": c0}, ...]} from (role, content) pairs.
inline std::string chat_line(const std::vector<std::pair<std::string, std::string>>& messages) {
  std::string line = R"({"messages": [)";
  for (size_t i = 0; i < messages.size(); ++i) {
    line += (i ? ", " : "") + std::string(R"({"role": ")") + messages[i].first + R"(", "content": ")" +
            messages[i].second + "\"}";
  }
  return line + "]}\n";
}

}  // namespace roundpipe::launcher::testing
