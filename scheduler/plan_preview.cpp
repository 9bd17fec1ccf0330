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

std::string timeline_svg(const SimulationResult& r, const PreviewOptions& options) {
  constexpr double kWidth = 960, kLeft = 84, kRight = 24, kTop = 64, kLane = 30, kGap = 8;
  constexpr const char* kColors[] = {"#4c78a8", "#e45756", "#f58518"};  // forward, fused, backward
  constexpr const char* kUploadColor = "#bbbbbb";
  const double lanes_bottom = kTop + static_cast<double>(r.num_devices) * (kLane + kGap);
  const double height = lanes_bottom + 70;
  const double span = r.makespan > 0 ? r.makespan : 1.0;
  auto px = [&](double t) { return kLeft + t / span * (kWidth - kLeft - kRight); };
  auto lane_y = [&](int64_t device) { return kTop + static_cast<double>(device) * (kLane + kGap); };

  std::ostringstream out;
  out << svg::document_start(kWidth, height, options.title) << "  <text x=\"" << kWidth / 2
      << "\" y=\"44\" text-anchor=\"middle\" fill=\"#555\">" << escape_xml(summary(r, options.time_unit))
      << "</text>\n";

  // Time axis: grid and tick labels.
  const std::vector<double> ticks = svg::nice_ticks(0, span, 8);
  const double spacing = ticks.size() > 1 ? ticks[1] - ticks[0] : span;
  out << "  <g stroke=\"#e6e6e6\" stroke-width=\"1\">\n";
  for (double t : ticks) {
    out << "    <line x1=\"" << fmt("%.1f", px(t)) << "\" x2=\"" << fmt("%.1f", px(t)) << "\" y1=\"" << kTop - 4
        << "\" y2=\"" << lanes_bottom << "\"/>\n";
  }
  out << "  </g>\n  <g fill=\"#444\" text-anchor=\"middle\">\n";
  for (double t : ticks) {
    out << "    <text x=\"" << fmt("%.1f", px(t)) << "\" y=\"" << lanes_bottom + 14 << "\">"
        << svg::tick_label(t, spacing) << "</text>\n";
  }
  out << "  </g>\n  <text x=\"" << (kLeft + kWidth - kRight) / 2 << "\" y=\"" << lanes_bottom + 32
      << "\" text-anchor=\"middle\" fill=\"#222\">time"
      << (options.time_unit.empty() ? "" : " (" + escape_xml(options.time_unit) + ")") << "</text>\n";

  // Lanes.
  out << "  <g fill=\"#222\" text-anchor=\"end\">\n";
  for (int64_t d = 0; d < r.num_devices; ++d) {
    out << "    <text x=\"" << kLeft - 8 << "\" y=\"" << fmt("%.1f", lane_y(d) + kLane / 2 + 4) << "\">device " << d
        << "</text>\n";
  }
  out << "  </g>\n";

  // Jobs: one group each, a rectangle per microbatch.
  for (const SimulatedJob& job : r.jobs) {
    const double y = lane_y(job.device);
    const std::string label = stage_label(job);
    out << "  <g class=\"job\" data-stage=\"" << job.index << "\" data-device=\"" << job.device << "\" data-phase=\""
        << to_string(job.phase) << "\">\n";
    const auto upload = upload_span(job);
    if (upload.second > upload.first) {
      out << "    <rect class=\"upload\" x=\"" << fmt("%.2f", px(upload.first)) << "\" y=\"" << y << "\" width=\""
          << fmt("%.2f", px(upload.second) - px(upload.first)) << "\" height=\"" << kLane << "\" fill=\""
          << kUploadColor << "\"><title>" << escape_xml(label) << ": upload, " << fmt("%.2f", upload.first) << " - "
          << escape_xml(with_unit(upload.second, options.time_unit)) << "</title></rect>\n";
    }
    for (size_t j = 0; j < job.microbatches.size(); ++j) {
      const MicrobatchSpan& mb = job.microbatches[j];
      out << "    <rect class=\"microbatch\" x=\"" << fmt("%.2f", px(mb.start)) << "\" y=\"" << y << "\" width=\""
          << fmt("%.2f", std::max(0.5, px(mb.end) - px(mb.start))) << "\" height=\"" << kLane << "\" fill=\""
          << kColors[static_cast<int>(job.phase)] << "\" stroke=\"#ffffff\" stroke-width=\"0.6\"><title>"
          << escape_xml(label) << " on device " << job.device << ", microbatch " << job.first_microbatch + int64_t(j)
          << ": " << fmt("%.2f", mb.start) << " - " << escape_xml(with_unit(mb.end, options.time_unit))
          << "</title></rect>\n";
    }
    const double first = job.microbatches.empty() ? job.start : job.microbatches.front().start;
    if (px(job.end) - px(first) >= 16) {
      out << "    <text x=\"" << fmt("%.1f", (px(first) + px(job.end)) / 2) << "\" y=\""
          << fmt("%.1f", y + kLane / 2 + 4)
          << "\" text-anchor=\"middle\" fill=\"#222222\" stroke=\"#ffffff\" stroke-width=\"3\" paint-order=\"stroke\" "
          << "font-weight=\"bold\">" << job.index << "</text>\n";
    }
    out << "  </g>\n";
  }

  // Legend.
  const std::pair<const char*, const char*> entries[] = {{kColors[0], "forward stage"},
                                                         {kColors[1], "fused tail (forward + loss + backward)"},
                                                         {kColors[2], "backward stage (recompute + backward)"},
                                                         {kUploadColor, "upload"}};
  double x = kLeft;
  const double y = lanes_bottom + 46;
  out << "  <g id=\"legend\" fill=\"#222\">\n";
  for (const auto& [color, text] : entries) {
    out << "    <rect x=\"" << x << "\" y=\"" << y << "\" width=\"14\" height=\"12\" fill=\"" << color << "\"/>\n"
        << "    <text x=\"" << x + 20 << "\" y=\"" << y + 10 << "\">" << text << "</text>\n";
    x += 20 + 7.0 * static_cast<double>(std::string(text).size()) + 24;
  }
  out << "  </g>\n</svg>\n";
  return out.str();
}

}  // namespace roundpipe::scheduler
