#include "roundpipe/detail/cuda_streams.h"

#if ROUNDPIPE_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>

namespace roundpipe::detail {

CudaStreamSet CudaStreamSet::create(c10::DeviceIndex device) {
  c10::cuda::CUDAGuard guard(device);
  return CudaStreamSet{c10::cuda::getStreamFromPool(false, device), c10::cuda::getStreamFromPool(false, device),
                       c10::cuda::getStreamFromPool(false, device), c10::cuda::getStreamFromPool(false, device)};
}

at::cuda::CUDAEvent wait_for(const c10::cuda::CUDAStream& waiter, const c10::cuda::CUDAStream& producer) {
  at::cuda::CUDAEvent event;
  event.record(producer);
  event.block(waiter);
  return event;
}

}  // namespace roundpipe::detail
#endif  // ROUNDPIPE_WITH_CUDA
