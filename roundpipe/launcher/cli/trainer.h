// `roundpipe train`: the launcher's training loop (RoundPipe, optimizer on the master weights, LR
// schedule, gradient accumulation, clipping, GradScaler, metrics, plot, checkpoints, resume), as a
// class whose steps are the ones a hand-written LibTorch loop has: set up, load, resume, train a
// step, evaluate, checkpoint, report.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "amp/grad_scaler.h"
#include "comm/process_group.h"
#include "roundpipe/launcher/cli/setup.h"
#include "roundpipe/launcher/config.h"
#include "roundpipe/launcher/lr_schedule.h"
#include "roundpipe/launcher/metrics.h"
#include "roundpipe/models/moe.h"
#include "roundpipe/round_pipe.h"

namespace roundpipe::launcher {

/// Trains as `config` says. `resume`: nullopt = a fresh run; "" = resume from
/// <out_dir>/checkpoints/latest; else the checkpoint directory to resume from. Prints the
/// progress line on stderr and the summary (where the metrics, plot and checkpoint are) on stdout.
/// Throws ConfigError (configuration) or c10::Error / std::exception (runtime).
void run_training(const LauncherConfig& config, const std::optional<std::string>& resume);

/// The training loop of run_training:
///
///   Trainer trainer(config, resume);
///   trainer.run();  // setup, load_model, resume, then train_step / report / evaluate / checkpoint
///                   // until train.steps, then finish
///
/// Thread-safety: one thread (the caller's) owns a Trainer and calls run(). The optimizer thread of
/// RoundPipe::step(kAsync) runs optimizer_step(); the members it touches say so. The device workers
/// run the step's loss function (StepLoss::loss_fn), which touches only scaler_.
class Trainer {
 public:
  Trainer(const LauncherConfig& config, std::optional<std::string> resume);
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  void run();

 private:
  /// What one optimizer step logs (the rank mean with data parallelism).
  struct StepResult {
    double lr = 0.0;
    double loss = 0.0;               ///< cross-entropy, mean over the step's trained labels
    std::optional<double> aux_loss;  ///< mixture of experts: the load-balancing loss
  };
  /// The step's global batches, one per train.grad_accum pass, and what they hold.
  struct StepBatches {
    std::vector<Batch> passes;
    int64_t labels = 0;  ///< trained labels over every pass and rank (Note [Loss normalization])
    int64_t tokens = 0;
  };

  /// The grad norm of the last finished step: written by the optimizer thread, read by the
  /// caller's; the one member both touch, guarded here once.
  class GradNormSlot {
   public:
    void set(std::optional<double> norm);
    std::optional<double> get() const;

   private:
    mutable std::mutex mutex_;
    std::optional<double> norm_;  // guarded by mutex_
  };

  // The steps of run(), in order. Caller thread.
  void setup();       // process group, data: what fails before the weights load
  void load_model();  // weights, out_dir, RoundPipe, optimizer, scaler, sampler
  void prepare_out_dir();
  void resume(const std::string& dir);
  void report_start();
  StepResult train_step();
  StepBatches draw_step_batches();
  void average_over_ranks(StepResult& result);
  void report(const StepResult& result);
  void evaluate();
  void checkpoint();
  void finish();
  void print_summary() const;
  // Queued by train_step through RoundPipe::step: runs on the optimizer thread (kAsync) or the
  // caller's (kSync), never while the caller touches optimizer_ (resume runs before the first
  // step, checkpoint after RoundPipe::synchronize()).
  void optimizer_step(double lr);
  const models::LoraOptions* lora() const;  // null: full training
  double seconds_since_start() const;
  bool due(int64_t every) const;

  // Settings: fixed by the constructor and setup(); read by any thread after that.
  const LauncherConfig& config_;
  const std::optional<std::string> resume_;
  const std::chrono::steady_clock::time_point start_time_;
  const LrSchedule schedule_;
  std::shared_ptr<comm::ProcessGroup> group_;  // null: one process
  int64_t world_ = 1;
  int64_t rank_ = 0;
  bool lead_ = true;  // rank 0 writes config.yaml, metrics, the plot and checkpoints

  // The data and the model. Caller thread, except where noted.
  std::optional<LauncherData> train_data_;
  std::optional<LauncherData> valid_data_;
  std::unique_ptr<BatchSampler> sampler_;
  std::optional<LauncherModel> pre_;  // the Sequential before RoundPipe wraps it, its HF config, LoRA
  std::string parameter_line_;
  std::unique_ptr<RoundPipe> model_;
  // The optimizer thread too, in optimizer_step (see there).
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
  // Every thread: GradScaler's own contract (scale on the workers, unscale_/step on the optimizer
  // thread, update and get_scale on the caller's).
  std::optional<amp::GradScaler> scaler_;
  std::vector<at::Tensor> masters_;  // model_->optim_parameters(); read by the optimizer thread
  // Mixture of experts: the heads report each microbatch's load-balancing loss here (its own mutex).
  std::shared_ptr<models::RouterLossLog> router_log_;
  double aux_coef_ = 0.0;
  GradNormSlot grad_norm_;

  // Progress. Caller thread only.
  int64_t step_ = 0;           // optimizer steps done (with resume: since the first run)
  int64_t tokens_ = 0;         // tokens trained on (the same)
  int64_t window_tokens_ = 0;  // since the last logged step, for tokens/s
  double window_start_ = 0.0;
  double first_time_ = 0.0;  // seconds_since_start() when the first step began
  std::string last_checkpoint_;
  std::optional<MetricsWriter> metrics_;  // lead only
  std::ostringstream quiet_;              // other ranks' progress goes nowhere
  std::optional<ProgressLine> progress_;
};

}  // namespace roundpipe::launcher
