// Chat training data of the launcher (data.format: chat): a JSONL file of conversations, rendered
// with the model's chat template and tokenized with its tokenizer (models::tokenize_chat marks the
// trained tokens), kept whole in memory and cut into batches whose labels are -100 wherever
// nothing is trained (docs/launcher.md, "Chat data").
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "roundpipe/launcher/token_data.h"
#include "roundpipe/models/chat_tokens.h"

namespace roundpipe::launcher {

struct ChatDataOptions {
  models::ChatTrainOn train_on = models::ChatTrainOn::kAssistant;
  /// Input tokens per row: a conversation keeps its first seq_len + 1 tokens (inputs and labels).
  int64_t seq_len = 256;
  /// The input id of padding positions (their labels are ignored; causal attention keeps them
  /// out of the real positions).
  int64_t pad_id = 0;
  /// data.packing: whole conversations packed into rows of seq_len input positions, best-fit
  /// decreasing (docs/launcher.md, "Chat data"); batches then carry the side inputs
  /// models::kPositionIds and kSegmentIds.
  bool packing = false;
};

/// What loading a chat file kept, cut and dropped (each line is one conversation).
struct ChatDataStats {
  int64_t lines = 0;              ///< conversations read (non-blank lines)
  int64_t conversations = 0;      ///< kept
  int64_t truncated = 0;          ///< kept, but longer than seq_len + 1 tokens: the end was cut
  int64_t tokens_cut = 0;         ///< tokens cut off the kept and dropped conversations
  int64_t dropped_untrained = 0;  ///< nothing to train even whole (e.g. no assistant turn)
  int64_t dropped_truncated = 0;  ///< every trained token was past seq_len + 1
  int64_t tokens = 0;             ///< kept tokens (after truncation)
  int64_t trained_tokens = 0;     ///< kept labels the loss counts
  int64_t packed_rows = 0;        ///< with packing: the rows the conversations were packed into
};

/// The conversations of one JSONL file as training rows. Immutable after load: const methods may be
/// called from any number of threads.
///
///   auto tmpl = models::ChatTemplate::from_model_dir(dir);
///   auto tok = models::Tokenizer::from_file(dir + "/tokenizer.json");
///   ChatDataset data = ChatDataset::load("train.jsonl", tmpl, tok, {});
///   Batch b = data.make_batch({0, 1});  // inputs/labels [2, longest row]
class ChatDataset {
 public:
  /// Reads every line of `path`: one JSON object {"messages": [{"role": "system" | "user" |
  /// "assistant", "content": "..."}, ...]} per line (blank lines are skipped). Throws ConfigError
  /// "PATH:LINE: what is wrong and how to fix it" at the first bad line (not JSON, not an object,
  /// `messages` missing or empty, a message without a string role/content, an unknown role, a
  /// conversation the template or the masking rule refuses), and for a file without any
  /// conversation or one where every conversation was dropped.
  static ChatDataset load(const std::string& path, const models::ChatTemplate& chat_template,
                          const models::Tokenizer& tokenizer, const ChatDataOptions& options);

  /// Training rows: conversations, or with packing the packed rows.
  int64_t size() const { return options_.packing ? static_cast<int64_t>(packs_.size()) : conversations(); }
  int64_t conversations() const { return static_cast<int64_t>(rows_.size()); }
  const ChatDataStats& stats() const { return stats_; }
  /// "chat file 'train.jsonl' (120 conversations, 9,310 tokens, 4,102 trained)".
  std::string describe() const;
  /// The rows `indices` (each in [0, size())) as one batch: inputs [rows, T] with T the longest of
  /// them (at most seq_len), right-padded with pad_id; labels[r][t] = the token after position t
  /// where that token is trained and belongs to the same conversation, else -100. `tokens` counts
  /// the non-padding inputs. With packing, a row holds the conversations of pack(i) one after the
  /// other, and side_inputs gets each position's place in its conversation (kPositionIds, from 0)
  /// and its conversation's index in the row (kSegmentIds; padding: one more).
  Batch make_batch(const std::vector<int64_t>& indices) const;
  /// Token ids and trained flags of conversation i (after truncation).
  const models::ChatTokens& row(int64_t i) const { return rows_.at(static_cast<size_t>(i)); }
  /// With packing: the conversations of packed row i, in their order in the row.
  const std::vector<int64_t>& pack(int64_t i) const { return packs_.at(static_cast<size_t>(i)); }

 private:
  std::string path_;
  ChatDataOptions options_;
  std::vector<models::ChatTokens> rows_;
  std::vector<std::vector<int64_t>> packs_;  // with packing: [packed row] conversation indices
  ChatDataStats stats_;
};

/// Training batches of a ChatDataset: epoch after epoch, every conversation once per epoch in the
/// order of a random permutation (Fisher-Yates driven by a SplitMix64 seeded from `seed` and the
/// epoch), `batch_rows` conversations per batch (a batch may span two epochs). The whole state is
/// the number of rows drawn so far, so checkpoints resume it exactly. Not thread-safe (one owner);
/// the dataset must outlive it.
class ChatSampler final : public BatchSampler {
 public:
  ChatSampler(const ChatDataset& data, int64_t batch_rows, uint64_t seed);
  Batch next() override;
  uint64_t state() const override { return drawn_; }
  void set_state(uint64_t state) override { drawn_ = state; }
  /// The conversation index of row number `n` (0-based, over all epochs).
  int64_t index_of(uint64_t n);

 private:
  const ChatDataset& data_;
  int64_t batch_rows_;
  uint64_t seed_;
  uint64_t drawn_ = 0;
  int64_t cached_epoch_ = -1;
  std::vector<int64_t> permutation_;
};

/// Evaluation batches of a ChatDataset: its conversations in file order, `batch_rows` per batch,
/// at most `max_batches` batches (0: all). Not thread-safe; the dataset must outlive it.
class ChatEvalBatches final : public BatchReader {
 public:
  ChatEvalBatches(const ChatDataset& data, int64_t batch_rows, int64_t max_batches);
  std::optional<Batch> next() override;

 private:
  const ChatDataset& data_;
  int64_t batch_rows_;
  int64_t end_;
  int64_t next_ = 0;
};

}  // namespace roundpipe::launcher
