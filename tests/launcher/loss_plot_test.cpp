#include "roundpipe/launcher/loss_plot.h"

#include <gtest/gtest.h>

#include <regex>
#include <sstream>

#include "launcher_test_util.h"
#include "tests/common/svg_check.h"

namespace roundpipe::launcher {
namespace {

using testing::ScratchDir;
using ::roundpipe::testing::tags_balanced;

MetricsLog example_log(int64_t steps) {
  MetricsLog log;
  for (int64_t s = 1; s <= steps; ++s) {
    TrainRecord r;
    r.step = s;
    r.loss = 6.0 / (1.0 + 0.1 * static_cast<double>(s)) + 0.05 * static_cast<double>(s % 3);
    log.train.push_back(r);
    if (s % 25 == 0) {
      log.eval.push_back({s, r.loss + 0.2});
    }
  }
  return log;
}

/// The `points` attribute of the polyline with id `id`, as (x, y) pairs.
std::vector<std::pair<double, double>> polyline_points(const std::string& svg, const std::string& id) {
  std::smatch m;
  std::regex pattern("<polyline id=\"" + id + "\"[^>]*points=\"([^\"]*)\"");
  std::vector<std::pair<double, double>> points;
  if (!std::regex_search(svg, m, pattern)) {
    return points;
  }
  std::istringstream in(m[1].str());
  std::string pair;
  while (in >> pair) {
    size_t comma = pair.find(',');
    points.emplace_back(std::stod(pair.substr(0, comma)), std::stod(pair.substr(comma + 1)));
  }
  return points;
}

TEST(LossPlotTest, Svg_IsWellFormedWithOnePointPerRecord) {
  MetricsLog log = example_log(100);
  const std::string svg = loss_plot_svg(log, "tiny llama");
  EXPECT_NE(svg.find("<svg"), std::string::npos);
  EXPECT_NE(svg.find("</svg>"), std::string::npos);
  std::string why;
  EXPECT_TRUE(tags_balanced(svg, &why)) << why;
  EXPECT_EQ(polyline_points(svg, "train-loss").size(), log.train.size());
  EXPECT_EQ(polyline_points(svg, "eval-loss").size(), log.eval.size());
  EXPECT_NE(svg.find(">tiny llama</text>"), std::string::npos);
  EXPECT_NE(svg.find(">step</text>"), std::string::npos);
  EXPECT_NE(svg.find(">loss</text>"), std::string::npos);
  EXPECT_NE(svg.find(">eval loss</text>"), std::string::npos);  // legend
}

TEST(LossPlotTest, Svg_MapsStepsRightAndLossUp) {
  MetricsLog log = example_log(40);
  auto points = polyline_points(loss_plot_svg(log, "t"), "train-loss");
  ASSERT_EQ(points.size(), log.train.size());
  for (size_t i = 1; i < points.size(); ++i) {
    EXPECT_GT(points[i].first, points[i - 1].first);
    // SVG y grows downwards: a higher loss is drawn higher (smaller y).
    const double dl = log.train[i].loss - log.train[i - 1].loss;
    const double dy = points[i].second - points[i - 1].second;
    EXPECT_TRUE((dl > 0 && dy < 0) || (dl < 0 && dy > 0) || (dl == 0 && dy == 0)) << i;
  }
  // Within the 800 x 480 canvas.
  for (const auto& [x, y] : points) {
    EXPECT_TRUE(x >= 0 && x <= 800 && y >= 0 && y <= 480) << x << "," << y;
  }
}

TEST(LossPlotTest, Svg_EscapesTitleAndHandlesNoData) {
  const std::string svg = loss_plot_svg(MetricsLog{}, "a<b & \"c\"");
  EXPECT_NE(svg.find("a&lt;b &amp; &quot;c&quot;"), std::string::npos);
  EXPECT_NE(svg.find("no data yet"), std::string::npos);
  std::string why;
  EXPECT_TRUE(tags_balanced(svg, &why)) << why;
  MetricsLog one = example_log(1);
  EXPECT_EQ(polyline_points(loss_plot_svg(one, "t"), "train-loss").size(), 1u);
}

TEST(LossPlotTest, Write_StoresTheSvgAtomically) {
  ScratchDir dir;
  MetricsLog log = example_log(10);
  write_loss_plot(dir.file("loss.svg"), log, "run");
  EXPECT_EQ(read_file(dir.file("loss.svg")), loss_plot_svg(log, "run"));
}

}  // namespace
}  // namespace roundpipe::launcher
