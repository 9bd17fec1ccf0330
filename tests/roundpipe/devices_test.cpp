#include "roundpipe/devices.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>

namespace roundpipe {
namespace {

TEST(DevicesTest, DefaultDevices_MatchVisibleGpus) {
  auto devices = default_devices();
  const int64_t n = static_cast<int64_t>(torch::cuda::device_count());
  if (n == 0) {
    ASSERT_EQ(devices.size(), 1u);
    EXPECT_TRUE(devices[0].is_cpu());
  } else {
    ASSERT_EQ(static_cast<int64_t>(devices.size()), n);
    for (int64_t i = 0; i < n; ++i) EXPECT_EQ(devices[i], c10::Device(c10::kCUDA, i));
  }
}

TEST(DevicesTest, CheckDevices_RejectsBadLists) {
  EXPECT_NO_THROW(check_devices({c10::kCPU, c10::kCPU, c10::kCPU}));
  EXPECT_THROW(check_devices({}), c10::Error);
  const auto n = static_cast<c10::DeviceIndex>(cuda_device_count());
  try {
    check_devices({c10::Device(c10::kCUDA, n)});
    FAIL() << "accepted a CUDA device that is not visible";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("devices[0]"), std::string::npos);
  }
}

}  // namespace
}  // namespace roundpipe
