// The launcher's subcommands other than `train` (trainer.h): validate, plan, eval, export.
// Each prints its result on stdout and throws ConfigError (exit code 2) or c10::Error /
// std::exception (exit code 1); main.cpp maps them.
#pragma once

#include <ostream>
#include <string>

#include "roundpipe/launcher/config.h"

namespace roundpipe::launcher {

/// Checks the configuration (and the model configuration and data it names); prints the resolved
/// configuration as YAML.
void run_validate(const LauncherConfig& config, std::ostream& out);

/// Prints the devices, the stages of the training plan (layer ranges, forward/backward, bytes)
/// and estimated host and device memory, without training.
void run_plan(const LauncherConfig& config, std::ostream& out);

/// Evaluates the configured model on data.valid (else data.train); the last line printed is
/// `eval_loss=<float>`. Appends {"step": 0, "eval_loss"} to <out_dir>/metrics.jsonl.
void run_eval(const LauncherConfig& config, std::ostream& out);

/// Writes a transformers model directory (config.json + safetensors of the master weights) from a
/// checkpoint directory of `roundpipe train`.
void run_export(const std::string& checkpoint_dir, const std::string& out_dir, std::ostream& out);

}  // namespace roundpipe::launcher
