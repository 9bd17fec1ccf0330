// Training data of the launcher: token streams (memory-mapped token files, raw bytes, or a
// deterministic synthetic stream) and the batch samplers that cut them into [batch, seq_len]
// input/label windows. The training loop owns one TrainSampler and, for evaluation, EvalBatches.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "roundpipe/side_inputs.h"

namespace roundpipe::launcher {

// Note [Token file format]:
// A token file is a 1024-byte header of 256 little-endian int32 followed by the tokens:
//   header[0] = 20240520 (magic), header[1] = 1 (uint16 tokens) or 2 (uint32 tokens),
//   header[2] = number of tokens, header[3..255] = 0.
// The file is exactly 1024 + header[2] * (2 or 4) bytes long; anything else is refused (a
// truncated copy or a file appended to after writing). scripts/prepare_data.py writes these from
// text with a HF tokenizer.json; write_token_file writes them from C++.
constexpr int32_t kTokenFileMagic = 20240520;
constexpr int64_t kTokenFileHeaderInts = 256;
constexpr int64_t kTokenFileHeaderBytes = kTokenFileHeaderInts * 4;

enum class TokenWidth { kUint16 = 1, kUint32 = 2 };

/// A random-access stream of tokens. Thread-safety: const methods may be called concurrently.
class TokenSource {
 public:
  virtual ~TokenSource() = default;
  /// Number of tokens.
  virtual int64_t size() const = 0;
  /// Copies tokens [start, start + count) to `out`; the range must lie within [0, size()).
  virtual void read(int64_t start, int64_t count, int64_t* out) const = 0;
  /// What this is, for messages ("token file 'x.bin'").
  virtual std::string describe() const = 0;
  /// The vocabulary size when the source knows it (bytes: 256, synthetic: its vocab), else
  /// nullopt (token files do not record it).
  virtual std::optional<int64_t> vocab_size() const = 0;
};

/// Memory-maps a token file (Note [Token file format]); throws c10::Error naming the file, the
/// header field at fault and the fix when the header is wrong.
std::unique_ptr<TokenSource> open_token_file(const std::string& path);

/// Memory-maps any file as a stream of byte tokens (vocab 256).
std::unique_ptr<TokenSource> open_byte_file(const std::string& path);

/// A deterministic stream of `num_tokens` tokens in [0, vocab_size), a pure function of (seed,
/// position); see Note [Synthetic tokens]. Use different seeds for training and evaluation data.
std::unique_ptr<TokenSource> make_synthetic_tokens(uint64_t seed, int64_t vocab_size, int64_t num_tokens);

// Note [Synthetic tokens]:
// The stream is cut into segments of kSyntheticSegment tokens. Segment k is an arithmetic sequence
// token(i) = (b_k + a_k * (i mod 64)) mod vocab with stride a_k = 1 + mix(seed ^ mix(2k)) mod
// (vocab - 1) and offset b_k = mix(seed ^ mix(2k + 1)) mod vocab, where mix is splitmix64's output
// function (x ^= x >> 30; x *= 0xBF58476D1CE4E5B9; x ^= x >> 27; x *= 0x94D049BB133111EB;
// x ^= x >> 31, all mod 2^64). A model cannot predict the first token of a segment
// nor (without seeing it) the stride, but after two tokens the rest of the segment follows, so a
// model that learns in-context arithmetic drives the loss well below ln(vocab): a learnable
// smoke-test task that needs no files.
constexpr int64_t kSyntheticSegment = 64;

/// Writes a token file atomically (Note [Token file format]); throws naming the first token that
/// does not fit `width` (or is negative) and when there are more than 2^31 - 1 tokens.
void write_token_file(const std::string& path, const std::vector<int64_t>& tokens, TokenWidth width);

/// splitmix64 (Steele, Lea, Flood 2014): a tiny platform-independent PRNG whose whole state is one
/// uint64, so checkpoints can store it.
class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t state) : state_(state) {}
  uint64_t next();
  /// Uniform integer in [0, bound) without modulo bias (rejection sampling); bound >= 1.
  uint64_t uniform(uint64_t bound);
  uint64_t state() const { return state_; }
  void set_state(uint64_t state) { state_ = state; }

 private:
  uint64_t state_;
};

