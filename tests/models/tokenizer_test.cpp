// models::Tokenizer against Hugging Face `tokenizers` (Python): real tokenizer.json files
// (SmolLM2, Qwen2.5, Llama-3.2), one trained here with Qwen2's pre-tokenizer and one handmade;
// every line of the fortunes corpus and common licenses plus hand-picked hard cases and random
// combining sequences, ids and offsets compared exactly. One Python run serves the whole suite
// (tests/models/tokenizer_oracle.py).
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <sys/stat.h>

#include <cstdlib>
#include <fstream>
#include <string>
#include <limits>
#include <random>
#include <utility>
#include <thread>
#include <vector>

#include "roundpipe/models/tokenizer.h"
#include "tests/models/test_files.h"

namespace roundpipe::testing {
namespace {

using models::Tokenizer;
using nlohmann::json;

// Hard cases: whitespace runs, digits, contractions, non-ASCII, NFC, emoji, CJK, special-token
// strings inside text, Unicode spaces Oniguruma and PCRE2 classify differently without care.
std::vector<std::string> hard_cases() {
  return {
      "",
      " ",
      "   leading and trailing   ",
      "tabs\tand\t\tmore\t",
      "line one\nline two\n\n\nline five\r\nwindows\r\n",
      "  \n  \n\t \n",
      "numbers 1 12 123 1234 12345 3.14159 1,000,000 2026-11-25",
      "I'm you're he's we've they'll I'd it's DON'T WE'VE She'S",
      "naïve café résumé coöperate Zürich",
      "cafe\xCC\x81 nai\xCC\x88ve A\xCC\x8A e\xCC\x81\xCC\x81",  // combining marks: NFC composes
      "\xEF\xAC\x81sh and ﬁsh \xE2\x84\xAB",                 // ligature, Angstrom sign
      "emoji 😀🎉👍🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵",
      "中文字符测试，标点符号。日本語のテキスト、カタカナ。한국어 텍스트",
      "Ελληνικά Русский текст עברית العربية हिन्दी ไทย",
      "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n",
      "text<|endoftext|>more text <|endoftext|><|endoftext|> end",
      "<|begin_of_text|>Llama <|eot_id|> and <|start_header_id|>",
      "<|im_start <|im_end| <| |> <|endoftext",
      "fish ﬁsh café cafe\xCC\x81 added tokens",
      "a -- b -- c--d",
      "nbsp\xC2\xA0here, em\xE2\x80\x83space, ideographic\xE3\x80\x80space, nel\xC2\x85x",
      "mongolian\xE1\xA0\x8Evowel zero\xE2\x80\x8Bwidth bom\xEF\xBB\xBF line\xE2\x80\xA8sep",
      "x\xE1\xA0\x8E\xE1\xA0\x8E 12 \xE1\xA0\x8E! \xE1\xA0\x8E\n\xE1\xA0\x8E",  // U+180E: not \s in Oniguruma
      "aaaaa bbbbbbb ccccccccc ddddddddddd xxxxx yyyyyyy hmmmmmmm ahhhhhhhhh nooooooo wheeeeee",
      "aaaaa aab aaab aaaab aaaaab aaaaaaa",
      "aaa aaaaa zzzzzzz !!!!!!! ===== ----- ....... 1111111 ~~~ oooooooooooooooooooooooooooooo",
      "mixed123abc456 x2 3x 1st 2nd ½ ² ٣ 四",
      "symbols !@#$%^&*()_+-=[]{}|;':\",./<>? ~` \\ «» „“ — … ©",
      "https://example.com/path?query=1&b=2#frag user@mail.org",
      "def f(x):\n    return x**2  # comment\n\tif x: pass\n",
      "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
      "                                                              many spaces",
      "\x01\x02 control \x7F chars \x1B[31m",
      "<|im_start|>user\nhi<|im_end|>",
      "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nWie geht's? 👋<|im_end|>\n"
      "<|im_start|>assistant\nGut, danke! Ça va très bien 😀  \n\n  fin<|im_end|>\n",
      "<|start_header_id|>user<|end_header_id|>\n\nhi 😀<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
      " x",
      "  two leading",
      "é",
      "😀",
      "a😀b 😀😀 \xF0\x9F\x91\x8D\xF0\x9F\x8F\xBD",
  };
}

// Combining sequences NFC composes, reorders or leaves alone (marks of several combining classes,
// Hangul jamo, singleton and excluded decompositions), at random from a fixed seed: offsets
// through the NFC alignment are compared with `tokenizers`.
std::vector<std::string> nfc_cases() {
  const std::vector<std::string> starters = {
      "a", "e", "o", "A", "C", "x", " ", "\xE1\x84\x80", "\xE1\x85\xA1", "\xE1\x86\xA8", "\xEA\xB0\x80",
      "\xE0\xA4\x95", "\xE0\xAD\x87", "\xE0\xAC\xBE", "\xE2\x84\xAB", "\xE2\x84\xA6", "\xC5\xBF",
      "\xC3\xA9", "\xE0\xA5\x98", "\xCD\x84", "\xE0\xBD\xB3", "\xCE\x90", "\xE1\xB8\x88", "1"};
  const std::vector<std::string> marks = {"\xCC\x81", "\xCC\x80", "\xCC\x88", "\xCC\xA3", "\xCC\xA7",
                                          "\xCD\x85", "\xE0\xA4\xBC", "\xE0\xBD\xB1", "\xE0\xBD\xB2",
                                          "\xCC\xB8", "\xD6\xB0", "\xD9\x91", "\xE3\x80\xAA"};
  // Written out: marks reordered past a two-part decomposition (U+0F73, U+0344), repeated marks
  // of which only the first composes, an excluded composition (U+0958), Hangul jamo.
  std::vector<std::string> texts = {
      "x\xCC\x81\xE0\xBD\xB3y", "a\xE0\xBD\xB3\xCC\x81", "e\xCC\x81\xCC\x81", "a\xCC\x81\xCC\xA3" "b",
      "a\xCC\xA3\xCC\x81" "b", "\xE0\xA5\x98", "\xCD\x84", "o\xCC\x88\xCD\x84", "\xE1\x84\x80\xE1\x85\xA1\xE1\x86\xA8",
      "C\xCC\x81\xCC\xA7", "x\xE0\xAD\x87\xE0\xAC\xBE"};
  std::mt19937 rng(20261125);
  for (int n = 0; n < 400; ++n) {
    std::string text;
    const size_t length = 1 + rng() % 8;
    for (size_t k = 0; k < length; ++k) {
      text += rng() % 2 ? starters[rng() % starters.size()] : marks[rng() % marks.size()];
    }
    texts.push_back(text);
  }
  return texts;
}

std::vector<std::string> read_lines(const std::string& path, std::vector<std::string>& entries) {
  std::ifstream in(path);
  std::vector<std::string> lines;
  std::string line;
  std::string entry;
  while (std::getline(in, line)) {
    if (line == "%") {
      entries.push_back(entry);
      entry.clear();
      continue;
    }
    lines.push_back(line);
    entry += line + "\n";
  }
  return lines;
}

// Every line of Debian's fortunes-min files and common licenses, every multi-line fortune whole,
// then the hard cases.
std::vector<std::string> corpus() {
  std::vector<std::string> texts;
  std::vector<std::string> entries;
  std::vector<std::string> files;
  for (const char* name : {"fortunes", "literature", "riddles"}) {
    files.push_back(std::string("/usr/share/games/fortunes/") + name);
  }
  for (const auto& name : list_dir("/usr/share/common-licenses")) {
    struct stat st {};
    const std::string path = "/usr/share/common-licenses/" + name;
    if (::lstat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode)) files.push_back(path);  // not GPL -> GPL-3
  }
  for (const auto& file : files) {
    const auto lines = read_lines(file, entries);
    texts.insert(texts.end(), lines.begin(), lines.end());
  }
  texts.insert(texts.end(), entries.begin(), entries.end());
  const auto hard = hard_cases();
  texts.insert(texts.end(), hard.begin(), hard.end());
  const auto nfc = nfc_cases();
  texts.insert(texts.end(), nfc.begin(), nfc.end());
  return texts;
}

// The oracle's output for corpus(), computed once per process (it converts SmolLM2's GGUF, ~10 s);
// the scratch directory goes at exit.
struct OracleRun {
  std::vector<std::string> texts = corpus();
  ScratchDir dir;
  json result;
  std::string error;

