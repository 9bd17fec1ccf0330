// The launcher's `generate` and `chat` subcommands: text from a configured model (model.pretrained,
// its LoRA adapter, or a `roundpipe train` checkpoint) through models::generate, with the model
// directory's tokenizer and chat template, streamed to stdout. docs/launcher.md, "Generate and chat".
#pragma once

#include <cstdint>
#include <istream>
#include <ostream>
#include <string>
#include <vector>

#include "roundpipe/launcher/config.h"

namespace roundpipe::launcher {

/// Options of `roundpipe generate` and `roundpipe chat` (models::GenerateOptions plus the CLI's own).
struct GenerateCommandOptions {
  int64_t max_new_tokens = 256;
  double temperature = 0.0;  ///< 0: greedy
  double top_p = 1.0;
  int64_t top_k = 0;  ///< 0: off
  uint64_t seed = 0;
  /// The prompt's text is tokenized as it is, without the chat template (generate only).
  bool raw = false;
  /// A `roundpipe train` checkpoint directory (full: config.json + safetensors; LoRA: a PEFT
  /// adapter over model.pretrained) to load instead of model.pretrained's weights; "" = none.
  std::string checkpoint;
  /// After each answer, a line `ids: <token ids>` (the generated ids, the stop token included).
  bool print_ids = false;
  /// generate only: prompts generated together, left-padded (models::generate_batch); >= 1.
  int64_t batch_size = 1;
  /// Generate through RoundPipe over every device of run.devices (models::generate_batch_streamed:
  /// the stages streamed, no KV cache) even when the model fits the first device. Without it, that
  /// happens only when the parameters exceed 80% of a CUDA first device's memory.
  bool streamed = false;
};

/// Generates an answer to each prompt: each one rendered as one user message with
/// add_generation_prompt (unless `raw`), tokenized, generated until the tokenizer_config's
/// eos_token, the config's eos_token_id(s) or max_new_tokens, then printed to `out` in prompt
/// order, each answer followed by a newline (and answers separated by an empty line). The prompts
/// go options.batch_size at a time through models::generate_batch; the first answer of each batch
/// streams as it comes (whole UTF-8 characters only), the others print when their batch ends. Throws ConfigError (exit
/// code 2) for bad options, a config without model.pretrained, a checkpoint directory that is not one, an empty or too
/// long prompt.
void run_generate(const LauncherConfig& config, const std::vector<std::string>& prompts,
                  const GenerateCommandOptions& options, std::ostream& out);

/// An interactive conversation: each line read from `in` is a user message; the conversation so
/// far is rendered with the chat template, and the answer is streamed to `out` and kept in the
/// history. `/reset` forgets the conversation, `/exit` or the end of `in` ends. Turn t (from 0)
/// samples with seed + t. Throws as run_generate.
void run_chat(const LauncherConfig& config, const GenerateCommandOptions& options, std::istream& in, std::ostream& out);

}  // namespace roundpipe::launcher