/// The label of a position the loss skips (models::kIgnoreIndex, torch's cross_entropy default).
inline constexpr int64_t kIgnoreLabel = -100;

/// One batch: `inputs` and `labels` are int64 [B, T] on the CPU; labels[b][t] is the token that
/// follows inputs[b][t] in the stream (token streams: T = seq_len), or -100 where the loss skips
/// the position (chat data: untrained tokens and padding).
struct Batch {
  at::Tensor inputs;
  at::Tensor labels;
  int64_t tokens = 0;  ///< non-padding input positions (token streams: B * seq_len)
  /// Per-row side inputs for the layers (packed chat rows: positions and segment ids, [B, T]);
  /// install them with a SideInputScope around the model's call. Empty otherwise.
  SideInputs side_inputs = {};
};

/// Training batches of any data format: an endless stream whose position is one integer, so a
/// checkpoint stores it and a resumed run draws the same batches.
class BatchSampler {
 public:
  virtual ~BatchSampler() = default;
  virtual Batch next() = 0;
  /// After set_state(state()) the sampler continues identically.
  virtual uint64_t state() const = 0;
  virtual void set_state(uint64_t state) = 0;
};

/// Evaluation batches of any data format: a finite sequence.
class BatchReader {
 public:
  virtual ~BatchReader() = default;
  /// The next batch, or nullopt after the last one.
  virtual std::optional<Batch> next() = 0;
};

/// Draws training batches: each of the `batch_size` windows starts at a position drawn uniformly
/// from [0, size - (seq_len + 1)] by a SplitMix64 seeded with `seed`, windows in draw order.
/// Thread-safety: not thread-safe (one owner). The source must outlive the sampler.
///
///   TrainSampler sampler(*source, /*batch_size=*/8, /*seq_len=*/256, /*seed=*/1234);
///   Batch batch = sampler.next();
///   uint64_t saved = sampler.state();   // checkpoint; sampler.set_state(saved) resumes
class TrainSampler final : public BatchSampler {
 public:
  /// Throws c10::Error when the source holds fewer than seq_len + 1 tokens.
  TrainSampler(const TokenSource& source, int64_t batch_size, int64_t seq_len, uint64_t seed);

  Batch next() override;
  /// Window starts of the next batch without building tensors (advances the state like next()).
  std::vector<int64_t> next_starts();

  /// The generator state: after set_state(state()) the sampler continues identically.
  uint64_t state() const override { return rng_.state(); }
  void set_state(uint64_t state) override { rng_.set_state(state); }

 private:
  const TokenSource& source_;
  int64_t batch_size_;
  int64_t seq_len_;
  SplitMix64 rng_;
};

/// Evaluation batches: consecutive non-overlapping windows of seq_len + 1 tokens from the start of
/// the source (window w starts at w * (seq_len + 1)), batch_size windows per batch; at most
/// `max_batches` batches (0: all windows). The last batch may hold fewer windows.
/// Thread-safety: not thread-safe (one owner). The source must outlive it.
class EvalBatches final : public BatchReader {
 public:
  /// Throws c10::Error when the source holds fewer than seq_len + 1 tokens.
  EvalBatches(const TokenSource& source, int64_t batch_size, int64_t seq_len, int64_t max_batches);

  std::optional<Batch> next() override;
  /// Starts over from the first window.
  void reset() { next_window_ = 0; }
  int64_t num_windows() const { return num_windows_; }
  int64_t num_batches() const { return (num_windows_ + batch_size_ - 1) / batch_size_; }

 private:
  const TokenSource& source_;
  int64_t batch_size_;
  int64_t seq_len_;
  int64_t num_windows_;
  int64_t next_window_ = 0;
};

/// Builds the batch whose windows start at `starts` (each window seq_len + 1 tokens).
Batch make_batch(const TokenSource& source, const std::vector<int64_t>& starts, int64_t seq_len);

}  // namespace roundpipe::launcher
