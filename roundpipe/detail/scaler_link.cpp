#include "roundpipe/detail/scaler_link.h"

#include <c10/core/Device.h>
#include <c10/util/Exception.h>

#include "amp/detail/grad_scaler_access.h"

namespace roundpipe::detail {

using amp::detail::GradScalerAccess;

void ScalerLink::observe_scale(amp::GradScaler& scaler, int64_t generation) {
  amp::GradScaler* seen = scaler_.load();
  if (seen == nullptr) {
    generation_.store(generation);
    scaler_.store(&scaler);
    return;
  }
  TORCH_CHECK(seen == &scaler, "loss_fn scaled losses with two different GradScalers in one forward_backward; ",
              "use one GradScaler per RoundPipe");
  TORCH_CHECK(generation_.load() == generation,
              "GradScaler::update() ran while forward_backward was scaling losses; call update() after ",
              "forward_backward returns");
}

void ScalerLink::post_found_inf(const at::Tensor& found_inf) {
  if (defer_) {
    at::Tensor host = found_inf.to(c10::kCPU);
    std::lock_guard<std::mutex> lock(mutex_);
    deferred_ = deferred_.defined() ? deferred_ + host : host;
    return;
  }
  GradScalerAccess::post_found_inf(*scaler_.load(), generation_.load(), flag_batch_, found_inf);
  flags_posted_.fetch_add(1);
}

at::Tensor ScalerLink::deferred_found_inf() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return deferred_;
}

void ScalerLink::post_combined(const at::Tensor& found_inf) const {
  GradScalerAccess::post_found_inf(*scaler_.load(), generation_.load(), flag_batch_, found_inf);
}

void ScalerLink::announce_flags(amp::GradScaler& scaler, int64_t count) const {
  GradScalerAccess::expect_found_inf(scaler, generation_.load(), flag_batch_, count);
}

void ScalerLink::drop_announced_flags(amp::GradScaler& scaler) const {
  GradScalerAccess::drop_run(scaler, generation_.load(), flag_batch_);
}

}  // namespace roundpipe::detail
