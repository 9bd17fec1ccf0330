#include "amp/detail/found_inf_inbox.h"

#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <boost/lockfree/queue.hpp>
#include <optional>

namespace roundpipe::amp::detail {

struct FoundInfInbox::Node {
  FoundInfFlag flag;
  std::optional<c10::Event> ready;  // recorded after the check (non-CPU devices only)
};

FoundInfInbox::FoundInfInbox() : queue_(std::make_unique<boost::lockfree::queue<Node*>>(64)) {}

FoundInfInbox::~FoundInfInbox() {
  Node* node = nullptr;
  while (queue_->pop(node)) delete node;
}

void FoundInfInbox::post(FoundInfFlag flag) {
  auto node = std::make_unique<Node>();
  const c10::Device device = flag.found_inf.defined() ? flag.found_inf.device() : c10::Device(c10::kCPU);
  if (!device.is_cpu()) {
    c10::impl::VirtualGuardImpl guard(device.type());
    node->ready.emplace(device.type());
    node->ready->record(guard.getStream(device));
  }
  node->flag = std::move(flag);
  queue_->push(node.release());  // seq_cst, before the waiters_ check below
  if (waiters_.load() > 0) {
    std::lock_guard<std::mutex> lock(wakeup_mutex_);
    wakeup_.notify_all();
  }
}

std::vector<FoundInfFlag> FoundInfInbox::drain() {
  std::vector<FoundInfFlag> out;
  Node* raw = nullptr;
  while (queue_->pop(raw)) {
    std::unique_ptr<Node> node(raw);
    at::Tensor& found_inf = node->flag.found_inf;
    if (node->ready) {
      // Note [found_inf across streams]: the consumer reads the flag on its own current stream of
      // the flag's device; wait for the check there, and keep the allocator from reusing the
      // flag's memory on the posting stream before that read is done.
      c10::impl::VirtualGuardImpl guard(found_inf.device().type());
      const c10::Stream stream = guard.getStream(found_inf.device());
      node->ready->block(stream);
      found_inf.record_stream(stream);
    }
    out.push_back(std::move(node->flag));
  }
  return out;
}

bool FoundInfInbox::wait_for_post(std::chrono::steady_clock::time_point deadline) {
  waiters_.fetch_add(1);
  std::unique_lock<std::mutex> lock(wakeup_mutex_);
  const bool posted = wakeup_.wait_until(lock, deadline, [&] { return !queue_->empty(); });
  lock.unlock();
  waiters_.fetch_sub(1);
  return posted;
}

}  // namespace roundpipe::amp::detail
