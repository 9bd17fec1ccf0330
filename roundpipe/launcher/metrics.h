// Training metrics of the launcher: out_dir/metrics.jsonl (one JSON object per logged step or
// evaluation, appended and flushed line by line so a crash loses at most the line being written)
// and the one-line console progress display.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <optional>
#include <string>
#include <vector>

namespace roundpipe::launcher {

/// One training step's record: {"step", "loss", "lr", "tokens", "tokens_per_s", "grad_norm",
/// "scale", "time"} in metrics.jsonl (grad_norm / scale are null when not measured / no scaler),
/// plus "aux_loss" for mixture-of-experts models.
struct TrainRecord {
  int64_t step = 0;
  /// Cross-entropy, mean over the step's tokens (without the load-balancing loss).
  double loss = 0.0;
  /// Mixture-of-experts models: the load-balancing loss (unweighted; the objective adds
  /// router_aux_loss_coef times it), token-weighted mean over the step's microbatches.
  std::optional<double> aux_loss;
  double lr = 0.0;
  int64_t tokens = 0;            ///< tokens trained on so far (cumulative, across resumes)
  double tokens_per_s = 0.0;
  std::optional<double> grad_norm;
  std::optional<double> scale;   ///< loss scale of the GradScaler
  double time_s = 0.0;           ///< seconds since the run started ("time")
};

/// One evaluation's record: {"step", "eval_loss"}.
struct EvalRecord {
  int64_t step = 0;
  double eval_loss = 0.0;
  /// Token accuracy: the share of trained labels whose most likely token is the label.
  std::optional<double> eval_accuracy;
};

/// The records of a metrics.jsonl file, each kind in file order.
struct MetricsLog {
  std::vector<TrainRecord> train;
  std::vector<EvalRecord> eval;
};

/// Parses metrics.jsonl text. A last line without its newline (torn by a crash) is dropped; any
/// other malformed line throws c10::Error naming `source` and the line number. Non-finite numbers
/// are stored as null and read back as NaN.
MetricsLog parse_metrics(const std::string& text, const std::string& source = "metrics.jsonl");
/// parse_metrics of a file; an absent file gives an empty log.
MetricsLog read_metrics(const std::string& path);

/// Appends records to `<out_dir>/metrics.jsonl` (out_dir must exist).
/// Thread-safety: not thread-safe (one owner, the training loop). Each record is one write(2) of a
/// whole line on an O_APPEND descriptor, so readers (tail -f) never see half a record.
class MetricsWriter {
 public:
  /// `resume_step` nullopt: a fresh run, an existing file is emptied. Otherwise the run resumes
  /// from the checkpoint of that step: records with step > resume_step (written after the
  /// checkpoint, by the run that stopped) are removed, atomically, before appending.
  MetricsWriter(const std::string& out_dir, std::optional<int64_t> resume_step);
  ~MetricsWriter();
  MetricsWriter(const MetricsWriter&) = delete;
  MetricsWriter& operator=(const MetricsWriter&) = delete;

  void log_train(const TrainRecord& record);
  void log_eval(const EvalRecord& record);

  /// Every record of the file: the ones kept on resume plus those logged since (for the plot).
  const MetricsLog& records() const { return log_; }
  const std::string& path() const { return path_; }

 private:
  void append_line(const std::string& line);

  std::string path_;
  int fd_ = -1;
  MetricsLog log_;
};

/// One refresh of the progress line.
struct ProgressInfo {
  int64_t step = 0;            ///< steps completed (1-based: "step 12/100" after the 12th)
  double loss = 0.0;
  double tokens_per_s = 0.0;
  double lr = 0.0;
  std::optional<double> scale;  ///< shown only when set (a GradScaler is active)
  double elapsed_s = 0.0;       ///< seconds since this process's first step (for the ETA)
};

/// Renders "step 12/100 | loss 3.2110 | 1.2k tok/s | lr 3.0e-04 | scale 65536 | ETA 1m02s".
/// On a terminal (is_tty) the line is redrawn in place with '\r'; otherwise each update is a plain
/// line. Thread-safety: not thread-safe (one owner). The stream must outlive it.
///
///   ProgressLine progress(std::cerr, isatty(2), cfg.train.steps, /*start_step=*/resumed_step);
///   progress.update({step, loss, tok_per_s, lr, scale, seconds_since_start});
///   progress.print_above("eval loss 2.91");  // a message that does not clobber the line
///   progress.finish();
class ProgressLine {
 public:
  /// `start_step`: steps already done when this process started (the ETA uses only the steps this
  /// process ran).
  ProgressLine(std::ostream& out, bool is_tty, int64_t total_steps, int64_t start_step = 0);

  void update(const ProgressInfo& info);
  /// Prints `message` on its own line; on a terminal the progress line is redrawn below it.
  void print_above(const std::string& message);
  /// Ends the in-place line with a newline (terminal only; idempotent).
  void finish();

  /// The text of one update (no '\r' or newline).
  std::string render(const ProgressInfo& info) const;

 private:
  void draw(const std::string& line);

  std::ostream& out_;
  bool is_tty_;
  int64_t total_steps_;
  int64_t start_step_;
  std::string last_line_;
  bool line_open_ = false;
};

/// "850", "1.2k", "12.3k", "1.2M", "3.4G" (3 significant digits at most).
std::string format_si(double value);
/// "45s", "1m02s", "2h05m", "--" for negative / non-finite.
std::string format_duration(double seconds);

}  // namespace roundpipe::launcher
