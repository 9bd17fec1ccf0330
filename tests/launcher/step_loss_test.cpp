#include "roundpipe/launcher/step_loss.h"

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <vector>

namespace roundpipe::launcher {
namespace {

// Counts the tensor reads to the host (Tensor::item() and the like dispatch
// aten::_local_scalar_dense; on a GPU each one synchronizes the device) on every thread while it
// lives: the dispatcher's own count, independent of the code under test.
class HostReadCounter {
 public:
  HostReadCounter() {
    handle_ = at::addGlobalCallback(
        at::RecordFunctionCallback([](const at::RecordFunction& fn) -> std::unique_ptr<at::ObserverContext> {
          if (std::strcmp(fn.name(), "aten::_local_scalar_dense") == 0) reads().fetch_add(1);
          return nullptr;
        }).scopes({at::RecordScope::FUNCTION}));
    reads().store(0);
  }
  ~HostReadCounter() { at::removeCallback(handle_); }
  HostReadCounter(const HostReadCounter&) = delete;
  HostReadCounter& operator=(const HostReadCounter&) = delete;

  int64_t count() const { return reads().load(); }

 private:
  static std::atomic<int64_t>& reads() {
    static std::atomic<int64_t> value{0};
    return value;
  }
  at::CallbackHandle handle_;
};

TEST(StepLossTest, HostReads_OnePerPassNonePerMicrobatch) {
  amp::GradScaler scaler(amp::GradScalerOptions().enabled(false));
  // 2 passes x 3 microbatches; 12 trained labels over 2 ranks: normalizer 6.
  const std::vector<std::vector<double>> summed = {{1.5, 3.0, 0.75}, {6.0, 2.25, 4.5}};
  StepLoss loss(/*step_labels=*/12, /*world=*/2, scaler);
  HostReadCounter counter;
  int64_t after_passes = 0;
  for (const auto& pass : summed) {
    const LossFn fn = loss.loss_fn();
    at::Tensor pass_loss = at::zeros({}, at::kDouble);
    for (double microbatch : pass) pass_loss = pass_loss + fn(at::scalar_tensor(microbatch, at::kDouble), at::Tensor());
    EXPECT_EQ(counter.count(), after_passes) << "loss_fn read a microbatch's loss to the host";
    loss.add_pass(pass_loss);
    EXPECT_EQ(counter.count(), ++after_passes) << "add_pass: one read per pass";
  }
  const double value = loss.unscaled_sum();
  EXPECT_EQ(counter.count(), 2);  // no scaler: no scale read
  EXPECT_DOUBLE_EQ(value, (1.5 + 3.0 + 0.75) / 6.0 + (6.0 + 2.25 + 4.5) / 6.0);
}

TEST(StepLossTest, Scaler_ScalesEachMicrobatchAndReadsTheScaleOncePerStep) {
  amp::GradScaler scaler(amp::GradScalerOptions().init_scale(1024.0));
  StepLoss loss(/*step_labels=*/4, /*world=*/1, scaler);
  const LossFn fn = loss.loss_fn();
  HostReadCounter counter;
  const at::Tensor first = fn(at::scalar_tensor(2.0, at::kFloat), at::Tensor());
  const at::Tensor second = fn(at::scalar_tensor(6.0, at::kFloat), at::Tensor());
  EXPECT_EQ(counter.count(), 0) << "loss_fn read a microbatch's loss or the scale to the host";
  loss.add_pass(first);
  loss.add_pass(second);
  const double value = loss.unscaled_sum();
  EXPECT_EQ(counter.count(), 3);  // two pass losses and the scale
  EXPECT_DOUBLE_EQ(first.item<double>(), 2.0 / 4.0 * 1024.0);
  EXPECT_DOUBLE_EQ(value, 2.0 / 4.0 + 6.0 / 4.0);
}

}  // namespace
}  // namespace roundpipe::launcher
