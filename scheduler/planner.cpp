#include "scheduler/planner.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <optional>

#include "scheduler/detail/pipeline_model.h"

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
// - Otherwise seeds: the partitioner's plan, the one-layer-per-stage plan, and greedy tilings
//   for a pair of stage-time caps (forward cap Tf, backward cap Tb; the fused tail is the
//   longest suffix within Tb) on grids between the largest layer and the whole model
//   (geometric, snapped to sums of contiguous layers): a diagonal scan (both caps at the same grid position), then alternating scans of
//   one cap with the other fixed. The best distinct seeds are refined by first-improvement
//   local search over these moves: move the tail by one layer (the layer joining the tail, or
//   leaving it into the last stages or into stages of its own), remove a cut (merge two
//   stages), shift a cut by one layer, split a stage at its time midpoint. Every move keeps
//   each stage within the memory budget. Each simulation costs O(stages x microbatches).
//
// Note [Choosing num_microbatch]:
// With num_microbatch = 0 the planner tries M in {D/2, D, D+1, 2D, 3D, 4D, 6D, 8D, 12D, 16D}
// (D devices) within [1, max_num_microbatch], plus max_num_microbatch itself, with the costs
// scaled to M (per-microbatch times x costs_num_microbatch / M: the batch's work is fixed;
// job_overhead and hop_latency are not scaled) and plans each. It returns the smallest M whose
// objective is within num_microbatch_tolerance of the best: more microbatches shrink the
// simulated bubble, but smaller microbatches use devices less efficiently and pay per-microbatch
// costs the model does not see, so a larger M must earn its place.

namespace {

constexpr double kRelTol = 1e-9;
// Kicks without improvement after which the iterated local search stops.
constexpr int64_t kPatience = 64;
// Stage-time caps per grid and the contiguous sums they are snapped to, at most.
constexpr int kGridPoints = 64;
constexpr int64_t kMaxSums = 1 << 18;

// A plan: stage boundaries strictly inside [0, tail), ascending.
struct Cuts {
  int64_t tail = 0;
  std::vector<int64_t> fwd;
  std::vector<int64_t> bwd;
  bool operator==(const Cuts& o) const { return tail == o.tail && fwd == o.fwd && bwd == o.bwd; }
};

struct Score {
  double primary = std::numeric_limits<double>::infinity();
  double secondary = std::numeric_limits<double>::infinity();
};

bool better(const Score& a, const Score& b) {
  if (a.primary < b.primary - kRelTol * std::abs(b.primary)) return true;
  if (a.primary > b.primary + kRelTol * std::abs(b.primary)) return false;
  return a.secondary < b.secondary - kRelTol * std::abs(b.secondary);
}

// Stages of [0, last) cut at `cuts`, ascending.
std::vector<LayerRange> stages_of(const std::vector<int64_t>& cuts, int64_t last) {
  std::vector<LayerRange> stages;
  int64_t begin = 0;
  for (int64_t c : cuts) {
    stages.push_back({begin, c});
    begin = c;
  }
  if (last > 0) stages.push_back({begin, last});
  return stages;
}

// Plans, scores and searches for one microbatch count. Not thread-safe (reuses buffers).
class Search {
 public:
  Search(const std::vector<LayerCost>& costs, RunType type, int64_t num_microbatch, const PlannerOptions& options)
      : costs_(costs),
        type_(type),
        num_layers_(static_cast<int64_t>(costs.size())),
        options_(options),
        prefix_(costs),
        model_(type, options.num_devices, num_microbatch, options.simulate) {
    fwd_bytes_.assign(costs.size() + 1, 0);
    bwd_bytes_.assign(costs.size() + 1, 0);
    for (size_t i = 0; i < costs.size(); ++i) {
      fwd_bytes_[i + 1] = fwd_bytes_[i] + costs[i].bytes;
      bwd_bytes_[i + 1] = bwd_bytes_[i] + costs[i].backward_bytes;
    }
  }

  int64_t evaluations() const { return evaluations_; }
  bool budget_left() const {
    return evaluations_ < options_.max_evaluations && simulated_ < options_.max_simulated_microbatches;
  }
  bool has_backward() const { return type_ != RunType::kInfer; }

