#include "optim/detail/parallel_tasks.h"

#include <boost/asio/post.hpp>
#include <boost/asio/thread_pool.hpp>

#include <algorithm>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>

namespace roundpipe::optim::detail {
namespace {

// Helper threads, started once and kept: a thread created per step would start on the caller's
// core and share it until the scheduler migrates it (measured slower on 2 cores).
boost::asio::thread_pool& helper_pool() {
  static boost::asio::thread_pool pool(std::max(1u, std::thread::hardware_concurrency()));
  return pool;
}

}  // namespace

void run_tasks(int64_t tasks, const std::function<void(int64_t)>& fn) {
  if (tasks <= 1) {
    fn(0);
    return;
  }
  std::mutex mutex;
  std::condition_variable done;
  int64_t remaining = tasks - 1;  // guarded by mutex
  std::exception_ptr error;       // guarded by mutex
  auto record = [&](std::exception_ptr e) {
    std::lock_guard<std::mutex> lock(mutex);
    if (e && !error) error = e;
  };
  for (int64_t task = 1; task < tasks; ++task) {
    boost::asio::post(helper_pool(), [&, task] {
      std::exception_ptr e;
      try {
        fn(task);
      } catch (...) {
        e = std::current_exception();
      }
      std::lock_guard<std::mutex> lock(mutex);
      if (e && !error) error = e;
      if (--remaining == 0) done.notify_one();
    });
  }
  try {
    fn(0);
  } catch (...) {
    record(std::current_exception());
  }
  std::unique_lock<std::mutex> lock(mutex);
  done.wait(lock, [&] { return remaining == 0; });
  if (error) std::rethrow_exception(error);
}

}  // namespace roundpipe::optim::detail
