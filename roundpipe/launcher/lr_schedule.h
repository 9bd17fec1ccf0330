// Learning-rate schedule of the launcher: linear warmup, then constant, linear or cosine decay to
// a floor. A pure function of the step, so a resumed run continues on the same curve.
#pragma once

#include <cstdint>
#include <string>

namespace roundpipe::launcher {

enum class LrDecay { kConstant, kLinear, kCosine };

/// "constant", "linear", "cosine".
const char* lr_decay_name(LrDecay decay);

// Note [Learning-rate schedule]:
// With step counted from 0, peak rate `lr`, floor `min_lr`, `warmup` = warmup_steps and
// `total` = train.steps:
//   step < warmup:  lr(step) = lr * (step + 1) / warmup           (the first step already moves)
//   otherwise:      p = clamp((step - warmup) / max(1, total - warmup), 0, 1)
//     constant:     lr(step) = lr
//     linear:       lr(step) = min_lr + (lr - min_lr) * (1 - p)
//     cosine:       lr(step) = min_lr + (lr - min_lr) * (1 + cos(pi * p)) / 2
// The decay reaches min_lr at step == total (one past the last step run), as in HF's
// get_{linear,cosine}_schedule_with_warmup; steps past total stay at min_lr.

/// The schedule of Note [Learning-rate schedule]. Thread-safety: immutable after construction.
///
///   LrSchedule schedule(3e-4, 3e-5, /*warmup_steps=*/100, /*total_steps=*/1000, LrDecay::kCosine);
///   optimizer_options.lr(schedule.at(step));
class LrSchedule {
 public:
  /// Throws c10::Error unless lr > 0, 0 <= min_lr <= lr, warmup_steps >= 0, total_steps >= 1.
  LrSchedule(double lr, double min_lr, int64_t warmup_steps, int64_t total_steps, LrDecay decay);

  /// The learning rate of `step` (0-based; step >= 0).
  double at(int64_t step) const;

 private:
  double lr_;
  double min_lr_;
  int64_t warmup_steps_;
  int64_t total_steps_;
  LrDecay decay_;
};

}  // namespace roundpipe::launcher