  ExecutePlan to_plan(const Cuts& c) const {
    std::vector<LayerRange> backward;
    if (type_ == RunType::kFused) backward.push_back({c.tail, num_layers_});
    if (has_backward()) {
      auto rest = stages_of(c.bwd, c.tail);
      backward.insert(backward.end(), rest.rbegin(), rest.rend());
    }
    return ExecutePlan(stages_of(c.fwd, c.tail), std::move(backward));
  }

  Cuts from_plan(const ExecutePlan& plan) const {
    Cuts c;
    c.tail = type_ == RunType::kFused ? plan.backward_stages().front().begin : num_layers_;
    for (const auto& r : plan.forward_stages()) {
      if (r.begin > 0) c.fwd.push_back(r.begin);
    }
    for (const auto& r : plan.backward_stages()) {
      if (r.begin > 0 && r.begin < c.tail) c.bwd.push_back(r.begin);
    }
    std::sort(c.bwd.begin(), c.bwd.end());
    return c;
  }

  bool fits(LayerRange r, bool backward) const {
    const auto& bytes = backward ? bwd_bytes_ : fwd_bytes_;
    return bytes[r.end] - bytes[r.begin] <= options_.memory_budget_bytes;
  }

  bool feasible(const Cuts& c) const {
    if (type_ == RunType::kFused && !fits({c.tail, num_layers_}, true)) return false;
    auto all_fit = [&](const std::vector<int64_t>& cuts, bool backward) {
      int64_t begin = 0;
      for (int64_t cut : cuts) {
        if (!fits({begin, cut}, backward)) return false;
        begin = cut;
      }
      return c.tail == 0 || fits({begin, c.tail}, backward);
    };
    return all_fit(c.fwd, false) && (!has_backward() || all_fit(c.bwd, true));
  }

  Score evaluate(const Cuts& c) {
    ++evaluations_;
    jobs_.clear();
    int64_t begin = 0;
    for (size_t i = 0; i <= c.fwd.size() && c.tail > 0; ++i) {
      const int64_t end = i < c.fwd.size() ? c.fwd[i] : c.tail;
      detail::append_job(jobs_, StagePhase::kForward, {begin, end}, prefix_, 0);
      begin = end;
    }
    const auto forward_jobs = static_cast<int64_t>(jobs_.size());
    if (type_ == RunType::kFused) {
      detail::append_job(jobs_, StagePhase::kFused, {c.tail, num_layers_}, prefix_, forward_jobs);
    }
    if (has_backward()) {
      int64_t end = c.tail;
      for (size_t i = c.bwd.size() + 1; i-- > 0 && c.tail > 0;) {
        const int64_t b = i > 0 ? c.bwd[i - 1] : 0;
        detail::append_job(jobs_, StagePhase::kBackward, {b, end}, prefix_, forward_jobs);
        end = b;
      }
    }
    Score s;
    if (options_.objective == PlanObjective::kIsolated) {
      const auto& out = model_.run(jobs_, 1);
      s.primary = out.iteration_end[0];
      s.secondary = out.sum_job_end;
      simulated_ += static_cast<int64_t>(jobs_.size()) * model_.num_microbatch();
    } else {
      const auto& out = model_.steady(jobs_);
      const double makespan = out.iteration_end[0];  // iteration 0 is the isolated run
      s.primary = out.period + (makespan - out.period) / static_cast<double>(options_.run_iterations);
      s.secondary = makespan;
      simulated_ += static_cast<int64_t>(jobs_.size() * out.iteration_end.size()) * model_.num_microbatch();
    }
    return s;
  }

  // Boundaries of a greedy tiling of [first, last) into stages of time <= cap (a stage always
  // takes one layer) and bytes within the budget; `from_end` leaves the short stage at `first`.
  std::vector<int64_t> greedy(int64_t first, int64_t last, bool backward, double cap, bool from_end) const {
    std::vector<int64_t> cuts;
    auto time_of = [&](int64_t i) { return backward ? costs_[i].backward : costs_[i].forward; };
    auto bytes_of = [&](int64_t i) { return backward ? costs_[i].backward_bytes : costs_[i].bytes; };
    const double limit = cap * (1 + kRelTol);
    double time = 0;
    int64_t bytes = 0, taken = 0;
    for (int64_t k = 0; k < last - first; ++k) {
      const int64_t i = from_end ? last - 1 - k : first + k;
      if (taken > 0 && (time + time_of(i) > limit || bytes + bytes_of(i) > options_.memory_budget_bytes)) {
        cuts.push_back(from_end ? i + 1 : i);
        time = 0;
        bytes = 0;
        taken = 0;
      }
      time += time_of(i);
      bytes += bytes_of(i);
      ++taken;
    }
    if (from_end) std::reverse(cuts.begin(), cuts.end());
    return cuts;
  }

