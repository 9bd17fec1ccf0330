#include "roundpipe/launcher/lr_schedule.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>

namespace roundpipe::launcher {

const char* lr_decay_name(LrDecay decay) {
  switch (decay) {
    case LrDecay::kConstant:
      return "constant";
    case LrDecay::kLinear:
      return "linear";
    case LrDecay::kCosine:
      return "cosine";
  }
  return "?";
}

LrSchedule::LrSchedule(double lr, double min_lr, int64_t warmup_steps, int64_t total_steps,
                       LrDecay decay)
    : lr_(lr), min_lr_(min_lr), warmup_steps_(warmup_steps), total_steps_(total_steps), decay_(decay) {
  TORCH_CHECK(lr > 0 && std::isfinite(lr), "optimizer.lr must be > 0, got ", lr);
  TORCH_CHECK(min_lr >= 0 && min_lr <= lr, "schedule.min_lr must be in [0, optimizer.lr = ", lr,
              "], got ", min_lr);
  TORCH_CHECK(warmup_steps >= 0, "schedule.warmup_steps must be >= 0, got ", warmup_steps);
  TORCH_CHECK(total_steps >= 1, "train.steps must be >= 1, got ", total_steps);
}

double LrSchedule::at(int64_t step) const {
  TORCH_CHECK(step >= 0, "LrSchedule::at: step must be >= 0, got ", step);
  if (step < warmup_steps_) {
    return lr_ * static_cast<double>(step + 1) / static_cast<double>(warmup_steps_);
  }
  const double span = static_cast<double>(std::max<int64_t>(1, total_steps_ - warmup_steps_));
  const double p = std::clamp(static_cast<double>(step - warmup_steps_) / span, 0.0, 1.0);
  switch (decay_) {
    case LrDecay::kConstant:
      return lr_;
    case LrDecay::kLinear:
      return min_lr_ + (lr_ - min_lr_) * (1.0 - p);
    case LrDecay::kCosine:
      return min_lr_ + (lr_ - min_lr_) * 0.5 * (1.0 + std::cos(M_PI * p));
  }
  return lr_;
}

}  // namespace roundpipe::launcher
