#include "amp/detail/grad_scaler_access.h"

#include <c10/util/Exception.h>

#include "amp/detail/scaler_core.h"
#include "amp/grad_scaler.h"

namespace roundpipe::amp::detail {
namespace {

thread_local ScaleObserver* current_observer = nullptr;
thread_local IterationScope* current_scope = nullptr;

}  // namespace

ScopedScaleObserver::ScopedScaleObserver(ScaleObserver* observer) : previous_(current_observer) {
  current_observer = observer;
}
ScopedScaleObserver::~ScopedScaleObserver() { current_observer = previous_; }

ScaleObserver* current_scale_observer() { return current_observer; }

IterationScope::IterationScope(const GradScaler& scaler, std::shared_ptr<Iteration> iteration)
    : scaler_(&scaler), iteration_(std::move(iteration)), previous_(current_scope) {
  TORCH_INTERNAL_ASSERT(iteration_ != nullptr, "IterationScope needs an Iteration");
  current_scope = this;
}
IterationScope::~IterationScope() { current_scope = previous_; }

Iteration* scope_iteration(const GradScaler& scaler) {
  for (IterationScope* s = current_scope; s != nullptr; s = s->previous_) {
    if (s->scaler_ == &scaler) return s->iteration_.get();
  }
  return nullptr;
}

void GradScalerAccess::post_found_inf(GradScaler& scaler, int64_t generation, uint64_t batch,
                                      const at::Tensor& found_inf) {
  if (!scaler.enabled_) return;
  TORCH_CHECK(found_inf.defined() && found_inf.numel() == 1,
              "GradScaler::post_found_inf: found_inf must be a 1-element tensor");
  scaler.core_->inbox.post(FoundInfFlag{generation, batch, found_inf});
}

void GradScalerAccess::drop_run(GradScaler& scaler, int64_t generation, uint64_t batch) {
  if (!scaler.enabled_) return;
  FoundInfFlag cancel;
  cancel.generation = generation;
  cancel.batch = batch;
  cancel.cancel = true;
  scaler.core_->inbox.post(std::move(cancel));
}

void GradScalerAccess::expect_found_inf(GradScaler& scaler, int64_t generation, uint64_t batch, int64_t count) {
  if (!scaler.enabled_) return;
  TORCH_CHECK(count >= 0, "GradScaler::expect_found_inf: count must be >= 0, got ", count);
  ScalerCore& core = *scaler.core_;
  std::lock_guard<std::mutex> lock(core.mutex);
  TORCH_CHECK(generation >= core.generation, "GradScaler::expect_found_inf: update ", generation,
              " already ran; a run's flags must be announced before the update() that follows its scale()");
  core.expected[generation][batch] += count;
}

std::shared_ptr<Iteration> GradScalerAccess::capture_iteration(GradScaler& scaler) {
  auto iteration = std::make_shared<Iteration>();
  ScalerCore& core = *scaler.core_;
  std::lock_guard<std::mutex> lock(core.mutex);
  core.complete_deferred_update_locked();
  core.scale_ready_locked();
  if (core.scale.defined()) iteration->scale = core.scale.clone();
  return iteration;
}

void GradScalerAccess::set_executor(GradScaler& scaler, std::weak_ptr<const Executor> executor) {
  ScalerCore& core = *scaler.core_;
  std::lock_guard<std::mutex> lock(core.mutex);
  core.executor = std::move(executor);
}

}  // namespace roundpipe::amp::detail
