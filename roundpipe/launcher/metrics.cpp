#include "roundpipe/launcher/metrics.h"

#include <c10/util/Exception.h>
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <ostream>

#include "roundpipe/launcher/atomic_file.h"

namespace roundpipe::launcher {
namespace {

using Json = nlohmann::json;

Json number(double value) {
  return std::isfinite(value) ? Json(value) : Json(nullptr);
}

Json optional_number(const std::optional<double>& value) {
  return value ? number(*value) : Json(nullptr);
}

double read_number(const Json& object, const char* key) {
  auto it = object.find(key);
  if (it == object.end() || it->is_null()) {
    return std::nan("");
  }
  return it->get<double>();
}

std::optional<double> read_optional(const Json& object, const char* key) {
  auto it = object.find(key);
  if (it == object.end() || it->is_null()) {
    return std::nullopt;
  }
  return it->get<double>();
}

std::string train_line(const TrainRecord& r) {
  Json j = Json::object();
  j["step"] = r.step;
  j["loss"] = number(r.loss);
  j["lr"] = number(r.lr);
  j["tokens"] = r.tokens;
  j["tokens_per_s"] = number(r.tokens_per_s);
  j["grad_norm"] = optional_number(r.grad_norm);
  j["scale"] = optional_number(r.scale);
  if (r.aux_loss) j["aux_loss"] = number(*r.aux_loss);
  j["time"] = number(r.time_s);
  return j.dump() + "\n";
}

std::string eval_line(const EvalRecord& r) {
  Json j = Json::object();
  j["step"] = r.step;
  j["eval_loss"] = number(r.eval_loss);
  if (r.eval_accuracy) j["eval_accuracy"] = number(*r.eval_accuracy);
  return j.dump() + "\n";
}

std::string serialize(const MetricsLog& log) {
  // Records are interleaved by step, evaluations after the training record of their step, as the
  // training loop writes them.
  std::string text;
  size_t e = 0;
  for (const TrainRecord& r : log.train) {
    while (e < log.eval.size() && log.eval[e].step < r.step) {
      text += eval_line(log.eval[e++]);
    }
    text += train_line(r);
  }
  while (e < log.eval.size()) {
    text += eval_line(log.eval[e++]);
  }
  return text;
}

}  // namespace

MetricsLog parse_metrics(const std::string& text, const std::string& source) {
  MetricsLog log;
  size_t pos = 0;
  int64_t line_number = 0;
  while (pos < text.size()) {
    size_t end = text.find('\n', pos);
    ++line_number;
    if (end == std::string::npos) {
      break;  // torn last line
    }
    std::string line = text.substr(pos, end - pos);
    pos = end + 1;
    if (line.find_first_not_of(" \t\r") == std::string::npos) {
      continue;
    }
    Json j;
    try {
      j = Json::parse(line);
    } catch (const Json::exception& e) {
      TORCH_CHECK(false, source, ":", line_number, ": not a JSON object (", e.what(),
                  "); fix or delete the line");
    }
    TORCH_CHECK(j.is_object() && j.contains("step") && j["step"].is_number_integer(), source, ":",
                line_number, ": a metrics record needs an integer \"step\"; fix or delete the line");
    try {
      if (j.contains("eval_loss")) {
        EvalRecord r{j["step"].get<int64_t>(), read_number(j, "eval_loss"), std::nullopt};
        if (j.contains("eval_accuracy")) r.eval_accuracy = read_number(j, "eval_accuracy");
        log.eval.push_back(r);
      } else {
        TrainRecord r;
        r.step = j["step"].get<int64_t>();
        r.loss = read_number(j, "loss");
        r.lr = read_number(j, "lr");
        r.tokens = j.value("tokens", int64_t(0));
        r.tokens_per_s = read_number(j, "tokens_per_s");
        r.grad_norm = read_optional(j, "grad_norm");
        r.scale = read_optional(j, "scale");
        r.aux_loss = read_optional(j, "aux_loss");
        r.time_s = read_number(j, "time");
        log.train.push_back(r);
      }
    } catch (const Json::exception& e) {
      TORCH_CHECK(false, source, ":", line_number, ": wrong field type (", e.what(),
                  "); fix or delete the line");
    }
  }
  return log;
}

MetricsLog read_metrics(const std::string& path) {
  if (!path_exists(path)) {
    return {};
  }
  return parse_metrics(read_file(path), path);
}

MetricsWriter::MetricsWriter(const std::string& out_dir, std::optional<int64_t> resume_step)
    : path_(join_path(out_dir, "metrics.jsonl")) {
  TORCH_CHECK(is_directory(out_dir), "metrics: out_dir '", out_dir, "' is not a directory");
  if (resume_step) {
    MetricsLog old = read_metrics(path_);
    for (const TrainRecord& r : old.train) {
      if (r.step <= *resume_step) {
        log_.train.push_back(r);
      }
    }
    for (const EvalRecord& r : old.eval) {
      if (r.step <= *resume_step) {
        log_.eval.push_back(r);
      }
    }
  }
  // Rewriting (rather than truncating in place) keeps the old file whole if we crash here.
  write_file_atomically(path_, serialize(log_));
  fd_ = ::open(path_.c_str(), O_WRONLY | O_APPEND | O_CLOEXEC);
  TORCH_CHECK(fd_ >= 0, "cannot open '", path_, "' for appending: ", std::strerror(errno));
}

MetricsWriter::~MetricsWriter() {
  if (fd_ >= 0) {
    ::close(fd_);
  }
}

void MetricsWriter::append_line(const std::string& line) {
  size_t done = 0;
  while (done < line.size()) {
    ssize_t n = ::write(fd_, line.data() + done, line.size() - done);
    if (n < 0 && errno == EINTR) {
      continue;
    }
    TORCH_CHECK(n > 0, "write to '", path_, "' failed: ", std::strerror(errno));
    done += static_cast<size_t>(n);
  }
}

void MetricsWriter::log_train(const TrainRecord& record) {
  append_line(train_line(record));
  log_.train.push_back(record);
}

void MetricsWriter::log_eval(const EvalRecord& record) {
  append_line(eval_line(record));
  log_.eval.push_back(record);
}

std::string format_si(double value) {
  if (!std::isfinite(value)) {
    return "--";
  }
  static const char* kSuffix[] = {"", "k", "M", "G", "T"};
  int unit = 0;
  double v = std::fabs(value);
  while (v >= 999.5 && unit < 4) {
    v /= 1000.0;
    ++unit;
  }
  char buffer[32];
  if (unit == 0) {
    std::snprintf(buffer, sizeof(buffer), "%.0f", value);
  } else {
    const char* sign = value < 0 ? "-" : "";
    if (v < 99.95) {
      std::snprintf(buffer, sizeof(buffer), "%s%.1f%s", sign, v, kSuffix[unit]);
    } else {
      std::snprintf(buffer, sizeof(buffer), "%s%.0f%s", sign, v, kSuffix[unit]);
    }
  }
  return buffer;
}

std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) {
    return "--";
  }
  long long s = std::llround(seconds);
  char buffer[32];
  if (s < 60) {
    std::snprintf(buffer, sizeof(buffer), "%llds", s);
  } else if (s < 3600) {
    std::snprintf(buffer, sizeof(buffer), "%lldm%02llds", s / 60, s % 60);
  } else {
    std::snprintf(buffer, sizeof(buffer), "%lldh%02lldm", s / 3600, (s % 3600) / 60);
  }
  return buffer;
}

