// RoundPipe C++: pipeline-parallel training of LibTorch models larger than one GPU's memory.
// The umbrella header: include this one to use every public part of the library.
#pragma once

#include "amp/autocast_guard.h"
#include "amp/grad_scaler.h"
#include "base/config.h"
#include "base/logging.h"
#include "comm/launch_env.h"
#include "optim/adam.h"
#include "roundpipe/devices.h"
#include "roundpipe/layer_seed.h"
#include "roundpipe/loss_fn.h"
#include "roundpipe/recompute_data.h"
#include "roundpipe/round_pipe.h"
#include "roundpipe/run_config.h"
#include "roundpipe/side_inputs.h"
#include "roundpipe/stage_trace.h"
#include "scheduler/dispatch.h"
#include "scheduler/execute_plan.h"
#include "scheduler/partitioner.h"
