#include "scheduler/detail/plan_search.h"

#include <algorithm>
#include <cmath>

namespace roundpipe::scheduler::detail {

bool better(const Score& a, const Score& b) {
  if (a.primary < b.primary - kRelTol * std::abs(b.primary)) return true;
  if (a.primary > b.primary + kRelTol * std::abs(b.primary)) return false;
  return a.secondary < b.secondary - kRelTol * std::abs(b.secondary);
}

namespace {

// Stage-time caps per grid and the contiguous sums they are snapped to, at most.
constexpr int kGridPoints = 64;
constexpr int64_t kMaxSums = 1 << 18;

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

}  // namespace

PlanSearch::PlanSearch(const std::vector<LayerCost>& costs, RunType type, int64_t num_microbatch,
                       const PlannerOptions& options)
    : costs_(costs),
      type_(type),
      num_layers_(static_cast<int64_t>(costs.size())),
      options_(options),
      prefix_(costs, options.simulate.fused_recompute),
      model_(type, options.num_devices, num_microbatch, options.simulate) {
  fwd_bytes_.assign(costs.size() + 1, 0);
  bwd_bytes_.assign(costs.size() + 1, 0);
  for (size_t i = 0; i < costs.size(); ++i) {
    fwd_bytes_[i + 1] = fwd_bytes_[i] + costs[i].bytes;
    bwd_bytes_[i + 1] = bwd_bytes_[i] + costs[i].backward_bytes;
  }
}

bool PlanSearch::budget_left() const {
  return evaluations_ < std::min(options_.max_evaluations, evaluation_cap_) &&
         simulated_ < std::min(options_.max_simulated_microbatches, simulated_cap_);
}

void PlanSearch::share_budget(int64_t parts) {
  evaluation_cap_ = evaluations_ + (options_.max_evaluations - evaluations_) / parts;
  simulated_cap_ = simulated_ + (options_.max_simulated_microbatches - simulated_) / parts;
}

ExecutePlan PlanSearch::to_plan(const Cuts& c) const {
  std::vector<LayerRange> backward;
  if (type_ == RunType::kFused) backward.push_back({c.tail, num_layers_});
  if (has_backward()) {
    auto rest = stages_of(c.bwd, c.tail);
    backward.insert(backward.end(), rest.rbegin(), rest.rend());
  }
  return ExecutePlan(stages_of(c.fwd, c.tail), std::move(backward));
}

Cuts PlanSearch::from_plan(const ExecutePlan& plan) const {
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

bool PlanSearch::fits(LayerRange r, bool backward) const {
  const auto& bytes = backward ? bwd_bytes_ : fwd_bytes_;
  return bytes[r.end] - bytes[r.begin] <= options_.memory_budget_bytes;
}

bool PlanSearch::feasible(const Cuts& c) const {
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

Score PlanSearch::evaluate(const Cuts& c) {
  ++evaluations_;
  jobs_.clear();
  int64_t begin = 0;
  for (size_t i = 0; i <= c.fwd.size() && c.tail > 0; ++i) {
    const int64_t end = i < c.fwd.size() ? c.fwd[i] : c.tail;
    append_job(jobs_, StagePhase::kForward, {begin, end}, prefix_, 0);
    begin = end;
  }
  const auto forward_jobs = static_cast<int64_t>(jobs_.size());
  if (type_ == RunType::kFused) {
    append_job(jobs_, StagePhase::kFused, {c.tail, num_layers_}, prefix_, forward_jobs);
  }
  if (has_backward()) {
    int64_t end = c.tail;
    for (size_t i = c.bwd.size() + 1; i-- > 0 && c.tail > 0;) {
      const int64_t b = i > 0 ? c.bwd[i - 1] : 0;
      append_job(jobs_, StagePhase::kBackward, {b, end}, prefix_, forward_jobs);
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
    // kSteadyState amortizes the first iteration's excess (fill and drain) over the run;
    // kMeasuredWindow only the last iteration's drain (the last iteration is a steady one).
    const double excess = options_.objective == PlanObjective::kMeasuredWindow
                              ? out.iteration_end.back() - out.iteration_return.back()
                              : makespan - out.period;
    s.primary = out.period + excess / static_cast<double>(options_.run_iterations);
    s.secondary = makespan;
    simulated_ += static_cast<int64_t>(jobs_.size() * out.iteration_end.size()) * model_.num_microbatch();
  }
  return s;
}

std::vector<int64_t> PlanSearch::greedy(int64_t first, int64_t last, bool backward, double cap, bool from_end,
                                        int64_t ramp) const {
  std::vector<int64_t> cuts;
  auto time_of = [&](int64_t i) { return backward ? costs_[i].backward : costs_[i].forward; };
  auto bytes_of = [&](int64_t i) { return backward ? costs_[i].backward_bytes : costs_[i].bytes; };
  auto limit = [&](int64_t stage) {
    const double share = ramp > 0 && stage < ramp ? static_cast<double>(stage + 1) / static_cast<double>(ramp) : 1.0;
    return cap * share * (1 + kRelTol);
  };
  double time = 0;
  int64_t bytes = 0, taken = 0, stage = 0;
  for (int64_t k = 0; k < last - first; ++k) {
    const int64_t i = from_end ? last - 1 - k : first + k;
    if (taken > 0 && (time + time_of(i) > limit(stage) || bytes + bytes_of(i) > options_.memory_budget_bytes)) {
      cuts.push_back(from_end ? i + 1 : i);
      time = 0;
      bytes = 0;
      taken = 0;
      ++stage;
    }
    time += time_of(i);
    bytes += bytes_of(i);
    ++taken;
  }
  if (from_end) std::reverse(cuts.begin(), cuts.end());
  return cuts;
}

Cuts PlanSearch::greedy_plan(double fwd_cap, double bwd_cap, int64_t ramp) const {
  Cuts c;
  c.tail = num_layers_;
  if (type_ == RunType::kFused) {
    c.tail = num_layers_ - 1;
    double time = costs_[c.tail].backward;
    int64_t bytes = costs_[c.tail].backward_bytes;
    while (c.tail > 0 && time + costs_[c.tail - 1].backward <= bwd_cap * (1 + kRelTol) &&
           bytes + costs_[c.tail - 1].backward_bytes <= options_.memory_budget_bytes) {
      --c.tail;
      time += costs_[c.tail].backward;
      bytes += costs_[c.tail].backward_bytes;
    }
  }
  c.fwd = greedy(0, c.tail, false, fwd_cap, /*from_end=*/ramp == 0, ramp);
  if (has_backward()) c.bwd = greedy(0, c.tail, true, bwd_cap, /*from_end=*/false, ramp);
  return c;
}

int64_t PlanSearch::num_moves(const Cuts& c) const {
  int64_t n = type_ == RunType::kFused ? 5 : 0;
  n += 3 * static_cast<int64_t>(c.fwd.size()) + static_cast<int64_t>(c.fwd.size()) + 1;
  if (has_backward()) n += 3 * static_cast<int64_t>(c.bwd.size()) + static_cast<int64_t>(c.bwd.size()) + 1;
  return n;
}

bool PlanSearch::neighbor(const Cuts& c, int64_t m, Cuts& out) const {
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

void PlanSearch::improve(Cuts& c, Score& score) {
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

void PlanSearch::iterate(Cuts& best, Score& best_score, int64_t patience) {
  uint64_t state = 0x9E3779B97F4A7C15ULL;
  auto next = [&state] {  // splitmix64
    uint64_t z = (state += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
  };
  Cuts current = best, kicked, moved;
  Score current_score = best_score;
  for (int64_t stale = 0; stale < patience && budget_left();) {
    kicked = current;
    const int kicks = 1 + static_cast<int>(next() % 2);
    for (int k = 0, tries = 0; k < kicks && tries < 20; ++tries) {
      const auto n = static_cast<uint64_t>(num_moves(kicked));
      if (neighbor(kicked, static_cast<int64_t>(next() % n), moved)) {
        kicked = moved;
        ++k;
      }
    }
    if (kicked == current) {
      ++stale;
      continue;
    }
    Score s = evaluate(kicked);
    improve(kicked, s);
    // Walk on from a local optimum that is no worse (plateaus are common); keep the best seen.
    if (s.primary <= current_score.primary) {
      current = kicked;
      current_score = s;
    }
    if (better(s, best_score)) {
      best = kicked;
      best_score = s;
      stale = 0;
    } else {
      ++stale;
    }
  }
}

std::optional<std::pair<Cuts, Score>> PlanSearch::exhaustive(int64_t limit) {
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

double PlanSearch::plan_count() const {
  const double L = static_cast<double>(num_layers_);
  switch (type_) {
    case RunType::kInfer:
      return std::pow(2.0, L - 1);
    case RunType::kTrain:
      return std::pow(4.0, L - 1);
    case RunType::kFused:
      return 1 + (std::pow(4.0, L - 1) - 1) / 3;
  }
  return 0;
}

std::vector<double> PlanSearch::cap_grid(bool backward) const {
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

}  // namespace roundpipe::scheduler::detail
