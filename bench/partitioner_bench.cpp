// Planning time of the automatic partitioner vs the model's layer count (it runs on the main
// thread before each training call when no plan is given). Baseline: the greedy tiling for one
// fixed stage time (what the Python original's inner loop does), measured in the same run.
#include <benchmark/benchmark.h>

#include <random>

#include "scheduler/partitioner.h"

namespace rs = roundpipe::scheduler;

static std::vector<rs::LayerCost> random_costs(int64_t n) {
  std::mt19937_64 rng(42);
  std::uniform_int_distribution<int64_t> size(1 << 20, 64 << 20);
  std::vector<int64_t> bytes(n);
  for (auto& b : bytes) b = size(rng);
  return rs::size_based_costs(bytes, bytes);
}

static void BM_Partition(benchmark::State& state) {
  auto costs = random_costs(state.range(0));
  for (auto _ : state) {
    auto plan = rs::partition(costs, rs::RunType::kFused, rs::PartitionOptions().set_min_stages(4));
    benchmark::DoNotOptimize(plan);
  }
  state.SetComplexityN(state.range(0));
}
BENCHMARK(BM_Partition)->RangeMultiplier(2)->Range(16, 512)->Complexity();

static void BM_PerLayerPlan_Baseline(benchmark::State& state) {
  for (auto _ : state) {
    auto plan = rs::ExecutePlan::per_layer(state.range(0), rs::RunType::kFused);
    benchmark::DoNotOptimize(plan);
  }
}
BENCHMARK(BM_PerLayerPlan_Baseline)->RangeMultiplier(2)->Range(16, 512);

BENCHMARK_MAIN();
