// The `roundpipe` executable: train, eval, plan, export, validate, generate and chat subcommands
// over a YAML configuration, and launch (start the ranks of a distributed job) with its diagnostic env
// (docs/launcher.md). Exit codes: 0 ok, 2 usage or configuration error, 1 runtime
// error. Errors print one line on stderr; the detail (with LibTorch's backtrace) goes to the log
// file <out_dir>/train.log (train) when it is open.
#include <c10/util/Exception.h>

#include <CLI/CLI.hpp>
#include <cstdlib>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include "base/logging.h"
#include "roundpipe/launcher/atomic_file.h"
#include "roundpipe/launcher/cli/commands.h"
#include "roundpipe/launcher/cli/generate.h"
#include "roundpipe/launcher/cli/host_allocator.h"
#include "roundpipe/launcher/cli/launch.h"
#include "roundpipe/launcher/cli/trainer.h"
#include "roundpipe/launcher/config.h"

namespace {

using namespace roundpipe::launcher;

struct ConfigArgs {
  std::string path;
  std::vector<std::string> overrides;
};

// The sampling and model options shared by `generate` and `chat`.
void add_generate_args(CLI::App* command, GenerateCommandOptions& options) {
  command->add_option("--max-new-tokens", options.max_new_tokens, "tokens to generate at most per answer")
      ->capture_default_str();
  command->add_option("--temperature", options.temperature, "0 = greedy; > 0 samples from softmax(logits / T)")
      ->capture_default_str();
  command
      ->add_option("--top-p", options.top_p,
                   "nucleus sampling: keep the most probable tokens up to this "
                   "cumulative probability (1 = off)")
      ->capture_default_str();
  command->add_option("--top-k", options.top_k, "keep the K most probable tokens (0 = off)")->capture_default_str();
  command->add_option("--seed", options.seed, "seed of the sampling")->capture_default_str();
  command->add_option("--checkpoint", options.checkpoint,
                      "a checkpoint directory of `roundpipe train` (full or LoRA) instead of model.pretrained's "
                      "weights; the tokenizer and chat template still come from model.pretrained");
  command->add_flag("--print-ids", options.print_ids, "after each answer, print `ids: ...` (the generated token ids)");
  command->add_flag("--streamed", options.streamed,
                    "generate through RoundPipe over all of run.devices, the stages streamed, no KV cache (automatic "
                    "when the parameters exceed 80% of a GPU first device's memory)");
}

void add_config_args(CLI::App* command, ConfigArgs& args) {
  command->add_option("CONFIG", args.path, "YAML configuration file (docs/config-reference.md)")->required();
  command->add_option("overrides", args.overrides,
                      "key=value overrides of nested keys, e.g. optimizer.lr=1e-4 train.steps=50");
}

// Sends the runtime's log to <out_dir>/<name> (every level the config allows); the console shows
// warnings and errors only, so the progress line stays readable.
// Ranks other than 0 of a data-parallel job write <stem>.rank<R>.log.
void open_log(const LauncherConfig& config, const std::string& name) {
  make_directories(config.out_dir);
  roundpipe::set_log_level(config.log.level);
  std::string file = name;
  const char* rank = std::getenv("RANK");
  if (rank != nullptr && *rank != '\0' && std::string(rank) != "0") {
    file = name.substr(0, name.rfind('.')) + ".rank" + rank + ".log";
  }
  roundpipe::add_log_file(join_path(config.out_dir, file));
}

// One line on stderr; the detail (LibTorch's backtrace included) only into the log file.
int fail(int code, const std::string& message, const std::string& detail) {
  std::cerr << "roundpipe: error: " << message << std::endl;
  roundpipe::set_console_log_level(roundpipe::LogLevel::kOff);
  const roundpipe::Logger& log = roundpipe::Logger::get("launcher");
  ROUNDPIPE_LOG(log, kError, detail);
  return code;
}

// The command line: every subcommand with the variables CLI11 parses its arguments into. Built
// in place (CLI::App holds pointers to the members), parsed once, then run() dispatches.
class CommandLine {
 public:
  CommandLine() {
    app_.require_subcommand(1);
    app_.set_version_flag("--version", "roundpipe 0.1");
    add_train();
    add_eval_and_plan();
    add_export();
    validate_ = app_.add_subcommand("validate", "check a configuration and print it resolved");
    add_config_args(validate_, validate_args_);
    add_generate_and_chat();
    add_launch();
    add_env();
  }

