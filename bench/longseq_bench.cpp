// Long sequences on CPU devices (docs/benchmarks.md, "Long sequences"): the LM head's loss without
// materialized logits. Two parts, each printing a table:
//   memory: peak RSS (ru_maxrss of a fresh child process per row) of a 2-step training run and of an
//           evaluation of a Qwen3-shaped model with a large vocabulary and tiny width (vocab
//           151,936, hidden 64, 2 layers, tied embeddings, fp32, RoundPipe on one CPU device, the
//           LmHead given the labels: models::linear_cross_entropy) at T = 2K ... 32K tokens; the
//           same with vocab 256, whose difference isolates the head/loss part (it should not grow
//           with T); and, where it fits, the full-logits loss (logits, fp32 cross-entropy).
//   speed:  the head's forward + backward (projection, loss, gradients of hidden and weight),
//           chunked vs full logits in plain LibTorch, in one run: the ratio of their times.
//   grain:  activations (issue 28 item 3): peak RSS of one training step of a deeper model
//           (8 decoder layers, hidden 128, vocab 256, fp32, one CPU device: the plan is one fused
//           stage) with run.recompute stage (autograd keeps every layer's activations) and layer
//           (Note [Fused tail recompute]: the layers' inputs and one layer's activations), at
//           T = 1K ... --grain-max-seq, beside the memory model's prediction of what grows with T
//           (scheduler/memory_model.cpp: the stage's activation terms and the kept inputs).
// Usage: longseq_bench [memory|speed|grain|all] [--max-seq 32768] [--full-max-seq 4096]
//                      [--grain-max-seq 8192]
//        longseq_bench child <train|eval> <fused|full> <seq> <vocab>   (one row; used by memory)
//        longseq_bench child-grain <stage|layer> <seq>                  (one row; used by grain)
#include <malloc.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "roundpipe/models/layers.h"
#include "roundpipe/models/linear_cross_entropy.h"
#include "roundpipe/models/pretrained.h"
#include "roundpipe/roundpipe.h"
#include "scheduler/memory_model.h"

namespace rp = roundpipe;
namespace rm = roundpipe::models;
using Clock = std::chrono::steady_clock;

