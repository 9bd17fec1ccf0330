#include "base/svg.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

namespace roundpipe::svg {

std::string escape_xml(const std::string& text) {
  std::string out;
  out.reserve(text.size());
  for (char c : text) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      default: out += c;
    }
  }
  return out;
}

std::string fmt(const char* format, double value) {
  char buffer[64];
  std::snprintf(buffer, sizeof(buffer), format, value);
  return buffer;
}

std::string document_start(double width, double height, const std::string& title) {
  std::ostringstream out;
  out << "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
      << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << width << "\" height=\"" << height
      << "\" viewBox=\"0 0 " << width << " " << height << "\" "
      << "font-family=\"DejaVu Sans, Helvetica, Arial, sans-serif\" font-size=\"12\">\n"
      << "  <rect width=\"100%\" height=\"100%\" fill=\"#ffffff\"/>\n"
      << "  <text x=\"" << width / 2 << "\" y=\"26\" text-anchor=\"middle\" font-size=\"17\" "
      << "font-weight=\"bold\" fill=\"#222\">" << escape_xml(title) << "</text>\n";
  return out.str();
}

std::vector<double> nice_ticks(double lo, double hi, int target) {
  std::vector<double> ticks;
  if (!(hi > lo) || target < 1) {
    ticks.push_back(lo);
    return ticks;
  }
  const double raw = (hi - lo) / target;
  const double magnitude = std::pow(10.0, std::floor(std::log10(raw)));
  double spacing = magnitude;
  for (double m : {1.0, 2.0, 5.0, 10.0}) {
    spacing = m * magnitude;
    if (spacing >= raw) {
      break;
    }
  }
  const double first = std::ceil(lo / spacing - 1e-9);
  for (double i = first; i * spacing <= hi + spacing * 1e-9; i += 1) {
    ticks.push_back(std::fabs(i) < 0.5 ? 0.0 : i * spacing);
  }
  return ticks;
}

std::string tick_label(double value, double spacing) {
  if (std::fabs(value) < spacing * 1e-9) {
    value = 0;
  }
  if (std::fabs(value) >= 10000 && std::fmod(spacing, 1000) == 0) {
    return fmt("%.0fk", value / 1000);
  }
  const int decimals = std::max(0, static_cast<int>(-std::floor(std::log10(spacing) + 1e-9)));
  char buffer[64];
  std::snprintf(buffer, sizeof(buffer), "%.*f", decimals, value);
  return buffer;
}

}  // namespace roundpipe::svg