  // Parses argv: nullopt to go on, else the exit code (--help and --version: 0; usage errors: 2).
  std::optional<int> parse(int argc, char** argv) {
    try {
      app_.parse(argc, argv);
    } catch (const CLI::ParseError& e) {
      const int code = app_.exit(e);
      return code == 0 ? 0 : 2;
    }
    return std::nullopt;
  }

  // Runs the chosen subcommand; its exit code. Throws what the command throws.
  int run(const char* argv0) {
    const std::string host_allocator = apply_host_allocator_policy();  // Note [Host allocator policy]
    if (*train_) {
      LauncherConfig config = load_config(train_args_.path, train_args_.overrides);
      open_log(config, "train.log");
      ROUNDPIPE_LOG(roundpipe::Logger::get("launcher"), kInfo, host_allocator);
      std::optional<std::string> resume_from;
      if (resume_option_->count() > 0) resume_from = resume_;
      run_training(config, resume_from);
    } else if (*eval_) {
      LauncherConfig config = load_config(eval_args_.path, eval_args_.overrides);
      open_log(config, "eval.log");
      run_eval(config, std::cout);
    } else if (*plan_) {
      run_plan(load(plan_args_), std::cout, plan_svg_);
    } else if (*export_) {
      run_export(checkpoint_dir_, export_dir_, std::cout, export_options_);
    } else if (*validate_) {
      run_validate(load(validate_args_), std::cout);
    } else if (*generate_) {
      run_generate(load(generate_args_), prompts_, generate_options_, std::cout);
    } else if (*chat_) {
      run_chat(load(chat_args_), chat_options_, std::cin, std::cout);
    } else if (*launch_) {
      return launch(argv0);
    } else if (*env_) {
      return run_env(env_options_, std::cout);
    }
    return 0;
  }

 private:
  static LauncherConfig load(const ConfigArgs& args) { return load_config(args.path, args.overrides); }

  void add_train() {
    train_ = app_.add_subcommand("train", "train a model (metrics, loss plot, checkpoints in out_dir)");
    add_config_args(train_, train_args_);
    resume_option_ = train_
                         ->add_option("--resume", resume_,
                                      "continue from a checkpoint directory (default: <out_dir>/checkpoints/latest)")
                         ->expected(0, 1);
  }

  void add_eval_and_plan() {
    eval_ = app_.add_subcommand("eval",
                                "mean token cross-entropy on data.valid (else data.train); "
                                "last line eval_loss=<float>");
    add_config_args(eval_, eval_args_);
    plan_ = app_.add_subcommand("plan",
                                "devices, pipeline stages, memory estimates and the simulated "
                                "timeline, without training");
    add_config_args(plan_, plan_args_);
    plan_->add_option("--svg", plan_svg_, "also write the simulated timeline as an SVG picture to this file");
  }

  void add_export() {
    export_ = app_.add_subcommand("export",
                                  "write a transformers model directory (or, for a LoRA "
                                  "checkpoint, a PEFT adapter directory) from a checkpoint");
    export_->add_option("CHECKPOINT_DIR", checkpoint_dir_, "e.g. runs/default/checkpoints/latest")->required();
    export_
        ->add_option("OUT_DIR", export_dir_,
                     "directory to write config.json + model.safetensors (LoRA: "
                     "adapter_config.json + adapter_model.safetensors) into")
        ->required();
    export_->add_flag("--merge", export_options_.merge,
                      "LoRA checkpoint: write the base model with the adapters merged in (PEFT's merge_and_unload)");
    export_->add_option("--base", export_options_.base,
                        "LoRA checkpoint with --merge: the base model directory (default: the adapter's "
                        "base_model_name_or_path, the run's model.pretrained)");
  }

  void add_generate_and_chat() {
    generate_ = app_.add_subcommand("generate",
                                    "answer prompts with the configured model (model.pretrained's "
                                    "tokenizer and chat template), streaming the text");
    add_config_args(generate_, generate_args_);
    generate_->add_option("--prompt", prompts_, "a prompt (repeat for several); rendered as one user message")
        ->required()
        ->expected(1)
        ->take_all();
    generate_->add_flag("--raw", generate_options_.raw, "tokenize the prompt as it is, without the chat template");
    generate_
        ->add_option("--batch-size", generate_options_.batch_size,
                     "prompts generated together in one left-padded batch (the first answer of each batch "
                     "streams, the others print when their batch ends)")
        ->capture_default_str();
    add_generate_args(generate_, generate_options_);
    chat_ = app_.add_subcommand("chat",
                                "talk to the configured model: one user message per stdin line; "
                                "/reset forgets the conversation, /exit or end of input ends");
    add_config_args(chat_, chat_args_);
    add_generate_args(chat_, chat_options_);
  }

