// `roundpipe train`: the launcher's training loop (RoundPipe, optimizer on the master weights, LR
// schedule, gradient accumulation, clipping, GradScaler, metrics, plot, checkpoints, resume).
#pragma once

#include <optional>
#include <string>

#include "roundpipe/launcher/config.h"

namespace roundpipe::launcher {

/// Trains as `config` says. `resume`: nullopt = a fresh run; "" = resume from
/// <out_dir>/checkpoints/latest; else the checkpoint directory to resume from. Prints the
/// progress line on stderr and the summary (where the metrics, plot and checkpoint are) on stdout.
/// Throws ConfigError (configuration) or c10::Error / std::exception (runtime).
void run_training(const LauncherConfig& config, const std::optional<std::string>& resume);

}  // namespace roundpipe::launcher
