// Byte-level BPE tokenizer of roundpipe::models: reads a Hugging Face `tokenizer.json` (SmolLM2 /
// GPT-2, Qwen2/Qwen3, Llama-3 style) and produces the token ids (and offsets) of Hugging Face
// `tokenizers`.
// Plain C++ (no LibTorch); what the file may contain and what is refused: docs/models.md,
// "Tokenizer".
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace roundpipe::models {

/// A byte-level BPE tokenizer loaded from a `tokenizer.json`. Immutable after `from_file`:
/// every const method may be called from any number of threads at once (the per-word BPE cache
/// is guarded by a mutex inside). Copies share the loaded tables (cheap to copy).
///
///   auto tok = Tokenizer::from_file(dir + "/tokenizer.json");
///   std::vector<int64_t> ids = tok.encode("Hello world");
///   std::string text = tok.decode(ids);  // "Hello world"
///   auto enc = tok.encode_with_offsets("Hello world");  // offsets {0, 5}, {5, 11} (" world")
class Tokenizer {
 public:
  /// Loads and validates `tokenizer_json_path`. Throws std::runtime_error naming the file, the
  /// JSON key and the value for a malformed file or a component this tokenizer does not
  /// implement (docs/models.md, "Tokenizer", lists them).
  static Tokenizer from_file(const std::string& tokenizer_json_path);
  /// As from_file, from the file's contents; `origin` names it in error messages.
  static Tokenizer from_json(std::string_view json, const std::string& origin = "<memory>");

  /// Token ids of `text` (valid UTF-8, else std::invalid_argument): added tokens split out first,
  /// then normalizer, pre-tokenizer and BPE as in `tokenizers`' `encode(text,
  /// add_special_tokens)`. With `add_special_tokens`, the post-processor's template (e.g.
  /// Llama-3's `<|begin_of_text|>`) is applied.
  std::vector<int64_t> encode(std::string_view text, bool add_special_tokens = false) const;

  /// Token ids and where each token came from in `text`.
  struct Encoding {
    std::vector<int64_t> ids;  ///< the same as encode(text, add_special_tokens)
    /// offsets[i] = [begin, end): BYTE offsets into the original `text` (before the normalizer)
    /// of token i, as `tokenizers`' Encoding.offsets (the Python binding counts characters where
    /// this counts their UTF-8 bytes). Tokens of the post-processor's template get {0, 0}; an
    /// added token found in the text gets its own span; a token holding part of a multi-byte
    /// character spans the whole character; through NFC a composed character aligns to its first
    /// original character. A ByteLevel post-processor with `trim_offsets` trims spaces off the
    /// spans as `tokenizers` does. docs/models.md, "Tokenizer", has the rules.
    std::vector<std::pair<int64_t, int64_t>> offsets;
  };
  /// encode() with offsets (`tokenizers`' `encode(text).offsets`, `return_offsets_mapping` in
  /// transformers). Throws std::invalid_argument for invalid UTF-8, and std::runtime_error for
  /// text whose NFC alignment it does not model (docs/models.md, "Tokenizer"); encode() still
  /// works on such text. Slower than encode(): it builds an alignment table per text.
  Encoding encode_with_offsets(std::string_view text, bool add_special_tokens = false) const;

  /// Text of `ids` through the ByteLevel decoder; bytes that do not form UTF-8 become U+FFFD (as
  /// `tokenizers`' decode). Unknown ids are skipped, as in `tokenizers`.
  std::string decode(const std::vector<int64_t>& ids, bool skip_special_tokens = false) const;

  /// Id of a vocabulary or added token (its text as in the file, e.g. "<|im_start|>" or "Ġthe").
  std::optional<int64_t> token_to_id(std::string_view token) const;
  /// Text of a token id as in the file, or nullopt for an id nothing maps to.
  std::optional<std::string> id_to_token(int64_t id) const;
  /// One past the largest id of the vocabulary and the added tokens (the embedding rows needed).
  int64_t vocab_size() const;

  ~Tokenizer();
  Tokenizer(const Tokenizer&);
  Tokenizer& operator=(const Tokenizer&);
  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;

 private:
  struct Impl;
  explicit Tokenizer(std::shared_ptr<const Impl> impl);
  std::shared_ptr<const Impl> impl_;
};

}  // namespace roundpipe::models
