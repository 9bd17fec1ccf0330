#include "tests/reliability/reliability_util.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <torch/nn/modules/linear.h>
#include <ATen/ATen.h>
#include <dirent.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstring>

#include "tests/common/sanitizer_memory.h"

namespace roundpipe::testing {
namespace {

// Counts live allocations of c10's CPU allocator: every block it hands out carries a context that
// decrements the counters when the storage is freed (by whatever thread frees it).
std::atomic<int64_t> live_bytes{0};
std::atomic<int64_t> live_blocks{0};

struct CountedBlock {
  c10::DataPtr inner;
  size_t bytes;
};

void free_counted(void* ctx) {
  auto* block = static_cast<CountedBlock*>(ctx);
  live_bytes.fetch_sub(static_cast<int64_t>(block->bytes));
  live_blocks.fetch_sub(block->bytes > 0 ? 1 : 0);
  delete block;  // frees the inner allocation through its own deleter
}

class CountingCpuAllocator final : public c10::Allocator {
 public:
  explicit CountingCpuAllocator(c10::Allocator* inner) : inner_(inner) {}
  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr inner = inner_->allocate(n);
    void* data = inner.get();
    const c10::Device device = inner.device();
    auto* block = new CountedBlock{std::move(inner), n};
    live_bytes.fetch_add(static_cast<int64_t>(n));
    live_blocks.fetch_add(n > 0 ? 1 : 0);
    return c10::DataPtr(data, block, &free_counted, device);
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }

 private:
  c10::Allocator* inner_;
};

// Installed before main, so every CPU tensor of the tests is counted.
const bool counting_allocator_installed = [] {
  static CountingCpuAllocator allocator(c10::GetCPUAllocator());
  c10::SetCPUAllocator(&allocator, /*priority=*/100);
  return true;
}();

int64_t count_entries(const char* dir) {
  DIR* handle = ::opendir(dir);
  if (handle == nullptr) return -1;
  int64_t n = 0;
  while (dirent* entry = ::readdir(handle)) {
    if (std::strcmp(entry->d_name, ".") != 0 && std::strcmp(entry->d_name, "..") != 0) ++n;
  }
  ::closedir(handle);
  return n;
}

char watchdog_message[512];
size_t watchdog_message_size = 0;

void on_alarm(int) {
  // Async-signal-safe only: write and _exit.
  ssize_t ignored = ::write(2, watchdog_message, watchdog_message_size);
  (void)ignored;
  ::_exit(124);
}

}  // namespace

Watchdog::Watchdog(unsigned seconds) {
  const ::testing::TestInfo* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const int n = std::snprintf(watchdog_message, sizeof(watchdog_message),
                              "\nwatchdog: %s.%s still running after %u s (hang); aborting the test binary\n",
                              info != nullptr ? info->test_suite_name() : "?", info != nullptr ? info->name() : "?",
                              seconds);
  watchdog_message_size = n > 0 ? std::min(static_cast<size_t>(n), sizeof(watchdog_message) - 1) : 0;
  struct sigaction action {};
  action.sa_handler = on_alarm;
  ::sigemptyset(&action.sa_mask);
  ::sigaction(SIGALRM, &action, nullptr);
  ::alarm(seconds);
}

Watchdog::~Watchdog() { ::alarm(0); }

int64_t thread_count() { return count_entries("/proc/self/task"); }

int64_t fd_count() { return count_entries("/proc/self/fd") - 1; }  // less opendir's own descriptor

CpuMemory live_cpu_memory() {
  (void)counting_allocator_installed;
  return {live_bytes.load(), live_blocks.load()};
}

int64_t rss_bytes() {
  FILE* f = std::fopen("/proc/self/statm", "r");
  if (f == nullptr) return -1;
  long size = 0, resident = 0;
  const int got = std::fscanf(f, "%ld %ld", &size, &resident);
  std::fclose(f);
  return got == 2 ? static_cast<int64_t>(resident) * ::sysconf(_SC_PAGESIZE) : -1;
}

int64_t process_memory_bytes() { return sanitizer_allocated_bytes().value_or(rss_bytes()); }

void warm_up_torch() {
  torch::nn::Linear layer(64, 64);
  layer->forward(at::randn({8, 64})).sum().backward();
  (void)at::mm(at::randn({512, 512}), at::randn({512, 512})).sum().item<float>();
}

Resources Resources::now() { return {thread_count(), fd_count(), live_cpu_memory()}; }

void expect_no_leak(const Resources& before, const Resources& after, const std::string& what) {
  EXPECT_LE(after.threads, before.threads) << what << ": threads leaked";
  EXPECT_LE(after.fds, before.fds) << what << ": file descriptors leaked";
  EXPECT_LE(after.cpu.blocks, before.cpu.blocks) << what << ": CPU tensor blocks leaked (" << after.cpu.bytes
                                                 << " bytes live, " << before.cpu.bytes << " before)";
  EXPECT_LE(after.cpu.bytes, before.cpu.bytes) << what << ": CPU tensor bytes leaked";
}

}  // namespace roundpipe::testing
