// The launcher's loss curve: a self-contained SVG (no scripts, no external fonts or styles) of the
// training loss and the evaluation loss against the step, rewritten after each log interval.
#pragma once

#include <string>
#include <vector>

#include "roundpipe/launcher/metrics.h"

namespace roundpipe::launcher {

/// The SVG text: title, axes with tick labels ("step", "loss"), grid, the training loss as one
/// polyline (id "train-loss", one point per finite training record), the evaluation loss as a
/// dashed polyline with markers (id "eval-loss", one point per finite record) and a legend.
/// With no finite record the plot says "no data yet". Pure function; thread-safe.
std::string loss_plot_svg(const MetricsLog& log, const std::string& title);

/// Writes loss_plot_svg to `path` atomically (a viewer never sees half a file).
void write_loss_plot(const std::string& path, const MetricsLog& log, const std::string& title);

}  // namespace roundpipe::launcher
