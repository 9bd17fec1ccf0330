#include "roundpipe/launcher/cli/trainer.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/sgd.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <memory>
#include <mutex>
#include <sstream>

#include "amp/grad_scaler.h"
#include "base/logging.h"
#include "optim/adam.h"
#include "optim/lion.h"
#include "roundpipe/launcher/atomic_file.h"
#include "roundpipe/launcher/cli/checkpoint.h"
#include "roundpipe/launcher/cli/memory_plan.h"
#include "roundpipe/launcher/cli/setup.h"
#include "roundpipe/launcher/loss_plot.h"
#include "roundpipe/launcher/lr_schedule.h"
#include "roundpipe/launcher/metrics.h"
#include "roundpipe/models/layers.h"
#include "roundpipe/models/moe.h"

namespace roundpipe::launcher {
namespace {

const Logger& launcher_log() { return Logger::get("launcher"); }

std::unique_ptr<torch::optim::Optimizer> make_optimizer(RoundPipe& model, const LauncherConfig& config) {
  OptimizerCtx ctx;  // model.parameters() are the master weights here
  const OptimizerConfig& o = config.optimizer;
  if (o.name == OptimizerName::kSgd) {
    return std::make_unique<torch::optim::SGD>(
        model.parameters(),
        torch::optim::SGDOptions(o.lr).momentum(o.momentum).weight_decay(o.weight_decay));
  }
  if (o.name == OptimizerName::kLion) {
    return std::make_unique<optim::Lion>(
        model.parameters(),
        optim::LionOptions(o.lr).betas(std::make_tuple(o.betas[0], o.betas[1])).weight_decay(o.weight_decay));
  }
  return std::make_unique<optim::Adam>(
      model.parameters(), optim::AdamOptions(o.lr)
                              .betas(std::make_tuple(o.betas[0], o.betas[1]))
                              .eps(o.eps)
                              .weight_decay(o.weight_decay)
                              .decoupled_weight_decay(o.name == OptimizerName::kAdamW)
                              .state_dtype(o.state_dtype == OptimizerStateDtype::kInt8 ? optim::AdamStateDtype::kInt8
                                                                                      : optim::AdamStateDtype::kFloat32));
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
void run_training(const LauncherConfig& config, const std::optional<std::string>& resume) {
  const auto start_time = std::chrono::steady_clock::now();
  auto seconds_since_start = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_time).count();
  };
  // Data parallelism (docs/distributed.md): every rank trains on its slice of each global batch;
  // only rank 0 (the lead) writes config.yaml, metrics, the plot and checkpoints.
  const std::shared_ptr<comm::ProcessGroup> group = make_process_group(config);
  const int64_t world = group ? group->world_size() : 1;
  const int64_t rank = group ? group->rank() : 0;
  const bool lead = rank == 0;
  check_memory_fits(config);  // refuses, before loading anything, what will not fit (memory_plan.h)
  // The data first: a bad line of a chat file fails before the weights load.
  const LauncherData train_data = open_data(config, config.data.train, 0);
  std::optional<LauncherData> valid_data;
  if (!config.data.valid.empty() || config.data.format == DataFormat::kSynthetic) {
    valid_data = open_data(config, config.data.valid, 1);
  }
  if (lead && train_data.chat) {
    std::cerr << "train data: " << train_data.describe() << "\n";
    if (valid_data) std::cerr << "valid data: " << valid_data->describe() << "\n";
  }
  ROUNDPIPE_LOG(launcher_log(), kInfo, "train data: ", train_data.describe());
  LauncherModel pre = make_launcher_model(config);
  const models::LoraOptions* lora = pre.lora.has_value() ? &*pre.lora : nullptr;
  const std::string parameter_line = describe_parameter_counts(count_parameters(*pre.model));
  if (lead) {
    make_directories(join_path(config.out_dir, "checkpoints"));
    remove_stale_temporaries(join_path(config.out_dir, "checkpoints"));
    write_file_atomically(join_path(config.out_dir, "config.yaml"), to_yaml(config));
  }

