#include "roundpipe/run_config.h"

namespace roundpipe {

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
