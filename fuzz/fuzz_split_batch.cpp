// libFuzzer target: the microbatch splitter (detail::split_batch) on the path RoundPipe's forward
// and forward_backward take: batch_rows, resolve_run_config (num_microbatch defaulted, checked and
// clamped to the rows), then split_batch. The bytes encode the call:
//   [0] devices - 1 (mod 4), [1] num_microbatch as int8 (0: unset), [2] tensors - 1 (mod 4),
//   then per tensor [kind] (mod 5: undefined, 0-dim, or 1-3 dims; bit 7: its rows differ from the
//   first tensor's) and one byte per dimension (size mod 9).
// Any call must either be refused with c10::Error (num_microbatch < 1, mismatched rows) or give
// num_microbatch microbatches whose pieces reassemble into the inputs, checked here by hand.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <vector>

#include "fuzz/fuzz_file.h"
#include "roundpipe/detail/run_launcher.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace detail = roundpipe::detail;
  size_t pos = 0;
  auto next = [&]() -> uint8_t { return pos < size ? data[pos++] : 0; };
  const int64_t devices = 1 + next() % 4;
  const auto mb_byte = static_cast<int8_t>(next());
  const int64_t count = 1 + next() % 4;
  std::vector<at::Tensor> inputs;
  int64_t first_rows = -1;
  bool mismatched = false;
  for (int64_t i = 0; i < count; ++i) {
    const uint8_t kind = next();
    const int64_t dims = (kind & 0x7f) % 5 - 1;  // -1: undefined
    if (dims < 0) {
      inputs.emplace_back();
      continue;
    }
    std::vector<int64_t> shape;
    for (int64_t d = 0; d < dims; ++d) shape.push_back(next() % 9);
    if (dims > 0) {
      if (first_rows < 0) {
        first_rows = shape[0];
      } else if (!(kind & 0x80)) {
        shape[0] = first_rows;
      }
      mismatched = mismatched || shape[0] != first_rows;
    }
    inputs.push_back(at::arange(c10::multiply_integers(shape), at::kFloat).reshape(shape) + 1000 * i);
  }

  const int64_t rows = detail::batch_rows(inputs);
  ROUNDPIPE_FUZZ_CHECK(rows == first_rows, "rows = size(0) of the first tensor with a dimension");
  if (rows <= 0) return 0;  // RoundPipe refuses such calls before splitting
  roundpipe::RunConfig call;
  if (mb_byte != 0) call.num_microbatch = mb_byte;
  detail::ResolvedRunConfig cfg;
  try {
    cfg = detail::resolve_run_config(call, roundpipe::RunConfig{}, roundpipe::scheduler::RunType::kTrain, devices, rows);
  } catch (const c10::Error&) {
    ROUNDPIPE_FUZZ_CHECK(mb_byte < 0, "only num_microbatch < 1 is refused");
    return 0;
  }
  const int64_t asked = mb_byte != 0 ? mb_byte : devices + 1;
  const int64_t m = cfg.num_microbatch;
  ROUNDPIPE_FUZZ_CHECK(m == std::min(asked, rows), "num_microbatch clamped to the rows");
  ROUNDPIPE_FUZZ_CHECK(cfg.clamped_from.has_value() == (asked > rows), "clamping reported");

  std::vector<roundpipe::detail::Activations> per_mb;
  try {
    per_mb = detail::split_batch(inputs, m, "inputs", "fuzz");
  } catch (const c10::Error&) {
    ROUNDPIPE_FUZZ_CHECK(mismatched, "only mismatched rows are refused");
    return 0;
  }
  ROUNDPIPE_FUZZ_CHECK(!mismatched, "mismatched rows are refused");
  ROUNDPIPE_FUZZ_CHECK(static_cast<int64_t>(per_mb.size()) == m, "one entry per microbatch");
  for (size_t i = 0; i < inputs.size(); ++i) {
    const at::Tensor& t = inputs[i];
    std::vector<at::Tensor> pieces;
    for (int64_t j = 0; j < m; ++j) {
      ROUNDPIPE_FUZZ_CHECK(per_mb[j].size() == inputs.size(), "every microbatch holds every tensor");
      const at::Tensor& piece = per_mb[j][i];
      if (!t.defined() || t.dim() == 0) {
        ROUNDPIPE_FUZZ_CHECK(piece.is_same(t), "undefined and 0-dim tensors are replicated");
        continue;
      }
      // Rows of microbatch j: the first rows % m microbatches hold one row more (tensor_split).
      const int64_t expected_rows = rows / m + (j < rows % m ? 1 : 0);
      ROUNDPIPE_FUZZ_CHECK(piece.size(0) == expected_rows, "microbatch rows differ by at most one");
      pieces.push_back(piece);
    }
    if (!pieces.empty()) {
      ROUNDPIPE_FUZZ_CHECK(at::cat(pieces, 0).equal(t), "the pieces reassemble into the input");
    }
  }
  return 0;
}
