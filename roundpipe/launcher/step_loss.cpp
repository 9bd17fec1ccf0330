#include "roundpipe/launcher/step_loss.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

namespace roundpipe::launcher {
namespace {

// A named functor rather than a lambda: it holds a copy of the normalizer and the scaler's
// address, nothing of the loop that made it.
struct NormalizedLoss {
  double normalizer;
  amp::GradScaler* scaler;

  at::Tensor operator()(const at::Tensor& summed_loss, const at::Tensor& /*labels*/) const {
    at::Tensor loss = summed_loss / normalizer;
    return scaler->is_enabled() ? scaler->scale(loss) : loss;
  }
};

}  // namespace

StepLoss::StepLoss(int64_t step_labels, int64_t world, amp::GradScaler& scaler)
    : normalizer_(static_cast<double>(step_labels) / static_cast<double>(world)), scaler_(scaler) {
  TORCH_INTERNAL_ASSERT(step_labels > 0 && world > 0, "StepLoss: ", step_labels, " labels, ", world, " ranks");
}

LossFn StepLoss::loss_fn() const { return NormalizedLoss{normalizer_, &scaler_}; }

void StepLoss::add_pass(const at::Tensor& pass_loss) { pass_losses_.push_back(pass_loss.item<double>()); }

double StepLoss::unscaled_sum() const {
  const double scale = scaler_.is_enabled() ? scaler_.get_scale() : 1.0;
  double sum = 0.0;
  for (const double loss : pass_losses_) sum += loss / scale;
  return sum;
}

}  // namespace roundpipe::launcher
