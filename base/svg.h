// roundpipe::svg: the small pieces every self-contained SVG the project writes needs (the
// launcher's loss curve, the scheduler's plan preview): XML escaping, number formatting and "nice"
// axis ticks. No LibTorch; pure functions, thread-safe.
#pragma once

#include <string>
#include <vector>

namespace roundpipe::svg {

/// `text` with &, <, > and " escaped for XML text and attribute values.
std::string escape_xml(const std::string& text);

/// printf-style formatting of one number (e.g. fmt("%.1f", x)).
std::string fmt(const char* format, double value);

/// The opening of a self-contained SVG document `width` x `height` px: the XML declaration, the
/// <svg> element (fonts: DejaVu Sans or the viewer's sans-serif, 12 px), a white background and
/// `title` (escaped) centred at the top in bold. The caller closes it with "</svg>\n".
std::string document_start(double width, double height, const std::string& title);

/// "Nice" tick positions covering [lo, hi]: multiples of 1, 2 or 5 x 10^k, about `target` of them.
std::vector<double> nice_ticks(double lo, double hi, int target);

/// The label of tick `value` on an axis whose ticks are `spacing` apart: as many decimals as the
/// spacing needs, and "12k" for round thousands from 10000 on.
std::string tick_label(double value, double spacing);

}  // namespace roundpipe::svg
