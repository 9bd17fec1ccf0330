#include "scheduler/partitioner.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <optional>

#include "scheduler/detail/layer_costs.h"

namespace roundpipe::scheduler {

std::vector<LayerCost> size_based_costs(const std::vector<int64_t>& bytes,
                                        const std::vector<int64_t>& grad_bytes) {
  TORCH_CHECK(bytes.size() == grad_bytes.size(), "size_based_costs: ", bytes.size(),
              " layer sizes but ", grad_bytes.size(), " gradient sizes");
  std::vector<LayerCost> costs(bytes.size());
  for (size_t i = 0; i < bytes.size(); ++i) {
    // A layer without parameters still costs something to run: count it as one byte.
    const double work = static_cast<double>(std::max<int64_t>(bytes[i], 1));
    costs[i] = LayerCost{work, 3.0 * work, bytes[i], bytes[i] + grad_bytes[i]};
  }
  return costs;
}

namespace {

// Relative slack for comparing a running sum against a candidate stage time that is itself a
// sum of the same numbers, added in another order.
constexpr double kRelTol = 1e-12;

bool fits(double sum, double cap) { return sum <= cap * (1 + kRelTol); }

// Greedy tiling of [first, last) into stages of time <= cap and bytes <= budget.
// `from_end`: grow stages from the last layer down (the short remainder lands at `first`),
// else from the first layer up. Returns stages in ascending order, nullopt if a layer alone
// does not fit.
std::optional<std::vector<LayerRange>> greedy(const std::vector<LayerCost>& costs, int64_t first,
                                              int64_t last, bool use_backward, double cap,
                                              int64_t budget, bool from_end) {
  std::vector<LayerRange> stages;
  auto time_of = [&](int64_t i) { return use_backward ? costs[i].backward : costs[i].forward; };
  auto bytes_of = [&](int64_t i) { return use_backward ? costs[i].backward_bytes : costs[i].bytes; };
  double time = 0;
  int64_t bytes = 0;
  if (from_end) {
    int64_t end = last;
    for (int64_t i = last - 1; i >= first; --i) {
      if (!fits(time_of(i), cap)) return std::nullopt;
      if (i + 1 < end && (!fits(time + time_of(i), cap) || bytes + bytes_of(i) > budget)) {
        stages.push_back({i + 1, end});
        end = i + 1;
        time = 0;
        bytes = 0;
      }
      time += time_of(i);
      bytes += bytes_of(i);
    }
    if (end > first) stages.push_back({first, end});
    std::reverse(stages.begin(), stages.end());
  } else {
    int64_t begin = first;
    for (int64_t i = first; i < last; ++i) {
      if (!fits(time_of(i), cap)) return std::nullopt;
      if (i > begin && (!fits(time + time_of(i), cap) || bytes + bytes_of(i) > budget)) {
        stages.push_back({begin, i});
        begin = i;
        time = 0;
        bytes = 0;
      }
      time += time_of(i);
      bytes += bytes_of(i);
    }
    if (last > begin) stages.push_back({begin, last});
  }
  return stages;
}

// The plan with the fewest stages whose stage times are all <= cap, or nullopt.
std::optional<ExecutePlan> plan_for_cap(const std::vector<LayerCost>& costs, RunType type, double cap,
                                        int64_t budget) {
  const auto num_layers = static_cast<int64_t>(costs.size());
  int64_t fwd_end = num_layers;  // forward stages cover [0, fwd_end)
  std::vector<LayerRange> backward;
  if (type == RunType::kFused) {
    // The longest fused tail is optimal: removing layers from the other partitions never adds
    // stages to them.
    double time = 0;
    int64_t bytes = 0;
    int64_t begin = num_layers;
    while (begin > 0 && fits(time + costs[begin - 1].backward, cap) &&
           bytes + costs[begin - 1].backward_bytes <= budget) {
      --begin;
      time += costs[begin].backward;
      bytes += costs[begin].backward_bytes;
    }
    if (begin == num_layers) return std::nullopt;
    backward.push_back({begin, num_layers});
    fwd_end = begin;
  }
  auto forward = greedy(costs, 0, fwd_end, /*use_backward=*/false, cap, budget, /*from_end=*/true);
  if (!forward) return std::nullopt;
  if (type != RunType::kInfer) {
    auto rest = greedy(costs, 0, fwd_end, /*use_backward=*/true, cap, budget, /*from_end=*/false);
    if (!rest) return std::nullopt;
    backward.insert(backward.end(), rest->rbegin(), rest->rend());
  }
  return ExecutePlan(std::move(*forward), std::move(backward));
}

void check_inputs(const std::vector<LayerCost>& costs, RunType type, const PartitionOptions& options) {
  TORCH_CHECK(!costs.empty(), "partition: the model has no layers");
  TORCH_CHECK(options.min_stages >= 1, "partition: min_stages must be >= 1, got ", options.min_stages);
  TORCH_CHECK(options.memory_budget_bytes > 0, "partition: memory_budget_bytes must be > 0, got ",
              options.memory_budget_bytes);
  detail::check_layer_costs(costs, type, options.memory_budget_bytes, "partition: ", "");
}

}  // namespace

double plan_cost(const ExecutePlan& plan, const std::vector<LayerCost>& costs,
                 const PartitionOptions& options) {
  double longest = 0;
  bool over_budget = false;
  auto visit = [&](const LayerRange& r, bool use_backward) {
    double time = 0;
    int64_t bytes = 0;
    for (int64_t i = r.begin; i < r.end; ++i) {
      time += use_backward ? costs[i].backward : costs[i].forward;
      bytes += use_backward ? costs[i].backward_bytes : costs[i].bytes;
    }
    longest = std::max(longest, time);
    over_budget = over_budget || bytes > options.memory_budget_bytes;
  };
  for (const auto& r : plan.forward_stages()) visit(r, false);
  for (const auto& r : plan.backward_stages()) visit(r, true);
  if (over_budget) return std::numeric_limits<double>::infinity();
  return static_cast<double>(std::max(plan.num_stages(), options.min_stages)) * longest;
}

ExecutePlan partition(const std::vector<LayerCost>& costs, RunType type, const PartitionOptions& options) {
  check_inputs(costs, type, options);
  const auto num_layers = static_cast<int64_t>(costs.size());

  // Candidate stage times: every contiguous sum of the costs a stage may sum. The optimal plan's
  // longest stage is one of them, and for that cap the greedy plan has no more stages.
  std::vector<double> candidates;
  auto add_sums = [&](bool use_backward) {
    for (int64_t i = 0; i < num_layers; ++i) {
      double sum = 0;
      for (int64_t j = i; j < num_layers; ++j) {
        sum += use_backward ? costs[j].backward : costs[j].forward;
        candidates.push_back(sum);
      }
    }
  };
  add_sums(false);
  if (type != RunType::kInfer) add_sums(true);
  std::sort(candidates.begin(), candidates.end());
  candidates.erase(std::unique(candidates.begin(), candidates.end()), candidates.end());

  // Feasibility and the stage count are monotone in the cap: find the first feasible cap, then
  // for each distinct stage count evaluate only the smallest cap reaching it.
  auto count_at = [&](size_t k) -> int64_t {
    auto plan = plan_for_cap(costs, type, candidates[k], options.memory_budget_bytes);
    return plan ? plan->num_stages() : std::numeric_limits<int64_t>::max();
  };
  std::optional<ExecutePlan> best;
  double best_cost = std::numeric_limits<double>::infinity();
  size_t k = 0;
  while (k < candidates.size()) {
    auto plan = plan_for_cap(costs, type, candidates[k], options.memory_budget_bytes);
    if (!plan) {
      // Binary search the first feasible cap.
      size_t lo = k + 1, hi = candidates.size();
      while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (plan_for_cap(costs, type, candidates[mid], options.memory_budget_bytes)) hi = mid; else lo = mid + 1;
      }
      k = lo;
      continue;
    }
    const double cost = plan_cost(*plan, costs, options);
    const int64_t stages = plan->num_stages();
    if (cost < best_cost) {
      best_cost = cost;
      best = std::move(plan);
    }
    if (stages <= options.min_stages) break;  // larger caps only cost more
    // First cap with fewer stages.
    size_t lo = k + 1, hi = candidates.size();
    while (lo < hi) {
      size_t mid = (lo + hi) / 2;
      if (count_at(mid) < stages) hi = mid; else lo = mid + 1;
    }
    k = lo;
  }
  TORCH_INTERNAL_ASSERT(best.has_value(), "partition found no feasible plan for ", num_layers, " layers");
  best->validate(num_layers, type);
  return *best;
}

}  // namespace roundpipe::scheduler