  RoundPipe model(pre.model, round_pipe_options(config).process_group(group));
  std::unique_ptr<torch::optim::Optimizer> optimizer = make_optimizer(model, config);
  amp::GradScaler scaler(amp::GradScalerOptions()
                             .enabled(config.amp.scaler)
                             .init_scale(config.amp.init_scale)
                             .growth_interval(config.amp.growth_interval));
  // The global batch (batch_size rows per rank) is drawn the same on every rank, whatever the world
  // size; rank r trains on rows [r * batch_size, (r + 1) * batch_size).
  const std::unique_ptr<BatchSampler> sampler = train_data.sampler(config.train.batch_size * world, config.train.seed);
  const LrSchedule schedule(config.optimizer.lr, config.schedule.min_lr, config.schedule.warmup_steps,
                            config.train.steps, config.schedule.decay);

  int64_t step = 0;
  int64_t tokens = 0;
  if (resume.has_value()) {
    const std::string dir = resolve_resume_dir(config, *resume);
    TrainerState state = load_checkpoint_dir(dir, model, pre.config, *optimizer, lora);
    if (state.world_size != world) {
      throw ConfigError("--resume " + dir + ": the checkpoint was written by a job of " +
                        std::to_string(state.world_size) + " rank(s), this job has " + std::to_string(world) +
                        "; resume with the same number of ranks (train.batch_size is per rank)");
    }
    step = state.step;
    tokens = state.tokens;
    sampler->set_state(state.sampler_state);
    at::Generator cpu_generator = at::detail::getDefaultCPUGenerator();  // a handle: shares the state
    cpu_generator.set_state(state.cpu_rng_state);
    if (config.amp.scaler) scaler.load_state_dict(state.scaler);
    ROUNDPIPE_LOG(launcher_log(), kInfo, "resumed from ", dir, " at step ", step);
    if (lead) std::cerr << "resumed from " << dir << " at step " << step << "\n";
    if (state.iteration >= 0) {
      model.set_iteration(state.iteration);  // the dropout masks of the uninterrupted run
    } else if (lora != nullptr && lora->dropout() > 0.0) {
      ROUNDPIPE_LOG(launcher_log(), kWarn, "model.lora.dropout = ", lora->dropout(), ": the checkpoint predates "
                    "the saved iteration index, so the resumed run draws other dropout masks than a straight "
                    "run would (RoundPipe's iteration counter restarts at 0): not bitwise equal to one");
    }
  }
  std::string lora_line;
  if (lora != nullptr) {
    std::string targets;
    for (const std::string& t : lora->target_modules()) targets += (targets.empty() ? "" : ", ") + t;
    lora_line = "LoRA rank " + std::to_string(lora->rank()) + " on " + targets + "; ";
  }
  if (lead) std::cerr << lora_line << parameter_line << "\n";
  ROUNDPIPE_LOG(launcher_log(), kInfo, lora_line, parameter_line);
  std::optional<MetricsWriter> metrics;
  if (lead) metrics.emplace(config.out_dir, resume.has_value() ? std::optional<int64_t>(step) : std::nullopt);
  std::ostringstream quiet;  // other ranks' progress goes nowhere
  ProgressLine progress(lead ? static_cast<std::ostream&>(std::cerr) : quiet, lead && ::isatty(2) != 0,
                        config.train.steps, step);
  ROUNDPIPE_LOG(launcher_log(), kInfo, "training ", config.train.steps, " steps on ", model.devices().size(),
                " device(s); plan ", model.plan().to_string());

  // Mixture of experts: the heads report each microbatch's load-balancing loss here.
  std::shared_ptr<models::RouterLossLog> router_log;
  double aux_coef = 0.0;
  if (pre.config.is_moe()) {
    auto head = model.module()->ptr<models::LmHeadImpl>(model.module()->size() - 1);
    router_log = std::make_shared<models::RouterLossLog>();
    head->set_router_loss_log(router_log);
    aux_coef = head->router_aux_loss_coef();
  }
  double step_loss = 0.0;  // unscaled: the sum of forward_backward's results over the step's passes
  const std::vector<at::Tensor> masters = model.optim_parameters();
  std::mutex norm_mutex;
  std::optional<double> grad_norm;  // of the last finished step (async: may lag by one)
  std::string last_checkpoint;
  const double first_time = seconds_since_start();
  int64_t window_tokens = 0;
  double window_start = first_time;

