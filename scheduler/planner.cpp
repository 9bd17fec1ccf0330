#include "scheduler/planner.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <utility>

#include "scheduler/detail/layer_costs.h"
#include "scheduler/detail/plan_search.h"

namespace roundpipe::scheduler {

// Note [Simulation-based planning]:
// A plan is the fused tail's first layer `tail` (kFused; else tail = L) and two sets of cuts,
// the forward and the backward stage boundaries inside [0, tail). Its score is the simulated
// objective: the makespan, ties broken by the sum of the jobs' end times (which prefers plans
// whose pipeline drains sooner and guides the search across plateaus); or the mean iteration
// time of a run (period + (makespan - period) / run_iterations), ties broken by the makespan.
// (Minimising the period alone favours a few long stages: their period is within a fraction of
// a percent of the best one, but their first iteration has a 40% bubble.)
// - Small plan spaces (at most exhaustive_limit plans) are enumerated: the plan is optimal.
// - Otherwise seeds: the partitioner's plan, the one-layer-per-stage plan, the caller's seeds,
//   and greedy tilings for a pair of stage-time caps (forward cap Tf, backward cap Tb; the
//   fused tail is the longest suffix within Tb) on grids between the largest layer and the
//   whole model (geometric, snapped to sums of contiguous layers), flat or ramped (the first D
//   stages from layer 0 growing, so the pipeline fills and drains sooner): a diagonal scan
//   (both caps at the same grid position), then alternating scans of one cap with the other
//   fixed. From each of the kStarts best seeds, with an equal share of the budget left: a
//   first-improvement local search over these moves: move the tail by one layer (the layer
//   joining the tail, or leaving it into the last stages or into stages of its own), remove a
//   cut (merge two stages), shift a cut by one layer, split a stage at its time midpoint; then
//   an iterated local search (kick with one or two random moves, improve, walk on when no
//   worse). Every move keeps each stage within the memory budget.
// - Cost: a simulation is O(stages x microbatches) (x iterations for the steady state); the
//   budget (max_simulated_microbatches) bounds the total deterministically. Measured
//   (bench/schedule_bench): 0.15-0.5 s for 28 to 500 layers on 8 devices. Against enumerating
//   every plan: optimal on 99 of 100 small instances (6-8 layers) and on 12 equal layers for
//   2-8 devices (1.4 million plans each).
//
// Note [Choosing num_microbatch]:
// With num_microbatch = 0 the planner tries M in {D/2, D, D+1, 2D, 3D, 4D, 6D, 8D, 12D, 16D}
// (D devices) within [1, max_num_microbatch], plus max_num_microbatch itself, with the costs
// scaled to M (per-microbatch times x costs_num_microbatch / M: the batch's work is fixed;
// job_overhead and hop_latency are not scaled) and plans each (with an equal share of the
// search budget). It returns the smallest M whose
// objective is within num_microbatch_tolerance of the best: more microbatches shrink the
// simulated bubble, but smaller microbatches use devices less efficiently and pay per-microbatch
// costs the model does not see, so a larger M must earn its place.

namespace {

// Kicks without improvement after which the iterated local search stops.
constexpr int64_t kPatience = 200;
// Seeds the local search and the iterated local search start from (each with a budget share).
constexpr size_t kStarts = 3;

using detail::Cuts;
using detail::PlanSearch;
using detail::Score;
using detail::better;
using detail::kRelTol;

struct Found {
  Cuts cuts;
  Score score;
  int64_t evaluations = 0;
  bool exhaustive = false;
};

Found search_plan(PlanSearch& search, const std::vector<LayerCost>& costs, RunType type,
                  const PlannerOptions& options) {
  if (auto best = search.exhaustive(options.exhaustive_limit)) {
    return {best->first, best->second, search.evaluations(), true};
  }
  std::vector<std::pair<Cuts, Score>> seeds;
  auto consider = [&](const Cuts& c) {
    if (!search.feasible(c)) return;
    for (const auto& s : seeds) {
      if (s.first == c) return;
    }
    seeds.emplace_back(c, search.evaluate(c));
  };
  consider(search.from_plan(partition(costs, type,
                                      PartitionOptions()
                                          .set_min_stages(options.num_devices)
                                          .set_memory_budget_bytes(options.memory_budget_bytes))));
  consider(search.from_plan(ExecutePlan::per_layer(static_cast<int64_t>(costs.size()), type)));
  for (const auto& plan : options.seeds) {
    try {
      plan.validate(static_cast<int64_t>(costs.size()), type);
    } catch (const c10::Error&) {
      continue;  // a stale seed (another model or type) is simply not used
    }
    consider(search.from_plan(plan));
  }

  // Cap grids: a diagonal scan, then each cap with the other fixed; flat and ramped tilings.
  const auto fwd_grid = search.cap_grid(false);
  const auto bwd_grid = search.has_backward() ? search.cap_grid(true) : std::vector<double>{0.0};
  for (const int64_t ramp : {int64_t{0}, options.num_devices}) {
    size_t best_f = 0, best_b = 0;
    Score best_score;
    auto scan = [&](size_t f, size_t b) {
      const Cuts c = search.greedy_plan(fwd_grid[f], bwd_grid[b], ramp);
      if (!search.feasible(c)) return;
      const Score s = search.evaluate(c);
      if (better(s, best_score)) {
        best_score = s;
        best_f = f;
        best_b = b;
      }
    };
    const size_t diagonal = std::max(fwd_grid.size(), bwd_grid.size());
    for (size_t k = 0; k < diagonal; ++k) {
      scan(std::min(k, fwd_grid.size() - 1), std::min(k, bwd_grid.size() - 1));
    }
    for (int round = 0; round < 2; ++round) {
      const size_t fixed_b = best_b;
      for (size_t f = 0; f < fwd_grid.size(); ++f) scan(f, fixed_b);
      const size_t fixed_f = best_f;
      for (size_t b = 0; b < bwd_grid.size(); ++b) scan(fixed_f, b);
    }
    consider(search.greedy_plan(fwd_grid[best_f], bwd_grid[best_b], ramp));
  }

  // Refine the best seeds.
  // Exact order (better() has a tolerance, so it is no strict weak order).
  std::sort(seeds.begin(), seeds.end(), [](const auto& a, const auto& b) {
    return std::make_pair(a.second.primary, a.second.secondary) < std::make_pair(b.second.primary, b.second.secondary);
  });
  TORCH_INTERNAL_ASSERT(!seeds.empty(), "plan_by_simulation: no feasible seed plan");
  Found found{seeds.front().first, seeds.front().second, 0, false};
  const size_t starts = std::min(kStarts, seeds.size());
  for (size_t i = 0; i < starts; ++i) {
    search.share_budget(static_cast<int64_t>(starts - i));  // an equal share of what is left
    if (!search.budget_left()) break;
    Cuts c = seeds[i].first;
    Score s = seeds[i].second;
    search.improve(c, s);
    search.iterate(c, s, kPatience);
    if (better(s, found.score)) {
      found.cuts = c;
      found.score = s;
    }
  }
  found.evaluations = search.evaluations();
  return found;
}

void check_inputs(const std::vector<LayerCost>& costs, RunType type, const PlannerOptions& options) {
  TORCH_CHECK(!costs.empty(), "plan_by_simulation: the model has no layers (costs is empty)");
  TORCH_CHECK(options.num_devices >= 1, "plan_by_simulation: num_devices must be >= 1, got ", options.num_devices);
  TORCH_CHECK(options.num_microbatch >= 0, "plan_by_simulation: num_microbatch must be >= 1, or 0 to choose it; got ",
              options.num_microbatch);
  if (options.num_microbatch == 0) {
    TORCH_CHECK(options.max_num_microbatch >= 1, "plan_by_simulation: num_microbatch is 0 (choose it) but ",
                "max_num_microbatch is ", options.max_num_microbatch, ": set it to the batch's rows");
    TORCH_CHECK(options.costs_num_microbatch >= 1, "plan_by_simulation: num_microbatch is 0 (choose it) but ",
                "costs_num_microbatch is ", options.costs_num_microbatch,
                ": set it to the microbatch count the per-microbatch costs were measured at");
    TORCH_CHECK(options.num_microbatch_tolerance >= 0,
                "plan_by_simulation: num_microbatch_tolerance must be >= 0, got ",
                options.num_microbatch_tolerance);
  }
  TORCH_CHECK(options.memory_budget_bytes > 0, "plan_by_simulation: memory_budget_bytes must be > 0, got ",
              options.memory_budget_bytes);
  TORCH_CHECK(options.run_iterations >= 1, "plan_by_simulation: run_iterations must be >= 1, got ",
              options.run_iterations);
  TORCH_CHECK(options.exhaustive_limit >= 0 && options.max_evaluations >= 1 &&
                  options.max_simulated_microbatches >= 1,
              "plan_by_simulation: exhaustive_limit must be >= 0, max_evaluations and max_simulated_microbatches ",
              ">= 1, got ", options.exhaustive_limit, ", ", options.max_evaluations, " and ",
              options.max_simulated_microbatches);
  TORCH_CHECK(options.simulate.first_device >= 0 && options.simulate.first_device < options.num_devices,
              "plan_by_simulation: simulate.first_device ", options.simulate.first_device, " is not in [0, ",
              options.num_devices, ")");
  detail::check_layer_costs(costs, type, options.memory_budget_bytes, "plan_by_simulation: ",
                            "plan_by_simulation: ");
}

std::vector<int64_t> microbatch_candidates(const PlannerOptions& options) {
  if (options.num_microbatch > 0) return {options.num_microbatch};
  const int64_t D = options.num_devices, max = options.max_num_microbatch;
  std::vector<int64_t> out;
  for (int64_t m : {D / 2, D, D + 1, 2 * D, 3 * D, 4 * D, 6 * D, 8 * D, 12 * D, 16 * D, max}) {
    if (m >= 1 && m <= max) out.push_back(m);
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

}  // namespace

PlannedSchedule plan_by_simulation(const std::vector<LayerCost>& costs, RunType type, const PlannerOptions& options) {
  check_inputs(costs, type, options);
  struct Candidate {
    int64_t num_microbatch;
    std::vector<LayerCost> costs;
    Found found;
  };
  std::vector<Candidate> candidates;
  int64_t evaluations = 0;
  // The budget is per call: each microbatch count gets an equal share.
  const auto counts = microbatch_candidates(options);
  PlannerOptions shared = options;
  shared.max_evaluations = std::max<int64_t>(1, options.max_evaluations / static_cast<int64_t>(counts.size()));
  shared.max_simulated_microbatches =
      std::max<int64_t>(1, options.max_simulated_microbatches / static_cast<int64_t>(counts.size()));
  for (int64_t m : counts) {
    Candidate cand{m, costs, {}};
    if (options.num_microbatch == 0) {
      const double scale = static_cast<double>(options.costs_num_microbatch) / static_cast<double>(m);
      for (auto& c : cand.costs) {
        c.forward *= scale;
        c.backward *= scale;
      }
    }
    PlanSearch search(cand.costs, type, m, shared);
    cand.found = search_plan(search, cand.costs, type, shared);
    evaluations += cand.found.evaluations;
    candidates.push_back(std::move(cand));
  }
  double best = std::numeric_limits<double>::infinity();
  for (const auto& c : candidates) best = std::min(best, c.found.score.primary);
  const Candidate* chosen = nullptr;
  for (const auto& c : candidates) {  // ascending num_microbatch
    if (c.found.score.primary <= best * (1 + options.num_microbatch_tolerance) + kRelTol * best) {
      chosen = &c;
      break;
    }
  }
  TORCH_INTERNAL_ASSERT(chosen != nullptr);

  PlannedSchedule out;
  PlanSearch search(chosen->costs, type, chosen->num_microbatch, options);
  out.plan = search.to_plan(chosen->found.cuts);
  out.plan.validate(static_cast<int64_t>(costs.size()), type);
  out.num_microbatch = chosen->num_microbatch;
  out.evaluations = evaluations;
  out.exhaustive = chosen->found.exhaustive;
  const auto isolated = simulate(out.plan, type, chosen->costs, options.num_devices, chosen->num_microbatch,
                                 options.simulate);
  const auto steady = simulate_steady_state(out.plan, type, chosen->costs, options.num_devices,
                                            chosen->num_microbatch, options.simulate);
  out.makespan = isolated.makespan;
  out.bubble = isolated.bubble_ratio();
  out.period = steady.period;
  out.steady_bubble = steady.bubble_ratio();
  return out;
}

}  // namespace roundpipe::scheduler