  Cuts greedy_plan(double fwd_cap, double bwd_cap) const {
    Cuts c;
    c.tail = num_layers_;
    if (type_ == RunType::kFused) {
      double time = 0;
      int64_t bytes = 0;
      c.tail = num_layers_ - 1;
      time = costs_[c.tail].backward;
      bytes = costs_[c.tail].backward_bytes;
      while (c.tail > 0 && time + costs_[c.tail - 1].backward <= bwd_cap * (1 + kRelTol) &&
             bytes + costs_[c.tail - 1].backward_bytes <= options_.memory_budget_bytes) {
        --c.tail;
        time += costs_[c.tail].backward;
        bytes += costs_[c.tail].backward_bytes;
      }
    }
    c.fwd = greedy(0, c.tail, false, fwd_cap, /*from_end=*/true);
    if (has_backward()) c.bwd = greedy(0, c.tail, true, bwd_cap, /*from_end=*/false);
    return c;
  }

  int64_t num_moves(const Cuts& c) const {
    int64_t n = type_ == RunType::kFused ? 5 : 0;
    n += 3 * static_cast<int64_t>(c.fwd.size()) + static_cast<int64_t>(c.fwd.size()) + 1;
    if (has_backward()) n += 3 * static_cast<int64_t>(c.bwd.size()) + static_cast<int64_t>(c.bwd.size()) + 1;
    return n;
  }

  // Applies move `m` (Note [Simulation-based planning]) to `c`; false if it does not apply or
  // breaks the budget.
  bool neighbor(const Cuts& c, int64_t m, Cuts& out) const {
    out = c;
    if (type_ == RunType::kFused) {
      if (m < 5) {
        if (m == 0) {
          if (c.tail == 0) return false;
          out.tail = c.tail - 1;
          auto drop = [&](std::vector<int64_t>& v) {
            while (!v.empty() && v.back() >= out.tail) v.pop_back();
          };
          drop(out.fwd);
          drop(out.bwd);
        } else {
          if (c.tail + 1 >= num_layers_) return false;
          out.tail = c.tail + 1;
          if (c.tail > 0 && (m == 2 || m == 4)) out.fwd.push_back(c.tail);
          if (c.tail > 0 && (m == 3 || m == 4)) out.bwd.push_back(c.tail);
          if (c.tail == 0 && m > 1) return false;
        }
        return feasible(out);
      }
      m -= 5;
    }
    for (int list = 0; list < (has_backward() ? 2 : 1); ++list) {
      auto& cuts = list == 0 ? out.fwd : out.bwd;
      const auto n = static_cast<int64_t>(cuts.size());
      if (m < 3 * n) {
        const int64_t i = m / 3, kind = m % 3;
        if (kind == 0) {
          cuts.erase(cuts.begin() + i);
        } else {
          const int64_t lo = i > 0 ? cuts[i - 1] : 0, hi = i + 1 < n ? cuts[i + 1] : out.tail;
          const int64_t p = cuts[i] + (kind == 1 ? -1 : 1);
          if (p <= lo || p >= hi) return false;
          cuts[i] = p;
        }
        return feasible(out);
      }
      m -= 3 * n;
      if (m < n + 1) {
        const int64_t a = m > 0 ? cuts[m - 1] : 0, b = m < n ? cuts[m] : out.tail;
        if (b - a < 2) return false;
        const auto& pre = list == 0 ? prefix_.fwd : prefix_.bwd;
        const double half = (pre[a] + pre[b]) / 2;
        // First p in (a, b) with pre[p] >= half, or the one before it if that is closer.
        int64_t p = std::lower_bound(pre.begin() + a + 1, pre.begin() + b, half) - pre.begin();
        if (p > a + 1 && half - pre[p - 1] < pre[p] - half) --p;
        p = std::clamp(p, a + 1, b - 1);
        cuts.insert(cuts.begin() + m, p);
        return feasible(out);
      }
      m -= n + 1;
    }
    return false;
  }

