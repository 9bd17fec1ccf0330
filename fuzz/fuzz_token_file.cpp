// libFuzzer target: the token file reader (open_token_file, Note [Token file format]) and the
// samplers over it. Any input must either be refused with c10::Error or give a source whose size
// and tokens match the header and the bytes, decoded here independently.
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "fuzz/fuzz_file.h"
#include "roundpipe/launcher/token_data.h"

namespace {

uint32_t le32(const uint8_t* p) {
  return uint32_t(p[0]) | uint32_t(p[1]) << 8 | uint32_t(p[2]) << 16 | uint32_t(p[3]) << 24;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace launcher = roundpipe::launcher;
  const std::string path = roundpipe::fuzz::write_input("tokens", data, size);
  std::unique_ptr<launcher::TokenSource> source;
  try {
    source = launcher::open_token_file(path);
  } catch (const c10::Error&) {
    return 0;  // refused with a message
  }
  // Independent reference: the header as documented.
  ROUNDPIPE_FUZZ_CHECK(size >= 1024 && le32(data) == 20240520u, "accepted files have the magic");
  const uint32_t width = le32(data + 4) == 1 ? 2 : 4;
  ROUNDPIPE_FUZZ_CHECK(le32(data + 4) == 1 || le32(data + 4) == 2, "accepted files have width 1 or 2");
  ROUNDPIPE_FUZZ_CHECK(source->size() == int64_t(le32(data + 8)), "size is header[2]");
  ROUNDPIPE_FUZZ_CHECK(size == 1024 + uint64_t(source->size()) * width, "file length matches the header");

  std::vector<int64_t> tokens(static_cast<size_t>(source->size()));
  source->read(0, source->size(), tokens.data());
  for (size_t i = 0; i < tokens.size(); ++i) {
    const uint8_t* p = data + 1024 + i * width;
    const int64_t expected = width == 2 ? int64_t(p[0] | p[1] << 8) : int64_t(le32(p));
    ROUNDPIPE_FUZZ_CHECK(tokens[i] == expected, "token i is the i-th little-endian word");
  }
  // The samplers cut windows of seq_len + 1 tokens whose labels are the inputs shifted by one.
  if (source->size() >= 2) {
    const int64_t seq_len = std::min<int64_t>(source->size() - 1, 1 + data[12] % 16);
    launcher::EvalBatches eval(*source, /*batch_size=*/1 + data[13] % 4, seq_len, /*max_batches=*/0);
    int64_t windows = 0;
    while (auto batch = eval.next()) {
      const auto* in = batch->inputs.data_ptr<int64_t>();
      const auto* lab = batch->labels.data_ptr<int64_t>();
      for (int64_t r = 0; r < batch->inputs.size(0); ++r, ++windows) {
        for (int64_t t = 0; t < seq_len; ++t) {
          const size_t at = static_cast<size_t>(windows * (seq_len + 1) + t);
          ROUNDPIPE_FUZZ_CHECK(in[r * seq_len + t] == tokens[at] && lab[r * seq_len + t] == tokens[at + 1],
                               "eval windows are consecutive");
        }
      }
    }
    ROUNDPIPE_FUZZ_CHECK(windows == source->size() / (seq_len + 1), "every whole window is evaluated once");
    launcher::TrainSampler train(*source, /*batch_size=*/2, seq_len, /*seed=*/data[14]);
    for (int64_t start : train.next_starts()) {
      ROUNDPIPE_FUZZ_CHECK(start >= 0 && start + seq_len + 1 <= source->size(), "train windows lie in the file");
    }
  }
  return 0;
}