  void add_launch() {
    LaunchOptions& o = launch_options_;
    launch_ = app_.add_subcommand("launch",
                                  "start the local ranks of a distributed job (torchrun's environment), e.g. "
                                  "roundpipe launch --nproc-per-node 2 train CONFIG [key=value ...]");
    launch_->add_option("--nproc-per-node", o.nproc_per_node, "ranks on this node")->capture_default_str();
    launch_->add_option("--nnodes", o.nnodes, "nodes of the job (run launch on each)")->capture_default_str();
    launch_->add_option("--node-rank", o.node_rank, "this node's index in [0, nnodes)")->capture_default_str();
    launch_->add_option("--master-addr", o.master_addr,
                        "address of the node-rank-0 node (default 127.0.0.1; required with --nnodes > 1)");
    launch_->add_option("--master-port", o.master_port,
                        "port of rank 0's store (default: a free port with one node, else 29500)");
    launch_->add_option("--run-id", o.run_id, "TORCHELASTIC_RUN_ID of the ranks")->capture_default_str();
    launch_
        ->add_option("--grace-period", o.grace_period_s, "seconds between SIGTERM and SIGKILL when stopping the ranks")
        ->capture_default_str();
    launch_->add_flag("--no-prefix", no_prefix_,
                      "let the ranks write to stdout/stderr directly, without \"[rank R]: \"");
    launch_->prefix_command();  // everything from COMMAND on is the ranks' command line
    launch_->footer("COMMAND [ARGS...]: what every rank runs, e.g. train CONFIG key=value (docs/launcher.md)");
  }

  int launch(const char* argv0) {
    launch_options_.command = launch_->remaining();
    launch_options_.prefix_output = !no_prefix_;
    std::vector<std::string> commands;
    for (const CLI::App* command : app_.get_subcommands({})) {
      if (command != launch_) commands.push_back(command->get_name());
    }
    resolve_launch_options(launch_options_, commands);
    return run_launch(launch_options_, argv0);
  }

  void add_env() {
    env_ = app_.add_subcommand("env",
                               "print the distributed launch variables this process sees "
                               "(try: roundpipe launch --nproc-per-node 2 env)");
    // Test hooks (tests/launcher/launch_test.cpp), hidden from --help.
    env_->add_option("--test-fail-rank", env_options_.fail_rank)->group("");
    env_->add_option("--test-exit-code", env_options_.exit_code)->group("");
    env_->add_option("--test-sleep", env_options_.sleep_s)->group("");
    env_->add_flag("--test-ignore-sigterm", env_options_.ignore_sigterm)->group("");
  }

  CLI::App app_{
      "roundpipe: pipeline-parallel training of transformers models from a YAML config "
      "(docs/launcher.md)"};
  CLI::App* train_ = nullptr;
  CLI::App* eval_ = nullptr;
  CLI::App* plan_ = nullptr;
  CLI::App* export_ = nullptr;
  CLI::App* validate_ = nullptr;
  CLI::App* generate_ = nullptr;
  CLI::App* chat_ = nullptr;
  CLI::App* launch_ = nullptr;
  CLI::App* env_ = nullptr;
  ConfigArgs train_args_, eval_args_, plan_args_, validate_args_, generate_args_, chat_args_;
  std::string resume_;
  CLI::Option* resume_option_ = nullptr;
  std::string plan_svg_;
  std::string checkpoint_dir_, export_dir_;
  ExportOptions export_options_;
  std::vector<std::string> prompts_;
  GenerateCommandOptions generate_options_, chat_options_;
  LaunchOptions launch_options_;
  bool no_prefix_ = false;
  EnvOptions env_options_;
};

}  // namespace

int main(int argc, char** argv) {
  CommandLine command_line;
  if (std::optional<int> code = command_line.parse(argc, argv)) return *code;
  roundpipe::set_console_log_level(roundpipe::LogLevel::kWarn);
  try {
    return command_line.run(argv[0]);
  } catch (const ConfigError& e) {
    return fail(2, e.what(), e.what());
  } catch (const c10::Error& e) {
    return fail(1, e.what_without_backtrace(), e.what());
  } catch (const std::exception& e) {
    return fail(1, e.what(), e.what());
  }
}