namespace {

constexpr int64_t kHidden = 64;

rm::ModelConfig model_config(int64_t vocab, int64_t seq) {
  rm::ModelConfig c;
  c.architecture = rm::Architecture::kQwen3;
  c.vocab_size = vocab;
  c.hidden_size = kHidden;
  c.intermediate_size = 128;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 16;
  c.max_position_embeddings = seq;
  c.tie_word_embeddings = true;
  return c;
}

// One row of the memory table, in this (fresh) process: prints the summed loss.
int child(const std::string& what, const std::string& head, int64_t seq, int64_t vocab) {
  torch::manual_seed(1);
  rm::Pretrained pre = rm::build(model_config(vocab, seq));
  const bool fused = head == "fused";
  rp::RunConfig one_microbatch;  // the batch is one row
  one_microbatch.num_microbatch = 1;
  rp::RoundPipe model(pre.model, rp::RoundPipeOptions()
                                     .devices({c10::kCPU})
                                     .run_config(one_microbatch)
                                     .label_to_last_layer(fused)
                                     .measure_layer_times(false));
  const at::Tensor ids = torch::randint(0, vocab, {1, seq}, torch::kLong);
  const at::Tensor targets = rm::shift_labels(ids);
  const rp::LossFn loss_fn = [fused, seq](const at::Tensor& out, const at::Tensor& t) {
    if (fused) return out / static_cast<double>(seq);
    return at::cross_entropy_loss(out.reshape({-1, out.size(-1)}).to(at::kFloat), t.reshape({-1}), {},
                                  at::Reduction::Sum, rm::kIgnoreIndex) /
           static_cast<double>(seq);
  };
  double loss = 0;
  if (what == "train") {
    auto sgd = [&] {
      rp::OptimizerCtx ctx;
      return torch::optim::SGD(model.parameters(), torch::optim::SGDOptions(0.01));
    }();
    for (int step = 0; step < 2; ++step) {
      loss = model.forward_backward({ids}, targets, loss_fn).item<double>();
      model.step(
          [&] {
            sgd.step();
            sgd.zero_grad();
          },
          rp::StepMode::kSync);
    }
  } else {
    at::NoGradGuard no_grad;
    if (fused) {
      loss = model.forward({ids}, targets).sum().item<double>() / static_cast<double>(seq);
    } else {
      loss = loss_fn(model.forward({ids}), targets).item<double>();
    }
  }
  std::printf("loss=%.6f\n", loss);
  return 0;
}

// The grain table's model: Qwen3-shaped, 8 decoder layers, hidden 128, a small vocabulary (the
// head is not what this table measures).
rm::ModelConfig grain_config(int64_t seq) {
  rm::ModelConfig c = model_config(256, seq);
  c.hidden_size = 128;
  c.intermediate_size = 256;
  c.num_hidden_layers = 8;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 32;
  c.tie_word_embeddings = false;
  return c;
}

// One row of the grain table, in this (fresh) process: one training step, with the launcher's
// default allocator policy (Note [Host allocator policy]: blocks of 1 MiB or more are mapped on
// their own and returned when freed; glibc's default keeps ~0.5-1 GiB of freed [T, h] blocks at
// T = 32K here, which is not what the run holds).
int child_grain(const std::string& grain, int64_t seq) {
  ::mallopt(M_MMAP_THRESHOLD, 1 << 20);
  torch::manual_seed(1);
  const rm::ModelConfig config = grain_config(seq);
  rm::Pretrained pre = rm::build(config);
  rp::RunConfig run;
  run.num_microbatch = 1;
  run.recompute_grain = grain == "layer" ? rp::RecomputeGrain::kLayer : rp::RecomputeGrain::kStage;
  rp::RoundPipe model(
      pre.model,
      rp::RoundPipeOptions().devices({c10::kCPU}).run_config(run).label_to_last_layer(true).measure_layer_times(false));
  const at::Tensor ids = torch::randint(0, config.vocab_size, {1, seq}, torch::kLong);
  const rp::LossFn loss_fn = [seq](const at::Tensor& out, const at::Tensor&) { return out / static_cast<double>(seq); };
  const double loss = model.forward_backward({ids}, rm::shift_labels(ids), loss_fn).item<double>();
  std::printf("loss=%.6f\n", loss);
  return 0;
}

// What the memory model says grows with T for the grain table's run: the fused stage's
// activation terms (saved activations, one layer's recompute, the head's, the boundary) and the
// inputs kept in host memory (scheduler/memory_model.cpp, Note [Memory model]), in GiB.
double predicted_activations_gib(bool layer, int64_t seq) {
  const rm::ModelConfig c = grain_config(seq);
  namespace sc = roundpipe::scheduler;
  sc::TransformerShape shape;
  shape.vocab = c.vocab_size;
  shape.hidden = c.hidden_size;
  shape.intermediate = c.intermediate_size;
  shape.num_layers = c.num_hidden_layers;
  shape.heads = c.num_attention_heads;
  shape.kv_heads = c.num_key_value_heads;
  shape.head_dim = c.head_dim;
  shape.qk_norm = true;
  sc::DeviceMemoryOptions o;
  o.dtype_bytes = 4;
  o.seq_len = seq;
  o.layer_recompute = layer;
  o.repeat_kv = true;
  o.inflight_microbatches = 1;  // CPU: the downloads are complete on return
  const sc::ExecutePlan plan({}, {{0, shape.num_layers + 2}});
  const sc::StageMemory m = sc::stage_memory(plan, shape, o).at(0);
  const int64_t bytes =
      m.saved_activations + m.recompute + m.head + m.boundary + sc::saved_input_bytes(plan, shape, o, 1);
  return static_cast<double>(bytes) / (1 << 30);
}

// Runs `args` as a child of this executable; its peak RSS in GiB, or a negative value on failure.
double child_peak_gib(const std::vector<std::string>& args) {
  std::fflush(stdout);  // or the child's freopen flushes our buffered lines a second time
  const pid_t pid = ::fork();
  if (pid < 0) return -1;
  if (pid == 0) {
    std::vector<char*> argv;
    static char self[] = "/proc/self/exe";
    argv.push_back(self);
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    if (std::freopen("/dev/null", "w", stdout) == nullptr) ::_exit(126);
    ::execv(self, argv.data());
    ::_exit(127);
  }
  int status = 0;
  struct rusage usage {};
  ::wait4(pid, &status, 0, &usage);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) return -1;
  return static_cast<double>(usage.ru_maxrss) / (1 << 20);  // KiB -> GiB
}

