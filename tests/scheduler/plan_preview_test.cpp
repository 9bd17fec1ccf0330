#include "scheduler/plan_preview.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <regex>
#include <sstream>

#include "tests/common/svg_check.h"

namespace roundpipe::scheduler {
namespace {

// The simulator test's hand-computed case (simulator_test.cpp): jobs F[0,1) d0, F[1,2) d1, the
// fused tail [2,3) d0, B[0,2) d1, 3 microbatches; makespan 17.
//   d0: F0 [0,3], fused [3,9], idle [9,17];  d1: idle [0,1], F1 [1,4], idle [4,5], B [5,17].
SimulationResult hand_computed() {
  return simulate(ExecutePlan({{0, 1}, {1, 2}}, {{2, 3}, {0, 2}}), RunType::kFused,
                  std::vector<LayerCost>(3, LayerCost{1, 2, 1, 2}), 2, 3);
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

TEST(PlanPreviewTest, Text_OneColumnPerTimeUnitMatchesTheHandComputedTimeline) {
  const std::string text = timeline_text(hand_computed(), PreviewOptions().set_width(17).set_time_unit("ms"));
  const std::vector<std::string> lines = lines_of(text);
  ASSERT_GE(lines.size(), 8u) << text;
  EXPECT_EQ(lines[0], "Simulated pipeline timeline: 2 devices, 3 microbatches: makespan 17.0 ms, bubble 29.4% "
                      "(fill 2.9%, drain 23.5%, steady 2.9%, upload 0.0%)");
  EXPECT_EQ(lines[2], "device 0  |000222222........|");
  EXPECT_EQ(lines[3], "device 1  |.111.333333333333|");
  EXPECT_EQ(lines[5], "  0  stage 0 (forward, layers [0, 1)) on device 0: 0.0 - 3.0 ms, 3 x 1.0 ms");
  EXPECT_EQ(lines[7], "  2  stage 2 (fused, layers [2, 3)) on device 0: 3.0 - 9.0 ms, 3 x 2.0 ms");
  EXPECT_EQ(lines[8], "  3  stage 3 (backward, layers [0, 2)) on device 1: 5.0 - 17.0 ms, 3 x 4.0 ms");
}

TEST(PlanPreviewTest, Text_HalfColumnsRoundToTheMajorityAndUploadsShow) {
  // Twice as many columns: each time unit is two characters.
  const std::string wide = timeline_text(hand_computed(), PreviewOptions().set_width(34));
  EXPECT_NE(wide.find("|000000222222222222................|"), std::string::npos) << wide;
  // Overheads of 0.5 per job and 0.25 per hop (simulator_test's OverheadAndHopLatency): device 0
  // uploads [0, 0.5], runs F0 [0.5, 3.5], uploads [3.5, 4], runs the fused tail [4, 10].
  auto r = simulate(ExecutePlan({{0, 1}, {1, 2}}, {{2, 3}, {0, 2}}), RunType::kFused,
                    std::vector<LayerCost>(3, LayerCost{1, 2, 1, 2}), 2, 3,
                    SimulateOptions().set_job_overhead(0.5).set_hop_latency(0.25));
  ASSERT_DOUBLE_EQ(r.makespan, 18.25);
  const std::string text = timeline_text(r, PreviewOptions().set_width(73));  // 0.25 per column
  EXPECT_NE(text.find("|~~000000000000~~222222222222222222222222"), std::string::npos) << text;
}

TEST(PlanPreviewTest, Text_ManyStagesUseBase36SymbolsAndBadWidthIsRefused) {
  EXPECT_EQ(stage_symbol(0), '0');
  EXPECT_EQ(stage_symbol(10), 'a');
  EXPECT_EQ(stage_symbol(36), 'A');
  EXPECT_EQ(stage_symbol(62), '#');
  try {
    timeline_text(hand_computed(), PreviewOptions().set_width(3));
    FAIL() << "width 3 accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("width must be at least 10 columns, got 3"), std::string::npos) << e.what();
  }
}

TEST(PlanPreviewTest, Svg_IsWellFormedWithOneRectanglePerMicrobatch) {
  const SimulationResult r = hand_computed();
  const std::string svg = timeline_svg(r, PreviewOptions().set_title("plan <4 layers>"));
  std::string why;
  EXPECT_TRUE(testing::tags_balanced(svg, &why)) << why;
  EXPECT_NE(svg.find(">plan &lt;4 layers&gt;</text>"), std::string::npos);
  EXPECT_NE(svg.find("bubble 29.4%"), std::string::npos);
  // 4 jobs x 3 microbatches; no uploads without overheads.
  const std::regex rect("<rect class=\"microbatch\" x=\"([0-9.]+)\" y=\"([0-9.]+)\" width=\"([0-9.]+)\"");
  std::vector<std::smatch> rects;
  for (auto it = std::sregex_iterator(svg.begin(), svg.end(), rect); it != std::sregex_iterator(); ++it) {
    rects.push_back(*it);
  }
  ASSERT_EQ(rects.size(), 12u);
  EXPECT_EQ(svg.find("class=\"upload\""), std::string::npos);
  // Positions are linear in time: the plot spans 84..936 px for 0..17; the backward job's last
  // microbatch is [13, 17] on device 1 (second lane).
  const double scale = (960.0 - 84 - 24) / 17;
  EXPECT_NEAR(std::stod(rects[11][1]), 84 + 13 * scale, 0.01);
  EXPECT_NEAR(std::stod(rects[11][3]), 4 * scale, 0.01);
  EXPECT_GT(std::stod(rects[11][2]), std::stod(rects[0][2]));
  EXPECT_NE(svg.find("stage 3 (backward, layers [0, 2)) on device 1, microbatch 2: 13.00 - 17.0 ms"), std::string::npos);
  EXPECT_NE(svg.find("data-phase=\"fused\""), std::string::npos);
}

}  // namespace
}  // namespace roundpipe::scheduler
