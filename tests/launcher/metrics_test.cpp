#include "roundpipe/launcher/metrics.h"

#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>
#include <sstream>

#include "launcher_test_util.h"
#include "tests/common/test_macros.h"

namespace roundpipe::launcher {
namespace {

using testing::ScratchDir;

std::vector<nlohmann::json> json_lines(const std::string& text) {
  std::vector<nlohmann::json> lines;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    lines.push_back(nlohmann::json::parse(line));
  }
  return lines;
}

TrainRecord record(int64_t step) {
  TrainRecord r;
  r.step = step;
  r.loss = 5.0 - 0.1 * static_cast<double>(step);
  r.lr = 1e-3;
  r.tokens = 256 * step;
  r.tokens_per_s = 1000.0;
  r.time_s = 0.5 * static_cast<double>(step);
  return r;
}

TEST(MetricsTest, Writer_AppendsOneJsonObjectPerLine) {
  ScratchDir dir;
  MetricsWriter writer(dir.path(), std::nullopt);
  TrainRecord r = record(1);
  r.grad_norm = 0.75;
  r.scale = 65536.0;
  writer.log_train(r);
  writer.log_train(record(2));
  writer.log_eval({2, 4.25});
  // Flushed per line: the file is complete while the writer is still open.
  const std::string text = read_file(dir.file("metrics.jsonl"));
  EXPECT_EQ(std::count(text.begin(), text.end(), '\n'), 3);
  auto lines = json_lines(text);
  ASSERT_EQ(lines.size(), 3u);
  EXPECT_EQ(lines[0], nlohmann::json::parse(R"({"step": 1, "loss": 4.9, "lr": 0.001, "tokens": 256,
      "tokens_per_s": 1000.0, "grad_norm": 0.75, "scale": 65536.0, "time": 0.5})"));
  EXPECT_TRUE(lines[1]["grad_norm"].is_null());
  EXPECT_TRUE(lines[1]["scale"].is_null());
  EXPECT_EQ(lines[2], nlohmann::json::parse(R"({"step": 2, "eval_loss": 4.25})"));
}

TEST(MetricsTest, Resume_DropsRecordsAfterTheCheckpoint) {
  ScratchDir dir;
  {
    MetricsWriter writer(dir.path(), std::nullopt);
    for (int64_t step = 1; step <= 10; ++step) {
      writer.log_train(record(step));
      if (step % 5 == 0) {
        writer.log_eval({step, 3.0});
      }
    }
  }
  // A crash can leave half a line at the end.
  {
    std::string text = read_file(dir.file("metrics.jsonl")) + R"({"step": 11, "lo)";
    write_file_atomically(dir.file("metrics.jsonl"), text);
  }
  MetricsWriter resumed(dir.path(), /*resume_step=*/6);
  ASSERT_EQ(resumed.records().train.size(), 6u);
  ASSERT_EQ(resumed.records().eval.size(), 1u);
  resumed.log_train(record(7));
  auto lines = json_lines(read_file(dir.file("metrics.jsonl")));
  std::vector<int64_t> steps;
  for (const auto& line : lines) {
    steps.push_back(line["step"].get<int64_t>());
  }
  EXPECT_EQ(steps, (std::vector<int64_t>{1, 2, 3, 4, 5, 5, 6, 7}));
  EXPECT_TRUE(lines[5].contains("eval_loss"));
  MetricsLog log = read_metrics(dir.file("metrics.jsonl"));
  EXPECT_EQ(log.train.size(), 7u);
  EXPECT_DOUBLE_EQ(log.train[6].loss, 5.0 - 0.7);
}

TEST(MetricsTest, FreshRun_EmptiesAnOldFile) {
  ScratchDir dir;
  dir.write("metrics.jsonl", "{\"step\": 3, \"loss\": 1.0}\n");
  MetricsWriter writer(dir.path(), std::nullopt);
  EXPECT_EQ(read_file(dir.file("metrics.jsonl")), "");
  EXPECT_TRUE(writer.records().train.empty());
}

