#include "roundpipe/launcher/token_data.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "launcher_test_util.h"
#include "tests/common/python_oracle.h"
#include "tests/common/test_config.h"
#include "tests/common/test_macros.h"

namespace roundpipe::launcher {
namespace {

using testing::ScratchDir;

uint32_t le32(const std::string& bytes, size_t at) {
  return uint32_t(uint8_t(bytes[at])) | uint32_t(uint8_t(bytes[at + 1])) << 8 |
         uint32_t(uint8_t(bytes[at + 2])) << 16 | uint32_t(uint8_t(bytes[at + 3])) << 24;
}

std::string header(int32_t magic, int32_t version, int32_t count) {
  std::string h(1024, '\0');
  for (auto [at, v] : {std::pair<size_t, int32_t>{0, magic}, {4, version}, {8, count}}) {
    for (int b = 0; b < 4; ++b) {
      h[at + b] = static_cast<char>((static_cast<uint32_t>(v) >> (8 * b)) & 0xff);
    }
  }
  return h;
}

std::vector<int64_t> read_all(const TokenSource& source) {
  std::vector<int64_t> out(static_cast<size_t>(source.size()));
  source.read(0, source.size(), out.data());
  return out;
}

// Reference splitmix64, written from the published algorithm.
uint64_t reference_splitmix(uint64_t& state) {
  state += 0x9E3779B97F4A7C15ULL;
  uint64_t z = state;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

TEST(TokenDataTest, SplitMix64_MatchesPublishedSequence) {
  // The first outputs for seed 1234567 (Rosetta Code "Pseudo-random numbers/Splitmix64").
  SplitMix64 rng(1234567);
  for (uint64_t expected : {6457827717110365317ULL, 3203168211198807973ULL, 9817491932198370423ULL,
                            4593380528125082431ULL, 16408922859458223821ULL}) {
    EXPECT_EQ(rng.next(), expected);
  }
}

TEST(TokenDataTest, TokenFile_RoundTripsUint16) {
  ScratchDir dir;
  std::vector<int64_t> tokens = {0, 1, 65535, 300, 7};
  const std::string path = dir.file("t16.bin");
  write_token_file(path, tokens, TokenWidth::kUint16);
  const std::string bytes = read_file(path);
  ASSERT_EQ(bytes.size(), 1024u + 2 * tokens.size());
  EXPECT_EQ(le32(bytes, 0), 20240520u);
  EXPECT_EQ(le32(bytes, 4), 1u);
  EXPECT_EQ(le32(bytes, 8), tokens.size());
  for (size_t i = 12; i < 1024; ++i) {
    ASSERT_EQ(bytes[i], 0) << "header byte " << i;
  }
  EXPECT_EQ(uint8_t(bytes[1024 + 4]), 0xff);  // 65535 little-endian
  auto source = open_token_file(path);
  EXPECT_EQ(read_all(*source), tokens);
  EXPECT_FALSE(source->vocab_size().has_value());
}

TEST(TokenDataTest, TokenFile_RoundTripsUint32) {
  ScratchDir dir;
  std::vector<int64_t> tokens = {0, 65536, 151935, 4294967295LL};
  const std::string path = dir.file("t32.bin");
  write_token_file(path, tokens, TokenWidth::kUint32);
  const std::string bytes = read_file(path);
  ASSERT_EQ(bytes.size(), 1024u + 4 * tokens.size());
  EXPECT_EQ(le32(bytes, 4), 2u);
  EXPECT_EQ(le32(bytes, 1024 + 4 * 2), 151935u);
  EXPECT_EQ(read_all(*open_token_file(path)), tokens);
  EXPECT_THROW_WITH(write_token_file(path, {1, 70000}, TokenWidth::kUint16), "token 1 is 70000");
}

TEST(TokenDataTest, TokenFile_RejectsLyingHeader) {
  ScratchDir dir;
  const std::string tokens6(12, '\1');  // 6 uint16 tokens
  std::string truncated = dir.write("truncated.bin", header(20240520, 1, 10) + tokens6);
  EXPECT_THROW_WITH(open_token_file(truncated), "token file '" + truncated + "': header[2] (number of tokens) says 10");
  EXPECT_THROW_WITH(open_token_file(truncated), "truncated");
  std::string longer = dir.write("longer.bin", header(20240520, 1, 3) + tokens6);
  EXPECT_THROW_WITH(open_token_file(longer), "header[2] (number of tokens) says 3");
  EXPECT_THROW_WITH(open_token_file(longer), "appended");
  std::string magic = dir.write("magic.bin", header(12345, 1, 6) + tokens6);
  EXPECT_THROW_WITH(open_token_file(magic), "header[0] (magic) is 12345, expected 20240520");
  EXPECT_THROW_WITH(open_token_file(magic), "data.format: bytes");
  std::string version = dir.write("version.bin", header(20240520, 3, 6) + tokens6);
  EXPECT_THROW_WITH(open_token_file(version), "header[1] (token width) is 3");
  std::string tiny = dir.write("tiny.bin", "hello");
  EXPECT_THROW_WITH(open_token_file(tiny), "is 5 bytes, shorter than the 1024-byte header");
  EXPECT_THROW_WITH(open_token_file(dir.file("absent.bin")), "absent.bin");
  // The well-formed version of the same data opens.
  std::string good = dir.write("good.bin", header(20240520, 1, 6) + tokens6);
  EXPECT_EQ(open_token_file(good)->size(), 6);
}

TEST(TokenDataTest, ByteFile_ReadsEveryByte) {
  ScratchDir dir;
  std::string path = dir.write("text.txt", std::string("Hi\xff\0!", 5));
  auto source = open_byte_file(path);
  EXPECT_EQ(read_all(*source), (std::vector<int64_t>{'H', 'i', 255, 0, '!'}));
  EXPECT_EQ(source->vocab_size(), 256);
}

TEST(TokenDataTest, Synthetic_IsTheDocumentedFunctionOfSeedAndPosition) {
  auto mix = [](uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
  };
  const uint64_t seed = 77;
  const uint64_t vocab = 50;
  auto source = make_synthetic_tokens(seed, vocab, 1000);
  std::vector<int64_t> got(300);
  source->read(500, 300, got.data());  // random access: mid-stream
  for (uint64_t i = 0; i < 300; ++i) {
    uint64_t pos = 500 + i, k = pos / 64, j = pos % 64;
    uint64_t stride = 1 + mix(seed ^ mix(2 * k)) % (vocab - 1);
    uint64_t offset = mix(seed ^ mix(2 * k + 1)) % vocab;
    ASSERT_EQ(got[i], static_cast<int64_t>((offset + stride * j) % vocab)) << "position " << pos;
  }
  std::vector<int64_t> other(300);
  make_synthetic_tokens(seed + 1, vocab, 1000)->read(500, 300, other.data());
  EXPECT_NE(got, other);
}

TEST(TokenDataTest, TrainSampler_DrawsDocumentedWindows) {
  auto source = make_synthetic_tokens(3, 1000, 5000);
  const int64_t batch = 4, seq_len = 16;
  TrainSampler sampler(*source, batch, seq_len, /*seed=*/1234);
  uint64_t state = 1234;
  const uint64_t bound = 5000 - (seq_len + 1) + 1;
  for (int step = 0; step < 3; ++step) {
    Batch b = sampler.next();
    ASSERT_EQ(b.inputs.sizes(), (std::vector<int64_t>{batch, seq_len}));
    ASSERT_EQ(b.inputs.scalar_type(), at::kLong);
    for (int64_t row = 0; row < batch; ++row) {
      uint64_t r;
      do {
        r = reference_splitmix(state);
      } while (r < (0 - bound) % bound);
      const int64_t start = static_cast<int64_t>(r % bound);
      std::vector<int64_t> window(seq_len + 1);
      source->read(start, seq_len + 1, window.data());
      for (int64_t t = 0; t < seq_len; ++t) {
        ASSERT_EQ(b.inputs[row][t].item<int64_t>(), window[t]);
        ASSERT_EQ(b.labels[row][t].item<int64_t>(), window[t + 1]);
      }
    }
  }
}

TEST(TokenDataTest, TrainSampler_SameSeedSameBatchesAndStateResumes) {
  auto source = make_synthetic_tokens(5, 97, 10000);
  TrainSampler a(*source, 3, 8, 42), b(*source, 3, 8, 42), c(*source, 3, 8, 43);
  for (int i = 0; i < 3; ++i) {
    Batch x = a.next(), y = b.next();
    EXPECT_TRUE(at::equal(x.inputs, y.inputs));
    EXPECT_TRUE(at::equal(x.labels, y.labels));
  }
  EXPECT_NE(a.next_starts(), c.next_starts());
  const uint64_t saved = a.state();
  std::vector<std::vector<int64_t>> continued = {a.next_starts(), a.next_starts()};
  TrainSampler resumed(*source, 3, 8, /*seed=*/0);
  resumed.set_state(saved);
  EXPECT_EQ(resumed.next_starts(), continued[0]);
  EXPECT_EQ(resumed.next_starts(), continued[1]);
}

TEST(TokenDataTest, TrainSampler_RejectsTooFewTokens) {
  auto source = make_synthetic_tokens(1, 10, 16);
  EXPECT_THROW_WITH(TrainSampler(*source, 2, 16, 0), "fewer than data.seq_len + 1 = 17");
  EXPECT_NO_THROW(TrainSampler(*source, 2, 15, 0));  // exactly one window
}

TEST(TokenDataTest, EvalBatches_CoverConsecutiveWindows) {
  const int64_t seq_len = 5;
  std::vector<int64_t> tokens(10 * (seq_len + 1) + 3);
  for (size_t i = 0; i < tokens.size(); ++i) {
    tokens[i] = static_cast<int64_t>(i);
  }
  ScratchDir dir;
  write_token_file(dir.file("valid.bin"), tokens, TokenWidth::kUint16);
  auto source = open_token_file(dir.file("valid.bin"));
  EvalBatches all(*source, 4, seq_len, 0);
  EXPECT_EQ(all.num_windows(), 10);
  EXPECT_EQ(all.num_batches(), 3);
  std::vector<int64_t> rows;
  int64_t window = 0;
  while (auto batch = all.next()) {
    rows.push_back(batch->inputs.size(0));
    for (int64_t r = 0; r < batch->inputs.size(0); ++r, ++window) {
      EXPECT_EQ(batch->inputs[r][0].item<int64_t>(), window * (seq_len + 1));
      EXPECT_EQ(batch->labels[r][seq_len - 1].item<int64_t>(), window * (seq_len + 1) + seq_len);
    }
  }
  EXPECT_EQ(rows, (std::vector<int64_t>{4, 4, 2}));
  all.reset();
  EXPECT_TRUE(all.next().has_value());
  EvalBatches capped(*source, 4, seq_len, 2);
  EXPECT_EQ(capped.num_windows(), 8);
  EXPECT_EQ(capped.num_batches(), 2);
}

TEST(TokenDataTest, PrepareDataScript_WritesFilesThisReaderAccepts) {
  ROUNDPIPE_REQUIRE_ORACLE();
  try {
    roundpipe::testing::run_python("import tokenizers");
  } catch (const std::exception&) {
    ROUNDPIPE_ORACLE_MISSING("tokenizers is not installed in the venv");
  }
  ScratchDir dir;
  const std::string snippet = R"(
import subprocess, sys
from tokenizers import Tokenizer, models, pre_tokenizers
d = ')" + dir.path() + R"('
words = ['[UNK]', '<eos>', 'the', 'cat', 'sat', 'on', 'mat', '.']
tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token='[UNK]'))
tok.pre_tokenizer = pre_tokenizers.Whitespace()
tok.save(d + '/tokenizer.json')
texts = ['the cat sat on the mat .', 'the dog sat .']
for i, t in enumerate(texts):
    open(f'{d}/doc{i}.txt', 'w').write(t)
subprocess.run([sys.executable, ')" + std::string(ROUNDPIPE_SOURCE_DIR) + R"(/scripts/prepare_data.py',
                '--tokenizer', d + '/tokenizer.json', '--eos', '<eos>', '--out', d + '/train.bin',
                d + '/doc0.txt', d + '/doc1.txt'], check=True, capture_output=True)
ids = []
for t in texts:
    ids += tok.encode(t).ids + [1]
outputs['ids'] = torch.tensor(ids, dtype=torch.int64)
)";
  at::Tensor expected = roundpipe::testing::run_python(snippet).at("ids");
  auto source = open_token_file(dir.file("train.bin"));
  std::vector<int64_t> want(expected.data_ptr<int64_t>(), expected.data_ptr<int64_t>() + expected.numel());
  EXPECT_EQ(read_all(*source), want);
  EXPECT_EQ(le32(read_file(dir.file("train.bin")), 4), 1u);  // uint16 for a small vocabulary
}

}  // namespace
}  // namespace roundpipe::launcher
