// Helpers of the `roundpipe` executable tests: run the built executable (path from the build) in a
// scratch directory and capture its exit code, stdout and stderr; tiny configurations.
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "launcher_test_util.h"
#include "roundpipe/launcher/atomic_file.h"

namespace roundpipe::launcher::testing {

struct CliResult {
  int code = -1;
  std::string out;
  std::string err;
};

/// Runs `roundpipe <args>` in `dir` with `env` ("NAME=value" words) prepended.
inline CliResult run_cli(const ScratchDir& dir, const std::string& args, const std::string& env = "") {
  const std::string out = dir.file(".cli.out"), err = dir.file(".cli.err");
  const std::string cmd = "cd '" + dir.path() + "' && " + env + " '" + ROUNDPIPE_CLI_PATH + "' " + args +
                          " > '" + out + "' 2> '" + err + "'";
  const int status = std::system(cmd.c_str());
  CliResult result;
  result.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  result.out = path_exists(out) ? read_file(out) : "";
  result.err = path_exists(err) ? read_file(err) : "";
  return result;
}

/// The last non-empty line of `text`.
inline std::string last_line(const std::string& text) {
  size_t end = text.find_last_not_of('\n');
  if (end == std::string::npos) return "";
  size_t begin = text.rfind('\n', end);
  return text.substr(begin == std::string::npos ? 0 : begin + 1, end - (begin == std::string::npos ? 0 : begin + 1) + 1);
}

/// A tiny Llama preset on synthetic data (vocab 64), 2 CPU workers.
inline std::string tiny_config(const std::string& out_dir) {
  return "out_dir: " + out_dir + R"(
model:
  preset: llama
  config: {vocab_size: 64, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2,
           num_attention_heads: 4, num_key_value_heads: 2, max_position_embeddings: 64}
data: {format: synthetic, seq_len: 16}
optimizer: {name: adamw, lr: 3.0e-3, weight_decay: 0.1}
schedule: {warmup_steps: 2, decay: cosine, min_lr: 1.0e-4}
train: {steps: 6, batch_size: 4, seed: 7}
run: {devices: 2, num_microbatch: 2, step_mode: async}
checkpoint: {every: 2, keep: 2}
eval: {every: 3, max_batches: 2}
log: {every: 1}
)";
}

}  // namespace roundpipe::launcher::testing