  // First-improvement local search from `c` until no move improves or the budget is spent.
  void improve(Cuts& c, Score& score) {
    Cuts candidate;
    int64_t offset = 0;
    while (budget_left()) {
      const int64_t n = num_moves(c);
      bool improved = false;
      for (int64_t t = 0; t < n && budget_left(); ++t) {
        const int64_t m = (offset + t) % n;
        if (!neighbor(c, m, candidate)) continue;
        const Score s = evaluate(candidate);
        if (better(s, score)) {
          c = candidate;
          score = s;
          offset = m;
          improved = true;
          break;
        }
      }
      if (!improved) break;
    }
  }

  // Iterated local search: kicks `best` with a few random moves, improves the result and keeps
  // it when better; stops after `patience` kicks in a row without improvement, or when the
  // budget is spent. Deterministic (fixed seed).
  void iterate(Cuts& best, Score& best_score, int64_t patience) {
    uint64_t state = 0x9E3779B97F4A7C15ULL;
    auto next = [&state] {  // splitmix64
      uint64_t z = (state += 0x9E3779B97F4A7C15ULL);
      z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
      z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
      return z ^ (z >> 31);
    };
    Cuts kicked, moved;
    for (int64_t stale = 0; stale < patience && budget_left();) {
      kicked = best;
      const int kicks = 2 + static_cast<int>(next() % 3);
      for (int k = 0, tries = 0; k < kicks && tries < 20; ++tries) {
        const auto n = static_cast<uint64_t>(num_moves(kicked));
        if (neighbor(kicked, static_cast<int64_t>(next() % n), moved)) {
          kicked = moved;
          ++k;
        }
      }
      if (kicked == best) {
        ++stale;
        continue;
      }
      Score s = evaluate(kicked);
      improve(kicked, s);
      if (better(s, best_score)) {
        best = kicked;
        best_score = s;
        stale = 0;
      } else {
        ++stale;
      }
    }
  }

  // Every plan, if there are at most `limit`.
  std::optional<std::pair<Cuts, Score>> exhaustive(int64_t limit) {
    const double count = plan_count();
    if (count > static_cast<double>(limit)) return std::nullopt;
    std::optional<std::pair<Cuts, Score>> best;
    auto masks = [](int64_t last) { return last > 0 ? int64_t{1} << (last - 1) : int64_t{1}; };
    auto cuts_of = [](int64_t mask, int64_t last) {
      std::vector<int64_t> cuts;
      for (int64_t i = 1; i < last; ++i) {
        if (mask & (int64_t{1} << (i - 1))) cuts.push_back(i);
      }
      return cuts;
    };
    const int64_t first_tail = type_ == RunType::kFused ? 0 : num_layers_;
    const int64_t last_tail = type_ == RunType::kFused ? num_layers_ - 1 : num_layers_;
    for (int64_t tail = first_tail; tail <= last_tail; ++tail) {
      for (int64_t f = 0; f < masks(tail); ++f) {
        for (int64_t b = 0; b < (has_backward() ? masks(tail) : 1); ++b) {
          Cuts c{tail, cuts_of(f, tail), has_backward() ? cuts_of(b, tail) : std::vector<int64_t>{}};
          if (!feasible(c)) continue;
          const Score s = evaluate(c);
          if (!best || better(s, best->second)) best.emplace(c, s);
        }
      }
    }
    return best;
  }

  double plan_count() const {
    const double L = static_cast<double>(num_layers_);
    switch (type_) {
      case RunType::kInfer: return std::pow(2.0, L - 1);
      case RunType::kTrain: return std::pow(4.0, L - 1);
      case RunType::kFused: return 1 + (std::pow(4.0, L - 1) - 1) / 3;
    }
    return 0;
  }

  // Stage-time caps from the largest layer to the whole model: geometric targets, each snapped
  // up to the nearest sum of contiguous layers (where the greedy tiling changes), deduplicated.
  std::vector<double> cap_grid(bool backward) const {
    const auto& pre = backward ? prefix_.bwd : prefix_.fwd;
    double largest = 0;
    for (int64_t i = 0; i < num_layers_; ++i) largest = std::max(largest, pre[i + 1] - pre[i]);
    const double total = pre[num_layers_];
    if (largest <= 0 || total <= largest) return {largest};
    // Contiguous sums: all of them up to kMaxSums, else those starting at every stride-th layer.
    std::vector<double> sums;
    const int64_t stride = std::max<int64_t>(1, num_layers_ * num_layers_ / kMaxSums);
    for (int64_t i = 0; i < num_layers_; i += stride) {
      for (int64_t j = i + 1; j <= num_layers_; ++j) {
        const double sum = pre[j] - pre[i];
        if (sum >= largest) sums.push_back(sum);
      }
    }
    std::sort(sums.begin(), sums.end());
    std::vector<double> grid;
    const double ratio = std::pow(total / largest, 1.0 / (kGridPoints - 1));
    for (int i = 0; i < kGridPoints; ++i) {
      const double target = largest * std::pow(ratio, i) * (1 - kRelTol);
      auto it = std::lower_bound(sums.begin(), sums.end(), target);
      const double cap = it == sums.end() ? total : *it;
      if (grid.empty() || cap > grid.back() * (1 + kRelTol)) grid.push_back(cap);
    }
    return grid;
  }

