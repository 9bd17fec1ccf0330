// The CUDA stream helpers: compiled whenever LibTorch has CUDA, run only where a GPU is visible.
#include <gtest/gtest.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <torch/torch.h>

#include "base/config.h"
#include "roundpipe/detail/cuda_streams.h"

namespace roundpipe::detail {
namespace {

#if ROUNDPIPE_WITH_CUDA
TEST(CudaStreamSetTest, WaitFor_OrdersCopyAfterCompute_CUDA) {
  auto set = CudaStreamSet::create(0);
  auto host = torch::arange(1 << 20, torch::kFloat).pin_memory();
  torch::Tensor device_copy, result;
  {
    c10::cuda::CUDAStreamGuard guard(set.param_upload);
    device_copy = host.to(torch::kCUDA, /*non_blocking=*/true);
  }
  wait_for(set.compute, set.param_upload);
  {
    c10::cuda::CUDAStreamGuard guard(set.compute);
    result = device_copy * 2;
  }
  auto done = wait_for(set.download, set.compute);
  torch::Tensor back;
  {
    c10::cuda::CUDAStreamGuard guard(set.download);
    back = result.to(torch::kCPU);
  }
  done.synchronize();
  EXPECT_TRUE(torch::equal(back, host * 2));
  EXPECT_NE(set.compute.id(), set.download.id());
}
#endif

TEST(CudaStreamSetTest, CudaPathIsCompiledIffLibTorchHasCuda) {
  // The CUDA translation units are part of the build exactly when LibTorch has CUDA (the PyPI
  // wheel does). CUDA hooks are registered by libtorch_cuda even on machines without a GPU.
  EXPECT_EQ(ROUNDPIPE_WITH_CUDA == 1, at::detail::getCUDAHooks().isBuilt())
      << "ROUNDPIPE_WITH_CUDA=" << ROUNDPIPE_WITH_CUDA << " disagrees with LibTorch's CUDA hooks";
}

}  // namespace
}  // namespace roundpipe::detail
