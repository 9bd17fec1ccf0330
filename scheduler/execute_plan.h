// Execute plans: how a model's layers are grouped into forward and backward stages.
// Pure CPU logic (no threads, no CUDA); the runtime executes plans, the partitioner builds them.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace roundpipe::scheduler {

/// A half-open range of layer indices [begin, end).
struct LayerRange {
  int64_t begin = 0;
  int64_t end = 0;

  int64_t size() const { return end - begin; }
  bool contains(int64_t layer) const { return layer >= begin && layer < end; }
  bool operator==(const LayerRange& other) const { return begin == other.begin && end == other.end; }
  bool operator!=(const LayerRange& other) const { return !(*this == other); }
  std::string to_string() const;  // "[begin, end)"
};

/// What a plan is for.
/// - kInfer: forward stages only, covering every layer.
/// - kTrain: forward stages covering every layer, then backward stages (with recompute) covering
///   every layer; used when forward and backward are separate calls.
/// - kFused: `forward_backward`: forward stages cover [0, f), the first backward stage is the
///   fused tail [f, L) (forward + loss + backward, no recompute), later backward stages cover
///   [0, f) from deep to shallow.
enum class RunType { kInfer, kTrain, kFused };

const char* to_string(RunType type);

/// Forward stages in ascending layer order; backward stages deepest first (the order they run).
/// Value type; thread-compatible (const methods may be called concurrently).
///
/// Example (4 layers, fused): forward {[0,3)}, backward {[3,4), [2,3), [1,2), [0,1)}.
class ExecutePlan {
 public:
  ExecutePlan() = default;
  ExecutePlan(std::vector<LayerRange> forward_stages, std::vector<LayerRange> backward_stages);

  const std::vector<LayerRange>& forward_stages() const { return forward_; }
  const std::vector<LayerRange>& backward_stages() const { return backward_; }
  int64_t num_stages() const { return static_cast<int64_t>(forward_.size() + backward_.size()); }
  bool empty() const { return forward_.empty() && backward_.empty(); }

  /// Throws c10::Error naming the offending range when the plan does not fit `num_layers`
  /// layers for `type`: empty ranges, gaps, overlaps, ranges past the last layer, forward not
  /// starting at 0 or not ending where it must, a fused stage not ending at the last layer.
  void validate(int64_t num_layers, RunType type) const;

  /// One stage per layer: forward {[0,1), ..., [L-2,L-1)} + fused {[L-1,L)} + backward per layer
  /// for kFused; analogous for kTrain / kInfer.
  static ExecutePlan per_layer(int64_t num_layers, RunType type);

  /// "fwd [0, 3) | bwd [3, 4) [2, 3) ..." (single line).
  std::string to_string() const;

  bool operator==(const ExecutePlan& other) const {
    return forward_ == other.forward_ && backward_ == other.backward_;
  }
  bool operator!=(const ExecutePlan& other) const { return !(*this == other); }

 private:
  std::vector<LayerRange> forward_;
  std::vector<LayerRange> backward_;
};

}  // namespace roundpipe::scheduler
