#include "roundpipe/launcher/token_data.h"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <limits>

#include "roundpipe/launcher/atomic_file.h"

namespace roundpipe::launcher {
namespace {

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ULL;

uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

/// A read-only memory map of a whole file (empty files map to nothing).
class MappedFile {
 public:
  explicit MappedFile(const std::string& path) : path_(path) {
    int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    TORCH_CHECK(fd >= 0, "cannot open data file '", path, "': ", std::strerror(errno),
                "; check data.train / data.valid");
    struct stat st;
    if (::fstat(fd, &st) != 0) {
      int err = errno;
      ::close(fd);
      TORCH_CHECK(false, "cannot stat data file '", path, "': ", std::strerror(err));
    }
    size_ = static_cast<int64_t>(st.st_size);
    if (size_ > 0) {
      void* data = ::mmap(nullptr, static_cast<size_t>(size_), PROT_READ, MAP_SHARED, fd, 0);
      int err = errno;
      ::close(fd);
      TORCH_CHECK(data != MAP_FAILED, "cannot memory-map data file '", path, "' (", size_,
                  " bytes): ", std::strerror(err));
      data_ = static_cast<const uint8_t*>(data);
      // Training reads random windows; evaluation reads sequentially but only once.
      ::madvise(data, static_cast<size_t>(size_), MADV_RANDOM);
    } else {
      ::close(fd);
    }
  }
  ~MappedFile() {
    if (data_ != nullptr) {
      ::munmap(const_cast<uint8_t*>(data_), static_cast<size_t>(size_));
    }
  }
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const uint8_t* data() const { return data_; }
  int64_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  const uint8_t* data_ = nullptr;
  int64_t size_ = 0;
};

int32_t load_le_int32(const uint8_t* p) {
  uint32_t v = uint32_t(p[0]) | uint32_t(p[1]) << 8 | uint32_t(p[2]) << 16 | uint32_t(p[3]) << 24;
  int32_t out;
  std::memcpy(&out, &v, 4);
  return out;
}

void check_range(const TokenSource& source, int64_t start, int64_t count) {
  TORCH_CHECK(start >= 0 && count >= 0 && start + count <= source.size(), "read of tokens [",
              start, ", ", start + count, ") is outside ", source.describe(), " (", source.size(),
              " tokens)");
}

class TokenFileSource final : public TokenSource {
 public:
  explicit TokenFileSource(const std::string& path) : file_(path) {
    constexpr const char* kFix =
        "; make token files with scripts/prepare_data.py (or set data.format: bytes to read the "
        "file as raw bytes)";
    TORCH_CHECK(file_.size() >= kTokenFileHeaderBytes, "token file '", path, "' is ",
                file_.size(), " bytes, shorter than the ", kTokenFileHeaderBytes,
                "-byte header", kFix);
    const uint8_t* h = file_.data();
    int32_t magic = load_le_int32(h);
    TORCH_CHECK(magic == kTokenFileMagic, "token file '", path, "': header[0] (magic) is ",
                magic, ", expected ", kTokenFileMagic, ": this is not a token file", kFix);
    int32_t version = load_le_int32(h + 4);
    TORCH_CHECK(version == 1 || version == 2, "token file '", path,
                "': header[1] (token width) is ", version,
                ", expected 1 (uint16 tokens) or 2 (uint32 tokens); the file is damaged or from "
                "an incompatible writer",
                kFix);
    width_ = version == 1 ? 2 : 4;
    int32_t count = load_le_int32(h + 8);
    TORCH_CHECK(count >= 0, "token file '", path, "': header[2] (number of tokens) is ", count,
                ", must be >= 0", kFix);
    num_tokens_ = count;
    int64_t expected = kTokenFileHeaderBytes + num_tokens_ * width_;
    TORCH_CHECK(file_.size() >= expected, "token file '", path,
                "': header[2] (number of tokens) says ", num_tokens_, " tokens (", expected,
                " bytes with the header) but the file holds only ", file_.size(),
                " bytes: the file is truncated (an interrupted copy?); copy or regenerate it",
                kFix);
    TORCH_CHECK(file_.size() == expected, "token file '", path,
                "': header[2] (number of tokens) says ", num_tokens_, " tokens (", expected,
                " bytes with the header) but the file holds ", file_.size(),
                " bytes: data was appended after writing or header[2] is wrong; regenerate it",
                kFix);
  }

  int64_t size() const override { return num_tokens_; }

