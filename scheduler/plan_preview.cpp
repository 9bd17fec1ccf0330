#include "scheduler/plan_preview.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <sstream>

#include "base/svg.h"

namespace roundpipe::scheduler {
namespace {

using svg::escape_xml;
using svg::fmt;

std::string with_unit(double value, const std::string& unit) {
  return fmt("%.1f", value) + (unit.empty() ? "" : " " + unit);
}

std::string percent(double ratio) { return fmt("%.1f%%", 100.0 * ratio); }

std::string summary(const SimulationResult& r, const std::string& unit) {
  std::ostringstream out;
  out << r.num_devices << " device" << (r.num_devices == 1 ? "" : "s") << ", " << r.num_microbatch << " microbatch"
      << (r.num_microbatch == 1 ? "" : "es") << ": makespan " << with_unit(r.makespan, unit) << ", bubble "
      << percent(r.bubble_ratio()) << " (fill " << percent(r.fill_ratio()) << ", drain " << percent(r.drain_ratio())
      << ", steady " << percent(r.steady_ratio()) << ", upload " << percent(r.overhead_ratio()) << ")";
  return out.str();
}

std::string stage_label(const SimulatedJob& job) {
  std::ostringstream out;
  out << "stage " << job.index << " (" << to_string(job.phase) << ", layers " << job.layers.to_string() << ")";
  if (job.iteration > 0) out << ", iteration " << job.iteration;
  return out.str();
}

/// The device time one job spends on its upload before its first microbatch, as [start, end).
std::pair<double, double> upload_span(const SimulatedJob& job) { return {job.start, job.start + job.overhead}; }

}  // namespace

char stage_symbol(int64_t index) {
  static constexpr const char* kSymbols = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ";
  return index >= 0 && index < 62 ? kSymbols[index] : '#';
}

std::string timeline_text(const SimulationResult& r, const PreviewOptions& options) {
  TORCH_CHECK(options.width >= 10, "timeline_text: width must be at least 10 columns, got ", options.width);
  std::ostringstream out;
  out << options.title << ": " << summary(r, options.time_unit) << "\n";
  if (r.makespan <= 0 || r.jobs.empty()) {
    out << "(no jobs)\n";
    return out.str();
  }
  const int64_t width = options.width;
  const double column = r.makespan / static_cast<double>(width);
  // coverage[device][column][symbol]: time covered inside the column.
  std::vector<std::vector<std::map<char, double>>> coverage(
      static_cast<size_t>(r.num_devices), std::vector<std::map<char, double>>(static_cast<size_t>(width)));
  auto add = [&](int64_t device, double start, double end, char symbol) {
    if (!(end > start)) return;
    const int64_t first = std::max<int64_t>(0, static_cast<int64_t>(std::floor(start / column)));
    const int64_t last = std::min<int64_t>(width - 1, static_cast<int64_t>(std::ceil(end / column)) - 1);
    for (int64_t c = first; c <= last; ++c) {
      const double lo = std::max(start, static_cast<double>(c) * column);
      const double hi = std::min(end, static_cast<double>(c + 1) * column);
      if (hi > lo) coverage[static_cast<size_t>(device)][static_cast<size_t>(c)][symbol] += hi - lo;
    }
  };
  for (const SimulatedJob& job : r.jobs) {
    const auto upload = upload_span(job);
    add(job.device, upload.first, upload.second, '~');
    for (const MicrobatchSpan& mb : job.microbatches) add(job.device, mb.start, mb.end, stage_symbol(job.index));
  }
  const std::string label_pad(10, ' ');
  const std::string left = "0", right = with_unit(r.makespan, options.time_unit);
  // The axis: 0 above the lanes' first column, the makespan ending above their last.
  out << label_pad << ' ' << left
      << std::string(
             static_cast<size_t>(std::max<int64_t>(1, width - static_cast<int64_t>(left.size() + right.size()))), ' ')
      << right << "\n";
  for (int64_t d = 0; d < r.num_devices; ++d) {
    std::string lane;
    for (const auto& cell : coverage[static_cast<size_t>(d)]) {
      char best = '.';
      double best_time = 0;
      for (const auto& [symbol, time] : cell) {
        if (time > best_time) {
          best = symbol;
          best_time = time;
        }
      }
      lane += best_time >= 0.5 * column ? best : '.';
    }
    std::string name = "device " + std::to_string(d);
    name.resize(std::max<size_t>(name.size() + 1, label_pad.size()), ' ');
    out << name << "|" << lane << "|\n";
  }
  out << "stages ('.' idle, '~' upload before the first microbatch):\n";
  for (const SimulatedJob& job : r.jobs) {
    const double first = job.microbatches.empty() ? job.start : job.microbatches.front().start;
    out << "  " << stage_symbol(job.index) << "  " << stage_label(job) << " on device " << job.device << ": "
        << fmt("%.1f", job.overhead > 0 ? job.start : first) << " - " << with_unit(job.end, options.time_unit) << ", "
        << job.microbatches.size() << " x " << with_unit(job.microbatch_cost, options.time_unit) << "\n";
  }
  return out.str();
}

namespace {

// Where the timeline's parts go: one lane per device, time scaled to the width.
struct TimelineGeometry {
  static constexpr double kWidth = 960, kLeft = 84, kRight = 24, kTop = 64, kLane = 30, kGap = 8;
  static constexpr const char* kColors[3] = {"#4c78a8", "#e45756", "#f58518"};  // forward, fused, backward
  static constexpr const char* kUploadColor = "#bbbbbb";

