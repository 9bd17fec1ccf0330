// The plan preview: a simulated timeline (scheduler/simulator.h) drawn per device and per stage,
// as text for a terminal and as a self-contained SVG for a person to open (`roundpipe plan`,
// docs/user-guide.md "Seeing the plan"). Pure functions; thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "scheduler/simulator.h"

namespace roundpipe::scheduler {

struct PreviewOptions {
  /// Text: characters of the time axis (one column covers makespan / width).
  int64_t width = 72;
  /// The unit of the simulated times ("ms" for measured costs; size-based estimates have none).
  std::string time_unit = "ms";
  /// First line of the text and the SVG's title.
  std::string title = "Simulated pipeline timeline";

  PreviewOptions& set_width(int64_t v) { width = v; return *this; }
  PreviewOptions& set_time_unit(std::string v) { time_unit = std::move(v); return *this; }
  PreviewOptions& set_title(std::string v) { title = std::move(v); return *this; }
};

/// The symbol of a stage in the text timeline: its dispatch index in base 36 ("0".."9", "a".."z"),
/// then "A".."Z"; '#' from index 62 on.
char stage_symbol(int64_t index);

/// The text preview: a summary line (makespan, bubble and its fill / drain / steady / upload
/// split), one lane per device where each column shows the stage that computes for at least half
/// of it ('.' idle, '~' a job's upload before its first microbatch), a time axis and one line per
/// stage (phase, layers, device, start, end). Columns: `options.width` (at least 10).
std::string timeline_text(const SimulationResult& result, const PreviewOptions& options = {});

/// The SVG preview: one lane per device, one rectangle per microbatch of each stage job (coloured
/// by phase: forward, fused tail, backward; uploads grey) with a tooltip, the stage number on jobs
/// wide enough, a time axis with grid, a legend and the summary as subtitle.
std::string timeline_svg(const SimulationResult& result, const PreviewOptions& options = {});

}  // namespace roundpipe::scheduler
