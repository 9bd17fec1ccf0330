// Shared main of every LibTorch test binary: GPU tests (named *_CUDA) are filtered out, with a
// note, when no GPU is visible, so the suites run unchanged on CI machines without a GPU or driver.
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <exception>
#include <iostream>

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  size_t gpus = 0;
  try {
    gpus = torch::cuda::device_count();
  } catch (const std::exception&) {
    gpus = 0;  // no driver: same as no GPU
  }
  if (gpus == 0) {
    std::string filter = ::testing::GTEST_FLAG(filter);
    filter += filter.find('-') == std::string::npos ? "-*_CUDA" : ":*_CUDA";
    ::testing::GTEST_FLAG(filter) = filter;
    std::cout << "[ NOTE     ] no CUDA device visible: skipping *_CUDA tests" << std::endl;
  }
  return RUN_ALL_TESTS();
}
