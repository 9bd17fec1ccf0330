#include "scheduler/execute_plan.h"

#include <c10/util/Exception.h>

#include <sstream>

namespace roundpipe::scheduler {

std::string LayerRange::to_string() const {
  std::ostringstream out;
  out << "[" << begin << ", " << end << ")";
  return out.str();
}

const char* to_string(RunType type) {
  switch (type) {
    case RunType::kInfer: return "infer";
    case RunType::kTrain: return "train";
    case RunType::kFused: return "fused";
  }
  return "unknown";
}

ExecutePlan::ExecutePlan(std::vector<LayerRange> forward_stages, std::vector<LayerRange> backward_stages)
    : forward_(std::move(forward_stages)), backward_(std::move(backward_stages)) {}

namespace {

// Checks that `stages` (listed in ascending layer order) are non-empty and tile [first, last)
// exactly. `what` names the list in messages ("forward stage", "backward stage").
void check_tiling(const std::vector<LayerRange>& stages, const std::vector<size_t>& listed_index,
                  int64_t first, int64_t last, int64_t num_layers, const char* what) {
  int64_t expected = first;
  for (size_t k = 0; k < stages.size(); ++k) {
    const LayerRange& r = stages[k];
    const size_t i = listed_index[k];
    TORCH_CHECK(r.begin < r.end, what, " ", i, " ", r.to_string(),
                " is empty: every stage needs at least one layer (begin < end)");
    TORCH_CHECK(r.begin >= 0 && r.end <= num_layers, what, " ", i, " ", r.to_string(),
                " is outside the model's layers [0, ", num_layers, ")");
    TORCH_CHECK(r.begin <= expected || k == 0, what, " ", i, " ", r.to_string(),
                " leaves a gap: layers [", expected, ", ", r.begin, ") are in no ", what);
    TORCH_CHECK(r.begin >= expected || k == 0, what, " ", i, " ", r.to_string(),
                " overlaps the previous ", what, ": layers [", r.begin, ", ", expected,
                ") would run twice");
    TORCH_CHECK(k != 0 || r.begin == first, what, " ", i, " ", r.to_string(), " must start at layer ",
                first);
    expected = r.end;
  }
  TORCH_CHECK(expected <= last, what, "s end at layer ", expected, ", past layer ", last,
              " where they must stop", last < num_layers ? " (the fused stage starts there)" : "",
              ": shorten the last ", what);
  TORCH_CHECK(expected == last, what, "s must cover layers up to ", last, " but end at ", expected,
              stages.empty() ? " (there are none)" : "", ": add a stage for layers [", expected, ", ",
              last, ") or extend the last one");
}

}  // namespace

void ExecutePlan::validate(int64_t num_layers, RunType type) const {
  TORCH_CHECK(num_layers > 0, "an execute plan needs a model with at least one layer, got ", num_layers);
  std::vector<size_t> fwd_index(forward_.size());
  for (size_t i = 0; i < forward_.size(); ++i) fwd_index[i] = i;
  // Backward stages are listed deepest first; check them in ascending order.
  std::vector<LayerRange> bwd_ascending(backward_.rbegin(), backward_.rend());
  std::vector<size_t> bwd_index(backward_.size());
  for (size_t i = 0; i < backward_.size(); ++i) bwd_index[i] = backward_.size() - 1 - i;

  switch (type) {
    case RunType::kInfer:
      TORCH_CHECK(backward_.empty(), "an inference plan has no backward stages, got ", backward_.size(),
                  " (", to_string(), ")");
      check_tiling(forward_, fwd_index, 0, num_layers, num_layers, "forward stage");
      break;
    case RunType::kTrain:
      check_tiling(forward_, fwd_index, 0, num_layers, num_layers, "forward stage");
      check_tiling(bwd_ascending, bwd_index, 0, num_layers, num_layers, "backward stage");
      break;
    case RunType::kFused: {
      TORCH_CHECK(!backward_.empty(),
                  "a fused (forward_backward) plan needs at least one backward stage: the fused tail");
      const LayerRange& tail = backward_.front();
      TORCH_CHECK(tail.end == num_layers, "fused stage (backward stage 0) ", tail.to_string(),
                  " must end at the last layer: it runs the loss, so it must be [", tail.begin, ", ",
                  num_layers, ")");
      check_tiling(bwd_ascending, bwd_index, 0, num_layers, num_layers, "backward stage");
      // Forward stages feed the fused tail: they cover exactly [0, tail.begin).
      check_tiling(forward_, fwd_index, 0, tail.begin, num_layers, "forward stage");
      break;
    }
  }
}

ExecutePlan ExecutePlan::per_layer(int64_t num_layers, RunType type) {
  TORCH_CHECK(num_layers > 0, "per_layer plan needs at least one layer, got ", num_layers);
  std::vector<LayerRange> fwd;
  std::vector<LayerRange> bwd;
  const int64_t fwd_end = type == RunType::kFused ? num_layers - 1 : num_layers;
  for (int64_t i = 0; i < fwd_end; ++i) fwd.push_back({i, i + 1});
  if (type != RunType::kInfer) {
    for (int64_t i = num_layers - 1; i >= 0; --i) bwd.push_back({i, i + 1});
  }
  return ExecutePlan(std::move(fwd), std::move(bwd));
}

std::string ExecutePlan::to_string() const {
  std::ostringstream out;
  out << "fwd";
  for (const auto& r : forward_) out << " " << r.to_string();
  out << " | bwd";
  for (const auto& r : backward_) out << " " << r.to_string();
  return out.str();
}

}  // namespace roundpipe::scheduler
