#include "optim/detail/parallel_tasks.h"

#include <ATen/Parallel.h>
#include <boost/asio/post.hpp>
#include <boost/asio/thread_pool.hpp>

#include <algorithm>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>

#include "base/thread_budget.h"

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

// Elements per thread below which splitting a step further does not pay for waking a thread.
constexpr int64_t kGrainElements = 32 * 1024;

int64_t run_split(const std::vector<int64_t>& numels, int64_t requested,
                  const std::function<void(size_t, int64_t, int64_t)>& fn) {
  std::vector<int64_t> offsets(numels.size() + 1, 0);
  for (size_t i = 0; i < numels.size(); ++i) offsets[i + 1] = offsets[i] + numels[i];
  const int64_t total = offsets.back();
  if (total == 0) return 0;
  int64_t max_threads = requested > 0 ? requested : at::get_num_threads();
  if (requested == 0 && base::thread_budget() > 0) max_threads = std::min(max_threads, base::thread_budget());
  const int64_t tasks = std::max<int64_t>(1, std::min<int64_t>(max_threads, (total + kGrainElements - 1) / kGrainElements));
  run_tasks(tasks, [&](int64_t task) {
    const int64_t begin = total * task / tasks;
    const int64_t end = total * (task + 1) / tasks;
    auto it = std::upper_bound(offsets.begin(), offsets.end(), begin) - 1;
    for (size_t j = static_cast<size_t>(it - offsets.begin()); j < numels.size() && offsets[j] < end; ++j) {
      const int64_t lo = std::max(begin, offsets[j]) - offsets[j];
      const int64_t hi = std::min(end, offsets[j + 1]) - offsets[j];
      if (lo < hi) fn(j, lo, hi);
    }
  });
  return tasks;
}

}  // namespace roundpipe::optim::detail
