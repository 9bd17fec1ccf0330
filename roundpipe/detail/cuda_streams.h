// CUDA streams and events of one device worker (internal). Only compiled with CUDA.
#pragma once

#include "base/config.h"

#if ROUNDPIPE_WITH_CUDA
#include <c10/cuda/CUDAStream.h>
#include <ATen/cuda/CUDAEvent.h>

namespace roundpipe::detail {

/// The four streams a CUDA device worker uses: parameter upload, activation upload, compute,
/// and download (gradients, activations, buffers). Work on them is ordered only by events
/// (see `wait_for`), never by the legacy default stream. Owned by one device worker thread.
struct CudaStreamSet {
  c10::cuda::CUDAStream param_upload;
  c10::cuda::CUDAStream activation_upload;
  c10::cuda::CUDAStream compute;
  c10::cuda::CUDAStream download;

  /// Fresh high-priority-free pool streams of `device`.
  static CudaStreamSet create(c10::DeviceIndex device);
};

/// Makes future work on `waiter` wait for all work enqueued so far on `producer`, without
/// blocking the host: records an event on `producer` and makes `waiter` wait on it.
/// Returns the event so a host thread may also synchronize on it.
at::cuda::CUDAEvent wait_for(const c10::cuda::CUDAStream& waiter, const c10::cuda::CUDAStream& producer);

}  // namespace roundpipe::detail
#endif  // ROUNDPIPE_WITH_CUDA
