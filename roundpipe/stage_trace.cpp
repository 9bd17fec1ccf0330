#include "roundpipe/stage_trace.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>

#include "roundpipe/detail/trace_recorder.h"

namespace roundpipe {
namespace {

struct Recorder {
  std::atomic<bool> on{false};
  std::atomic<int64_t> origin_ns{0};  // steady_clock at enable(true)
  std::mutex mutex;                   // guards entries
  std::vector<detail::TraceEntry> entries;
};

Recorder& recorder() {
  static Recorder instance;
  return instance;
}

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

namespace trace {

void enable(bool on) {
  Recorder& r = recorder();
  if (on) {
    std::lock_guard<std::mutex> lock(r.mutex);
    r.entries.clear();
    r.origin_ns = now_ns();
  }
  r.on = on;
}

bool enabled() { return recorder().on.load(std::memory_order_relaxed); }

std::vector<StageSpan> collect() {
  std::vector<detail::TraceEntry> entries;
  {
    Recorder& r = recorder();
    std::lock_guard<std::mutex> lock(r.mutex);
    entries = r.entries;
  }
  std::vector<StageSpan> spans;
  spans.reserve(entries.size());
  for (auto& entry : entries) {
    if (entry.resolve) entry.resolve(entry.span);
    spans.push_back(entry.span);
  }
  std::stable_sort(spans.begin(), spans.end(),
                   [](const StageSpan& a, const StageSpan& b) { return a.upload_begin_ms < b.upload_begin_ms; });
  return spans;
}

double upload_overlap_fraction(const std::vector<StageSpan>& spans) {
  double upload = 0, hidden = 0;
  for (const auto& s : spans) {
    const double begin = s.upload_begin_ms, end = s.upload_end_ms;
    if (end <= begin) continue;
    upload += end - begin;
    // Union of the same device's compute intervals clipped to [begin, end].
    std::vector<std::pair<double, double>> covered;
    for (const auto& c : spans) {
      if (c.worker != s.worker) continue;
      const double lo = std::max(begin, c.compute_begin_ms), hi = std::min(end, c.compute_end_ms);
      if (hi > lo) covered.emplace_back(lo, hi);
    }
    std::sort(covered.begin(), covered.end());
    double reach = begin;
    for (const auto& [lo, hi] : covered) {
      if (hi <= reach) continue;
      hidden += hi - std::max(lo, reach);
      reach = hi;
    }
  }
  return upload > 0 ? hidden / upload : 0.0;
}

}  // namespace trace

namespace detail {

int64_t trace_origin() { return recorder().origin_ns.load(); }

double trace_host_ms() { return static_cast<double>(now_ns() - recorder().origin_ns.load()) * 1e-6; }

void trace_record(TraceEntry entry) {
  Recorder& r = recorder();
  if (!r.on) return;
  std::lock_guard<std::mutex> lock(r.mutex);
  r.entries.push_back(std::move(entry));
}

}  // namespace detail
}  // namespace roundpipe
