#include "roundpipe/launcher/loss_plot.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <sstream>
#include <utility>

#include "base/svg.h"
#include "roundpipe/launcher/atomic_file.h"

namespace roundpipe::launcher {
namespace {

using svg::escape_xml;
using svg::fmt;
using svg::nice_ticks;
using svg::tick_label;

using Point = std::pair<double, double>;  // (step, loss)

constexpr double kWidth = 800;
constexpr double kHeight = 480;
constexpr double kLeft = 72;
constexpr double kRight = 24;
constexpr double kTop = 64;
constexpr double kBottom = 56;
constexpr const char* kTrainColor = "#1f77b4";
constexpr const char* kSmoothColor = "#0b3d91";
constexpr const char* kEvalColor = "#e8590c";
// Above this many training records, consecutive records are averaged into buckets so the file
// stays small (about 30 bytes per point).
constexpr size_t kMaxPoints = 20000;

std::vector<Point> finite_train_points(const MetricsLog& log) {
  std::vector<Point> points;
  for (const TrainRecord& r : log.train) {
    if (std::isfinite(r.loss)) {
      points.emplace_back(static_cast<double>(r.step), r.loss);
    }
  }
  if (points.size() <= kMaxPoints) {
    return points;
  }
  std::vector<Point> buckets;
  const size_t per_bucket = (points.size() + kMaxPoints - 1) / kMaxPoints;
  for (size_t i = 0; i < points.size(); i += per_bucket) {
    size_t end = std::min(points.size(), i + per_bucket);
    double step = 0, loss = 0;
    for (size_t j = i; j < end; ++j) {
      step += points[j].first;
      loss += points[j].second;
    }
    buckets.emplace_back(step / double(end - i), loss / double(end - i));
  }
  return buckets;
}

std::vector<Point> finite_eval_points(const MetricsLog& log) {
  std::vector<Point> points;
  for (const EvalRecord& r : log.eval) {
    if (std::isfinite(r.eval_loss)) {
      points.emplace_back(static_cast<double>(r.step), r.eval_loss);
    }
  }
  return points;
}

/// Bias-corrected exponential moving average with a window of about `window` points.
std::vector<Point> smoothed(const std::vector<Point>& points, double window) {
  const double beta = 1.0 - 1.0 / window;
  std::vector<Point> out;
  double average = 0, weight = 0;
  for (const Point& p : points) {
    average = beta * average + (1 - beta) * p.second;
    weight = beta * weight + (1 - beta);
    out.emplace_back(p.first, average / weight);
  }
  return out;
}

/// Maps data coordinates to the plot area.
struct Frame {
  double x_lo, x_hi, y_lo, y_hi;
  double px(double x) const {
    return kLeft + (x - x_lo) / (x_hi - x_lo) * (kWidth - kLeft - kRight);
  }
  double py(double y) const {
    return kHeight - kBottom - (y - y_lo) / (y_hi - y_lo) * (kHeight - kTop - kBottom);
  }
};

std::string polyline(const Frame& frame, const std::vector<Point>& points, const char* id,
                     const std::string& style) {
  std::ostringstream out;
  out << "  <polyline id=\"" << id << "\" fill=\"none\" " << style << " points=\"";
  for (size_t i = 0; i < points.size(); ++i) {
    out << (i ? " " : "") << fmt("%.1f", frame.px(points[i].first)) << ","
        << fmt("%.1f", frame.py(points[i].second));
  }
  out << "\"/>\n";
  return out.str();
}

// The data ranges over both series and their ticks; the loss axis is widened to whole tick steps.
struct Axes {
  Frame frame{};
  std::vector<double> x_ticks, y_ticks;
  double x_spacing = 1, y_spacing = 1;
};

Axes make_axes(const std::vector<Point>& train, const std::vector<Point>& eval) {
  double x_lo = std::numeric_limits<double>::infinity(), x_hi = -x_lo;
  double y_lo = x_lo, y_hi = -x_lo;
  for (const auto* series : {&train, &eval}) {
    for (const Point& p : *series) {
      x_lo = std::min(x_lo, p.first);
      x_hi = std::max(x_hi, p.first);
      y_lo = std::min(y_lo, p.second);
      y_hi = std::max(y_hi, p.second);
    }
  }
  if (x_hi == x_lo) {
    x_lo -= 1;
    x_hi += 1;
  }
  if (y_hi == y_lo) {
    double pad = std::max(0.05, std::fabs(y_lo) * 0.05);
    y_lo -= pad;
    y_hi += pad;
  }
  Axes axes;
  axes.y_ticks = nice_ticks(y_lo, y_hi, 6);
  std::vector<double>& y_ticks = axes.y_ticks;
  axes.y_spacing = y_ticks.size() > 1 ? y_ticks[1] - y_ticks[0] : (y_hi - y_lo);
  if (y_ticks.front() > y_lo) y_ticks.insert(y_ticks.begin(), y_ticks.front() - axes.y_spacing);
  if (y_ticks.back() < y_hi) y_ticks.push_back(y_ticks.back() + axes.y_spacing);
  axes.frame = Frame{x_lo, x_hi, y_ticks.front(), y_ticks.back()};
  axes.x_ticks = nice_ticks(x_lo, x_hi, 8);
  axes.x_spacing = axes.x_ticks.size() > 1 ? axes.x_ticks[1] - axes.x_ticks[0] : 1.0;
  return axes;
}

constexpr double kPlotLeft = kLeft, kPlotRight = kWidth - kRight, kPlotTop = kTop, kPlotBottom = kHeight - kBottom;

// Subtitle: the latest values.
void write_subtitle(std::ostream& svg, const std::vector<Point>& train, const std::vector<Point>& eval) {
  std::string subtitle;
  if (!train.empty()) {
    subtitle += "train " + fmt("%.4f", train.back().second) + " at step " + fmt("%.0f", train.back().first);
  }
  if (!eval.empty()) {
    subtitle += (subtitle.empty() ? "" : "   ") + std::string("eval ") + fmt("%.4f", eval.back().second) +
                " at step " + fmt("%.0f", eval.back().first);
  }
  svg << "  <text x=\"" << kWidth / 2 << "\" y=\"46\" text-anchor=\"middle\" fill=\"#555\">" << escape_xml(subtitle)
      << "</text>\n";
}

// Grid, tick labels, the frame and the axis titles.
void write_axes(std::ostream& svg, const Axes& axes) {
  const Frame& frame = axes.frame;
  const double left = kPlotLeft, right = kPlotRight, top = kPlotTop, bottom = kPlotBottom;
  svg << "  <g stroke=\"#e6e6e6\" stroke-width=\"1\">\n";
  for (double t : axes.y_ticks) {
    svg << "    <line x1=\"" << left << "\" x2=\"" << right << "\" y1=\"" << fmt("%.1f", frame.py(t)) << "\" y2=\""
        << fmt("%.1f", frame.py(t)) << "\"/>\n";
  }
  for (double t : axes.x_ticks) {
    svg << "    <line x1=\"" << fmt("%.1f", frame.px(t)) << "\" x2=\"" << fmt("%.1f", frame.px(t)) << "\" y1=\"" << top
        << "\" y2=\"" << bottom << "\"/>\n";
  }
  svg << "  </g>\n  <g fill=\"#444\">\n";
  for (double t : axes.y_ticks) {
    svg << "    <text x=\"" << left - 8 << "\" y=\"" << fmt("%.1f", frame.py(t) + 4) << "\" text-anchor=\"end\">"
        << tick_label(t, axes.y_spacing) << "</text>\n";
  }
  for (double t : axes.x_ticks) {
    svg << "    <text x=\"" << fmt("%.1f", frame.px(t)) << "\" y=\"" << bottom + 18 << "\" text-anchor=\"middle\">"
        << tick_label(t, axes.x_spacing) << "</text>\n";
  }
  svg << "  </g>\n"
      << "  <rect x=\"" << left << "\" y=\"" << top << "\" width=\"" << right - left << "\" height=\"" << bottom - top
      << "\" fill=\"none\" stroke=\"#888\"/>\n"
      << "  <text x=\"" << (left + right) / 2 << "\" y=\"" << kHeight - 14
      << "\" text-anchor=\"middle\" fill=\"#222\">step</text>\n"
      << "  <text x=\"18\" y=\"" << (top + bottom) / 2 << "\" text-anchor=\"middle\" fill=\"#222\" "
      << "transform=\"rotate(-90 18 " << (top + bottom) / 2 << ")\">loss</text>\n";
}

// The training loss (raw, and smoothed when `smooth`) and the evaluation loss with its points.
void write_series(std::ostream& svg, const Frame& frame, const std::vector<Point>& train,
                  const std::vector<Point>& eval, double window, bool smooth) {
  if (!train.empty()) {
    svg << polyline(frame, train, "train-loss",
                    std::string("stroke=\"") + kTrainColor + "\" stroke-width=\"1.2\" " +
                        (smooth ? "stroke-opacity=\"0.35\"" : "stroke-opacity=\"0.9\"") + " stroke-linejoin=\"round\"");
    if (smooth) {
      svg << polyline(frame, smoothed(train, window), "train-loss-smooth",
                      std::string("stroke=\"") + kSmoothColor + "\" stroke-width=\"2\" stroke-linejoin=\"round\"");
    }
    if (train.size() == 1) {
      svg << "  <circle cx=\"" << fmt("%.1f", frame.px(train[0].first)) << "\" cy=\""
          << fmt("%.1f", frame.py(train[0].second)) << "\" r=\"3\" fill=\"" << kTrainColor << "\"/>\n";
    }
  }
  if (!eval.empty()) {
    svg << polyline(frame, eval, "eval-loss",
                    std::string("stroke=\"") + kEvalColor + "\" stroke-width=\"2\" stroke-dasharray=\"6 4\"");
    svg << "  <g fill=\"" << kEvalColor << "\" stroke=\"#ffffff\" stroke-width=\"1\">\n";
    for (const Point& p : eval) {
      svg << "    <circle cx=\"" << fmt("%.1f", frame.px(p.first)) << "\" cy=\"" << fmt("%.1f", frame.py(p.second))
          << "\" r=\"3.5\"/>\n";
    }
    svg << "  </g>\n";
  }
}

// Legend (top right, inside the plot).
void write_legend(std::ostream& svg, bool train, bool eval, bool smooth) {
  std::vector<std::pair<std::string, std::string>> entries;  // (label, swatch attributes)
  if (train) {
    entries.emplace_back("train loss", std::string("stroke=\"") + kTrainColor + "\" stroke-width=\"2\"");
    if (smooth) {
      entries.emplace_back("train loss (smoothed)", std::string("stroke=\"") + kSmoothColor + "\" stroke-width=\"2\"");
    }
  }
  if (eval) {
    entries.emplace_back("eval loss",
                         std::string("stroke=\"") + kEvalColor + "\" stroke-width=\"2\" stroke-dasharray=\"6 4\"");
  }
  const double box_w = 170, box_h = 10 + 18 * static_cast<double>(entries.size());
  const double box_x = kPlotRight - box_w - 10, box_y = kPlotTop + 10;
  svg << "  <g id=\"legend\">\n    <rect x=\"" << box_x << "\" y=\"" << box_y << "\" width=\"" << box_w
      << "\" height=\"" << box_h << "\" rx=\"4\" fill=\"#ffffff\" fill-opacity=\"0.9\" stroke=\"#cccccc\"/>\n";
  for (size_t i = 0; i < entries.size(); ++i) {
    const double y = box_y + 18 + 18 * static_cast<double>(i);
    svg << "    <line x1=\"" << box_x + 10 << "\" x2=\"" << box_x + 38 << "\" y1=\"" << y - 4 << "\" y2=\"" << y - 4
        << "\" " << entries[i].second << "/>\n"
        << "    <text x=\"" << box_x + 46 << "\" y=\"" << y << "\" fill=\"#222\">" << entries[i].first << "</text>\n";
  }
  svg << "  </g>\n";
}

}  // namespace

std::string loss_plot_svg(const MetricsLog& log, const std::string& title) {
  const std::vector<Point> train = finite_train_points(log);
  const std::vector<Point> eval = finite_eval_points(log);
  std::ostringstream svg;
  svg << svg::document_start(kWidth, kHeight, title);
  if (train.empty() && eval.empty()) {
    svg << "  <text x=\"" << kWidth / 2 << "\" y=\"" << kHeight / 2
        << "\" text-anchor=\"middle\" font-size=\"15\" fill=\"#888\">no data yet</text>\n</svg>\n";
    return svg.str();
  }
  const Axes axes = make_axes(train, eval);
  write_subtitle(svg, train, eval);
  write_axes(svg, axes);
  const double window = std::min(100.0, static_cast<double>(train.size()) / 50.0);
  const bool smooth = window >= 2;
  write_series(svg, axes.frame, train, eval, window, smooth);
  write_legend(svg, !train.empty(), !eval.empty(), smooth);
  svg << "</svg>\n";
  return svg.str();
}

void write_loss_plot(const std::string& path, const MetricsLog& log, const std::string& title) {
  write_file_atomically(path, loss_plot_svg(log, title));
}

}  // namespace roundpipe::launcher
