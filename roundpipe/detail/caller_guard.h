// The "one caller thread at a time" check of RoundPipe's entry points (internal; Note [One
// caller thread]).
#pragma once

#include <c10/util/Exception.h>

#include <atomic>
#include <string>
#include <thread>

namespace roundpipe::detail {

// Note [One caller thread]:
// A RoundPipe is driven by one thread at a time: forward_backward, forward, step and synchronize
// share caller-thread-only state (the step queue, the iteration counter, the device cursor) that
// no lock protects. Two user threads calling in at once used to race silently. Each entry point
// now holds a CallerGuard::Scope: one compare-and-swap of the owning thread's id on entry and one
// store on exit (no lock, nothing on the hot path of the stage jobs). A second thread entering
// while another is inside gets a c10::Error naming the model, both calls and the fix, and the
// first thread's call is not disturbed. The same thread may nest (a kSync step function may call
// forward on its own thread). Handing the model from one thread to another between calls is
// fine: the release on exit and the acquire on entry order the two threads' accesses.
// Calls from RoundPipe's own threads are rejected by the caller of `enter` (round_pipe.cpp): a
// step function that calls synchronize() on the optimizer thread would wait for itself.

/// Tracks which thread is inside a RoundPipe's entry points. Thread-safety: any thread may call
/// `enter`; `depth_` is touched only by the owning thread.
class CallerGuard {
 public:
  /// Leaves the guard on destruction (only made by `enter`).
  class Scope {
   public:
    explicit Scope(CallerGuard* guard) : guard_(guard) {}
    Scope(Scope&& other) noexcept : guard_(other.guard_) { other.guard_ = nullptr; }
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;
    Scope& operator=(Scope&&) = delete;
    ~Scope() {
      if (guard_ != nullptr) guard_->leave();
    }

   private:
    CallerGuard* guard_;
  };

  /// Enters `entry` (e.g. "forward_backward") on the calling thread; throws c10::Error if another
  /// thread is inside one of the model's entry points.
  Scope enter(const char* entry, const std::string& model_name) {
    const std::thread::id self = std::this_thread::get_id();
    std::thread::id expected{};
    if (!owner_.compare_exchange_strong(expected, self, std::memory_order_acquire, std::memory_order_relaxed) &&
        expected != self) {
      const char* other_entry = entry_.load(std::memory_order_relaxed);
      TORCH_CHECK(false, "RoundPipe '", model_name, "': ", entry, " called on thread ", self, " while thread ",
                  expected, " is inside ", other_entry != nullptr ? other_entry : "a call",
                  " of the same model; a RoundPipe is driven by one thread at a time (forward_backward, forward, "
                  "step, synchronize): serialize the calls (e.g. with a mutex around each iteration) or give "
                  "each thread its own RoundPipe");
    }
    if (depth_++ == 0) entry_.store(entry, std::memory_order_relaxed);
    return Scope(this);
  }

 private:
  void leave() {
    if (--depth_ == 0) {
      entry_.store(nullptr, std::memory_order_relaxed);
      owner_.store(std::thread::id{}, std::memory_order_release);
    }
  }

  std::atomic<std::thread::id> owner_{};
  std::atomic<const char*> entry_{nullptr};  // the owner's outermost call, for the message only
  int depth_ = 0;                             // owner thread only
};

}  // namespace roundpipe::detail
