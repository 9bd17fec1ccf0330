// models::Tokenizer throughput on one thread: encodes every line of the given text files (e.g. the
// fortunes corpus) with the given tokenizer.json, three passes (the first with a cold per-word
// cache), and prints lines, tokens and tokens/s. docs/models.md, "Tokenizer", has the numbers and
// the matching Hugging Face `tokenizers` command.
//
//   tokenizer_bench TOKENIZER_JSON FILE...
#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "roundpipe/models/tokenizer.h"

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s TOKENIZER_JSON FILE...\n", argv[0]);
    return 2;
  }
  const auto tok = roundpipe::models::Tokenizer::from_file(argv[1]);
  std::vector<std::string> lines;
  size_t bytes = 0;
  for (int i = 2; i < argc; ++i) {
    std::ifstream in(argv[i]);
    for (std::string line; std::getline(in, line);) {
      bytes += line.size();
      lines.push_back(std::move(line));
    }
  }
  for (int pass = 0; pass < 3; ++pass) {
    const auto start = std::chrono::steady_clock::now();
    size_t tokens = 0;
    for (const auto& line : lines) tokens += tok.encode(line).size();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::printf("pass %d: %zu lines, %zu bytes, %zu tokens, %.3f s, %.0f tokens/s\n", pass, lines.size(), bytes,
                tokens, s, static_cast<double>(tokens) / s);
  }
  return 0;
}
