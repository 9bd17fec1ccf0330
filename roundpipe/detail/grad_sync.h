// Data parallelism across processes: averages each forward_backward's parameter gradients over
// the ranks of a comm::ProcessGroup, in buckets launched while the backward still runs, runs
// overlapping (internal).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <vector>

#include "comm/process_group.h"
#include "roundpipe/detail/stage_jobs.h"

namespace roundpipe::detail {

/// Cumulative counters of a GradSync (RoundPipe::data_parallel_stats).
struct GradSyncStats {
  int64_t runs = 0;
  int64_t buckets = 0;   // collectives launched for gradients
  int64_t bytes = 0;     // gradient bytes all-reduced (per rank)
  double wait_ms = 0.0;  // time finish() spent waiting for them after the backward finished
};

/// Note [Gradient buckets]: the bucket layout is fixed at construction from the model alone
/// (layers from last to first, each trainable parameter use once, whole layers per bucket, a new
/// bucket once `bucket_bytes` is reached, one flat tensor per gradient dtype in a bucket), never
/// from the plan: plans may differ between ranks (measured layer times), the order and sizes of
/// collectives must not. A bucket is launched when every layer in it has its gradients final
/// (reported by the stage jobs of any worker). Every rank issues the same collectives in the same
/// order: runs in the order of begin() (the caller's forward_backward calls), within a run its
/// buckets in order and then one all-reduce (max) of the run's found_inf sum, given by finish()
/// once all of the run's jobs are done. Whichever thread completes the prefix launches, under
/// `mutex_`: a bucket of the next run that is ready before this run's found_inf waits for it.
/// Runs overlap (Note [Overlapping iterations] in round_pipe.cpp): the next run begins, and its
/// jobs report layers, while the previous run's tail still waits for its buckets.
///
/// The collectives go over a group split from the caller's (ProcessGroup::split), so the caller's
/// own collectives (the launcher's loss average, a barrier) never interleave with these, which run
/// on other threads and, with overlapping runs, after forward_backward has returned.
///
/// finish() waits for a run's collectives (outside `mutex_`: the next run's layers are reported
/// meanwhile), divides by the world size and copies the averages into the run's gradients.
///
/// Thread-safety: begin on the caller thread; layers_ready from any worker thread during a run;
/// finish/abandon on the thread that owns the run's tail. Shared state is guarded by `mutex_`; a
/// Run's buffers and works belong to it (written under `mutex_` when launched, read by its
/// finish after all of them were launched).
class GradSync {
 public:
  /// One forward_backward's averaging.
  struct Run;

  /// `uses`, `params` as in LayerSet::uses and RoundPipe's compute copies.
  GradSync(std::shared_ptr<comm::ProcessGroup> group, const LayerSet& layers,
           const std::vector<std::vector<at::Tensor>>& params, int64_t bucket_bytes);
  ~GradSync();

  /// A run starts; its stage jobs will fill `grads` ([layer][use]), which must outlive it.
  std::shared_ptr<Run> begin(std::vector<std::vector<at::Tensor>>* grads);
  /// Layers [begin, end) have their final gradients in the run's grads.
  void layers_ready(Run& run, int64_t begin, int64_t end);
  /// After every job of the run succeeded: all-reduces `found_inf` (a [1] float CPU tensor, this
  /// rank's found_inf sum; max over the ranks), waits for the run's buckets and replaces the run's
  /// gradients by their average over the ranks. Returns the combined found_inf ([1]).
  at::Tensor finish(Run& run, at::Tensor found_inf);
  /// After a failed run: this rank's collectives are out of step with the others' (they may have
  /// launched what this run never will); every later call fails with an error that says so.
  void abandon(Run& run);

  int64_t world_size() const { return group_->world_size(); }
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
  };
  struct Bucket {
    std::vector<Flat> flats;
    int64_t layers = 0;  // how many layers it spans
  };

  void launch(Run& run, size_t bucket);
  void pump();
  void check_usable() const;

  std::shared_ptr<comm::ProcessGroup> group_;  // split from the caller's; before the runs' works
  std::vector<Bucket> buckets_;
  std::vector<int64_t> bucket_of_layer_;
  mutable std::mutex mutex_;
  std::deque<std::shared_ptr<Run>> launching_;  // guarded by mutex_: begun runs not fully launched
  bool broken_ = false;                         // guarded by mutex_
  GradSyncStats stats_;                         // guarded by mutex_
};

/// Rank 0's parameters and buffers copied into every rank's (at construction), after checking that
/// every rank built the same model (names, shapes, dtypes). Caller thread.
void broadcast_model(comm::ProcessGroup& group, const std::string& model_name, const LayerSet& layers);

}  // namespace roundpipe::detail