std::string cell(double gib) {
  if (gib < 0) return "failed";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f", gib);
  return buf;
}

void memory_table(int64_t max_seq, int64_t full_max_seq) {
  constexpr int64_t kVocab = 151936, kSmallVocab = 256;
  std::printf("## memory: peak RSS (GiB), Qwen3-shaped, vocab %lld, hidden %lld, 2 layers, fp32, 1 CPU device\n",
              static_cast<long long>(kVocab), static_cast<long long>(kHidden));
  std::printf(
      "| T | train fused | train vocab 256 | head/loss part | train full logits | eval fused | eval vocab 256 | "
      "eval full logits |\n|---|---|---|---|---|---|---|---|\n");
  for (int64_t seq = 2048; seq <= max_seq; seq *= 2) {
    const std::string t = std::to_string(seq), v = std::to_string(kVocab), s = std::to_string(kSmallVocab);
    const double train = child_peak_gib({"child", "train", "fused", t, v});
    const double train_small = child_peak_gib({"child", "train", "fused", t, s});
    const double train_full = seq <= full_max_seq ? child_peak_gib({"child", "train", "full", t, v}) : -2;
    const double eval = child_peak_gib({"child", "eval", "fused", t, v});
    const double eval_small = child_peak_gib({"child", "eval", "fused", t, s});
    const double eval_full = seq <= full_max_seq ? child_peak_gib({"child", "eval", "full", t, v}) : -2;
    std::printf("| %lld | %s | %s | %s | %s | %s | %s | %s |\n", static_cast<long long>(seq), cell(train).c_str(),
                cell(train_small).c_str(), cell(train - train_small).c_str(),
                train_full == -2 ? "(not run)" : cell(train_full).c_str(), cell(eval).c_str(), cell(eval_small).c_str(),
                eval_full == -2 ? "(not run)" : cell(eval_full).c_str());
    std::fflush(stdout);
  }
}

std::string signed_cell(double gib) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f", gib);
  return buf;
}

void grain_table(int64_t max_seq) {
  std::printf(
      "\n## grain: peak RSS (GiB) of one training step, Qwen3-shaped, 8 decoder layers, hidden 128, vocab 256, "
      "fp32, 1 CPU device (one fused stage); growth = peak - peak at T = 1024, beside the memory model's\n");
  std::printf(
      "| T | stage: peak | stage: growth | stage: model's growth | layer: peak | layer: growth | layer: model's "
      "growth |\n|---|---|---|---|---|---|---|\n");
  double stage0 = 0, layer0 = 0;
  const double stage_model0 = predicted_activations_gib(false, 1024),
               layer_model0 = predicted_activations_gib(true, 1024);
  for (int64_t seq = 1024; seq <= max_seq; seq *= 2) {
    const std::string t = std::to_string(seq);
    const double stage = child_peak_gib({"child-grain", "stage", t});
    const double layer = child_peak_gib({"child-grain", "layer", t});
    if (seq == 1024) {
      stage0 = stage;
      layer0 = layer;
    }
    std::printf("| %lld | %s | %s | %.3f | %s | %s | %.3f |\n", static_cast<long long>(seq), cell(stage).c_str(),
                stage < 0 ? "failed" : signed_cell(stage - stage0).c_str(),
                predicted_activations_gib(false, seq) - stage_model0, cell(layer).c_str(),
                layer < 0 ? "failed" : signed_cell(layer - layer0).c_str(),
                predicted_activations_gib(true, seq) - layer_model0);
    std::fflush(stdout);
  }
}

