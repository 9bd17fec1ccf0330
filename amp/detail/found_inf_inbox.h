// The lock-free mailbox that carries found_inf flags from device worker threads to the thread
// that runs GradScaler::update() (internal to roundpipe::amp).
#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

namespace boost::lockfree {
template <typename T, typename... Options>
class queue;
}  // namespace boost::lockfree

namespace roundpipe::amp::detail {

/// One posted flag: the found_inf of one backward stage of one run.
struct FoundInfFlag {
  int64_t generation = 0;  // the scaler's update count when the iteration called scale()
  uint64_t batch = 0;      // the run (forward_backward call) it belongs to
  at::Tensor found_inf;    // 1 element, on the device that checked the gradients
  bool cancel = false;     // no flag: run `batch` failed after it was announced (found_inf undefined)
};

/// Multi-producer, single-consumer mailbox of found_inf flags.
///
/// Thread-safety: `post` from any number of threads, lock-free (Boost.Lockfree queue; on a CUDA
/// tensor it records an event on the device's current stream, so the consumer orders its reads
/// after the check without a host sync). `drain` and `wait_for_post` from one consumer at a time
/// (the GradScaler holds its mutex). A poster takes `wakeup_mutex_` only when a consumer is
/// waiting (`waiters_ > 0`), to notify it; the check of `waiters_` after the push and the
/// consumer's registration before its re-check make a lost wakeup impossible.
class FoundInfInbox {
 public:
  FoundInfInbox();
  ~FoundInfInbox();  // frees flags never drained
  FoundInfInbox(const FoundInfInbox&) = delete;
  FoundInfInbox& operator=(const FoundInfInbox&) = delete;

  void post(FoundInfFlag flag);

  /// Every flag posted so far, in no particular order. On CUDA the flag's tensor is ready to be
  /// read on its device's current stream of the calling thread.
  std::vector<FoundInfFlag> drain();

  /// Blocks until a post after the last `drain` (returns true) or until `deadline` (false).
  bool wait_for_post(std::chrono::steady_clock::time_point deadline);

 private:
  struct Node;
  std::unique_ptr<boost::lockfree::queue<Node*>> queue_;
  std::atomic<int> waiters_{0};
  std::mutex wakeup_mutex_;  // guards nothing but the wait/notify handshake
  std::condition_variable wakeup_;
};

}  // namespace roundpipe::amp::detail