  OracleRun() {
    write_bytes(dir.file("texts.json"), json(texts).dump());
    const std::string cmd = std::string("TOKENIZERS_PARALLELISM=false \"") + ROUNDPIPE_TEST_PYTHON + "\" \"" +
                            ROUNDPIPE_SOURCE_DIR + "/tests/models/tokenizer_oracle.py\" \"" + dir.path() + "\" \"" +
                            dir.file("texts.json") + "\" 2>\"" + dir.file("stderr.txt") + "\"";
    if (std::system(cmd.c_str()) != 0) {
      error = "tokenizer_oracle.py failed: " + read_bytes(dir.file("stderr.txt"));
    } else {
      result = json::parse(read_bytes(dir.file("result.json")));
    }
  }
};

const OracleRun& oracle() {
  static const OracleRun run;
  return run;
}

class TokenizerParityTest : public ::testing::TestWithParam<std::string> {};

TEST_P(TokenizerParityTest, Encode_MatchesTokenizers) {
  ROUNDPIPE_REQUIRE_PYTHON("tokenizers transformers gguf");
  const OracleRun& run = oracle();
  ASSERT_TRUE(run.error.empty()) << run.error;
  const std::string name = GetParam();
  if (run.result["missing"].contains(name)) {
    const std::string reason = run.result["missing"][name].get<std::string>();
    ROUNDPIPE_ORACLE_MISSING(reason + " (run scripts/setup.sh)");
  }
  const json& expected = run.result["tokenizers"][name];
  const Tokenizer tok = Tokenizer::from_file(run.dir.path() + "/" + name + "/tokenizer.json");
  const auto& texts = run.texts;
  ASSERT_EQ(expected["ids"].size(), texts.size());
  size_t mismatches = 0;
  size_t tokens = 0;
  std::vector<std::vector<int64_t>> ours(texts.size());
  for (size_t i = 0; i < texts.size(); ++i) {
    const auto want = expected["ids"][i].get<std::vector<int64_t>>();
    const auto& got = ours[i] = tok.encode(texts[i]);
    tokens += got.size();
    if (got != want && ++mismatches <= 5) {
      ADD_FAILURE() << name << " line " << i << " ids differ: " << ::testing::PrintToString(texts[i]) << "\n  ours "
                    << ::testing::PrintToString(got) << "\n  tokenizers " << ::testing::PrintToString(want);
    }
    // Without a normalizer or a prefix space, decode inverts encode exactly.
    if ((name == "smollm2" || name == "llama3") && tok.decode(got) != texts[i] && ++mismatches <= 5) {
      ADD_FAILURE() << name << " line " << i << " decode(encode(x)) != x for " << ::testing::PrintToString(texts[i]);
    }
    const std::string decoded = tok.decode(want);
    if (decoded != expected["decoded"][i].get<std::string>() && ++mismatches <= 5) {
      ADD_FAILURE() << name << " line " << i << " decode differs: " << ::testing::PrintToString(decoded);
    }
  }
  for (size_t i = 0; i < expected["ids_special"].size(); ++i) {
    EXPECT_EQ(tok.encode(texts[i], /*add_special_tokens=*/true), expected["ids_special"][i].get<std::vector<int64_t>>())
        << name << " line " << i << " with add_special_tokens";
  }
  for (size_t i = 0; i < expected["decoded_skip"].size(); ++i) {
    EXPECT_EQ(tok.decode(expected["ids"][i].get<std::vector<int64_t>>(), /*skip_special_tokens=*/true),
              expected["decoded_skip"][i].get<std::string>())
        << name << " line " << i << " with skip_special_tokens";
  }
  // encode_with_offsets: the ids of encode and `tokenizers`' offsets (converted to bytes), which
  // transformers' return_offsets_mapping matches (checked by the oracle).
  using Offsets = std::vector<std::pair<int64_t, int64_t>>;
  size_t offset_mismatches = 0;
  for (size_t i = 0; i < texts.size(); ++i) {
    Tokenizer::Encoding got;
    try {
      got = tok.encode_with_offsets(texts[i]);
    } catch (const std::exception& e) {
      if (++offset_mismatches <= 5) {
        ADD_FAILURE() << name << " line " << i << " encode_with_offsets threw: " << e.what();
      }
      continue;
    }
    const auto want = expected["offsets"][i].get<Offsets>();
    if ((got.ids != ours[i] || got.offsets != want) && ++offset_mismatches <= 5) {
      ADD_FAILURE() << name << " line " << i << " offsets differ: " << ::testing::PrintToString(texts[i]) << "\n  ids "
                    << ::testing::PrintToString(got.ids) << "\n  ours " << ::testing::PrintToString(got.offsets)
                    << "\n  tokenizers " << ::testing::PrintToString(want);
    }
  }
  EXPECT_EQ(offset_mismatches, 0u) << name << ": offsets of " << offset_mismatches << " lines differ";
  for (size_t i = 0; i < expected["offsets_special"].size(); ++i) {
    const Tokenizer::Encoding got = tok.encode_with_offsets(texts[i], /*add_special_tokens=*/true);
    EXPECT_EQ(got.ids, expected["ids_special"][i].get<std::vector<int64_t>>()) << name << " line " << i;
    EXPECT_EQ(got.offsets, expected["offsets_special"][i].get<Offsets>()) << name << " line " << i;
  }
  EXPECT_EQ(expected["transformers_offsets_differ"], json::array())
      << name << ": transformers' return_offsets_mapping differs from tokenizers' offsets on these lines";
  // Four threads on one (shared) Tokenizer, word cache included, give the same ids.
  std::vector<std::thread> threads;
  std::vector<size_t> thread_mismatches(4, 0);
  for (size_t t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (size_t i = t; i < texts.size(); i += 2) {
        thread_mismatches[t] += tok.encode(texts[i]) != ours[i];
        if (i % 16 != t) continue;
        try {
          thread_mismatches[t] += tok.encode_with_offsets(texts[i]).offsets != expected["offsets"][i].get<Offsets>();
        } catch (const std::exception&) {
          ++thread_mismatches[t];  // reported by the single-thread loop above
        }
      }
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(thread_mismatches, std::vector<size_t>(4, 0)) << name << ": encoding from four threads differs";
  EXPECT_EQ(mismatches, 0u) << name << ": " << mismatches << " of " << texts.size() << " lines differ";
  RecordProperty("lines", std::to_string(texts.size()));
  RecordProperty("tokens", std::to_string(tokens));
}

INSTANTIATE_TEST_SUITE_P(RealFiles, TokenizerParityTest,
                         ::testing::Values("smollm2", "qwen2", "llama3", "trained", "handmade", "trained_trim",
                                           "smollm2_trim"),
                         [](const auto& info) { return info.param; });

// A minimal valid file: bytes a, b and their merge, GPT-2 pre-tokenizer, ByteLevel decoder.
json minimal_file() {
  return json::parse(R"({
    "added_tokens": [{"id": 3, "content": "<s>", "special": true, "normalized": false}],
    "normalizer": null,
    "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "use_regex": true},
    "post_processor": null,
    "decoder": {"type": "ByteLevel"},
    "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": ["a b"]}
  })");
}