 private:
  const std::vector<LayerCost>& costs_;
  RunType type_;
  int64_t num_layers_;
  const PlannerOptions& options_;
  detail::CostPrefix prefix_;
  detail::PipelineModel model_;
  std::vector<int64_t> fwd_bytes_, bwd_bytes_;
  std::vector<detail::JobSpec> jobs_;
  int64_t evaluations_ = 0;
  int64_t simulated_ = 0;  // job-microbatches simulated
};

struct Found {
  Cuts cuts;
  Score score;
  int64_t evaluations = 0;
  bool exhaustive = false;
};

Found search_plan(Search& search, const std::vector<LayerCost>& costs, RunType type, const PlannerOptions& options) {
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

  // Cap grids: a diagonal scan, then each cap with the other fixed.
  const auto fwd_grid = search.cap_grid(false);
  const auto bwd_grid = search.has_backward() ? search.cap_grid(true) : std::vector<double>{0.0};
  size_t best_f = 0, best_b = 0;
  Score best_score;
  auto scan = [&](size_t f, size_t b) {
    const Cuts c = search.greedy_plan(fwd_grid[f], bwd_grid[b]);
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
  consider(search.greedy_plan(fwd_grid[best_f], bwd_grid[best_b]));

  // Refine the best seeds.
  std::sort(seeds.begin(), seeds.end(), [](const auto& a, const auto& b) { return better(a.second, b.second); });
  TORCH_INTERNAL_ASSERT(!seeds.empty(), "plan_by_simulation: no feasible seed plan");
  Found found{seeds.front().first, seeds.front().second, 0, false};
  constexpr size_t kRefined = 3;
  for (size_t i = 0; i < std::min(kRefined, seeds.size()) && search.budget_left(); ++i) {
    Cuts c = seeds[i].first;
    Score s = seeds[i].second;
    search.improve(c, s);
    if (better(s, found.score)) {
      found.cuts = c;
      found.score = s;
    }
  }
  search.iterate(found.cuts, found.score, kPatience);
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
    TORCH_CHECK(options.num_microbatch_tolerance >= 0, "plan_by_simulation: num_microbatch_tolerance must be >= 0, got ",
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
  for (size_t i = 0; i < costs.size(); ++i) {
    const LayerCost& c = costs[i];
    TORCH_CHECK(std::isfinite(c.forward) && std::isfinite(c.backward) && c.forward >= 0 && c.backward >= 0 &&
                    c.bytes >= 0 && c.backward_bytes >= 0,
                "plan_by_simulation: layer ", i, " has an invalid cost estimate (forward ", c.forward, ", backward ",
                c.backward, ", bytes ", c.bytes, ", backward_bytes ", c.backward_bytes,
                "): times must be finite and >= 0, sizes >= 0");
    const int64_t need = type == RunType::kInfer ? c.bytes : std::max(c.bytes, c.backward_bytes);
    TORCH_CHECK(need <= options.memory_budget_bytes, "plan_by_simulation: layer ", i, " needs ", need,
                " bytes on a device", type == RunType::kInfer ? "" : " (with its gradients)",
                " but the per-stage memory budget is ", options.memory_budget_bytes,
                " bytes: split the layer into smaller layers, or raise the budget (more device memory)");
  }
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
  for (int64_t m : microbatch_candidates(options)) {
    Candidate cand{m, costs, {}};
    if (options.num_microbatch == 0) {
      const double scale = static_cast<double>(options.costs_num_microbatch) / static_cast<double>(m);
      for (auto& c : cand.costs) {
        c.forward *= scale;
        c.backward *= scale;
      }
    }
    Search search(cand.costs, type, m, options);
    cand.found = search_plan(search, cand.costs, type, options);
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
  Search search(chosen->costs, type, chosen->num_microbatch, options);
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
