// The loss of one optimizer step of `roundpipe train`: the per-microbatch loss function handed to
// RoundPipe::forward_backward (normalized, scaled, no host read) and the step's logged loss, read
// from the host once per pass (docs/launcher.md, "Loss normalization").
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "amp/grad_scaler.h"
#include "roundpipe/loss_fn.h"

namespace roundpipe::launcher {

/// The loss of one optimizer step, from its passes' summed losses.
///
///   StepLoss loss(step_labels, world, scaler);
///   for (const Batch& batch : passes) loss.add_pass(model.forward_backward({batch.inputs}, batch.labels,
///   loss.loss_fn())); double logged = loss.unscaled_sum();  // the step's mean token loss on this rank
///
/// Host reads (the test counts them, tests/launcher/step_loss_test.cpp): loss_fn() none per
/// microbatch (on a GPU worker a read would synchronize the device each microbatch); add_pass one
/// per pass, of the CPU loss forward_backward returns; unscaled_sum() one of the scale per step.
/// Thread-safety: loss_fn()'s function runs on the device workers and touches only the scaler
/// (GradScaler::scale is thread-safe) and a copy of the normalizer; the rest is the caller's
/// thread only. The scaler must outlive the StepLoss and every call of its loss function.
class StepLoss {
 public:
  /// `step_labels`: the trained labels of the step's global batches (all passes, all ranks);
  /// `world`: the data-parallel ranks, whose gradient sync averages.
  StepLoss(int64_t step_labels, int64_t world, amp::GradScaler& scaler);

  /// The per-microbatch loss: the LmHead's summed token loss / (step_labels / world), times the
  /// loss scale when the scaler is enabled. Reads nothing from the device.
  LossFn loss_fn() const;
  /// Records one pass's forward_backward result (the sum of its microbatches' loss_fn values):
  /// the one host read of the pass.
  void add_pass(const at::Tensor& pass_loss);
  /// The passes' losses divided by the loss scale (which update() changes only after the step),
  /// summed in pass order.
  double unscaled_sum() const;

 private:
  double normalizer_;
  amp::GradScaler& scaler_;
  std::vector<double> pass_losses_;  // scaled, as forward_backward returned them
};

}  // namespace roundpipe::launcher
