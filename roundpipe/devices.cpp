#include "roundpipe/devices.h"

#include <c10/core/DeviceGuard.h>
#include <c10/util/Exception.h>
#include <torch/cuda.h>

#include <string>

#include "base/config.h"
#if ROUNDPIPE_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#endif

namespace roundpipe {

int64_t cuda_device_count() {
  try {
    return static_cast<int64_t>(torch::cuda::device_count());
  } catch (const std::exception&) {
    return 0;
  }
}

int64_t cuda_device_memory_bytes(int64_t index) {
#if ROUNDPIPE_WITH_CUDA
  if (index < 0 || index >= cuda_device_count()) return 0;
  return static_cast<int64_t>(at::cuda::getDeviceProperties(static_cast<c10::DeviceIndex>(index))->totalGlobalMem);
#else
  (void)index;
  return 0;
#endif
}

std::vector<c10::Device> default_devices() {
  const int64_t n = cuda_device_count();
  if (n == 0) return {c10::Device(c10::kCPU)};
  std::vector<c10::Device> devices;
  for (int64_t i = 0; i < n; ++i) devices.emplace_back(c10::kCUDA, static_cast<c10::DeviceIndex>(i));
  return devices;
}

void check_devices(const std::vector<c10::Device>& devices) {
  TORCH_CHECK(!devices.empty(), "RoundPipeOptions::devices is empty: give at least one device, e.g. ",
              "{torch::kCPU} or {torch::Device(torch::kCUDA, 0)}");
  const int64_t num_cuda = cuda_device_count();
  for (size_t i = 0; i < devices.size(); ++i) {
    const c10::Device& d = devices[i];
    if (d.is_cpu()) continue;
    TORCH_CHECK(d.is_cuda(), "RoundPipeOptions::devices[", i, "] = ", d,
                " is not supported: use CPU or CUDA devices");
    TORCH_CHECK(ROUNDPIPE_WITH_CUDA, "RoundPipeOptions::devices[", i, "] = ", d,
                " but this build of RoundPipe has no CUDA support (LibTorch without CUDA)");
    TORCH_CHECK(d.has_index(), "RoundPipeOptions::devices[", i, "] = ", d,
                " has no index: write torch::Device(torch::kCUDA, k)");
    TORCH_CHECK(d.index() < num_cuda, "RoundPipeOptions::devices[", i, "] = ", d, " but only ", num_cuda,
                " CUDA device(s) are visible: ",
                num_cuda == 0 ? std::string("use CPU devices ({torch::kCPU}) or run where a GPU is visible")
                              : "use indices 0 to " + std::to_string(num_cuda - 1) +
                                    " (CUDA_VISIBLE_DEVICES renumbers the visible GPUs from 0)");
  }
}

}  // namespace roundpipe
