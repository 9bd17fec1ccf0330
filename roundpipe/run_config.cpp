#include "roundpipe/run_config.h"

namespace roundpipe {

// Note [Engine self-model]:
// Three places need to know how the engine runs without running it: the runtime's planner
// (roundpipe/detail/planner.cpp, which rates plans by simulating them), `roundpipe plan` (which
// prints the simulated timeline and the memory plan of a config) and the tests that check the
// planner's choice against the simulator's optimum. Each used to spell the rules itself (the
// default microbatch count, whether backward stages recompute ahead, whether iterations overlap)
// and the spellings had drifted apart: the planner modelled recompute-ahead for the layer grain
// too, which runs without it, and the launcher's evaluation split batches into one microbatch
// instead of the engine's default. They now all call default_num_microbatch and
// engine_simulate_options, so a change to the engine's behaviour is made here once.

int64_t default_num_microbatch(int64_t num_devices) { return num_devices + 1; }

scheduler::SimulateOptions engine_simulate_options(RecomputeGrain grain, bool iterations_overlap) {
  return scheduler::SimulateOptions()
      .set_recompute_ahead(grain == RecomputeGrain::kStage)
      .set_fused_recompute(grain == RecomputeGrain::kLayer)
      .set_overlap_backward_tail(iterations_overlap);
}

RunConfig RunConfig::merged_over(const RunConfig& base) const {
  RunConfig out = base;
  if (num_microbatch) out.num_microbatch = num_microbatch;
  if (recompute_grain) out.recompute_grain = recompute_grain;
  if (preserve_rng_state) out.preserve_rng_state = preserve_rng_state;
  if (execute_plan) out.execute_plan = execute_plan;
  if (output_device) out.output_device = output_device;
  return out;
}

}  // namespace roundpipe
