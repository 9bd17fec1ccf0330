// Data parallelism across processes: averages each forward_backward's parameter gradients over
// the ranks of a comm::ProcessGroup, in buckets launched while the backward still runs (internal).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "comm/process_group.h"
#include "roundpipe/detail/stage_jobs.h"

namespace roundpipe::detail {

/// Cumulative counters of a GradSync (RoundPipe::data_parallel_stats).
struct GradSyncStats {
  int64_t runs = 0;
  int64_t buckets = 0;       // collectives launched for gradients
  int64_t bytes = 0;         // gradient bytes all-reduced (per rank)
  double wait_ms = 0.0;      // caller time spent waiting for them after the backward finished
};

/// Note [Gradient buckets]: the bucket layout is fixed at construction from the model alone
/// (layers from last to first, each trainable parameter use once, whole layers per bucket, a new
/// bucket once `bucket_bytes` is reached, one flat tensor per gradient dtype in a bucket), never
/// from the plan: plans may differ between ranks (measured layer times), the order and sizes of
/// collectives must not. A bucket is launched when every layer in it has its gradients final
/// (reported by the stage jobs of any worker), and buckets are launched strictly in order, by
/// whichever thread completes the prefix, under `mutex_`: every rank issues the same collectives
/// in the same order. The caller then waits for them, divides by the world size and hands the
/// averaged gradients over as views of the flat buckets (no copy back).
///
/// Thread-safety: begin/finish/abandon on the caller thread; layers_ready from any worker thread
/// during a run (guarded by `mutex_`).
class GradSync {
 public:
  /// `uses`, `params` as in LayerSet::uses and RoundPipe's compute copies.
  GradSync(std::shared_ptr<comm::ProcessGroup> group, const LayerSet& layers,
           const std::vector<std::vector<at::Tensor>>& params, int64_t bucket_bytes);

  /// A run starts; its stage jobs will fill `grads` ([layer][use]).
  void begin(std::vector<std::vector<at::Tensor>>* grads);
  /// Layers [begin, end) have their final gradients in the run's grads.
  void layers_ready(int64_t begin, int64_t end);
  /// After every job of the run succeeded: waits for the buckets and replaces the run's gradients
  /// by their average over the ranks.
  void finish();
  /// After a failed run: this rank's collectives are out of step with the others'; every later
  /// call fails with an error that says so.
  void abandon();

  int64_t world_size() const { return group_->world_size(); }
  comm::ProcessGroup& group() { return *group_; }
  GradSyncStats stats() const;

 private:
  struct Entry {
    int64_t layer = 0;
    int64_t use = 0;
    int64_t offset = 0;  // in the flat tensor of its dtype
    std::vector<int64_t> shape;
  };
  struct Flat {
    c10::ScalarType dtype = c10::kFloat;
    int64_t numel = 0;
    std::vector<Entry> entries;
    at::Tensor buffer;  // per run
    comm::Work work;    // per run
  };
  struct Bucket {
    std::vector<Flat> flats;
    int64_t layers = 0;     // how many layers it spans
    int64_t remaining = 0;  // per run: layers not yet ready
  };

  void launch(Bucket& bucket);
  void check_usable() const;

  std::shared_ptr<comm::ProcessGroup> group_;
  std::vector<Bucket> buckets_;
  std::vector<int64_t> bucket_of_layer_;
  mutable std::mutex mutex_;
  std::vector<std::vector<at::Tensor>>* grads_ = nullptr;  // guarded by mutex_ during a run
  size_t next_launch_ = 0;                                   // guarded by mutex_
  bool broken_ = false;                                      // caller thread
  GradSyncStats stats_;                                      // guarded by mutex_
};

/// Rank 0's parameters and buffers copied into every rank's (at construction), after checking that
/// every rank built the same model (names, shapes, dtypes). Caller thread.
void broadcast_model(comm::ProcessGroup& group, const std::string& model_name, const LayerSet& layers);

}  // namespace roundpipe::detail