TEST(MetricsTest, Parse_RejectsMalformedLinesWithLineNumber) {
  EXPECT_THROW_WITH(parse_metrics("{\"step\": 1}\nnot json\n", "m.jsonl"), "m.jsonl:2");
  EXPECT_THROW_WITH(parse_metrics("{\"loss\": 1}\n", "m.jsonl"), "integer \"step\"");
  MetricsLog log = parse_metrics("{\"step\": 1, \"loss\": null}\n");
  ASSERT_EQ(log.train.size(), 1u);
  EXPECT_TRUE(std::isnan(log.train[0].loss));
}

ProgressInfo example_info() {
  ProgressInfo info;
  info.step = 12;
  info.loss = 3.211;
  info.tokens_per_s = 1234;
  info.lr = 3e-4;
  info.scale = 65536;
  info.elapsed_s = 62.0 * 12 / 88;  // ETA = elapsed / 12 * (100 - 12) = 62 s
  return info;
}

TEST(MetricsTest, ProgressLine_RendersTheDocumentedFormat) {
  std::ostringstream out;
  ProgressLine progress(out, /*is_tty=*/false, 100);
  EXPECT_EQ(progress.render(example_info()),
            "step 12/100 | loss 3.2110 | 1.2k tok/s | lr 3.0e-04 | scale 65536 | ETA 1m02s");
  ProgressInfo no_scale = example_info();
  no_scale.scale.reset();
  no_scale.step = 0;
  EXPECT_EQ(progress.render(no_scale), "step 0/100 | loss 3.2110 | 1.2k tok/s | lr 3.0e-04 | ETA --");
}

TEST(MetricsTest, ProgressLine_PlainLinesWhenNotATerminal) {
  std::ostringstream out;
  ProgressLine progress(out, /*is_tty=*/false, 100);
  progress.update(example_info());
  progress.print_above("eval loss 2.0");
  progress.update(example_info());
  progress.finish();
  const std::string line = progress.render(example_info());
  EXPECT_EQ(out.str(), line + "\neval loss 2.0\n" + line + "\n");
}

TEST(MetricsTest, ProgressLine_RedrawsInPlaceOnATerminal) {
  std::ostringstream out;
  ProgressLine progress(out, /*is_tty=*/true, 100, /*start_step=*/10);
  ProgressInfo first = example_info();
  first.tokens_per_s = 123456;  // "123k": a longer line than the next
  progress.update(first);
  ProgressInfo second = example_info();
  second.scale.reset();
  progress.update(second);
  const std::string a = progress.render(first), b = progress.render(second);
  ASSERT_GT(a.size(), b.size());
  EXPECT_EQ(out.str(), "\r" + a + "\r" + b + std::string(a.size() - b.size(), ' '));
  progress.print_above("saved");
  EXPECT_EQ(out.str().substr(out.str().size() - b.size() - 1), "\n" + b);
  progress.finish();
  EXPECT_EQ(out.str().back(), '\n');
  // start_step = 10: two steps in 8.45 s -> 88 steps to go take 372 s.
  EXPECT_NE(b.find("ETA 6m12s"), std::string::npos) << b;
}

TEST(MetricsTest, Formatting_SiAndDurations) {
  EXPECT_EQ(format_si(850), "850");
  EXPECT_EQ(format_si(1234), "1.2k");
  EXPECT_EQ(format_si(12345), "12.3k");
  EXPECT_EQ(format_si(123456), "123k");
  EXPECT_EQ(format_si(1.5e6), "1.5M");
  EXPECT_EQ(format_duration(45), "45s");
  EXPECT_EQ(format_duration(62), "1m02s");
  EXPECT_EQ(format_duration(7500), "2h05m");
  EXPECT_EQ(format_duration(-1), "--");
}

}  // namespace
}  // namespace roundpipe::launcher
