// Shared main of every test binary: GPU tests (named *_CUDA) are filtered out, with a note, when
// no GPU is visible, so the suites run unchanged on CI machines without a GPU or driver.
#include <gtest/gtest.h>

#include <iostream>

#include "roundpipe/devices.h"

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  if (roundpipe::cuda_device_count() == 0) {
    std::string filter = ::testing::GTEST_FLAG(filter);
    filter += filter.find('-') == std::string::npos ? "-*_CUDA" : ":*_CUDA";
    ::testing::GTEST_FLAG(filter) = filter;
    std::cout << "[ NOTE     ] no CUDA device visible: skipping *_CUDA tests" << std::endl;
  }
  return RUN_ALL_TESTS();
}
