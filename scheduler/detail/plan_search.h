// The planner's search (internal): plans as stage cuts, their simulated scores, the seeds, the
// local moves, the iterated local search and the enumeration (Note [Simulation-based planning]
// in planner.cpp).
#pragma once

#include <cstdint>
#include <limits>
#include <optional>
#include <utility>
#include <vector>

#include "scheduler/detail/pipeline_model.h"
#include "scheduler/planner.h"

namespace roundpipe::scheduler::detail {

/// Relative tolerance for comparing simulated times.
constexpr double kRelTol = 1e-9;

/// A plan: the fused tail's first layer (kFused; else the layer count) and the forward and
/// backward stage boundaries strictly inside [0, tail), ascending.
struct Cuts {
  int64_t tail = 0;
  std::vector<int64_t> fwd;
  std::vector<int64_t> bwd;
  bool operator==(const Cuts& o) const { return tail == o.tail && fwd == o.fwd && bwd == o.bwd; }
};

/// A plan's simulated objective, and the tie-break.
struct Score {
  double primary = std::numeric_limits<double>::infinity();
  double secondary = std::numeric_limits<double>::infinity();
};

/// Lexicographic, with kRelTol slack.
bool better(const Score& a, const Score& b);

/// Plans, scores and searches for one microbatch count. Holds references to `costs` and
/// `options`, which must outlive it. Not thread-safe (reuses buffers).
class PlanSearch {
 public:
  PlanSearch(const std::vector<LayerCost>& costs, RunType type, int64_t num_microbatch,
             const PlannerOptions& options);

  int64_t evaluations() const { return evaluations_; }
  /// Whether the evaluation and simulation budgets (and the current share) are not spent.
  bool budget_left() const;
  /// Caps further search at 1 / `parts` of the budget left.
  void share_budget(int64_t parts);
  bool has_backward() const { return type_ != RunType::kInfer; }

  ExecutePlan to_plan(const Cuts& c) const;
  Cuts from_plan(const ExecutePlan& plan) const;
  /// Every stage of `c` within the memory budget.
  bool feasible(const Cuts& c) const;
  /// Simulates `c` (counted against the budget).
  Score evaluate(const Cuts& c);

  /// Boundaries of a greedy tiling of [first, last) into stages of time <= cap (a stage always
  /// takes one layer) and bytes within the budget; `from_end` leaves the short stage at `first`.
  /// With `ramp` > 0 the k-th stage from `first` may take only cap x (k + 1) / ramp while
  /// k < ramp (growing stages: the pipeline fills, resp. drains, sooner).
  std::vector<int64_t> greedy(int64_t first, int64_t last, bool backward, double cap, bool from_end,
                              int64_t ramp = 0) const;
  /// The greedy plan for caps (fwd_cap, bwd_cap): the longest fused tail within bwd_cap, forward
  /// stages from the tail down, backward stages from layer 0 up; with `ramp` > 0 both grow from
  /// layer 0 over the first `ramp` stages.
  Cuts greedy_plan(double fwd_cap, double bwd_cap, int64_t ramp = 0) const;
  /// Stage-time caps from the largest layer to the whole model: geometric targets, each snapped
  /// up to the nearest sum of contiguous layers (where the greedy tiling changes).
  std::vector<double> cap_grid(bool backward) const;

  int64_t num_moves(const Cuts& c) const;
  /// Applies move `m` to `c` into `out`; false if it does not apply or breaks the budget.
  bool neighbor(const Cuts& c, int64_t m, Cuts& out) const;
  /// First-improvement local search from `c` until no move improves or the budget is spent.
  void improve(Cuts& c, Score& score);
  /// Iterated local search: kicks the current plan with one or two random moves, improves it,
  /// walks on when no worse and keeps the best; stops after `patience` kicks in a row without a
  /// new best, or when the budget is spent. Deterministic (fixed seed).
  void iterate(Cuts& best, Score& best_score, int64_t patience);
  /// The best of every plan, if there are at most `limit` (else nullopt, nothing evaluated).
  std::optional<std::pair<Cuts, Score>> exhaustive(int64_t limit);
  /// The number of plans of the type for this model.
  double plan_count() const;

 private:
  bool fits(LayerRange r, bool backward) const;

  const std::vector<LayerCost>& costs_;
  RunType type_;
  int64_t num_layers_;
  const PlannerOptions& options_;
  CostPrefix prefix_;
  PipelineModel model_;
  std::vector<int64_t> fwd_bytes_, bwd_bytes_;  // prefix sums
  std::vector<JobSpec> jobs_;                   // evaluate()'s buffer
  int64_t evaluations_ = 0;
  int64_t simulated_ = 0;  // job-microbatches simulated
  int64_t evaluation_cap_ = std::numeric_limits<int64_t>::max();
  int64_t simulated_cap_ = std::numeric_limits<int64_t>::max();
};

}  // namespace roundpipe::scheduler::detail
