// Recording side of roundpipe/stage_trace.h (internal).
#pragma once

#include <cstdint>
#include <functional>

#include "roundpipe/stage_trace.h"

namespace roundpipe::detail {

/// A finished job's span; `resolve` (may be empty) fills device-side times at collect().
struct TraceEntry {
  trace::StageSpan span;
  std::function<void(trace::StageSpan&)> resolve;
};

/// Milliseconds since trace::enable(true), host clock.
double trace_host_ms();
/// Identifies the current enable(true) (changes with each).
int64_t trace_origin();
/// Appends `entry` if tracing is on (any thread).
void trace_record(TraceEntry entry);

}  // namespace roundpipe::detail
