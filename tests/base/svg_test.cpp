#include "base/svg.h"

#include <gtest/gtest.h>

namespace roundpipe::svg {
namespace {

TEST(SvgTest, NiceTicks_AreRoundNumbersCoveringTheRange) {
  EXPECT_EQ(nice_ticks(0, 10, 5), (std::vector<double>{0, 2, 4, 6, 8, 10}));
  std::vector<double> t = nice_ticks(0.13, 0.87, 4);
  ASSERT_EQ(t.size(), 4u);
  EXPECT_NEAR(t[0], 0.2, 1e-12);
  EXPECT_NEAR(t[3], 0.8, 1e-12);
  EXPECT_EQ(nice_ticks(1, 1000, 8), (std::vector<double>{200, 400, 600, 800, 1000}));
  EXPECT_EQ(nice_ticks(3, 3, 5), (std::vector<double>{3}));  // empty range: the one value
}

TEST(SvgTest, TickLabel_HasTheDecimalsTheSpacingNeeds) {
  EXPECT_EQ(tick_label(0.2, 0.2), "0.2");
  EXPECT_EQ(tick_label(1e-12, 0.05), "0.00");
  EXPECT_EQ(tick_label(400, 200), "400");
  EXPECT_EQ(tick_label(20000, 5000), "20k");
}

TEST(SvgTest, EscapeXml_EscapesMarkupCharacters) {
  EXPECT_EQ(escape_xml("a<b & \"c\">"), "a&lt;b &amp; &quot;c&quot;&gt;");
  EXPECT_EQ(fmt("%.1f", 2.26), "2.3");
}

}  // namespace
}  // namespace roundpipe::svg
