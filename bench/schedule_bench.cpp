// Simulated pipeline bubble of the paper's five workloads (8 devices, 16 microbatches, per-layer
// costs from the original's artifact, pp-simulate/run.sh): the plan of our current partitioner,
// the simulation-based planner's plans (isolated makespan and steady-state objectives), the
// paper's own RoundPipe plans under our runtime's model, and 1F1B (simulated, see one_f_one_b),
// next to the paper's figures. Then the 12-equal-layer case against GPipe's closed form and the
// planning time for 100 and 500 heterogeneous layers. Pure simulation: no devices, no threads.
//
//   build/bench/schedule_bench            (prints the tables in docs/schedule-notes.md)
#include <time.h>

#include <algorithm>
#include <cstdio>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "scheduler/partitioner.h"
#include "scheduler/planner.h"
#include "scheduler/simulator.h"

namespace rs = roundpipe::scheduler;

namespace {

constexpr int64_t kDevices = 8;
constexpr int64_t kMicrobatches = 16;

struct Workload {
  const char* name;
  int64_t layers;
  double fwd, bwd, head_fwd, head_bwd;  // ms per microbatch; bwd without recompute
  double comm;                          // the artifact's per-hop transfer time, ms
  std::vector<int64_t> one_f_one_b;     // the artifact's 1F1B layers per stage (head on the last)
  std::vector<int64_t> paper_fwd, paper_bwd;  // the artifact's RoundPipe plan (bwd[0]: layers with the head)
  double paper_isolated, paper_async, paper_1f1b;  // % bubble
};

std::vector<int64_t> repeat(int64_t value, int64_t n) { return std::vector<int64_t>(n, value); }
std::vector<int64_t> concat(std::vector<int64_t> a, const std::vector<int64_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

std::vector<Workload> workloads() {
  return {
      {"Qwen3-1.7B", 28, 7.429, 15.831, 22.0655, 43.707, 1.6, {3, 3, 4, 4, 4, 4, 4, 2}, {7, 7, 7, 7},
       {0, 3, 3, 3, 3, 3, 3, 3, 3, 2, 2}, 19.1, 4.0, 35.2},
      {"Llama3-8B", 32, 18.50370313, 41.20659375, 37.2255, 74.501, 3.2, repeat(4, 8), {5, 5, 5, 5, 6, 6},
       concat({0}, repeat(2, 16)), 14.3, 1.3, 42.1},
      {"GPT-OSS-20B", 24, 21.6445625, 81.780875, 44.2925, 86.264, 2.25, repeat(3, 8), {4, 5, 5, 5, 5},
       concat({0}, repeat(1, 24)), 14.0, 3.3, 41.7},
      {"Qwen3-32B", 64, 40.5610625, 91.17429688, 54.928, 108.294, 4.0, repeat(8, 8), concat({2, 2}, repeat(3, 20)),
       concat({0}, repeat(1, 64)), 6.7, 2.6, 34.9},
      {"Qwen3-235B", 94, 43.016, 58.376, 42.444, 43.294, 3.2, {11, 12, 12, 12, 12, 12, 12, 11}, repeat(2, 47),
       concat({0}, repeat(1, 94)), 3.3, 1.0, 31.2},
  };
}

// Layers 0..n-1 are blocks, layer n the LM head. LayerCost::backward is recompute + backward.
std::vector<rs::LayerCost> layer_costs(const Workload& w) {
  std::vector<rs::LayerCost> costs(w.layers, rs::LayerCost{w.fwd, w.fwd + w.bwd, 0, 0});
  costs.push_back(rs::LayerCost{w.head_fwd, w.head_fwd + w.head_bwd, 0, 0});
  return costs;
}

// The artifact's RoundPipe plan as an ExecutePlan: the fused tail holds bwd[0] blocks + the head.
rs::ExecutePlan paper_plan(const Workload& w) {
  std::vector<rs::LayerRange> fwd, bwd;
  int64_t begin = 0;
  for (int64_t n : w.paper_fwd) {
    fwd.push_back({begin, begin + n});
    begin += n;
  }
  int64_t end = w.layers + 1;
  for (size_t i = 0; i < w.paper_bwd.size(); ++i) {
    const int64_t n = w.paper_bwd[i] + (i == 0 ? 1 : 0);
    bwd.push_back({end - n, end});
    end -= n;
  }
  return rs::ExecutePlan(fwd, bwd);
}

// 1F1B as the artifact simulates it (PyTorch Schedule1F1B order: rank r runs min(M, D - r)
// forwards, then alternates backward and forward): stage s = rank s holds `layers[s]` blocks (the
// last also the head); a backward recomputes the stage's blocks (not the head) before its
// backward; each cross-rank edge costs `comm`. Returns the bubble ratio
// 1 - work / (D x makespan) with recompute counted as work, as the artifact does.
double one_f_one_b(const Workload& w, double comm) {
  const auto D = static_cast<int64_t>(w.one_f_one_b.size());
  const int64_t M = kMicrobatches;
  std::vector<double> fwd(D), bwd(D);
  double work = 0;
  for (int64_t s = 0; s < D; ++s) {
    const auto n = static_cast<double>(w.one_f_one_b[s]);
    const bool last = s == D - 1;
    fwd[s] = n * w.fwd + (last ? w.head_fwd : 0);
    bwd[s] = n * w.fwd + n * w.bwd + (last ? w.head_bwd : 0);
    work += M * (fwd[s] + bwd[s]);
  }
  struct Op {
    bool backward;
    int64_t mb;
  };
  std::vector<std::vector<Op>> ops(D);
  for (int64_t r = 0; r < D; ++r) {
    int64_t f = 0, b = 0;
    for (; f < std::min(M, D - r); ++f) ops[r].push_back({false, f});
    while (true) {
      ops[r].push_back({true, b++});
      if (f == M) break;
      ops[r].push_back({false, f++});
    }
    while (b < M) ops[r].push_back({true, b++});
  }
  const double unset = -1;
  std::vector<std::vector<double>> f_end(D, std::vector<double>(M, unset)), b_end = f_end;
  std::vector<size_t> next(D, 0);
  std::vector<double> free_at(D, 0);
  double makespan = 0;
  for (bool progress = true; progress;) {
    progress = false;
    for (int64_t r = 0; r < D; ++r) {
      while (next[r] < ops[r].size()) {
        const Op op = ops[r][next[r]];
        double ready = free_at[r];
        if (!op.backward) {
          if (r > 0) {
            if (f_end[r - 1][op.mb] == unset) break;
            ready = std::max(ready, f_end[r - 1][op.mb] + comm);
          }
          free_at[r] = f_end[r][op.mb] = ready + fwd[r];
        } else {
          if (r + 1 < D) {
            if (b_end[r + 1][op.mb] == unset) break;
            ready = std::max(ready, b_end[r + 1][op.mb] + comm);
          }
          free_at[r] = b_end[r][op.mb] = ready + bwd[r];
        }
        makespan = std::max(makespan, free_at[r]);
        ++next[r];
        progress = true;
      }
    }
  }
  return 1 - work / (static_cast<double>(D) * makespan);
}

// "4F+11B: F 7 7 7 7 | T 0+h | B 3 3 ..." in layers per stage (layer `blocks`, if any, is the
// LM head, counted as h); B lists the backward stages after the fused tail T, deepest first.
std::string describe(const rs::ExecutePlan& plan, int64_t blocks) {
  std::ostringstream out;
  out << plan.forward_stages().size() << "F+" << plan.backward_stages().size() << "B: F";
  for (const auto& r : plan.forward_stages()) out << " " << r.size();
  const auto& bwd = plan.backward_stages();
  const bool head = bwd.front().end > blocks;
  out << " | T " << bwd.front().size() - (head ? 1 : 0) << (head ? "+h" : "") << " | B";
  for (size_t i = 1; i < bwd.size(); ++i) out << " " << bwd[i].size();
  return out.str();
}

double pct(double ratio) { return 100.0 * ratio; }

struct Figures {
  double makespan, period;   // ms
  double work;               // ms per iteration, this plan's own (the tail recomputes nothing)
};

Figures figures(const rs::ExecutePlan& plan, const std::vector<rs::LayerCost>& costs,
                const rs::SimulateOptions& options) {
  const auto isolated = rs::simulate(plan, rs::RunType::kFused, costs, kDevices, kMicrobatches, options);
  const auto steady = rs::simulate_steady_state(plan, rs::RunType::kFused, costs, kDevices, kMicrobatches, options);
  return {isolated.makespan, steady.period, isolated.work};
}

// Planning time as CPU time of this (single) thread: the build machine is shared, wall time is not
// reproducible there.
double cpu_ms() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return 1e3 * static_cast<double>(t.tv_sec) + 1e-6 * static_cast<double>(t.tv_nsec);
}

double planning_ms(const std::vector<rs::LayerCost>& costs, const rs::PlannerOptions& options,
                   rs::PlannedSchedule* out) {
  const double t0 = cpu_ms();
  *out = rs::plan_by_simulation(costs, rs::RunType::kFused, options);
  return cpu_ms() - t0;
}

// Bubbles against the paper's work (every block recomputed, the head not): 1 - work / (D x time),
// so plans are compared by time; "own" uses the plan's own work (a longer fused tail recomputes
// less, so it does less work in the same time and shows a larger own-work bubble).
void paper_workloads(double hop_scale) {
  std::printf("\n## Paper workloads: 8 devices, 16 microbatches, hop latency = %s\n\n",
              hop_scale > 0 ? "the artifact's comm time" : "0");
  std::printf("%-12s %-26s %9s %7s %6s %9s %7s %6s %8s  %s\n", "workload", "plan", "makespan", "bubble", "(own)",
              "period", "steady", "(own)", "plan cpu", "stages (layers per stage; T = fused tail + head)");
  for (const auto& w : workloads()) {
    const auto costs = layer_costs(w);
    rs::SimulateOptions sim;
    sim.hop_latency = hop_scale * w.comm;
    const double reference = figures(paper_plan(w), costs, sim).work;
    auto row = [&](const char* what, const rs::ExecutePlan& plan, const rs::SimulateOptions& options, double ms) {
      const Figures f = figures(plan, costs, options);
      const double cap_iso = kDevices * f.makespan, cap_steady = kDevices * f.period;
      char time[16] = "";
      if (ms >= 0) std::snprintf(time, sizeof(time), "%.0f", ms);
      std::printf("%-12s %-26s %9.0f %6.1f%% %5.1f%% %9.1f %6.1f%% %5.1f%% %8s  %s\n", w.name, what, f.makespan,
                  pct(1 - reference / cap_iso), pct(1 - f.work / cap_iso), f.period, pct(1 - reference / cap_steady),
                  pct(1 - f.work / cap_steady), time, describe(plan, w.layers).c_str());
    };
    const auto partitioned =
        rs::partition(costs, rs::RunType::kFused, rs::PartitionOptions().set_min_stages(kDevices));
    row("partitioner (today)", partitioned, sim, -1);
    row("paper's plan, our runtime", paper_plan(w), sim, -1);
    auto options = rs::PlannerOptions().set_num_devices(kDevices).set_num_microbatch(kMicrobatches).set_simulate(sim);
    rs::PlannedSchedule planned;
    double ms = planning_ms(costs, options, &planned);
    row("planned: isolated", planned.plan, sim, ms);
    options.objective = rs::PlanObjective::kSteadyState;
    ms = planning_ms(costs, options, &planned);
    row("planned: steady state", planned.plan, sim, ms);
    // What-ifs: runtime changes the simulator can model (not the runtime today).
    options.objective = rs::PlanObjective::kIsolated;
    auto ahead = sim;
    ahead.recompute_ahead = true;
    options.simulate = ahead;
    ms = planning_ms(costs, options, &planned);
    row("if recompute ahead", planned.plan, ahead, ms);
    auto rounds = sim;
    rounds.round_size = kDevices;
    options.simulate = rounds;
    ms = planning_ms(costs, options, &planned);
    row("if rounds of 8 microbatches", planned.plan, rounds, ms);
    std::printf("%-12s %-26s %9s %6.1f%% %6s %9s %6.1f%%   (the artifact's simulator; async = its steady share)\n",
                w.name, "paper: RoundPipe", "", w.paper_isolated, "", "", w.paper_async);
    std::printf("%-12s %-26s %9s %6.1f%% %6s (comm %.2f ms; %.1f%% with comm 0; paper %.1f%%)\n", w.name,
                "1F1B, simulated", "", pct(one_f_one_b(w, w.comm)), "", w.comm, pct(one_f_one_b(w, 0)), w.paper_1f1b);
  }
}

void equal_layers_vs_gpipe() {
  std::printf("\n## 12 equal layers (forward 1, recompute + backward 3), M = D + 1 (the runtime's default)\n\n");
  std::printf("%7s %8s %8s %9s %9s  %s\n", "devices", "GPipe", "today", "planned", "steady", "planned plan");
  const std::vector<rs::LayerCost> costs(12, rs::LayerCost{1, 3, 0, 0});
  for (int64_t d = 2; d <= 8; ++d) {
    const int64_t m = d + 1;
    const double gpipe = static_cast<double>(d - 1) / static_cast<double>(m + d - 1);
    const auto today = rs::partition(costs, rs::RunType::kFused, rs::PartitionOptions().set_min_stages(d));
    const double today_bubble = rs::simulate(today, rs::RunType::kFused, costs, d, m).bubble_ratio();
    const auto planned = rs::plan_by_simulation(
        costs, rs::RunType::kFused, rs::PlannerOptions().set_num_devices(d).set_num_microbatch(m));
    std::printf("%7lld %7.1f%% %7.1f%% %8.1f%% %8.1f%%  %s\n", static_cast<long long>(d), pct(gpipe),
                pct(today_bubble), pct(planned.bubble), pct(planned.steady_bubble),
                describe(planned.plan, 12).c_str());
  }
}

// Heterogeneous model: a cheap embedding, blocks of three widths, an LM head 4x a block.
std::vector<rs::LayerCost> heterogeneous(int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> width(0, 2);
  std::vector<rs::LayerCost> costs;
  costs.push_back({0.2, 0.6, 1, 2});
  for (int64_t i = 1; i + 1 < n; ++i) {
    const double f = 1.0 + 0.5 * width(rng);
    costs.push_back({f, 3 * f, 1, 2});
  }
  costs.push_back({4.0, 12.0, 1, 2});
  return costs;
}

void planning_time() {
  std::printf("\n## Planning time (8 devices, 16 microbatches, heterogeneous layers)\n\n");
  std::printf("%7s %-13s %10s %12s %9s %9s\n", "layers", "objective", "cpu ms", "simulations", "stages", "bubble");
  for (int64_t n : {100, 500}) {
    const auto costs = heterogeneous(n, 11);
    for (auto objective : {rs::PlanObjective::kIsolated, rs::PlanObjective::kSteadyState}) {
      auto options = rs::PlannerOptions()
                         .set_num_devices(kDevices)
                         .set_num_microbatch(kMicrobatches)
                         .set_objective(objective);
      rs::PlannedSchedule planned;
      const double ms = planning_ms(costs, options, &planned);
      const bool steady = objective == rs::PlanObjective::kSteadyState;
      std::printf("%7lld %-13s %10.1f %12lld %9lld %8.1f%%\n", static_cast<long long>(n),
                  steady ? "steady state" : "isolated", ms, static_cast<long long>(planned.evaluations),
                  static_cast<long long>(planned.plan.num_stages()),
                  pct(steady ? planned.steady_bubble : planned.bubble));
    }
    const double t0 = cpu_ms();
    const auto partitioned = rs::partition(costs, rs::RunType::kFused, rs::PartitionOptions().set_min_stages(kDevices));
    const double ms = cpu_ms() - t0;
    std::printf("%7lld %-13s %10.1f %12s %9lld %8.1f%%\n", static_cast<long long>(n), "partitioner", ms, "-",
                static_cast<long long>(partitioned.num_stages()),
                pct(rs::simulate(partitioned, rs::RunType::kFused, costs, kDevices, kMicrobatches).bubble_ratio()));
  }
}

}  // namespace

int main() {
  paper_workloads(0);
  paper_workloads(1);
  equal_layers_vs_gpipe();
  planning_time();
  return 0;
}