std::string load_error(const json& file) {
  try {
    Tokenizer::from_json(file.dump(), "test.json");
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  return "no error";
}

TEST(TokenizerTest, MinimalFile_EncodesAndDecodes) {
  const Tokenizer tok = Tokenizer::from_json(minimal_file().dump());
  EXPECT_EQ(tok.encode("abab<s>ba"), (std::vector<int64_t>{2, 2, 3, 1, 0}));
  EXPECT_EQ(tok.decode({2, 3, 1}), "ab<s>b");
  EXPECT_EQ(tok.decode({2, 3, 1}, /*skip_special_tokens=*/true), "abb");
  EXPECT_EQ(tok.token_to_id("<s>"), 3);
  EXPECT_EQ(tok.token_to_id("ab"), 2);
  EXPECT_FALSE(tok.token_to_id("zz").has_value());
  EXPECT_EQ(tok.id_to_token(2), "ab");
  EXPECT_EQ(tok.vocab_size(), 4);
  EXPECT_THROW(tok.encode("\xC3"), std::invalid_argument);
}

// Offsets worked out by hand: added tokens keep their own span, BPE tokens cover their bytes, the
// post-processor's template tokens get {0, 0}, and a token holding part of a UTF-8 character (no
// token here joins the bytes of "é") spans the whole character.
TEST(TokenizerTest, EncodeWithOffsets_MinimalFile) {
  json file = minimal_file();
  file["post_processor"] = json::parse(R"({"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<s>"}},
      {"Sequence": {"id": "A"}}, {"SpecialToken": {"id": "<s>"}}],
      "special_tokens": {"<s>": {"id": "<s>", "ids": [3]}}})");
  file["model"]["vocab"]["\u00c3"] = 4;  // "Ã", the ByteLevel character of byte 0xC3
  file["model"]["vocab"]["\u00a9"] = 5;  // "©", of byte 0xA9 ("é" is C3 A9)
  const Tokenizer tok = Tokenizer::from_json(file.dump());
  using Offsets = std::vector<std::pair<int64_t, int64_t>>;
  const Tokenizer::Encoding enc = tok.encode_with_offsets("abab<s>ba");
  EXPECT_EQ(enc.ids, (std::vector<int64_t>{2, 2, 3, 1, 0}));
  EXPECT_EQ(enc.offsets, (Offsets{{0, 2}, {2, 4}, {4, 7}, {7, 8}, {8, 9}}));
  const Tokenizer::Encoding special = tok.encode_with_offsets("ab\xC3\xA9", /*add_special_tokens=*/true);
  EXPECT_EQ(special.ids, (std::vector<int64_t>{3, 2, 4, 5, 3}));
  EXPECT_EQ(special.ids, tok.encode("ab\xC3\xA9", /*add_special_tokens=*/true));
  EXPECT_EQ(special.offsets, (Offsets{{0, 0}, {0, 2}, {2, 4}, {2, 4}, {0, 0}}));
  EXPECT_TRUE(tok.encode_with_offsets("").ids.empty());
  EXPECT_THROW(tok.encode_with_offsets("\xC3"), std::invalid_argument);
}

