// launcher::ChatDataset / ChatSampler / ChatEvalBatches (data.format: chat) on a byte-level
// tokenizer whose ids are the bytes themselves, so every expected id and label is written out by
// hand: the trained tokens of the prefix rule, truncation and dropping, padding, FILE:LINE errors,
// and the sampler's epochs and resumption. transformers' side: cli_chat_test.cpp.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <array>
#include <set>
#include <string>
#include <vector>

#include "chat_test_util.h"
#include "roundpipe/launcher/chat_data.h"
#include "roundpipe/models/layers.h"

namespace roundpipe::launcher::testing {
namespace {

constexpr int64_t kStart = 256, kEnd = 257;

struct Fixture {
  ScratchDir dir;
  std::string model = write_byte_chat_model(dir, "model");
  models::ChatTemplate tmpl = models::ChatTemplate::from_model_dir(model);
  models::Tokenizer tok = models::Tokenizer::from_file(model + "/tokenizer.json");

  ChatDataset load(const std::string& jsonl, ChatDataOptions options = {}) {
    return ChatDataset::load(dir.write("data.jsonl", jsonl), tmpl, tok, options);
  }
};

std::vector<int64_t> bytes(const std::string& s) { return std::vector<int64_t>(s.begin(), s.end()); }

std::vector<int64_t> concat(std::initializer_list<std::vector<int64_t>> parts) {
  std::vector<int64_t> out;
  for (const auto& p : parts) out.insert(out.end(), p.begin(), p.end());
  return out;
}

std::vector<int64_t> to_vector(const at::Tensor& t) {
  at::Tensor c = t.contiguous();
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
}

TEST(ChatDataTest, OneConversation_IdsAndLabelsOfTheAssistantTurn) {
  Fixture f;
  ChatDataset data = f.load(chat_line({{"user", "hi"}, {"assistant", "yo"}}));
  const std::vector<int64_t> ids = concat({{kStart}, bytes("user\nhi"), {kEnd}, bytes("\n"), {kStart},
                                           bytes("assistant\nyo"), {kEnd}, bytes("\n")});
  ASSERT_EQ(data.size(), 1);
  EXPECT_EQ(data.row(0).ids, ids);
  Batch b = data.make_batch({0});
  const int64_t n = static_cast<int64_t>(ids.size()) - 1;
  ASSERT_EQ(b.inputs.sizes(), (std::vector<int64_t>{1, n}));
  EXPECT_EQ(to_vector(b.inputs), std::vector<int64_t>(ids.begin(), ids.end() - 1));
  // Trained: the content "yo" and its <|im_end|>; not the "\n" after it, nothing before.
  std::vector<int64_t> labels(static_cast<size_t>(n), kIgnoreLabel);
  labels[static_cast<size_t>(n - 4)] = 'y';
  labels[static_cast<size_t>(n - 3)] = 'o';
  labels[static_cast<size_t>(n - 2)] = kEnd;
  EXPECT_EQ(to_vector(b.labels), labels);
  EXPECT_EQ(b.tokens, n);
  EXPECT_EQ(data.stats().trained_tokens, 3);
  EXPECT_EQ(data.stats().tokens, static_cast<int64_t>(ids.size()));

  ChatDataOptions all;
  all.train_on = models::ChatTrainOn::kAll;
  ChatDataset everything = f.load(chat_line({{"user", "hi"}, {"assistant", "yo"}}), all);
  EXPECT_EQ(to_vector(everything.make_batch({0}).labels), std::vector<int64_t>(ids.begin() + 1, ids.end()));
}

TEST(ChatDataTest, LastAssistantOnly_TrainsTheLastTurn) {
  Fixture f;
  ChatDataOptions last;
  last.train_on = models::ChatTrainOn::kLastAssistant;
  ChatDataset data = f.load(chat_line({{"user", "a"}, {"assistant", "bb"}, {"user", "c"}, {"assistant", "ddd"}}), last);
  EXPECT_EQ(data.stats().trained_tokens, 4);  // "ddd" + <|im_end|>
  ChatDataset both = f.load(chat_line({{"user", "a"}, {"assistant", "bb"}, {"user", "c"}, {"assistant", "ddd"}}));
  EXPECT_EQ(both.stats().trained_tokens, 7);
}

TEST(ChatDataTest, TruncationKeepsTheStart_DropsWhatHasNothingToTrain) {
  Fixture f;
  // Prompt of the first turn: <s>user\nQ<e>\n<s>assistant\n = 1 + 5 + 1 + 1 + 1 + 1 + 10 = 20 tokens.
  const std::string jsonl = chat_line({{"user", "Q"}, {"assistant", "0123456789"}}) +  // 20 + 11 + 1 = 32 tokens
                            "\n" +                                                     // blank: skipped
                            chat_line({{"user", "just asking"}}) +                     // nothing to train
                            chat_line({{"user", "a much longer question"}, {"assistant", "x"}}) +  // 41 + 3: answer past 25
                            chat_line({{"user", "Q"}, {"assistant", "ok"}});            // 20 + 3 + 1 = 24 tokens
  ChatDataOptions options;
  options.seq_len = 24;  // rows keep 25 tokens
  ChatDataset data = f.load(jsonl, options);
  const ChatDataStats& s = data.stats();
  EXPECT_EQ(s.lines, 4);
  EXPECT_EQ(s.conversations, 2);
  EXPECT_EQ(s.truncated, 1);
  EXPECT_EQ(s.dropped_untrained, 1);
  EXPECT_EQ(s.dropped_truncated, 1);
  EXPECT_EQ(s.tokens_cut, (32 - 25) + (44 - 25));
  EXPECT_EQ(data.row(0).ids.size(), 25u);
  EXPECT_EQ(data.row(0).ids.back(), '4');  // "01234" kept of the answer
  EXPECT_EQ(s.trained_tokens, 5 + 3);
  const std::string text = data.describe();
  for (const char* part : {"2 conversations", "1 truncated", "2 dropped", "1 of them by truncation"}) {
    EXPECT_NE(text.find(part), std::string::npos) << text;
  }
}

TEST(ChatDataTest, Batch_PadsToTheLongestRow) {
  Fixture f;
  ChatDataOptions options;
  options.pad_id = 7;
  ChatDataset data = f.load(chat_line({{"user", "Q"}, {"assistant", "0123456789"}}) +
                                chat_line({{"user", "Q"}, {"assistant", "ok"}}),
                            options);
  Batch b = data.make_batch({1, 0});
  ASSERT_EQ(b.inputs.sizes(), (std::vector<int64_t>{2, 31}));  // 32 tokens: 31 inputs
  EXPECT_EQ(b.tokens, 23 + 31);
  EXPECT_TRUE(b.inputs[0].narrow(0, 23, 8).eq(7).all().item<bool>());
  EXPECT_TRUE(b.labels[0].narrow(0, 23, 8).eq(kIgnoreLabel).all().item<bool>());
  EXPECT_FALSE(b.inputs[0].narrow(0, 0, 23).eq(7).any().item<bool>());
  EXPECT_EQ(b.labels.ne(kIgnoreLabel).sum().item<int64_t>(), 3 + 11);
  EXPECT_TRUE(b.inputs[1].equal(data.make_batch({0}).inputs[0]));
}

struct BadLine {
  std::string jsonl;
  std::vector<std::string> expected;
};

TEST(ChatDataTest, BadLines_NameFileAndLine) {
  Fixture f;
  const std::string ok = chat_line({{"user", "Q"}, {"assistant", "A"}});
  const std::vector<BadLine> cases = {
      {ok + "\n{\"messages\": [\n", {"data.jsonl:3:", "not valid JSON", "one JSON object"}},
      {"[1, 2]\n", {"data.jsonl:1:", "a JSON array, not an object"}},
      {ok + R"({"conversation": [], "id": 3})" "\n", {"data.jsonl:2:", "no \"messages\" key", "conversation, id"}},
      {R"({"messages": []})" "\n", {"data.jsonl:1:", "non-empty array", "an empty array"}},
      {R"({"messages": "hi"})" "\n", {"data.jsonl:1:", "a JSON string"}},
      {R"({"messages": ["hi"]})" "\n", {"data.jsonl:1:", "messages[0] is a JSON string"}},
      {R"({"messages": [{"content": "hi"}]})" "\n", {"data.jsonl:1:", "messages[0] has no \"role\""}},
      {ok + chat_line({{"user", "Q"}, {"tool", "42"}}), {"data.jsonl:2:", "messages[1]", "unknown role \"tool\"",
                                                        "\"system\", \"user\" and \"assistant\""}},
      {R"({"messages": [{"role": "user", "content": [{"type": "text"}]}]})" "\n",
       {"data.jsonl:1:", "\"content\" that is a JSON array, not a string"}},
      {R"({"messages": [{"role": "user"}]})" "\n", {"data.jsonl:1:", "has no \"content\""}},
      {"", {"data.jsonl", "no conversations", "empty"}},
      {"\n  \n", {"data.jsonl", "no conversations"}},
      {chat_line({{"user", "Q"}}) + chat_line({{"system", "S"}}), {"none of its 2 conversations", "data.train_on: all"}},
  };
  for (const BadLine& c : cases) {
    SCOPED_TRACE(c.jsonl);
    try {
      (void)f.load(c.jsonl);
      ADD_FAILURE() << "expected a ConfigError";
    } catch (const ConfigError& e) {
      for (const std::string& part : c.expected) EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
  }
}

TEST(ChatDataTest, TemplateRefusal_NamesTheLine) {
  Fixture f;
  const std::string dir = f.dir.file("strict");
  f.dir.write("strict/tokenizer.json", byte_chat_tokenizer_json());
  f.dir.write("strict/tokenizer_config.json", R"({"eos_token": "<|im_end|>"})");
  f.dir.write("strict/chat_template.jinja",
              "{% for m in messages %}{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}"
              "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
              "{% endif %}{{ m.content }}<|im_end|>{% endfor %}");
  const auto tmpl = models::ChatTemplate::from_model_dir(dir);
  const std::string path = f.dir.write("d.jsonl", chat_line({{"user", "Q"}, {"assistant", "A"}}) +
                                                      chat_line({{"user", "Q"}, {"user", "Q2"}}));
  try {
    (void)ChatDataset::load(path, tmpl, f.tok, {});
    ADD_FAILURE() << "expected a ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("d.jsonl:2: the chat template refused this conversation"), std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("roles must alternate"), std::string::npos) << e.what();
  }
}

ChatDataset numbered(Fixture& f, int n) {
  std::string jsonl;
  for (int i = 0; i < n; ++i) jsonl += chat_line({{"user", std::to_string(i)}, {"assistant", "A"}});
  return f.load(jsonl);
}

// The conversation a row came from: its user content, the decimal number after "user\n".
int64_t row_number(const Batch& b, int64_t r) {
  std::vector<int64_t> ids = to_vector(b.inputs[r]);
  int64_t n = 0;
  for (size_t i = 6; i < ids.size() && ids[i] >= '0' && ids[i] <= '9'; ++i) n = n * 10 + (ids[i] - '0');
  return n;
}

TEST(ChatDataTest, Sampler_EveryConversationOncePerEpoch_Resumable) {
  Fixture f;
  ChatDataset data = numbered(f, 7);
  ChatSampler sampler(data, 3, 42);
  std::vector<int64_t> order;
  for (int k = 0; k < 7; ++k) {  // 21 rows: three epochs
    Batch b = sampler.next();
    for (int64_t r = 0; r < 3; ++r) order.push_back(row_number(b, r));
  }
  for (int epoch = 0; epoch < 3; ++epoch) {
    std::set<int64_t> seen(order.begin() + epoch * 7, order.begin() + epoch * 7 + 7);
    EXPECT_EQ(seen.size(), 7u) << "epoch " << epoch;
  }
  EXPECT_FALSE(std::equal(order.begin(), order.begin() + 7, order.begin() + 7)) << "epochs should differ in order";
  // Resume after 2 batches: the same rows as straight on.
  ChatSampler resumed(data, 3, 42);
  resumed.set_state(6);
  for (int k = 2; k < 7; ++k) {
    Batch b = resumed.next();
    for (int64_t r = 0; r < 3; ++r) EXPECT_EQ(row_number(b, r), order[static_cast<size_t>(k * 3 + r)]);
  }
  EXPECT_EQ(resumed.state(), 21u);
  ChatSampler other(data, 3, 43);
  std::vector<int64_t> other_order;
  for (int k = 0; k < 3; ++k) {
    Batch b = other.next();
    for (int64_t r = 0; r < 3; ++r) other_order.push_back(row_number(b, r));
  }
  EXPECT_FALSE(std::equal(other_order.begin(), other_order.end(), order.begin())) << "the seed should matter";
}

TEST(ChatDataTest, EvalBatches_InFileOrder_MaxBatches) {
  Fixture f;
  ChatDataset data = numbered(f, 5);
  ChatEvalBatches all(data, 2, 0);
  std::vector<int64_t> seen;
  std::vector<int64_t> sizes;
  while (auto b = all.next()) {
    sizes.push_back(b->inputs.size(0));
    for (int64_t r = 0; r < b->inputs.size(0); ++r) seen.push_back(row_number(*b, r));
  }
  EXPECT_EQ(seen, (std::vector<int64_t>{0, 1, 2, 3, 4}));
  EXPECT_EQ(sizes, (std::vector<int64_t>{2, 2, 1}));
  ChatEvalBatches two(data, 2, 2);
  int batches = 0;
  while (two.next()) ++batches;
  EXPECT_EQ(batches, 2);
}

// Note [Chat packing]: answers of 2, 9, 1 and 5 characters make conversations of 23, 30, 22 and 26
// input positions (20 prompt tokens + the answer + <|im_end|> + "\n", less the last token). Best fit
// decreasing into rows of 52: 30 opens row 0 (22 left), 26 opens row 1 (26 left), 23 takes row 1
// (the least room that fits), 22 fills row 0.
TEST(ChatDataTest, Packing_BestFitDecreasing_EachConversationAsUnpacked) {
  Fixture f;
  const std::string jsonl = chat_line({{"user", "Q"}, {"assistant", "ab"}}) +
                            chat_line({{"user", "Q"}, {"assistant", "123456789"}}) +
                            chat_line({{"user", "Q"}, {"assistant", "z"}}) +
                            chat_line({{"user", "Q"}, {"assistant", "vwxyz"}});
  ChatDataOptions options;
  options.seq_len = 52;
  options.pad_id = 7;
  ChatDataset unpacked = f.load(jsonl, options);
  options.packing = true;
  ChatDataset packed = f.load(jsonl, options);
  ASSERT_EQ(packed.size(), 2);
  EXPECT_EQ(packed.conversations(), 4);
  EXPECT_EQ(packed.pack(0), (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(packed.pack(1), (std::vector<int64_t>{3, 0}));
  EXPECT_EQ(packed.stats().packed_rows, 2);
  EXPECT_NE(packed.describe().find("packed into 2 rows of 52 positions, 97.1% filled"), std::string::npos)
      << packed.describe();

  Batch b = packed.make_batch({0, 1});
  ASSERT_EQ(b.inputs.sizes(), (std::vector<int64_t>{2, 52}));
  EXPECT_EQ(b.tokens, 52 + 49);
  const at::Tensor positions = b.side_inputs.at(models::kPositionIds);
  const at::Tensor segments = b.side_inputs.at(models::kSegmentIds);
  // [row][(conversation, start, length)]
  const std::vector<std::vector<std::array<int64_t, 3>>> layout = {{{1, 0, 30}, {2, 30, 22}},
                                                                    {{3, 0, 26}, {0, 26, 23}}};
  for (int64_t r = 0; r < 2; ++r) {
    int64_t segment = 0;
    for (const auto& [conv, start, length] : layout[static_cast<size_t>(r)]) {
      SCOPED_TRACE("row " + std::to_string(r) + ", conversation " + std::to_string(conv));
      const Batch alone = unpacked.make_batch({conv});
      ASSERT_EQ(alone.inputs.size(1), length);
      EXPECT_TRUE(b.inputs[r].narrow(0, start, length).equal(alone.inputs[0]));
      // Its own labels: the last position's label is its own last token, never the next one's first.
      EXPECT_TRUE(b.labels[r].narrow(0, start, length).equal(alone.labels[0]));
      EXPECT_TRUE(positions[r].narrow(0, start, length).equal(at::arange(length, at::kLong)));
      EXPECT_TRUE(segments[r].narrow(0, start, length).eq(segment).all().item<bool>());
      ++segment;
    }
  }
  // Row 1's 3 padding positions: pad id, no label, a segment of their own, positions from 0.
  EXPECT_TRUE(b.inputs[1].narrow(0, 49, 3).eq(7).all().item<bool>());
  EXPECT_TRUE(b.labels[1].narrow(0, 49, 3).eq(kIgnoreLabel).all().item<bool>());
  EXPECT_TRUE(segments[1].narrow(0, 49, 3).eq(2).all().item<bool>());
  EXPECT_TRUE(positions[1].narrow(0, 49, 3).equal(at::arange(3, at::kLong)));
  EXPECT_EQ(b.labels.ne(kIgnoreLabel).sum().item<int64_t>(), packed.stats().trained_tokens);
  EXPECT_TRUE(unpacked.make_batch({0}).side_inputs.empty());
}

// Packing keeps truncation's rule (the start of each conversation) and its report.
TEST(ChatDataTest, Packing_TruncatesAndDropsAsUnpacked) {
  Fixture f;
  const std::string jsonl = chat_line({{"user", "Q"}, {"assistant", "0123456789"}}) +  // 32 tokens: cut to 25
                            chat_line({{"user", "just asking"}}) +                     // nothing to train
                            chat_line({{"user", "Q"}, {"assistant", "ok"}});            // 24 tokens
  ChatDataOptions options;
  options.seq_len = 24;
  options.packing = true;
  ChatDataset data = f.load(jsonl, options);
  EXPECT_EQ(data.stats().truncated, 1);
  EXPECT_EQ(data.stats().dropped_untrained, 1);
  EXPECT_EQ(data.size(), 2);  // 24 + 23 input positions do not share a row of 24
  const std::string text = data.describe();
  for (const char* part : {"1 truncated", "1 dropped", "packed into 2 rows of 24 positions"}) {
    EXPECT_NE(text.find(part), std::string::npos) << text;
  }
}

}  // namespace
}  // namespace roundpipe::launcher::testing
