#include "scheduler/simulator.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>

namespace roundpipe::scheduler {
namespace {

// 3 layers, forward 1 and backward (recompute + backward) 2 each: 2 forward stages, the fused
// tail and one backward stage.
std::vector<LayerCost> unit_costs(int64_t n) { return std::vector<LayerCost>(n, LayerCost{1, 2, 1, 2}); }
ExecutePlan two_forward_plan() { return ExecutePlan({{0, 1}, {1, 2}}, {{2, 3}, {0, 2}}); }

struct Expected {
  int64_t device;
  std::vector<std::pair<double, double>> spans;
};

void expect_timeline(const std::vector<SimulatedJob>& jobs, const std::vector<Expected>& expected) {
  ASSERT_EQ(jobs.size(), expected.size());
  for (size_t k = 0; k < jobs.size(); ++k) {
    EXPECT_EQ(jobs[k].device, expected[k].device) << "job " << k;
    ASSERT_EQ(jobs[k].microbatches.size(), expected[k].spans.size()) << "job " << k;
    for (size_t j = 0; j < expected[k].spans.size(); ++j) {
      EXPECT_DOUBLE_EQ(jobs[k].microbatches[j].start, expected[k].spans[j].first) << "job " << k << " mb " << j;
      EXPECT_DOUBLE_EQ(jobs[k].microbatches[j].end, expected[k].spans[j].second) << "job " << k << " mb " << j;
    }
  }
}

// Hand-computed: jobs F[0,1) d0, F[1,2) d1, fused [2,3) d0 (cost 2), B[0,2) d1 (cost 4), M = 3.
//   d0: F0 mb0 [0,1] mb1 [1,2] mb2 [2,3]; fused waits for F1: mb0 [3,5] mb1 [5,7] mb2 [7,9]
//   d1: F1 mb0 [1,2] mb1 [2,3] mb2 [3,4]; B waits for the fused: mb0 [5,9] mb1 [9,13] mb2 [13,17]
TEST(SimulatorTest, HandComputedTimeline_TwoDevicesFusedPlan) {
  auto r = simulate(two_forward_plan(), RunType::kFused, unit_costs(3), 2, 3);
  expect_timeline(r.jobs, {{0, {{0, 1}, {1, 2}, {2, 3}}},
                           {1, {{1, 2}, {2, 3}, {3, 4}}},
                           {0, {{3, 5}, {5, 7}, {7, 9}}},
                           {1, {{5, 9}, {9, 13}, {13, 17}}}});
  EXPECT_EQ(r.jobs[2].phase, StagePhase::kFused);
  EXPECT_EQ(r.jobs[3].phase, StagePhase::kBackward);
  EXPECT_DOUBLE_EQ(r.makespan, 17);
  EXPECT_DOUBLE_EQ(r.work, 24);  // 3 x (1 + 1 + 2 + 4)
  EXPECT_DOUBLE_EQ(r.busy[0], 9);
  EXPECT_DOUBLE_EQ(r.busy[1], 15);
  EXPECT_DOUBLE_EQ(r.bubble_ratio(), 1 - 24.0 / 34);
  EXPECT_DOUBLE_EQ(r.fill, 1);    // d1 waits [0,1] for F0's first microbatch
  EXPECT_DOUBLE_EQ(r.drain, 8);   // d0 idles [9,17]
  EXPECT_DOUBLE_EQ(r.steady, 1);  // d1 idles [4,5] between its jobs
}

// Same plan, recompute ahead: B recomputes (2) as soon as d1 is free, then waits for the gradient.
//   mb0: recompute [4,6], gradient at 5, backward [6,8]; mb1 [8,12]; mb2 [12,16].
TEST(SimulatorTest, HandComputedTimeline_RecomputeAhead) {
  auto r =
      simulate(two_forward_plan(), RunType::kFused, unit_costs(3), 2, 3, SimulateOptions().set_recompute_ahead(true));
  expect_timeline(r.jobs, {{0, {{0, 1}, {1, 2}, {2, 3}}},
                           {1, {{1, 2}, {2, 3}, {3, 4}}},
                           {0, {{3, 5}, {5, 7}, {7, 9}}},
                           {1, {{4, 8}, {8, 12}, {12, 16}}}});
  EXPECT_DOUBLE_EQ(r.makespan, 16);
  EXPECT_DOUBLE_EQ(r.jobs[3].microbatches[0].wait, 0);
}

// Fused recompute (the layer grain): a tail of layers [1, 3) costs 2 x 2 + the forward of layer 1
// (1) per microbatch. F[0,1) d0: [0,1] [1,2] [2,3]; fused [1,3) d1: [1,6] [6,11] [11,16];
// B[0,1) d0 after the fused: [6,8] [11,13] [16,18]. Without it the tail is 4 per microbatch.
TEST(SimulatorTest, HandComputedTimeline_FusedRecompute) {
  const ExecutePlan plan({{0, 1}}, {{1, 3}, {0, 1}});
  auto r = simulate(plan, RunType::kFused, unit_costs(3), 2, 3, SimulateOptions().set_fused_recompute(true));
  expect_timeline(r.jobs,
                  {{0, {{0, 1}, {1, 2}, {2, 3}}}, {1, {{1, 6}, {6, 11}, {11, 16}}}, {0, {{6, 8}, {11, 13}, {16, 18}}}});
  EXPECT_DOUBLE_EQ(r.work, 24);  // 3 x (1 + 5 + 2)
  const auto plain = simulate(plan, RunType::kFused, unit_costs(3), 2, 3);
  EXPECT_DOUBLE_EQ(plain.jobs[1].microbatches[0].end - plain.jobs[1].microbatches[0].start, 4);
  // A tail of one layer recomputes nothing.
  const auto one =
      simulate(two_forward_plan(), RunType::kFused, unit_costs(3), 2, 3, SimulateOptions().set_fused_recompute(true));
  EXPECT_DOUBLE_EQ(one.makespan, 17);
}

// Overheads: each job spends 0.5 before microbatch 0; every edge adds 0.25.
//   d0: F0 [0.5,1.5] [1.5,2.5] [2.5,3.5]
//   d1: F1 takes d1 at 0, ready 1.75: [1.75,2.75] [2.75,3.75] [3.75,4.75]
//   d0: fused at 3.5 + 0.5 = 4: ready 3: [4,6] [6,8] [8,10]
//   d1: B at 4.75 + 0.5 = 5.25: ready 6.25: [6.25,10.25] [10.25,14.25] [14.25,18.25]
TEST(SimulatorTest, HandComputedTimeline_OverheadAndHopLatency) {
  auto r = simulate(two_forward_plan(), RunType::kFused, unit_costs(3), 2, 3,
                    SimulateOptions().set_job_overhead(0.5).set_hop_latency(0.25));
  expect_timeline(r.jobs, {{0, {{0.5, 1.5}, {1.5, 2.5}, {2.5, 3.5}}},
                           {1, {{1.75, 2.75}, {2.75, 3.75}, {3.75, 4.75}}},
                           {0, {{4, 6}, {6, 8}, {8, 10}}},
                           {1, {{6.25, 10.25}, {10.25, 14.25}, {14.25, 18.25}}}});
  EXPECT_DOUBLE_EQ(r.overhead, 2);
  EXPECT_NEAR(r.bubble_ratio(), r.fill_ratio() + r.drain_ratio() + r.steady_ratio() + r.overhead_ratio(), 1e-12);
}

// Rounds of 2 microbatches (M = 3): each round posts the 4 jobs again, round robin.
//   round 0: F0 d0 [0,1] [1,2]; F1 d1 [1,2] [2,3]; fused d0 [2,4] [4,6]; B d1 [4,8] [8,12]
//   round 1: F0 d0 [6,7]; F1 d1 [12,13]; fused d0 [13,15]; B d1 [15,19]
TEST(SimulatorTest, HandComputedTimeline_Rounds) {
  auto r = simulate(two_forward_plan(), RunType::kFused, unit_costs(3), 2, 3, SimulateOptions().set_round_size(2));
  expect_timeline(r.jobs, {{0, {{0, 1}, {1, 2}}},
                           {1, {{1, 2}, {2, 3}}},
                           {0, {{2, 4}, {4, 6}}},
                           {1, {{4, 8}, {8, 12}}},
                           {0, {{6, 7}}},
                           {1, {{12, 13}}},
                           {0, {{13, 15}}},
                           {1, {{15, 19}}}});
  EXPECT_EQ(r.jobs[4].first_microbatch, 2);
  EXPECT_EQ(r.jobs[4].index, 0);
  EXPECT_DOUBLE_EQ(r.makespan, 19);
  EXPECT_DOUBLE_EQ(r.work, 24);
}

// Back to back, same plan. Iteration 0 returns at 9 (fused end) and ends at 17; iteration 1 is
// posted at 9 (gate = step 0's start = 9): F0 d0 [9,12], F1 d1 after B: [17,20], fused d0
// [18,24], B d1 [20,32]. Iteration 2 (gate 24): F0 [24,27], F1 [32,35], fused [33,39], B [35,47].
// d1 (F1 + B = 15 per iteration) is the bottleneck: period 15.
TEST(SimulatorTest, SteadyState_HandComputedPeriod) {
  auto r = simulate_steady_state(two_forward_plan(), RunType::kFused, unit_costs(3), 2, 3,
                                 SimulateOptions().set_num_iterations(3));
  ASSERT_EQ(r.iteration_end.size(), 3u);
  EXPECT_DOUBLE_EQ(r.iteration_return[0], 9);
  EXPECT_DOUBLE_EQ(r.iteration_end[0], 17);
  EXPECT_DOUBLE_EQ(r.iteration_return[1], 24);
  EXPECT_DOUBLE_EQ(r.iteration_end[1], 32);
  EXPECT_DOUBLE_EQ(r.iteration_end[2], 47);
  EXPECT_DOUBLE_EQ(r.period, 15);
  EXPECT_DOUBLE_EQ(r.work_per_iteration, 24);
  EXPECT_DOUBLE_EQ(r.bubble_ratio(), 1 - 24.0 / 30);
  EXPECT_EQ(r.timeline.jobs[4].device, 0);  // the cursor continues: 4 jobs on 2 devices
  // Found by the repeating state (iteration 2 repeats iteration 1, shifted by 15).
  auto exact = simulate_steady_state(two_forward_plan(), RunType::kFused, unit_costs(3), 2, 3);
  EXPECT_TRUE(exact.periodic);
  EXPECT_DOUBLE_EQ(exact.period, 15);
}

// Note [Measured windows]: timing iterations 1..2 of the run above from iteration 0's return
// (9, when iteration 1 is posted) to iteration 2's end (47) gives (47 - 9) / 2 = 19 per
// iteration, against the period 15: the last iteration's drain (fused end 39 to 47) is in it.
TEST(SimulatorTest, SteadyState_MeasuredWindowIncludesTheLastDrain) {
  auto r = simulate_steady_state(two_forward_plan(), RunType::kFused, unit_costs(3), 2, 3,
                                 SimulateOptions().set_num_iterations(3));
  EXPECT_DOUBLE_EQ(r.mean_iteration_time(1, 2), 19);
  EXPECT_DOUBLE_EQ(r.window_bubble_ratio(1, 2), 1 - 24.0 / (2 * 19));
  EXPECT_DOUBLE_EQ(r.mean_iteration_time(0, 2), 47.0 / 3);  // from 0: the first fill too
  EXPECT_DOUBLE_EQ(r.mean_iteration_time(2, 2), 47 - 24);   // one iteration: posted at 24
  EXPECT_THROW(r.mean_iteration_time(1, 3), c10::Error);
  EXPECT_THROW(r.mean_iteration_time(2, 1), c10::Error);
}

// Without the overlap (forward_backward returns after the whole iteration) iterations do not
// overlap at all: the period is the isolated makespan.
TEST(SimulatorTest, SteadyState_NoOverlapRepeatsTheIsolatedMakespan) {
  auto costs = unit_costs(3);
  auto isolated = simulate(two_forward_plan(), RunType::kFused, costs, 2, 3);
  auto r = simulate_steady_state(two_forward_plan(), RunType::kFused, costs, 2, 3,
                                 SimulateOptions().set_overlap_backward_tail(false));
  EXPECT_DOUBLE_EQ(r.period, isolated.makespan);
  EXPECT_TRUE(r.periodic);
}

// One compute copy per layer: step 0 publishes layer l for iteration 1 only once iteration 0's
// last reader of l has uploaded it (job start + overhead). Plan F[0,1) F[1,2) | T[2,3) B[1,2)
// B[0,1), forward 1 and backward 2 per layer, 2 devices, M = 1, job overhead 3:
//   iteration 0: F0 d0 up [0,3] mb [3,4]; F1 d1 up [0,3] mb [4,5]; T d0 up [4,7] mb [7,9]
//   (returns at 9); B1 d1 up [5,8] mb [9,11]; B0 d0 up [9,12] (layer 0 released at 12) mb [12,14].
//   iteration 1 (cursor 1), layers published at 12 (the prefix maximum of the releases):
//   F0 d1 from 12 (d1 is free at 11), up [12,15] mb [15,16]; F1 d0 up [14,17] mb [17,18];
//   T d1 up [16,19] mb [19,21]; B1 d0 up [18,21] mb [21,23]; B0 d1 up [21,24] mb [24,26].
//   Without the rule F0 starts at 11 and iteration 1 ends at 25.
TEST(SimulatorTest, SteadyState_PublishWaitsForThePreviousIterationsLastReaders) {
  const ExecutePlan plan({{0, 1}, {1, 2}}, {{2, 3}, {1, 2}, {0, 1}});
  const auto options = SimulateOptions().set_job_overhead(3).set_num_iterations(2);
  auto r = simulate_steady_state(plan, RunType::kFused, unit_costs(3), 2, 1, options);
  ASSERT_EQ(r.timeline.jobs.size(), 10u);
  EXPECT_DOUBLE_EQ(r.iteration_return[0], 9);
  EXPECT_DOUBLE_EQ(r.iteration_end[0], 14);
  EXPECT_EQ(r.timeline.jobs[5].device, 1);
  EXPECT_DOUBLE_EQ(r.timeline.jobs[5].start, 12);
  EXPECT_DOUBLE_EQ(r.timeline.jobs[9].microbatches[0].start, 24);
  EXPECT_DOUBLE_EQ(r.iteration_end[1], 26);
  auto free = simulate_steady_state(plan, RunType::kFused, unit_costs(3), 2, 1,
                                    SimulateOptions(options).set_publish_waits_for_readers(false));
  EXPECT_DOUBLE_EQ(free.timeline.jobs[5].start, 11);
  EXPECT_DOUBLE_EQ(free.iteration_end[1], 25);
  // Without upload time the rule does not bind here: every job's last microbatch needs the one
  // before it in dispatch order, so the device the next iteration's first job lands on is busy
  // until after the last backward stage took its own device (docs/schedule.md).
  auto no_upload = simulate_steady_state(plan, RunType::kFused, unit_costs(3), 2, 1);
  auto no_upload_free = simulate_steady_state(plan, RunType::kFused, unit_costs(3), 2, 1,
                                              SimulateOptions().set_publish_waits_for_readers(false));
  EXPECT_DOUBLE_EQ(no_upload.period, no_upload_free.period);
  EXPECT_TRUE(no_upload.periodic);
}

// A slow optimizer step limits the period to one step per iteration.
TEST(SimulatorTest, SteadyState_SlowStepBoundsThePeriod) {
  auto r = simulate_steady_state(two_forward_plan(), RunType::kFused, unit_costs(3), 2, 3,
                                 SimulateOptions().set_step_time(100));
  EXPECT_NEAR(r.period, 100, 1e-9);
}

// One device, one fused stage: no pipeline, no bubble; the closed form is M x sum(backward).
TEST(SimulatorTest, SingleStage_HasNoBubble) {
  auto costs = unit_costs(4);
  auto r = simulate(ExecutePlan({}, {{0, 4}}), RunType::kFused, costs, 1, 5);
  EXPECT_DOUBLE_EQ(r.makespan, 5 * 8);
  EXPECT_DOUBLE_EQ(r.bubble_ratio(), 0);
}

// Inference with D equal stages on D devices and M >= D microbatches: a perfect pipeline,
// makespan (S - 1 + M) t, the GPipe forward closed form.
TEST(SimulatorTest, EqualInferenceStages_MatchPipelineClosedForm) {
  for (int64_t d = 1; d <= 6; ++d) {
    for (int64_t m = d; m <= d + 3; ++m) {
      auto plan = ExecutePlan::per_layer(d, RunType::kInfer);
      auto r = simulate(plan, RunType::kInfer, unit_costs(d), d, m);
      EXPECT_DOUBLE_EQ(r.makespan, static_cast<double>(d - 1 + m)) << d << " devices, " << m << " microbatches";
    }
  }
}

// Random plans: work is conserved, a device never runs two microbatches at once, every
// dependency is respected, and the bubble split adds up.
TEST(SimulatorTest, RandomInstances_KeepInvariants) {
  std::mt19937_64 rng(99);
  std::uniform_real_distribution<double> time(0.1, 5.0);
  for (int trial = 0; trial < 200; ++trial) {
    const int64_t L = 2 + trial % 9, D = 1 + trial % 5, M = 1 + (trial * 7) % 11;
    std::vector<LayerCost> costs(L);
    for (auto& c : costs) {
      c.forward = time(rng);
      c.backward = c.forward + time(rng);
    }
    // A random fused plan: random tail, random cuts.
    const int64_t tail = std::uniform_int_distribution<int64_t>(0, L - 1)(rng);
    auto random_stages = [&](int64_t last) {
      std::vector<LayerRange> stages;
      int64_t begin = 0;
      for (int64_t i = 1; i <= last; ++i) {
        if (i == last || rng() % 2 == 0) {
          stages.push_back({begin, i});
          begin = i;
        }
      }
      return stages;
    };
    auto fwd = random_stages(tail);
    auto rest = random_stages(tail);
    std::vector<LayerRange> bwd{{tail, L}};
    bwd.insert(bwd.end(), rest.rbegin(), rest.rend());
    ExecutePlan plan(fwd, bwd);
    SimulateOptions options;
    options.first_device = trial % D;
    options.job_overhead = trial % 3 == 0 ? 0.3 : 0.0;
    options.hop_latency = trial % 4 == 0 ? 0.2 : 0.0;
    options.recompute_ahead = trial % 2 == 1;
    auto r = simulate(plan, RunType::kFused, costs, D, M, options);

    double expected_work = 0;
    for (const auto& s : fwd) {
      for (int64_t l = s.begin; l < s.end; ++l) expected_work += M * costs[l].forward;
    }
    for (int64_t l = 0; l < L; ++l) expected_work += M * costs[l].backward;
    EXPECT_NEAR(r.work, expected_work, 1e-9 * expected_work) << "trial " << trial;
    double busy = 0;
    for (double b : r.busy) busy += b;
    EXPECT_NEAR(busy, r.work + r.overhead, 1e-9 * busy);
    EXPECT_NEAR(r.bubble_ratio() * r.capacity(), r.fill + r.drain + r.steady + r.overhead, 1e-9 * r.capacity());

    // Per device: intervals in order, disjoint; jobs round-robin from first_device.
    std::map<int64_t, double> device_time;
    std::map<std::pair<int64_t, int64_t>, double> end_of;  // (job, mb) -> end
    for (size_t k = 0; k < r.jobs.size(); ++k) {
      const auto& job = r.jobs[k];
      EXPECT_EQ(job.device, (options.first_device + static_cast<int64_t>(k)) % D);
      double t = device_time[job.device];
      EXPECT_GE(job.start, t - 1e-12);
      t = job.start + options.job_overhead;
      for (int64_t j = 0; j < M; ++j) {
        const auto& span = job.microbatches[j];
        EXPECT_GE(span.start, t - 1e-12) << "trial " << trial << " job " << k << " overlaps on its device";
        EXPECT_NEAR(span.end - span.start - span.wait, job.microbatch_cost, 1e-9);
        // Its input: the previous job's microbatch j (the batch for job 0).
        if (k > 0) {
          const double input = end_of[{static_cast<int64_t>(k) - 1, j}] + options.hop_latency;
          if (options.recompute_ahead && job.phase == StagePhase::kBackward) {
            // Only the backward part (after the recompute and the wait) needs the gradient.
            double recompute = 0;
            for (int64_t l = job.layers.begin; l < job.layers.end; ++l) recompute += costs[l].forward;
            EXPECT_GE(span.start + recompute + span.wait, input - 1e-9) << "trial " << trial << " job " << k;
          } else {
            EXPECT_GE(span.start, input - 1e-9) << "trial " << trial << " job " << k;
          }
        }
        end_of[{static_cast<int64_t>(k), j}] = span.end;
        t = span.end;
      }
      EXPECT_DOUBLE_EQ(job.end, t);
      device_time[job.device] = t;
    }
  }
}

// Steady state: each iteration ends no earlier than the previous; the period lies between the
// busiest device's share of one iteration and the isolated makespan.
TEST(SimulatorTest, SteadyState_PeriodIsBounded) {
  std::mt19937_64 rng(5);
  std::uniform_real_distribution<double> time(0.5, 3.0);
  for (int trial = 0; trial < 50; ++trial) {
    const int64_t L = 6, D = 1 + trial % 4, M = 2 + trial % 6;
    std::vector<LayerCost> costs(L);
    for (auto& c : costs) {
      c.forward = time(rng);
      c.backward = 3 * c.forward;
    }
    auto plan = ExecutePlan::per_layer(L, RunType::kFused);
    auto isolated = simulate(plan, RunType::kFused, costs, D, M);
    auto steady = simulate_steady_state(plan, RunType::kFused, costs, D, M);
    for (size_t i = 1; i < steady.iteration_end.size(); ++i) {
      EXPECT_GE(steady.iteration_end[i], steady.iteration_end[i - 1]);
    }
    EXPECT_LE(steady.period, isolated.makespan * (1 + 1e-9)) << "trial " << trial;
    EXPECT_GE(steady.period, isolated.work / static_cast<double>(D) * (1 - 1e-9)) << "trial " << trial;
    EXPECT_NEAR(steady.work_per_iteration, isolated.work, 1e-9 * isolated.work);
  }
}

TEST(SimulatorTest, InvalidInputs_AreRejected) {
  auto costs = unit_costs(3);
  EXPECT_THROW(simulate(two_forward_plan(), RunType::kFused, costs, 0, 3), c10::Error);
  EXPECT_THROW(simulate(two_forward_plan(), RunType::kFused, costs, 2, 0), c10::Error);
  EXPECT_THROW(simulate(two_forward_plan(), RunType::kFused, unit_costs(4), 2, 3), c10::Error);  // plan too short
  EXPECT_THROW(simulate(two_forward_plan(), RunType::kFused, costs, 2, 3, SimulateOptions().set_first_device(2)),
               c10::Error);
  EXPECT_THROW(simulate(two_forward_plan(), RunType::kFused, costs, 2, 3, SimulateOptions().set_hop_latency(-1)),
               c10::Error);
}

}  // namespace
}  // namespace roundpipe::scheduler