// Median seconds of `reps` runs of fn (after one warm-up).
template <typename Fn>
double median_seconds(int reps, Fn fn) {
  fn();
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    const auto t0 = Clock::now();
    fn();
    t.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

void speed_table() {
  std::printf(
      "\n## speed: head forward + backward (projection, loss, grads of hidden and weight), fp32, "
      "median of 5\n");
  std::printf(
      "| tokens | hidden | vocab | full logits ms | chunk MiB | tokens/chunk | chunked ms | chunked / full |\n"
      "|---|---|---|---|---|---|---|---|\n");
  struct Shape {
    int64_t tokens, hidden, vocab;
  };
  for (const Shape& s : {Shape{2048, 256, 32000}, Shape{4096, 64, 151936}}) {
    torch::manual_seed(2);
    const at::Tensor x = torch::randn({s.tokens, s.hidden});
    const at::Tensor w = torch::randn({s.vocab, s.hidden}) * 0.05;
    const at::Tensor t = torch::randint(0, s.vocab, {s.tokens}, torch::kLong);
    auto run = [&](bool chunked, int64_t chunk_mib) {
      const at::Tensor xg = x.detach().requires_grad_(true), wg = w.detach().requires_grad_(true);
      at::Tensor loss;
      if (chunked) {
        loss = rm::linear_cross_entropy(xg, wg, t, rm::LinearCrossEntropyOptions().chunk_bytes(chunk_mib << 20));
      } else {
        loss = at::cross_entropy_loss(at::mm(xg, wg.t()), t, {}, at::Reduction::Sum, rm::kIgnoreIndex);
      }
      loss.backward();
    };
    const double full = median_seconds(5, [&] { run(false, 0); });
    for (int64_t mib : {64, 256, 1024}) {
      const double chunked = median_seconds(5, [&] { run(true, mib); });
      std::printf(
          "| %lld | %lld | %lld | %.1f | %lld | %lld | %.1f | %.3f |\n", static_cast<long long>(s.tokens),
          static_cast<long long>(s.hidden), static_cast<long long>(s.vocab), full * 1e3, static_cast<long long>(mib),
          static_cast<long long>(rm::loss_chunk_tokens(s.vocab, at::kFloat, mib << 20)), chunked * 1e3, chunked / full);
      std::fflush(stdout);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const std::string mode = argc > 1 ? argv[1] : "all";
    if (mode == "child" && argc == 6) return child(argv[2], argv[3], std::atoll(argv[4]), std::atoll(argv[5]));
    if (mode == "child-grain" && argc == 4) return child_grain(argv[2], std::atoll(argv[3]));
    int64_t max_seq = 32768, full_max_seq = 4096, grain_max_seq = 8192;
    for (int i = 2; i + 1 < argc; i += 2) {
      if (std::strcmp(argv[i], "--max-seq") == 0) max_seq = std::atoll(argv[i + 1]);
      if (std::strcmp(argv[i], "--full-max-seq") == 0) full_max_seq = std::atoll(argv[i + 1]);
      if (std::strcmp(argv[i], "--grain-max-seq") == 0) grain_max_seq = std::atoll(argv[i + 1]);
    }
    if (mode != "memory" && mode != "speed" && mode != "grain" && mode != "all") {
      std::fprintf(stderr,
                   "usage: longseq_bench [memory|speed|grain|all] [--max-seq N] [--full-max-seq N] "
                   "[--grain-max-seq N]\n");
      return 2;
    }
    if (mode == "memory" || mode == "all") memory_table(max_seq, full_max_seq);
    if (mode == "speed" || mode == "all") speed_table();
    if (mode == "grain" || mode == "all") grain_table(grain_max_seq);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "longseq_bench: %s\n", e.what());
    return 1;
  }
}