  auto write_plot = [&] {
    write_loss_plot(join_path(config.out_dir, "loss.svg"), metrics->records(), plot_title(config));
  };
  auto checkpoint = [&] {
    if (!lead) {
      // A checkpoint is a sync point (Note [Checkpoints are sync points]) on every rank, or the
      // ranks' next steps would see parameters of different staleness.
      model.synchronize();
      return;
    }
    TrainerState state;
    state.world_size = world;
    state.iteration = model.iteration();
    state.step = step;
    state.tokens = tokens;
    state.sampler_state = sampler->state();
    state.cpu_rng_state = at::detail::getDefaultCPUGenerator().get_state();
    state.scaler = scaler.state_dict();
    last_checkpoint = save_checkpoint_dir({model, pre.config, *optimizer, config, state, lora});
    write_plot();
    ROUNDPIPE_LOG(launcher_log(), kInfo, "checkpoint ", last_checkpoint);
  };
  auto run_eval = [&] {
    model.synchronize();
    const EvalResult result = evaluate(model, config, *valid_data);  // the same on every rank
    if (!lead) return;
    metrics->log_eval({step, result.loss, result.accuracy});
    ROUNDPIPE_LOG(launcher_log(), kInfo, "step ", step, " eval_loss ", result.loss, " eval_accuracy ", result.accuracy);
    char accuracy[32];
    std::snprintf(accuracy, sizeof(accuracy), "%.1f%%", 100.0 * result.accuracy);
    progress.print_above("step " + std::to_string(step) + " | eval loss " + std::to_string(result.loss) +
                         " | token accuracy " + accuracy);
  };