ProgressLine::ProgressLine(std::ostream& out, bool is_tty, int64_t total_steps, int64_t start_step)
    : out_(out), is_tty_(is_tty), total_steps_(total_steps), start_step_(start_step) {}

std::string ProgressLine::render(const ProgressInfo& info) const {
  char buffer[64];
  std::string line = "step " + std::to_string(info.step) + "/" + std::to_string(total_steps_);
  std::snprintf(buffer, sizeof(buffer), " | loss %.4f", info.loss);
  line += buffer;
  line += " | " + format_si(info.tokens_per_s) + " tok/s";
  std::snprintf(buffer, sizeof(buffer), " | lr %.1e", info.lr);
  line += buffer;
  if (info.scale) {
    std::snprintf(buffer, sizeof(buffer), *info.scale >= 1 ? " | scale %.0f" : " | scale %g", *info.scale);
    line += buffer;
  }
  const int64_t done = info.step - start_step_;
  double eta = -1;
  if (done > 0 && info.elapsed_s > 0) {
    eta = info.elapsed_s / static_cast<double>(done) * static_cast<double>(total_steps_ - info.step);
  }
  line += " | ETA " + format_duration(eta);
  return line;
}

void ProgressLine::draw(const std::string& line) {
  if (!is_tty_) {
    out_ << line << '\n';
    out_.flush();
    return;
  }
  // Pad with blanks over the rest of a longer previous line (no terminal escape codes needed).
  std::string padded = line;
  if (line_open_ && last_line_.size() > line.size()) {
    padded.append(last_line_.size() - line.size(), ' ');
  }
  out_ << '\r' << padded;
  out_.flush();
  line_open_ = true;
}

void ProgressLine::update(const ProgressInfo& info) {
  std::string line = render(info);
  draw(line);
  last_line_ = line;
}

void ProgressLine::print_above(const std::string& message) {
  if (!is_tty_ || !line_open_) {
    out_ << message << '\n';
    out_.flush();
    return;
  }
  std::string padded = message;
  if (last_line_.size() > message.size()) {
    padded.append(last_line_.size() - message.size(), ' ');
  }
  out_ << '\r' << padded << '\n' << last_line_;
  out_.flush();
}

void ProgressLine::finish() {
  if (is_tty_ && line_open_) {
    out_ << '\n';
    out_.flush();
    line_open_ = false;
  }
}

}  // namespace roundpipe::launcher
