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

/// Prints the devices, the stages of the training plan (layer ranges, forward/backward, bytes),
/// estimated host and device memory and the plan's simulated timeline (scheduler/plan_preview.h),
/// without training, from the model's configuration alone: no weights, no allocation, no GPU
/// (docs/launcher.md, "plan"). A non-empty `svg_path` also gets the timeline as an SVG picture
/// (atomically).
void run_plan(const LauncherConfig& config, std::ostream& out, const std::string& svg_path = "");

/// Evaluates the configured model on data.valid (else data.train); the last line printed is
/// `eval_loss=<float>`. Appends {"step": 0, "eval_loss"} to <out_dir>/metrics.jsonl.
void run_eval(const LauncherConfig& config, std::ostream& out);

/// Options of `roundpipe export`.
struct ExportOptions {
  /// LoRA checkpoints: write the merged full model (base + B A alpha / r, PEFT's
  /// merge_and_unload) instead of the PEFT adapter directory.
  bool merge = false;
  /// LoRA checkpoints with `merge`: the base model directory; "" = the adapter's
  /// base_model_name_or_path (model.pretrained of the run, absolute).
  std::string base;
};

/// Writes a transformers model directory (config.json + safetensors of the master weights) from a
/// checkpoint directory of `roundpipe train`. A LoRA checkpoint gives a PEFT adapter directory
/// (adapter_config.json + adapter_model.safetensors, for peft.PeftModel.from_pretrained), or with
/// `merge` the base model with the adapters folded in, saved in the base's dtype.
void run_export(const std::string& checkpoint_dir, const std::string& out_dir, std::ostream& out,
                const ExportOptions& options = {});

}  // namespace roundpipe::launcher