  void read(int64_t start, int64_t count, int64_t* out) const override {
    check_range(*this, start, count);
    const uint8_t* base = file_.data() + kTokenFileHeaderBytes + start * width_;
    // Tokens are little-endian; so is every platform LibTorch supports.
    if (width_ == 2) {
      for (int64_t i = 0; i < count; ++i) {
        out[i] = int64_t(base[2 * i]) | int64_t(base[2 * i + 1]) << 8;
      }
    } else {
      for (int64_t i = 0; i < count; ++i) {
        out[i] = static_cast<int64_t>(static_cast<uint32_t>(load_le_int32(base + 4 * i)));
      }
    }
  }

  std::string describe() const override { return "token file '" + file_.path() + "'"; }
  std::optional<int64_t> vocab_size() const override { return std::nullopt; }

 private:
  MappedFile file_;
  int64_t width_ = 2;
  int64_t num_tokens_ = 0;
};

class ByteFileSource final : public TokenSource {
 public:
  explicit ByteFileSource(const std::string& path) : file_(path) {}
  int64_t size() const override { return file_.size(); }
  void read(int64_t start, int64_t count, int64_t* out) const override {
    check_range(*this, start, count);
    const uint8_t* base = file_.data() + start;
    for (int64_t i = 0; i < count; ++i) {
      out[i] = base[i];
    }
  }
  std::string describe() const override { return "byte file '" + file_.path() + "'"; }
  std::optional<int64_t> vocab_size() const override { return 256; }

 private:
  MappedFile file_;
};

class SyntheticSource final : public TokenSource {
 public:
  SyntheticSource(uint64_t seed, int64_t vocab_size, int64_t num_tokens)
      : seed_(seed), vocab_size_(vocab_size), num_tokens_(num_tokens) {
    TORCH_CHECK(vocab_size >= 2, "synthetic data needs a vocabulary of at least 2 tokens, got ",
                vocab_size, "; set data.vocab_size");
    TORCH_CHECK(num_tokens >= 0, "synthetic data: num_tokens must be >= 0, got ", num_tokens);
  }
  int64_t size() const override { return num_tokens_; }
  void read(int64_t start, int64_t count, int64_t* out) const override {
    check_range(*this, start, count);
    const uint64_t vocab = static_cast<uint64_t>(vocab_size_);
    for (int64_t i = 0; i < count; ++i) {
      uint64_t pos = static_cast<uint64_t>(start + i);
      uint64_t segment = pos / kSyntheticSegment;
      uint64_t stride = 1 + mix64(seed_ ^ mix64(2 * segment)) % (vocab - 1);
      uint64_t offset = mix64(seed_ ^ mix64(2 * segment + 1)) % vocab;
      // (offset + stride * j) mod vocab without overflow: both factors are < vocab < 2^32.
      uint64_t j = pos % kSyntheticSegment;
      out[i] = static_cast<int64_t>((offset + (stride * j) % vocab) % vocab);
    }
  }
  std::string describe() const override {
    return "synthetic data (seed " + std::to_string(seed_) + ", vocab " +
           std::to_string(vocab_size_) + ")";
  }
  std::optional<int64_t> vocab_size() const override { return vocab_size_; }

