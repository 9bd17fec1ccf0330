#include "roundpipe/launcher/cli/trainer.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>
#include <sys/resource.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/sgd.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <memory>
#include <sstream>
#include <utility>

#include "amp/grad_scaler.h"
#include "base/logging.h"
#include "optim/adafactor.h"
#include "optim/adam.h"
#include "optim/lion.h"
#include "roundpipe/launcher/atomic_file.h"
#include "roundpipe/launcher/cli/checkpoint.h"
#include "roundpipe/launcher/cli/memory_plan.h"
#include "roundpipe/launcher/cli/setup.h"
#include "roundpipe/launcher/loss_plot.h"
#include "roundpipe/launcher/lr_schedule.h"
#include "roundpipe/launcher/metrics.h"
#include "roundpipe/launcher/step_loss.h"
#include "roundpipe/models/layers.h"
#include "roundpipe/models/moe.h"
#include "roundpipe/side_inputs.h"

namespace roundpipe::launcher {
namespace {

const Logger& launcher_log() { return Logger::get("launcher"); }

std::unique_ptr<torch::optim::Optimizer> make_optimizer(RoundPipe& model, const LauncherConfig& config) {
  OptimizerCtx ctx;  // model.parameters() are the master weights here
  const OptimizerSection& o = config.optimizer;
  if (o.name == OptimizerName::kSgd) {
    return std::make_unique<torch::optim::SGD>(
        model.parameters(), torch::optim::SGDOptions(o.lr).momentum(o.momentum).weight_decay(o.weight_decay));
  }
  if (o.name == OptimizerName::kAdafactor) {
    return std::make_unique<optim::Adafactor>(model.parameters(),
                                              optim::AdafactorOptions(o.lr).weight_decay(o.weight_decay));
  }
  if (o.name == OptimizerName::kLion) {
    return std::make_unique<optim::Lion>(
        model.parameters(),
        optim::LionOptions(o.lr).betas(std::make_tuple(o.betas[0], o.betas[1])).weight_decay(o.weight_decay));
  }
  return std::make_unique<optim::Adam>(model.parameters(), optim::AdamOptions(o.lr)
                                                               .betas(std::make_tuple(o.betas[0], o.betas[1]))
                                                               .eps(o.eps)
                                                               .weight_decay(o.weight_decay)
                                                               .decoupled_weight_decay(o.name == OptimizerName::kAdamW)
                                                               .state_dtype(o.state_dtype == OptimizerStateDtype::kInt8
                                                                                ? optim::AdamStateDtype::kInt8
                                                                                : optim::AdamStateDtype::kFloat32)
                                                               .kahan_sum(o.kahan_sum));
}

std::string plot_title(const LauncherConfig& config) { return "roundpipe train: " + config.out_dir; }

}  // namespace

// Note [Loss normalization]:
// The loss of an optimizer step is the sum of the cross-entropy of every trained label of the step
// (every microbatch, every train.grad_accum pass, every data-parallel rank) divided by their count,
// N. Each rank draws the step's global batches (train.batch_size rows per rank) before its first
// pass, counts N over all of them, and divides its microbatches' summed losses by N / world; the
// data-parallel gradient sync averages over the world, so the step's gradient is that of
// sum / N whatever the split into microbatches, passes and ranks, and whatever padding the rows
// carry (transformers' gradient-accumulation fix of 2024, num_items_in_batch, is the same rule).
// Token streams label every position, so N = rows * seq_len as before.
// StepLoss (roundpipe/launcher/step_loss.h) holds the rule: its loss function reads nothing to the
// host per microbatch, and the trainer reads one summed loss per pass, the CPU tensor
// forward_backward returns (tests/launcher/step_loss_test.cpp counts the reads).
void run_training(const LauncherConfig& config, const std::optional<std::string>& resume) {
  Trainer(config, resume).run();
}

Trainer::Trainer(const LauncherConfig& config, std::optional<std::string> resume)
    : config_(config),
      resume_(std::move(resume)),
      start_time_(std::chrono::steady_clock::now()),
      schedule_(config.optimizer.lr, config.schedule.min_lr, config.schedule.warmup_steps, config.train.steps,
                config.schedule.decay) {}

void Trainer::run() {
  setup();
  // setup() checks the memory plan (check_memory_fits) before it opens the data; nothing before
  // load_model() touches the weights.
  load_model();
  if (resume_.has_value()) resume(resolve_resume_dir(config_, *resume_));
  report_start();
  if (valid_data_ && config_.eval.at_start && !resume_.has_value()) evaluate();  // step 0: before training
  while (step_ < config_.train.steps) {
    const StepResult result = train_step();
    if (due(config_.log.every) || step_ == config_.train.steps) report(result);
    if (valid_data_ && due(config_.eval.every) && step_ != config_.train.steps) evaluate();
    if (due(config_.checkpoint.every) && step_ != config_.train.steps) checkpoint();
  }
  finish();
}

// Data parallelism (docs/distributed.md): every rank trains on its slice of each global batch;
// only rank 0 (the lead) writes config.yaml, metrics, the plot and checkpoints. The data comes
// before the model: a bad line of a chat file fails before the weights load.
void Trainer::setup() {
  group_ = make_process_group(config_);
  world_ = group_ ? group_->world_size() : 1;
  rank_ = group_ ? group_->rank() : 0;
  lead_ = rank_ == 0;
  check_memory_fits(config_);  // refuses, before loading anything, what will not fit (memory_plan.h)
  if (lead_ && config_.model.master_dtype == c10::kBFloat16 && !config_.optimizer.kahan_sum) {
    ROUNDPIPE_LOG(launcher_log(), kWarn,
                  "model.master_dtype: bfloat16 without optimizer.kahan_sum: every update is rounded to bf16, so "
                  "updates below half an ulp of their weight (about 1/512 of it) are lost and training with a "
                  "small learning rate stalls (docs/optimizer.md, \"Quality on real text\"); add "
                  "optimizer.kahan_sum: true (2 B/param) to keep them");
  }
  train_data_ = open_data(config_, config_.data.train, 0);
  if (!config_.data.valid.empty() || config_.data.format == DataFormat::kSynthetic) {
    valid_data_ = open_data(config_, config_.data.valid, 1);
  }
  if (lead_ && train_data_->chat) {
    std::cerr << "train data: " << train_data_->describe() << "\n";
    if (valid_data_) std::cerr << "valid data: " << valid_data_->describe() << "\n";
  }
  ROUNDPIPE_LOG(launcher_log(), kInfo, "train data: ", train_data_->describe());
}

void Trainer::load_model() {
  pre_ = make_launcher_model(config_);
  parameter_line_ = describe_parameter_counts(count_parameters(*pre_->model));
  if (lead_) prepare_out_dir();
  model_ = std::make_unique<RoundPipe>(
      pre_->model, round_pipe_options(config_, models::draws_in_training(*pre_->model)).process_group(group_));
  optimizer_ = make_optimizer(*model_, config_);
  scaler_.emplace(amp::GradScalerOptions()
                      .enabled(config_.amp.scaler)
                      .init_scale(config_.amp.init_scale)
                      .growth_interval(config_.amp.growth_interval));
  // The global batch (batch_size rows per rank) is drawn the same on every rank, whatever the world
  // size; rank r trains on rows [r * batch_size, (r + 1) * batch_size).
  sampler_ = train_data_->sampler(config_.train.batch_size * world_, config_.train.seed);
}

void Trainer::prepare_out_dir() {
  make_directories(join_path(config_.out_dir, "checkpoints"));
  remove_stale_temporaries(join_path(config_.out_dir, "checkpoints"));
  write_file_atomically(join_path(config_.out_dir, "config.yaml"), to_yaml(config_));
}

void Trainer::resume(const std::string& dir) {
  TrainerState state = load_checkpoint_dir(dir, *model_, pre_->config, *optimizer_, lora());
  if (state.world_size != world_) {
    throw ConfigError("--resume " + dir + ": the checkpoint was written by a job of " +
                      std::to_string(state.world_size) + " rank(s), this job has " + std::to_string(world_) +
                      "; resume with the same number of ranks (train.batch_size is per rank)");
  }
  step_ = state.step;
  tokens_ = state.tokens;
  sampler_->set_state(state.sampler_state);
  at::Generator cpu_generator = at::detail::getDefaultCPUGenerator();  // a handle: shares the state
  cpu_generator.set_state(state.cpu_rng_state);
  if (config_.amp.scaler) scaler_->load_state_dict(state.scaler);
  ROUNDPIPE_LOG(launcher_log(), kInfo, "resumed from ", dir, " at step ", step_);
  if (lead_) std::cerr << "resumed from " << dir << " at step " << step_ << "\n";
  if (state.iteration >= 0) {
    model_->set_iteration(state.iteration);  // the dropout masks of the uninterrupted run
  } else if (lora() != nullptr && lora()->dropout() > 0.0) {
    ROUNDPIPE_LOG(launcher_log(), kWarn, "model.lora.dropout = ", lora()->dropout(),
                  ": the checkpoint predates "
                  "the saved iteration index, so the resumed run draws other dropout masks than a straight "
                  "run would (RoundPipe's iteration counter restarts at 0): not bitwise equal to one");
  }
}

// The parameter line, the metrics file and the progress line (which need the resumed step), and the
// mixture-of-experts router log.
void Trainer::report_start() {
  std::string lora_line;
  if (lora() != nullptr) {
    std::string targets;
    for (const std::string& t : lora()->target_modules()) targets += (targets.empty() ? "" : ", ") + t;
    for (const std::string& t : lora()->target_parameters()) targets += (targets.empty() ? "" : ", ") + t;
    lora_line = "LoRA rank " + std::to_string(lora()->rank()) + " on " + targets + "; ";
  }
  if (lead_) std::cerr << lora_line << parameter_line_ << "\n";
  ROUNDPIPE_LOG(launcher_log(), kInfo, lora_line, parameter_line_);
  if (lead_) metrics_.emplace(config_.out_dir, resume_.has_value() ? std::optional<int64_t>(step_) : std::nullopt);
  progress_.emplace(lead_ ? static_cast<std::ostream&>(std::cerr) : quiet_, lead_ && ::isatty(2) != 0,
                    config_.train.steps, step_);
  ROUNDPIPE_LOG(launcher_log(), kInfo, "training ", config_.train.steps, " steps on ", model_->devices().size(),
                " device(s); plan ", model_->plan().to_string());
  if (pre_->config.is_moe()) {
    auto head = model_->module()->ptr<models::LmHeadImpl>(model_->module()->size() - 1);
    router_log_ = std::make_shared<models::RouterLossLog>();
    head->set_router_loss_log(router_log_);
    aux_coef_ = head->router_aux_loss_coef();
  }
  masters_ = model_->optim_parameters();
  first_time_ = seconds_since_start();
  window_start_ = first_time_;
}

// One optimizer step: train.grad_accum passes of forward_backward, each read once (StepLoss), then
// the optimizer step queued on the optimizer thread and the scaler's update.
Trainer::StepResult Trainer::train_step() {
  StepResult result;
  result.lr = schedule_.at(step_);
  StepBatches batches = draw_step_batches();
  StepLoss loss(batches.labels, world_, *scaler_);
  for (Batch& batch : batches.passes) {
    if (world_ > 1) {
      batch.inputs = batch.inputs.narrow(0, rank_ * config_.train.batch_size, config_.train.batch_size);
      batch.labels = batch.labels.narrow(0, rank_ * config_.train.batch_size, config_.train.batch_size);
      for (auto& [name, t] : batch.side_inputs) {
        t = t.narrow(0, rank_ * config_.train.batch_size, config_.train.batch_size);
      }
    }
    // The LmHead returns each microbatch's summed token loss (RoundPipeOptions::label_to_last_layer:
    // chunked, no logits); forward_backward returns their sum on the CPU. Packed chat rows carry
    // their positions and segment ids to every layer as side inputs.
    SideInputScope side(batch.side_inputs);
    loss.add_pass(model_->forward_backward({batch.inputs}, batch.labels, loss.loss_fn()));
  }
  result.loss = loss.unscaled_sum();
  // Mixture of experts: the passes' losses include coef * aux (Note [Router statistics] in
  // models/moe.h); the logged loss is the cross-entropy alone, aux its own field.
  if (router_log_) {
    result.aux_loss = router_log_->take();
    result.loss -= aux_coef_ * *result.aux_loss;
  }
  const double lr = result.lr;
  model_->step([this, lr] { optimizer_step(lr); }, config_.run.step_mode);
  if (scaler_->is_enabled()) scaler_->update();
  if (group_) average_over_ranks(result);
  ++step_;
  tokens_ += batches.tokens;
  window_tokens_ += batches.tokens;
  TORCH_CHECK(std::isfinite(result.loss), "the training loss is ", result.loss, " at step ", step_,
              " (diverged): lower optimizer.lr, set train.clip_grad_norm or enable amp.scaler");
  return result;
}

// Every rank draws the step's global batches, so every rank knows the step's trained-label count
// without communicating: Note [Loss normalization]. The labels are host tensors: no device read.
Trainer::StepBatches Trainer::draw_step_batches() {
  StepBatches batches;
  for (int64_t pass = 0; pass < config_.train.grad_accum; ++pass) {
    batches.passes.push_back(sampler_->next());
    batches.labels += batches.passes.back().labels.ne(kIgnoreLabel).sum().item<int64_t>();
    batches.tokens += batches.passes.back().tokens;
  }
  TORCH_CHECK(batches.labels > 0, "step ", step_ + 1, " has no trained label");
  return batches;
}

// The logged loss is the global batch's: the mean of the ranks' (equal token counts).
void Trainer::average_over_ranks(StepResult& result) {
  at::Tensor sum = at::full({2}, result.loss, at::kDouble);
  sum[1].fill_(result.aux_loss.value_or(0.0));
  group_->all_reduce(sum).wait();
  result.loss = sum[0].item<double>() / static_cast<double>(world_);
  if (result.aux_loss) result.aux_loss = sum[1].item<double>() / static_cast<double>(world_);
}

void Trainer::optimizer_step(double lr) {
  for (auto& group : optimizer_->param_groups()) group.options().set_lr(lr);
  std::optional<double> norm;
  if (config_.train.clip_grad_norm > 0.0) {
    if (scaler_->is_enabled()) scaler_->unscale_(*optimizer_);
    // Adam: the coefficient is applied inside the step (16-bit gradients are never rounded back;
    // Note [Gradients in the compute dtype] in setup.cpp), bitwise clip_grad_norm_'s result.
    if (auto* adam = dynamic_cast<optim::Adam*>(optimizer_.get())) {
      norm = optim::clip_grad_norm(*adam, config_.train.clip_grad_norm);
    } else {
      norm = torch::nn::utils::clip_grad_norm_(masters_, config_.train.clip_grad_norm);
    }
  }
  if (scaler_->is_enabled()) {
    scaler_->step(*optimizer_);
  } else {
    optimizer_->step();
  }
  optimizer_->zero_grad();
  grad_norm_.set(norm);
}

// The metrics record, the progress line and the log line of a logged step.
void Trainer::report(const StepResult& result) {
  const double now = seconds_since_start();
  TrainRecord record;
  record.step = step_;
  record.loss = result.loss;
  record.aux_loss = result.aux_loss;
  record.lr = result.lr;
  record.tokens = tokens_;
  record.tokens_per_s = window_tokens_ / std::max(now - window_start_, 1e-9);
  record.grad_norm = grad_norm_.get();  // of the last finished step (async: may lag by one)
  if (scaler_->is_enabled()) record.scale = scaler_->get_scale();
  record.time_s = now;
  if (lead_) metrics_->log_train(record);
  progress_->update({step_, result.loss, record.tokens_per_s, result.lr, record.scale, now - first_time_});
  ROUNDPIPE_LOG(launcher_log(), kInfo, "step ", step_, " loss ", result.loss, " lr ", result.lr, " tok/s ",
                record.tokens_per_s);
  window_tokens_ = 0;
  window_start_ = now;
}

void Trainer::evaluate() {
  model_->synchronize();
  const EvalResult result = launcher::evaluate(*model_, config_, *valid_data_);  // the same on every rank
  if (!lead_) return;
  metrics_->log_eval({step_, result.loss, result.accuracy});
  ROUNDPIPE_LOG(launcher_log(), kInfo, "step ", step_, " eval_loss ", result.loss, " eval_accuracy ", result.accuracy);
  char accuracy[32];
  std::snprintf(accuracy, sizeof(accuracy), "%.1f%%", 100.0 * result.accuracy);
  progress_->print_above("step " + std::to_string(step_) + " | eval loss " + std::to_string(result.loss) +
                         " | token accuracy " + accuracy);
}

void Trainer::checkpoint() {
  if (!lead_) {
    // A checkpoint is a sync point (Note [Checkpoints are sync points]) on every rank, or the
    // ranks' next steps would see parameters of different staleness.
    model_->synchronize();
    return;
  }
  TrainerState state;
  state.world_size = world_;
  state.iteration = model_->iteration();
  state.step = step_;
  state.tokens = tokens_;
  state.sampler_state = sampler_->state();
  state.cpu_rng_state = at::detail::getDefaultCPUGenerator().get_state();
  state.scaler = scaler_->state_dict();
  last_checkpoint_ = save_checkpoint_dir({*model_, pre_->config, *optimizer_, config_, state, lora()});
  write_loss_plot(join_path(config_.out_dir, "loss.svg"), metrics_->records(), plot_title(config_));
  ROUNDPIPE_LOG(launcher_log(), kInfo, "checkpoint ", last_checkpoint_);
}

// The last evaluation and checkpoint; every rank exits once the lead's final checkpoint is written
// (or fails naming it if it died).
void Trainer::finish() {
  if (valid_data_ && (config_.eval.every > 0 || !config_.data.valid.empty())) evaluate();
  checkpoint();
  progress_->finish();
  if (group_) group_->barrier();
  if (lead_) print_summary();
}

void Trainer::print_summary() const {
  const auto& train_records = metrics_->records().train;
  std::cout << "trained " << step_ << " steps in " << format_duration(seconds_since_start());
  if (!train_records.empty()) std::cout << ", final loss " << train_records.back().loss;
  if (!metrics_->records().eval.empty()) std::cout << ", eval loss " << metrics_->records().eval.back().eval_loss;
  if (world_ > 1) std::cout << " (" << world_ << " ranks)";
  std::cout << "\n  metrics:    " << metrics_->path() << "\n  loss plot:  " << join_path(config_.out_dir, "loss.svg")
            << "\n  checkpoint: " << last_checkpoint_ << " (also " << join_path(config_.out_dir, "checkpoints/latest")
            << ")\n  log:        " << join_path(config_.out_dir, "train.log") << "\n";
  // The peak so far, taken here rather than by the parent after exit: a process's teardown
  // (static destructors paging in library code) can raise a small run's peak resident set by
  // ~0.1 GiB after its model is gone (bench/host_memory_bench.py reads this line).
  struct rusage usage {};
  if (::getrusage(RUSAGE_SELF, &usage) == 0) {
    char line[96];
    std::snprintf(line, sizeof(line), "  peak host memory: %.2f GiB resident (%ld KiB)\n",
                  static_cast<double>(usage.ru_maxrss) / (1 << 20), static_cast<long>(usage.ru_maxrss));
    std::cout << line;
  }
}

const models::LoraOptions* Trainer::lora() const { return pre_->lora.has_value() ? &*pre_->lora : nullptr; }

double Trainer::seconds_since_start() const {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_time_).count();
}

bool Trainer::due(int64_t every) const { return every > 0 && step_ % every == 0; }

void Trainer::GradNormSlot::set(std::optional<double> norm) {
  std::lock_guard<std::mutex> lock(mutex_);
  norm_ = norm;
}

std::optional<double> Trainer::GradNormSlot::get() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return norm_;
}

}  // namespace roundpipe::launcher
