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

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "roundpipe: pipeline-parallel training of transformers models from a YAML config "
      "(docs/launcher.md)"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "roundpipe 0.1");

  ConfigArgs train_args, eval_args, plan_args, validate_args;
  std::string resume;
  CLI::App* train = app.add_subcommand("train", "train a model (metrics, loss plot, checkpoints in out_dir)");
  add_config_args(train, train_args);
  CLI::Option* resume_option =
      train
          ->add_option("--resume", resume,
                       "continue from a checkpoint directory (default: <out_dir>/checkpoints/latest)")
          ->expected(0, 1);
  CLI::App* eval = app.add_subcommand("eval",
                                      "mean token cross-entropy on data.valid (else data.train); "
                                      "last line eval_loss=<float>");
  add_config_args(eval, eval_args);
  CLI::App* plan = app.add_subcommand("plan",
                                      "devices, pipeline stages, memory estimates and the simulated "
                                      "timeline, without training");
  add_config_args(plan, plan_args);
  std::string plan_svg;
  plan->add_option("--svg", plan_svg, "also write the simulated timeline as an SVG picture to this file");
  std::string checkpoint_dir, export_dir;
  ExportOptions export_options;
  CLI::App* exp = app.add_subcommand("export",
                                     "write a transformers model directory (or, for a LoRA "
                                     "checkpoint, a PEFT adapter directory) from a checkpoint");
  exp->add_option("CHECKPOINT_DIR", checkpoint_dir, "e.g. runs/default/checkpoints/latest")->required();
  exp->add_option("OUT_DIR", export_dir,
                  "directory to write config.json + model.safetensors (LoRA: "
                  "adapter_config.json + adapter_model.safetensors) into")
      ->required();
  exp->add_flag("--merge", export_options.merge,
                "LoRA checkpoint: write the base model with the adapters merged in (PEFT's merge_and_unload)");
  exp->add_option("--base", export_options.base,
                  "LoRA checkpoint with --merge: the base model directory (default: the adapter's "
                  "base_model_name_or_path, the run's model.pretrained)");
  CLI::App* validate = app.add_subcommand("validate", "check a configuration and print it resolved");
  add_config_args(validate, validate_args);

  ConfigArgs generate_args, chat_args;
  std::vector<std::string> prompts;
  GenerateCommandOptions generate_options, chat_options;
  CLI::App* generate = app.add_subcommand("generate",
                                          "answer prompts with the configured model (model.pretrained's "
                                          "tokenizer and chat template), streaming the text");
  add_config_args(generate, generate_args);
  generate->add_option("--prompt", prompts, "a prompt (repeat for several); rendered as one user message")
      ->required()
      ->expected(1)
      ->take_all();
  generate->add_flag("--raw", generate_options.raw, "tokenize the prompt as it is, without the chat template");
  add_generate_args(generate, generate_options);
  CLI::App* chat = app.add_subcommand("chat",
                                      "talk to the configured model: one user message per stdin line; "
                                      "/reset forgets the conversation, /exit or end of input ends");
  add_config_args(chat, chat_args);
  add_generate_args(chat, chat_options);

  LaunchOptions launch_options;
  CLI::App* launch = app.add_subcommand("launch",
                                        "start the local ranks of a distributed job (torchrun's environment), e.g. "
                                        "roundpipe launch --nproc-per-node 2 train CONFIG [key=value ...]");
  launch->add_option("--nproc-per-node", launch_options.nproc_per_node, "ranks on this node")->capture_default_str();
  launch->add_option("--nnodes", launch_options.nnodes, "nodes of the job (run launch on each)")->capture_default_str();
  launch->add_option("--node-rank", launch_options.node_rank, "this node's index in [0, nnodes)")
      ->capture_default_str();
  launch->add_option("--master-addr", launch_options.master_addr,
                     "address of the node-rank-0 node (default 127.0.0.1; required with --nnodes > 1)");
  launch->add_option("--master-port", launch_options.master_port,
                     "port of rank 0's store (default: a free port with one node, else 29500)");
  launch->add_option("--run-id", launch_options.run_id, "TORCHELASTIC_RUN_ID of the ranks")->capture_default_str();
  launch
      ->add_option("--grace-period", launch_options.grace_period_s,
                   "seconds between SIGTERM and SIGKILL when stopping the ranks")
      ->capture_default_str();
  bool no_prefix = false;
  launch->add_flag("--no-prefix", no_prefix, "let the ranks write to stdout/stderr directly, without \"[rank R]: \"");
  launch->prefix_command();  // everything from COMMAND on is the ranks' command line
  launch->footer("COMMAND [ARGS...]: what every rank runs, e.g. train CONFIG key=value (docs/launcher.md)");

  EnvOptions env_options;
  CLI::App* env = app.add_subcommand("env",
                                     "print the distributed launch variables this process sees "
                                     "(try: roundpipe launch --nproc-per-node 2 env)");
  // Test hooks (tests/launcher/launch_test.cpp), hidden from --help.
  env->add_option("--test-fail-rank", env_options.fail_rank)->group("");
  env->add_option("--test-exit-code", env_options.exit_code)->group("");
  env->add_option("--test-sleep", env_options.sleep_s)->group("");
  env->add_flag("--test-ignore-sigterm", env_options.ignore_sigterm)->group("");

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);
    return code == 0 ? 0 : 2;
  }

  roundpipe::set_console_log_level(roundpipe::LogLevel::kWarn);
  try {
    const std::string host_allocator = apply_host_allocator_policy();  // Note [Host allocator policy]
    if (*train) {
      LauncherConfig config = load_config(train_args.path, train_args.overrides);
      open_log(config, "train.log");
      ROUNDPIPE_LOG(roundpipe::Logger::get("launcher"), kInfo, host_allocator);
      std::optional<std::string> resume_from;
      if (resume_option->count() > 0) resume_from = resume;
      run_training(config, resume_from);
    } else if (*eval) {
      LauncherConfig config = load_config(eval_args.path, eval_args.overrides);
      open_log(config, "eval.log");
      run_eval(config, std::cout);
    } else if (*plan) {
      run_plan(load_config(plan_args.path, plan_args.overrides), std::cout, plan_svg);
    } else if (*exp) {
      run_export(checkpoint_dir, export_dir, std::cout, export_options);
    } else if (*validate) {
      run_validate(load_config(validate_args.path, validate_args.overrides), std::cout);
    } else if (*generate) {
      run_generate(load_config(generate_args.path, generate_args.overrides), prompts, generate_options, std::cout);
    } else if (*chat) {
      run_chat(load_config(chat_args.path, chat_args.overrides), chat_options, std::cin, std::cout);
    } else if (*launch) {
      launch_options.command = launch->remaining();
      launch_options.prefix_output = !no_prefix;
      std::vector<std::string> commands;
      for (const CLI::App* command : app.get_subcommands({})) {
        if (command != launch) commands.push_back(command->get_name());
      }
      resolve_launch_options(launch_options, commands);
      return run_launch(launch_options, argv[0]);
    } else if (*env) {
      return run_env(env_options, std::cout);
    }
  } catch (const ConfigError& e) {
    return fail(2, e.what(), e.what());
  } catch (const c10::Error& e) {
    return fail(1, e.what_without_backtrace(), e.what());
  } catch (const std::exception& e) {
    return fail(1, e.what(), e.what());
  }
  return 0;
}
