// The device pool a RoundPipe model streams its stages to.
#pragma once

#include <c10/core/Device.h>

#include <vector>

namespace roundpipe {

/// All visible CUDA devices, or {kCPU} when no GPU (or no GPU driver) is present.
std::vector<c10::Device> default_devices();

/// Number of visible CUDA devices; 0 without a GPU or driver (never throws).
int64_t cuda_device_count();

/// Total memory of CUDA device `index` in bytes; 0 without CUDA.
int64_t cuda_device_memory_bytes(int64_t index);

/// Throws c10::Error naming the device when `devices` is empty or holds a device this process
/// cannot use (CUDA index out of range, a CUDA device in a build without CUDA, an unsupported
/// type). CPU devices may repeat: each entry is one worker thread.
void check_devices(const std::vector<c10::Device>& devices);

}  // namespace roundpipe
