// The gradient check-and-unscale driver shared by GradScaler and the runtime's per-stage inf/NaN
// checks (internal to RoundPipe).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <utility>
#include <vector>

namespace roundpipe::amp::detail {

/// Unscales `grads` in place by `inv_scale` and checks them for inf/NaN, one
/// `at::_amp_foreach_non_finite_check_and_unscale_` per (device, dtype) bucket, in order of first
/// appearance. Returns one 0-dim float32 found_inf per device (0: all finite, non-zero: some
/// inf/NaN), on that device. `inv_scale` is a 1-element float32 tensor (copied to each device);
/// pass 1.0 to check without unscaling. Undefined tensors are skipped; sparse gradients unscale
/// their values (fp16 sparse ones must be coalesced by the caller). With `allow_fp16 = false` an
/// fp16 gradient fails with "Attempting to unscale FP16 gradients.". No host sync.
std::vector<std::pair<c10::Device, at::Tensor>> non_finite_check_and_unscale(
    const std::vector<at::Tensor>& grads, const at::Tensor& inv_scale, bool allow_fp16);

}  // namespace roundpipe::amp::detail
