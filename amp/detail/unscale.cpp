#include "amp/detail/unscale.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <iterator>

namespace roundpipe::amp::detail {

std::vector<std::pair<c10::Device, at::Tensor>> non_finite_check_and_unscale(
    const std::vector<at::Tensor>& grads, const at::Tensor& inv_scale, bool allow_fp16) {
  // Buckets by (device, dtype) in order of first appearance, like torch's nested defaultdicts.
  // Every gradient is validated before any is touched, so a rejected list is left unmodified.
  struct DtypeBucket {
    c10::ScalarType dtype;
    std::vector<at::Tensor> tensors;
  };
  struct DeviceBucket {
    c10::Device device;
    std::vector<DtypeBucket> by_dtype;
  };
  std::vector<DeviceBucket> buckets;
  for (const auto& grad : grads) {
    if (!grad.defined()) continue;
    TORCH_CHECK_VALUE(allow_fp16 || grad.scalar_type() != at::kHalf, "Attempting to unscale FP16 gradients.");
    at::Tensor to_unscale = grad.is_sparse() ? grad._values() : grad;
    auto device_it = std::find_if(buckets.begin(), buckets.end(),
                                  [&](const DeviceBucket& b) { return b.device == to_unscale.device(); });
    if (device_it == buckets.end()) {
      buckets.push_back(DeviceBucket{to_unscale.device(), {}});
      device_it = std::prev(buckets.end());
    }
    auto& by_dtype = device_it->by_dtype;
    auto dtype_it = std::find_if(by_dtype.begin(), by_dtype.end(),
                                 [&](const DtypeBucket& b) { return b.dtype == to_unscale.scalar_type(); });
    if (dtype_it == by_dtype.end()) {
      by_dtype.push_back(DtypeBucket{to_unscale.scalar_type(), {}});
      dtype_it = std::prev(by_dtype.end());
    }
    dtype_it->tensors.push_back(std::move(to_unscale));
  }

  std::vector<std::pair<c10::Device, at::Tensor>> found_inf_per_device;
  at::NoGradGuard no_grad;
  for (auto& bucket : buckets) {
    auto found_inf = at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(bucket.device));
    auto device_inv_scale = inv_scale.to(at::TensorOptions().device(bucket.device), /*non_blocking=*/true);
    for (auto& dtype_bucket : bucket.by_dtype) {
      at::_amp_foreach_non_finite_check_and_unscale_(dtype_bucket.tensors, found_inf, device_inv_scale);
    }
    found_inf_per_device.emplace_back(bucket.device, std::move(found_inf));
  }
  return found_inf_per_device;
}

}  // namespace roundpipe::amp::detail
