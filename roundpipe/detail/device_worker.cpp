#include "roundpipe/detail/device_worker.h"

#include <boost/asio/post.hpp>
#include <boost/asio/thread_pool.hpp>

#include "base/config.h"
#if ROUNDPIPE_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif

namespace roundpipe::detail {
namespace {
thread_local const DeviceWorker* current_worker = nullptr;
}  // namespace

DeviceWorker::DeviceWorker(c10::Device device)
    : device_(device), pool_(std::make_unique<boost::asio::thread_pool>(1)) {}

DeviceWorker::~DeviceWorker() { pool_->join(); }

bool DeviceWorker::is_current() const { return current_worker == this; }

std::future<void> DeviceWorker::post(std::function<void()> job) {
  // The job is moved out and destroyed before the future becomes ready: whatever it captured
  // (an iteration's scale copy, gradients) is released by the time a waiter wakes, not later,
  // when the pool drops the handler.
  auto task = std::make_shared<std::packaged_task<void()>>([this, job = std::move(job)]() mutable {
#if ROUNDPIPE_WITH_CUDA
    if (device_.is_cuda()) c10::cuda::set_device(device_.index());
#endif
    current_worker = this;  // the pool's one thread serves only this worker
    std::function<void()> run = std::move(job);
    run();
  });
  auto future = task->get_future();
  boost::asio::post(*pool_, [task] { (*task)(); });
  return future;
}

}  // namespace roundpipe::detail
