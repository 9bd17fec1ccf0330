// One worker thread per device: runs stage jobs in FIFO order (internal).
#pragma once

#include <c10/core/Device.h>

#include <functional>
#include <future>
#include <memory>

namespace boost::asio {
class thread_pool;
}

namespace roundpipe::detail {

/// A FIFO executor with exactly one thread, bound to one device (Boost.Asio thread_pool(1)).
/// `post` may be called from any thread; jobs run in posting order. A job's exception is
/// captured in its future (never terminates the thread). A job and its captures are destroyed
/// before its future becomes ready. The destructor waits for posted jobs.
class DeviceWorker {
 public:
  explicit DeviceWorker(c10::Device device);
  ~DeviceWorker();
  DeviceWorker(const DeviceWorker&) = delete;
  DeviceWorker& operator=(const DeviceWorker&) = delete;

  const c10::Device& device() const { return device_; }
  std::future<void> post(std::function<void()> job);
  /// True on this worker's thread (while it runs a job).
  bool is_current() const;

 private:
  c10::Device device_;
  std::unique_ptr<boost::asio::thread_pool> pool_;
};

}  // namespace roundpipe::detail
