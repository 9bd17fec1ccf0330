// optim::detail::run_tasks (Note [Why not at::parallel_for]); that optim::Adam's results do not
// depend on the thread count is AdamKernelTest.ResultsIndependentOfThreadCount.
#include "optim/detail/parallel_tasks.h"

#include <gtest/gtest.h>

#include <atomic>
#include <map>
#include <mutex>
#include <set>
#include <stdexcept>
#include <thread>

namespace roundpipe::optim {
namespace {

TEST(ParallelTasksTest, RunsEveryTaskOnce_Task0OnCallerOthersOnHelperThreads) {
  std::mutex mutex;
  std::multiset<int64_t> ran;
  std::map<int64_t, std::thread::id> thread_of;
  detail::run_tasks(4, [&](int64_t task) {
    std::lock_guard<std::mutex> lock(mutex);
    ran.insert(task);
    thread_of[task] = std::this_thread::get_id();
  });
  EXPECT_EQ(ran, (std::multiset<int64_t>{0, 1, 2, 3}));
  // The contract: task 0 on the caller, every other task on a helper thread (not the caller).
  EXPECT_EQ(thread_of[0], std::this_thread::get_id());
  for (int64_t task = 1; task < 4; ++task) EXPECT_NE(thread_of[task], std::this_thread::get_id()) << "task " << task;
  std::set<std::thread::id> single;
  detail::run_tasks(1, [&](int64_t) { single.insert(std::this_thread::get_id()); });
  EXPECT_EQ(single, std::set<std::thread::id>{std::this_thread::get_id()});
}

TEST(ParallelTasksTest, RethrowsATaskError_AfterAllTasksFinished) {
  std::atomic<int> finished{0};
  EXPECT_THROW(detail::run_tasks(3,
                                 [&](int64_t task) {
                                   if (task == 2) throw std::runtime_error("task 2 failed");
                                   finished.fetch_add(1);
                                 }),
               std::runtime_error);
  EXPECT_EQ(finished.load(), 2);
}

}  // namespace
}  // namespace roundpipe::optim