 private:
  uint64_t seed_;
  int64_t vocab_size_;
  int64_t num_tokens_;
};

void check_window_fits(const TokenSource& source, int64_t batch_size, int64_t seq_len) {
  TORCH_CHECK(batch_size >= 1, "batch_size must be >= 1, got ", batch_size);
  TORCH_CHECK(seq_len >= 1, "seq_len must be >= 1, got ", seq_len);
  TORCH_CHECK(source.size() >= seq_len + 1, source.describe(), " holds ", source.size(),
              " tokens, fewer than data.seq_len + 1 = ", seq_len + 1,
              " (one window plus its next-token label); use a smaller data.seq_len or more data");
}

}  // namespace

std::unique_ptr<TokenSource> open_token_file(const std::string& path) {
  return std::make_unique<TokenFileSource>(path);
}

std::unique_ptr<TokenSource> open_byte_file(const std::string& path) {
  return std::make_unique<ByteFileSource>(path);
}

std::unique_ptr<TokenSource> make_synthetic_tokens(uint64_t seed, int64_t vocab_size,
                                                   int64_t num_tokens) {
  TORCH_CHECK(vocab_size <= (int64_t(1) << 32), "synthetic data: vocab_size ", vocab_size,
              " exceeds 2^32");
  return std::make_unique<SyntheticSource>(seed, vocab_size, num_tokens);
}

void write_token_file(const std::string& path, const std::vector<int64_t>& tokens,
                      TokenWidth width) {
  TORCH_CHECK(tokens.size() <= static_cast<size_t>(std::numeric_limits<int32_t>::max()),
              "write_token_file '", path, "': ", tokens.size(),
              " tokens do not fit the int32 count of the header; split the data into several files");
  const int64_t bytes_per_token = width == TokenWidth::kUint16 ? 2 : 4;
  const int64_t limit = width == TokenWidth::kUint16 ? (int64_t(1) << 16) : (int64_t(1) << 32);
  std::string buffer(static_cast<size_t>(kTokenFileHeaderBytes + bytes_per_token * tokens.size()), '\0');
  auto store = [&](size_t at, uint64_t value, int64_t bytes) {
    for (int64_t b = 0; b < bytes; ++b) {
      buffer[at + b] = static_cast<char>((value >> (8 * b)) & 0xff);
    }
  };
  store(0, static_cast<uint32_t>(kTokenFileMagic), 4);
  store(4, static_cast<uint32_t>(width), 4);
  store(8, static_cast<uint32_t>(tokens.size()), 4);
  for (size_t i = 0; i < tokens.size(); ++i) {
    TORCH_CHECK(tokens[i] >= 0 && tokens[i] < limit, "write_token_file '", path, "': token ", i,
                " is ", tokens[i], ", outside [0, ", limit, ") of ",
                width == TokenWidth::kUint16 ? "uint16" : "uint32",
                width == TokenWidth::kUint16 ? "; write uint32 tokens for vocabularies of 65536 or more" : "");
    store(kTokenFileHeaderBytes + i * bytes_per_token, static_cast<uint64_t>(tokens[i]), bytes_per_token);
  }
  write_file_atomically(path, buffer);
}

uint64_t SplitMix64::next() {
  state_ += kGolden;
  return mix64(state_);
}

uint64_t SplitMix64::uniform(uint64_t bound) {
  TORCH_CHECK(bound >= 1, "SplitMix64::uniform: bound must be >= 1");
  // 2^64 mod bound: draws below it would make the low residues more likely.
  const uint64_t threshold = (0 - bound) % bound;
  while (true) {
    uint64_t r = next();
    if (r >= threshold) {
      return r % bound;
    }
  }
}

Batch make_batch(const TokenSource& source, const std::vector<int64_t>& starts, int64_t seq_len) {
  const int64_t rows = static_cast<int64_t>(starts.size());
  at::Tensor inputs = at::empty({rows, seq_len}, at::kLong);
  at::Tensor labels = at::empty({rows, seq_len}, at::kLong);
  std::vector<int64_t> window(static_cast<size_t>(seq_len + 1));
  int64_t* in = inputs.data_ptr<int64_t>();
  int64_t* lab = labels.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    source.read(starts[r], seq_len + 1, window.data());
    std::memcpy(in + r * seq_len, window.data(), sizeof(int64_t) * seq_len);
    std::memcpy(lab + r * seq_len, window.data() + 1, sizeof(int64_t) * seq_len);
  }
  return Batch{inputs, labels, rows * seq_len};
}

TrainSampler::TrainSampler(const TokenSource& source, int64_t batch_size, int64_t seq_len,
                           uint64_t seed)
    : source_(source), batch_size_(batch_size), seq_len_(seq_len), rng_(seed) {
  check_window_fits(source, batch_size, seq_len);
}

std::vector<int64_t> TrainSampler::next_starts() {
  const uint64_t num_starts = static_cast<uint64_t>(source_.size() - (seq_len_ + 1)) + 1;
  std::vector<int64_t> starts(static_cast<size_t>(batch_size_));
  for (int64_t& start : starts) {
    start = static_cast<int64_t>(rng_.uniform(num_starts));
  }
  return starts;
}

Batch TrainSampler::next() {
  return make_batch(source_, next_starts(), seq_len_);
}

EvalBatches::EvalBatches(const TokenSource& source, int64_t batch_size, int64_t seq_len,
                         int64_t max_batches)
    : source_(source), batch_size_(batch_size), seq_len_(seq_len) {
  check_window_fits(source, batch_size, seq_len);
  TORCH_CHECK(max_batches >= 0, "eval.max_batches must be >= 0, got ", max_batches);
  num_windows_ = source.size() / (seq_len + 1);
  if (max_batches > 0) {
    num_windows_ = std::min(num_windows_, max_batches * batch_size);
  }
}

std::optional<Batch> EvalBatches::next() {
  if (next_window_ >= num_windows_) {
    return std::nullopt;
  }
  int64_t end = std::min(num_windows_, next_window_ + batch_size_);
  std::vector<int64_t> starts;
  for (int64_t w = next_window_; w < end; ++w) {
    starts.push_back(w * (seq_len_ + 1));
  }
  next_window_ = end;
  return make_batch(source_, starts, seq_len_);
}

}  // namespace roundpipe::launcher