  explicit TimelineGeometry(const SimulationResult& r)
      : span(r.makespan > 0 ? r.makespan : 1.0),
        lanes_bottom(kTop + static_cast<double>(r.num_devices) * (kLane + kGap)) {}
  double px(double t) const { return kLeft + t / span * (kWidth - kLeft - kRight); }
  static double lane_y(int64_t device) { return kTop + static_cast<double>(device) * (kLane + kGap); }

  double span;
  double lanes_bottom;
};
using Geo = TimelineGeometry;

// Time axis: grid and tick labels, and the device lanes' names.
void write_time_axis(std::ostream& out, const Geo& g, int64_t num_devices, const std::string& time_unit) {
  const std::vector<double> ticks = svg::nice_ticks(0, g.span, 8);
  const double spacing = ticks.size() > 1 ? ticks[1] - ticks[0] : g.span;
  out << "  <g stroke=\"#e6e6e6\" stroke-width=\"1\">\n";
  for (double t : ticks) {
    out << "    <line x1=\"" << fmt("%.1f", g.px(t)) << "\" x2=\"" << fmt("%.1f", g.px(t)) << "\" y1=\""
        << Geo::kTop - 4 << "\" y2=\"" << g.lanes_bottom << "\"/>\n";
  }
  out << "  </g>\n  <g fill=\"#444\" text-anchor=\"middle\">\n";
  for (double t : ticks) {
    out << "    <text x=\"" << fmt("%.1f", g.px(t)) << "\" y=\"" << g.lanes_bottom + 14 << "\">"
        << svg::tick_label(t, spacing) << "</text>\n";
  }
  out << "  </g>\n  <text x=\"" << (Geo::kLeft + Geo::kWidth - Geo::kRight) / 2 << "\" y=\"" << g.lanes_bottom + 32
      << "\" text-anchor=\"middle\" fill=\"#222\">time" << (time_unit.empty() ? "" : " (" + escape_xml(time_unit) + ")")
      << "</text>\n";
  out << "  <g fill=\"#222\" text-anchor=\"end\">\n";
  for (int64_t d = 0; d < num_devices; ++d) {
    out << "    <text x=\"" << Geo::kLeft - 8 << "\" y=\"" << fmt("%.1f", Geo::lane_y(d) + Geo::kLane / 2 + 4)
        << "\">device " << d << "</text>\n";
  }
  out << "  </g>\n";
}

// One job: a group with its upload, a rectangle per microbatch and its stage number.
void write_job(std::ostream& out, const Geo& g, const SimulatedJob& job, const std::string& time_unit) {
  const double y = Geo::lane_y(job.device);
  const std::string label = stage_label(job);
  out << "  <g class=\"job\" data-stage=\"" << job.index << "\" data-device=\"" << job.device << "\" data-phase=\""
      << to_string(job.phase) << "\">\n";
  const auto upload = upload_span(job);
  if (upload.second > upload.first) {
    out << "    <rect class=\"upload\" x=\"" << fmt("%.2f", g.px(upload.first)) << "\" y=\"" << y << "\" width=\""
        << fmt("%.2f", g.px(upload.second) - g.px(upload.first)) << "\" height=\"" << Geo::kLane << "\" fill=\""
        << Geo::kUploadColor << "\"><title>" << escape_xml(label) << ": upload, " << fmt("%.2f", upload.first) << " - "
        << escape_xml(with_unit(upload.second, time_unit)) << "</title></rect>\n";
  }
  for (size_t j = 0; j < job.microbatches.size(); ++j) {
    const MicrobatchSpan& mb = job.microbatches[j];
    out << "    <rect class=\"microbatch\" x=\"" << fmt("%.2f", g.px(mb.start)) << "\" y=\"" << y << "\" width=\""
        << fmt("%.2f", std::max(0.5, g.px(mb.end) - g.px(mb.start))) << "\" height=\"" << Geo::kLane << "\" fill=\""
        << Geo::kColors[static_cast<int>(job.phase)] << "\" stroke=\"#ffffff\" stroke-width=\"0.6\"><title>"
        << escape_xml(label) << " on device " << job.device << ", microbatch " << job.first_microbatch + int64_t(j)
        << ": " << fmt("%.2f", mb.start) << " - " << escape_xml(with_unit(mb.end, time_unit)) << "</title></rect>\n";
  }
  const double first = job.microbatches.empty() ? job.start : job.microbatches.front().start;
  if (g.px(job.end) - g.px(first) >= 16) {
    out << "    <text x=\"" << fmt("%.1f", (g.px(first) + g.px(job.end)) / 2) << "\" y=\""
        << fmt("%.1f", y + Geo::kLane / 2 + 4)
        << "\" text-anchor=\"middle\" fill=\"#222222\" stroke=\"#ffffff\" stroke-width=\"3\" paint-order=\"stroke\" "
        << "font-weight=\"bold\">" << job.index << "</text>\n";
  }
  out << "  </g>\n";
}

void write_timeline_legend(std::ostream& out, const Geo& g) {
  const std::pair<const char*, const char*> entries[] = {{Geo::kColors[0], "forward stage"},
                                                         {Geo::kColors[1], "fused tail (forward + loss + backward)"},
                                                         {Geo::kColors[2], "backward stage (recompute + backward)"},
                                                         {Geo::kUploadColor, "upload"}};
  double x = Geo::kLeft;
  const double y = g.lanes_bottom + 46;
  out << "  <g id=\"legend\" fill=\"#222\">\n";
  for (const auto& [color, text] : entries) {
    out << "    <rect x=\"" << x << "\" y=\"" << y << "\" width=\"14\" height=\"12\" fill=\"" << color << "\"/>\n"
        << "    <text x=\"" << x + 20 << "\" y=\"" << y + 10 << "\">" << text << "</text>\n";
    x += 20 + 7.0 * static_cast<double>(std::string(text).size()) + 24;
  }
  out << "  </g>\n";
}

}  // namespace

std::string timeline_svg(const SimulationResult& r, const PreviewOptions& options) {
  const Geo g(r);
  std::ostringstream out;
  out << svg::document_start(Geo::kWidth, g.lanes_bottom + 70, options.title) << "  <text x=\"" << Geo::kWidth / 2
      << "\" y=\"44\" text-anchor=\"middle\" fill=\"#555\">" << escape_xml(summary(r, options.time_unit))
      << "</text>\n";
  write_time_axis(out, g, r.num_devices, options.time_unit);
  for (const SimulatedJob& job : r.jobs) write_job(out, g, job, options.time_unit);
  write_timeline_legend(out, g);
  out << "</svg>\n";
  return out.str();
}

}  // namespace roundpipe::scheduler