TEST(TokenizerTest, MalformedJson_NamesTheFile) {
  try {
    Tokenizer::from_json("{\"model\": ", "broken.json");
    FAIL() << "no error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("broken.json: not valid JSON"), std::string::npos) << e.what();
  }
  EXPECT_THROW(Tokenizer::from_file("/nonexistent/tokenizer.json"), std::runtime_error);
}

TEST(TokenizerTest, UnsupportedComponents_NameKeyAndValue) {
  const auto expect_error = [](const json& file, const std::string& fragment) {
    const std::string error = load_error(file);
    EXPECT_NE(error.find(fragment), std::string::npos) << "expected \"" << fragment << "\" in: " << error;
    EXPECT_NE(error.find("test.json"), std::string::npos) << error;
  };
  json f = minimal_file();
  f["model"]["type"] = "WordPiece";
  expect_error(f, "model.type = \"WordPiece\" is not supported (supported: BPE");
  f = minimal_file();
  f["pre_tokenizer"] = json::parse(R"({"type": "Sequence", "pretokenizers": [{"type": "Whitespace"}, {"type": "ByteLevel"}]})");
  expect_error(f, "pre_tokenizer.pretokenizers[0].type = \"Whitespace\" is not supported");
  f = minimal_file();
  f["pre_tokenizer"] = json::parse(R"({"type": "Metaspace"})");
  expect_error(f, "pre_tokenizer.type = \"Metaspace\"");
  f = minimal_file();
  f["normalizer"] = json::parse(R"({"type": "Lowercase"})");
  expect_error(f, "normalizer.type = \"Lowercase\"");
  f = minimal_file();
  f["decoder"] = json::parse(R"({"type": "WordPiece"})");
  expect_error(f, "decoder = {\"type\":\"WordPiece\"}");
  f = minimal_file();
  f["added_tokens"][0]["lstrip"] = true;
  expect_error(f, "added_tokens[0].lstrip = true");
  f = minimal_file();
  f["model"]["byte_fallback"] = true;
  expect_error(f, "model.byte_fallback");
  f = minimal_file();
  f["model"]["merges"] = json::parse(R"(["a b c"])");
  expect_error(f, "model.merges[0] = \"a b c\"");
  f = minimal_file();
  f["model"]["merges"] = json::parse(R"(["a z"])");
  expect_error(f, "merge 0 (\"a\", \"z\")");
  f = minimal_file();
  f["pre_tokenizer"] = json::parse(R"({"type": "Split", "pattern": {"Regex": "(unclosed"}, "behavior": "Isolated"})");
  expect_error(f, "the pre-tokenizer must end with ByteLevel");
  f = minimal_file();
  f["pre_tokenizer"] = json::parse(
      R"({"type": "Sequence", "pretokenizers": [{"type": "Split", "pattern": {"Regex": "(unclosed"}, "behavior": "Isolated"}, {"type": "ByteLevel"}]})");
  expect_error(f, "pre_tokenizer.pretokenizers[0].pattern: regex (unclosed does not compile");
  f = minimal_file();
  f["truncation"] = json::parse(R"({"max_length": 8})");
  expect_error(f, "truncation = ");
  f = minimal_file();
  f.erase("model");
  expect_error(f, "missing key model");
  // Ids that are not integers in [0, 2^31): converting them was undefined behaviour (fuzz_tokenizer).
  f = minimal_file();
  f["model"]["vocab"]["b"] = 1e300;
  expect_error(f, "model.vocab[\"b\"] = 1e+300 is not supported (an integer token id");
  f = minimal_file();
  f["model"]["vocab"]["b"] = -1;
  expect_error(f, "model.vocab[\"b\"] = -1 is not supported (a token id in [0, 2147483647]");
  f = minimal_file();
  f["added_tokens"][0]["id"] = std::numeric_limits<uint64_t>::max();
  expect_error(f, "added_tokens[0].id = 18446744073709551615 is not supported");
  f = minimal_file();
  f["post_processor"] = json::parse(R"({"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<s>"}},
      {"Sequence": {"id": "A"}}], "special_tokens": {"<s>": {"id": "<s>", "ids": [2.5]}}})");
  expect_error(f, "post_processor.special_tokens.<s>.ids = 2.5");
}

}  // namespace
}  // namespace roundpipe::testing