  if (valid_data && config.eval.at_start && !resume.has_value()) run_eval();  // step 0: before training
  while (step < config.train.steps) {
    const double lr = schedule.at(step);
    step_loss = 0.0;
    // Every rank draws the step's global batches, so every rank knows the step's trained-label
    // count without communicating: Note [Loss normalization].
    std::vector<Batch> passes;
    int64_t step_labels = 0;
    int64_t step_tokens = 0;
    for (int64_t micro = 0; micro < config.train.grad_accum; ++micro) {
      passes.push_back(sampler->next());
      step_labels += passes.back().labels.ne(kIgnoreLabel).sum().item<int64_t>();
      step_tokens += passes.back().tokens;
    }
    TORCH_CHECK(step_labels > 0, "step ", step + 1, " has no trained label");
    const double normalizer = static_cast<double>(step_labels) / static_cast<double>(world);
    // The LmHead returns each microbatch's summed token loss (RoundPipeOptions::label_to_last_layer:
    // chunked, no logits). No host read here: on a GPU worker a .item() per microbatch would
    // synchronize the device.
    const LossFn loss_fn = [&scaler, normalizer](const at::Tensor& summed_loss, const at::Tensor& /*labels*/) {
      at::Tensor loss = summed_loss / normalizer;
      return scaler.is_enabled() ? scaler.scale(loss) : loss;
    };
    for (Batch& batch : passes) {
      if (world > 1) {
        batch.inputs = batch.inputs.narrow(0, rank * config.train.batch_size, config.train.batch_size);
        batch.labels = batch.labels.narrow(0, rank * config.train.batch_size, config.train.batch_size);
      }
      const at::Tensor pass_loss = model.forward_backward({batch.inputs}, batch.labels, loss_fn);  // on the CPU
      // The scale the pass's losses were multiplied by (update() runs after the step).
      step_loss += pass_loss.item<double>() / (scaler.is_enabled() ? scaler.get_scale() : 1.0);
    }
    // Mixture of experts: the passes' losses include coef * aux (Note [Router statistics] in
    // models/moe.h); the logged loss is the cross-entropy alone, aux its own field.
    std::optional<double> step_aux;
    if (router_log) {
      step_aux = router_log->take();
      step_loss -= aux_coef * *step_aux;
    }
    model.step(
        [&, lr] {
          for (auto& group : optimizer->param_groups()) group.options().set_lr(lr);
          std::optional<double> norm;
          if (config.train.clip_grad_norm > 0.0) {
            if (scaler.is_enabled()) scaler.unscale_(*optimizer);
            norm = torch::nn::utils::clip_grad_norm_(masters, config.train.clip_grad_norm);
          }
          if (scaler.is_enabled()) {
            scaler.step(*optimizer);
          } else {
            optimizer->step();
          }
          optimizer->zero_grad();
          std::lock_guard<std::mutex> lock(norm_mutex);
          grad_norm = norm;
        },
        config.run.step_mode);
    if (scaler.is_enabled()) scaler.update();
    if (group) {
      // The logged loss is the global batch's: the mean of the ranks' (equal token counts).
      at::Tensor sum = at::full({2}, step_loss, at::kDouble);
      sum[1].fill_(step_aux.value_or(0.0));
      group->all_reduce(sum).wait();
      step_loss = sum[0].item<double>() / static_cast<double>(world);
      if (step_aux) step_aux = sum[1].item<double>() / static_cast<double>(world);
    }
    ++step;
    tokens += step_tokens;
    window_tokens += step_tokens;
    TORCH_CHECK(std::isfinite(step_loss), "the training loss is ", step_loss, " at step ", step,
                " (diverged): lower optimizer.lr, set train.clip_grad_norm or enable amp.scaler");

    if (step % config.log.every == 0 || step == config.train.steps) {
      const double now = seconds_since_start();
      TrainRecord record;
      record.step = step;
      record.loss = step_loss;
      record.aux_loss = step_aux;
      record.lr = lr;
      record.tokens = tokens;
      record.tokens_per_s = window_tokens / std::max(now - window_start, 1e-9);
      {
        std::lock_guard<std::mutex> lock(norm_mutex);
        record.grad_norm = grad_norm;
      }
      if (scaler.is_enabled()) record.scale = scaler.get_scale();
      record.time_s = now;
      if (lead) metrics->log_train(record);
      progress.update({step, step_loss, record.tokens_per_s, lr, record.scale, now - first_time});
      ROUNDPIPE_LOG(launcher_log(), kInfo, "step ", step, " loss ", step_loss, " lr ", lr, " tok/s ",
                    record.tokens_per_s);
      window_tokens = 0;
      window_start = now;
    }
    if (valid_data && config.eval.every > 0 && step % config.eval.every == 0 &&
        step != config.train.steps) {
      run_eval();
    }
    if (config.checkpoint.every > 0 && step % config.checkpoint.every == 0 && step != config.train.steps) {
      checkpoint();
    }
  }
  if (valid_data && (config.eval.every > 0 || !config.data.valid.empty())) run_eval();
  checkpoint();
  progress.finish();
  // Every rank exits once the lead's final checkpoint is written (or fails naming it if it died).
  if (group) group->barrier();
  if (!lead) return;

  const auto& train_records = metrics->records().train;
  std::cout << "trained " << step << " steps in " << format_duration(seconds_since_start());
  if (!train_records.empty()) std::cout << ", final loss " << train_records.back().loss;
  if (!metrics->records().eval.empty()) std::cout << ", eval loss " << metrics->records().eval.back().eval_loss;
  if (world > 1) std::cout << " (" << world << " ranks)";
  std::cout << "\n  metrics:    " << metrics->path()
            << "\n  loss plot:  " << join_path(config.out_dir, "loss.svg")
            << "\n  checkpoint: " << last_checkpoint << " (also " << join_path(config.out_dir, "checkpoints/latest")
            << ")\n  log:        " << join_path(config.out_dir, "train.log") << "\n";
}

}  // namespace roundpipe::launcher
