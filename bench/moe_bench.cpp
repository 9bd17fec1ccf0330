// One Qwen3-MoE-shaped sparse MLP on CPU, forward + backward (docs/benchmarks.md, "Mixture of
// experts"): our SparseMoeBlock (tokens sorted by expert, one GEMM pair per expert, a custom
// autograd function: Note [Sorted experts]) against, in the same run,
//   - transformers' own Qwen3MoeSparseMoeBlock with experts_implementation "eager" and
//     "grouped_mm" (bench/moe_bench.py in the venv's Python, same shapes and thread count);
//   - a LibTorch port of transformers' eager loop (one_hot mask, where, weight[e], index_add_ under
//     autograd): the same algorithm without Python, so the ratio isolates the method;
//   - a dense SwiGLU MLP with the same active parameters (width top_k * expert width), the cost a
//     perfectly balanced MoE layer cannot beat by much;
//   - our block with expert LoRA (rank 8 on both expert weights, base frozen) against the same
//     frozen block without it.
// Each is timed with its parameters' .grad cleared before every call (a step's first microbatch);
// ours and the dense MLP also with the .grad kept, the backward adding into it (every later
// microbatch: Note [Expert gradients in place]).
// After the table: the minor page faults per forward + backward of each (getrusage), i.e. how much
// of the time is the allocator handing out fresh pages, and the bytes per token each forward keeps
// for its backward (malloc's bytes in use while the output is held, less the output), beside the
// memory model's count (scheduler/memory_model.cpp, "saved activations"); the same for a whole
// Qwen3-MoE decoder layer (attention with q/k norms, 8 heads of 64, 4 kv heads, and the sparse
// block) against the memory model's per-token count for that layer, which plans use.
// Usage: moe_bench [--tokens 2048] [--hidden 512] [--width 192] [--experts 64] [--top-k 8]
//                  [--reps 5] [--threads N] [--python PATH | --no-python]
#include <malloc.h>
#include <sys/resource.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "roundpipe/models/layers.h"
#include "roundpipe/models/moe.h"
#include "scheduler/memory_model.h"

#ifndef ROUNDPIPE_PYTHON_DEFAULT
#define ROUNDPIPE_PYTHON_DEFAULT ""
#endif
#ifndef ROUNDPIPE_SOURCE_DIR_DEFAULT
#define ROUNDPIPE_SOURCE_DIR_DEFAULT "."
#endif

namespace rm = roundpipe::models;
using Clock = std::chrono::steady_clock;

namespace {

struct Shape {
  int64_t tokens = 2048, hidden = 512, width = 192, experts = 64, top_k = 8, reps = 5, threads = 0;
};

// Median milliseconds of `reps` runs of fn after one warm-up.
template <typename Fn>
double median_ms(int64_t reps, Fn fn) {
  std::vector<double> ms;
  for (int64_t r = 0; r <= reps; ++r) {
    const auto t0 = Clock::now();
    fn();
    const double t = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    if (r > 0) ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

rm::ModelConfig config_of(const Shape& s) {
  rm::ModelConfig c;
  c.architecture = rm::Architecture::kQwen3Moe;
  c.hidden_size = s.hidden;
  c.num_experts = s.experts;
  c.num_experts_per_tok = s.top_k;
  c.moe_intermediate_size = s.width;
  c.intermediate_size = s.top_k * s.width;  // the dense comparison's width
  c.norm_topk_prob = true;
  c.num_hidden_layers = 1;
  return c;
}

// transformers' Qwen3MoeExperts.forward (eager) + router, in LibTorch.
at::Tensor hf_eager_block(rm::SparseMoeBlock block, const at::Tensor& x, int64_t top_k) {
  const int64_t e_count = block->experts->gate_up_proj.size(0);
  const at::Tensor flat = x.reshape({-1, x.size(-1)});
  const at::Tensor logits = block->gate(flat);
  at::Tensor probs = torch::softmax(logits, -1, torch::kFloat);
  auto [top_value, top_index] = torch::topk(probs, top_k, -1);
  top_value = (top_value / top_value.sum(-1, true)).to(logits.scalar_type());
  at::Tensor out = torch::zeros_like(flat);
  at::Tensor mask, hit;
  {
    torch::NoGradGuard no_grad;
    mask = torch::one_hot(top_index, e_count + 1).permute({2, 1, 0});
    hit = torch::greater(mask.sum({-1, -2}), 0).nonzero();
  }
  const auto& gate_up = block->experts->gate_up_proj;
  const auto& down = block->experts->down_proj;
  for (int64_t i = 0; i < hit.size(0); ++i) {
    const int64_t e = hit[i][0].item<int64_t>();
    if (e == e_count) continue;
    const auto where = torch::where(mask[e]);
    const at::Tensor& pos = where[0];
    const at::Tensor& tok = where[1];
    const auto gu = torch::linear(flat.index({tok}), gate_up[e]).chunk(2, -1);
    at::Tensor h = torch::silu(gu[0]) * gu[1];
    h = torch::linear(h, down[e]) * top_value.index({tok, pos}).unsqueeze(-1);
    out = out.index_add(0, tok, h);
  }
  return out.view(x.sizes());
}

// transformers' timings from bench/moe_bench.py: {eager ms, grouped_mm ms}, or empty.
std::vector<std::pair<std::string, double>> python_times(const std::string& python, const Shape& s, int64_t threads) {
  std::vector<std::pair<std::string, double>> out;
  if (python.empty()) return out;
  const std::string cmd = python + " " + ROUNDPIPE_SOURCE_DIR_DEFAULT + "/bench/moe_bench.py " +
                          std::to_string(s.tokens) + " " + std::to_string(s.hidden) + " " + std::to_string(s.width) +
                          " " + std::to_string(s.experts) + " " + std::to_string(s.top_k) + " " +
                          std::to_string(s.reps) + " " + std::to_string(threads) + " 2>/dev/null";
  FILE* pipe = ::popen(cmd.c_str(), "r");
  if (pipe == nullptr) return out;
  char name[64];
  double ms = 0;
  while (std::fscanf(pipe, "%63s %lf", name, &ms) == 2) out.emplace_back(name, ms);
  ::pclose(pipe);
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  Shape s;
  std::string python = ROUNDPIPE_PYTHON_DEFAULT;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> int64_t {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        std::exit(2);
      }
      return std::atoll(argv[++i]);
    };
    if (a == "--tokens")
      s.tokens = next();
    else if (a == "--hidden")
      s.hidden = next();
    else if (a == "--width")
      s.width = next();
    else if (a == "--experts")
      s.experts = next();
    else if (a == "--top-k")
      s.top_k = next();
    else if (a == "--reps")
      s.reps = next();
    else if (a == "--threads")
      s.threads = next();
    else if (a == "--python" && i + 1 < argc)
      python = argv[++i];
    else if (a == "--no-python")
      python.clear();
    else {
      std::fprintf(stderr,
                   "usage: moe_bench [--tokens N] [--hidden H] [--width I] [--experts E] [--top-k K] "
                   "[--reps R] [--threads N] [--python PATH | --no-python]\n");
      return 2;
    }
  }
  if (s.threads > 0) at::set_num_threads(static_cast<int>(s.threads));
  const int64_t threads = at::get_num_threads();
  const rm::ModelConfig config = config_of(s);
  torch::manual_seed(0);
  rm::SparseMoeBlock block(config, 0);
  rm::init_weights(*block, 0.05);
  rm::Mlp dense(config);
  rm::init_weights(*dense, 0.05);
  const at::Tensor x = torch::randn({1, s.tokens, s.hidden}).requires_grad_(true);

  // Minor page faults per forward + backward: the allocator handing out fresh pages (docs/benchmarks.md,
  // "Mixture of experts").
  auto minor_faults = [] {
    rusage usage{};
    getrusage(RUSAGE_SELF, &usage);
    return static_cast<double>(usage.ru_minflt);
  };
  std::vector<std::pair<const char*, double>> faults;
  // `keep_grads`: the parameters' .grad from the previous call stays and the backward adds into it,
  // as for every microbatch after the first of a training step (RoundPipe's stage jobs).
  auto run = [&](const char* name, auto forward, bool keep_grads = false) {
    block->zero_grad();
    dense->zero_grad();
    const double before = minor_faults();
    const double ms = median_ms(s.reps, [&] {
      if (!keep_grads) {
        block->zero_grad();
        dense->zero_grad();
      }
      x.mutable_grad() = at::Tensor();
      forward().sum().backward();
    });
    faults.emplace_back(name, (minor_faults() - before) / static_cast<double>(s.reps + 1));
    return ms;
  };
  const double ours = run("ours", [&] { return block(x)[0]; });
  const double eager_port = run("eager port", [&] { return hf_eager_block(block, x, s.top_k); });
  const double dense_ms = run("dense", [&] { return dense(x); });
  const double ours_kept = run(
      "ours (.grad kept)", [&] { return block(x)[0]; }, true);
  // Expert LoRA (PEFT's target_parameters, rank 8 on both expert weights, base frozen): computed on
  // the sorted rows (Note [Expert LoRA on the rows]), against the same frozen block without LoRA.
  rm::SparseMoeBlock lora_block(config, 0);
  rm::init_weights(*lora_block, 0.05);
  for (auto& p : lora_block->parameters()) p.requires_grad_(false);
  const double frozen_ms = run("frozen block", [&] { return lora_block(x)[0]; });
  const int64_t lora_rank = 8;
  lora_block->experts->enable_lora(true, true, lora_rank, 16.0);
  for (auto& p : lora_block->experts->parameters()) {
    if (p.requires_grad()) {
      at::NoGradGuard no_grad;
      p.normal_(0, 0.05);
    }
  }
  const double lora_ms = run("LoRA block", [&] { return lora_block(x)[0]; });
  const double dense_kept = run(
      "dense (.grad kept)", [&] { return dense(x); }, true);
  const auto hf = python_times(python, s, threads);

  // Bytes per token a forward keeps for the backward (the graph's saved tensors and small
  // bookkeeping): malloc's bytes in use with the output held, less before and less the output.
  // mallinfo2 counts the main arena, where the calling thread's tensors live.
  auto in_use = [] {
    const struct mallinfo2 m = ::mallinfo2();
    return static_cast<double>(m.uordblks + m.hblkhd);
  };
  auto saved_per_token = [&](auto forward) {
    block->zero_grad();
    dense->zero_grad();
    x.mutable_grad() = at::Tensor();
    forward();  // a first call (its graph freed at once), so one-time allocations are not counted
    const double before = in_use();
    const at::Tensor y = forward();
    return (in_use() - before - static_cast<double>(y.nbytes())) / static_cast<double>(s.tokens);
  };
  const double ours_saved = saved_per_token([&] { return block(x)[0]; });
  const double dense_saved = saved_per_token([&] { return dense(x); });
  const double lora_saved = saved_per_token([&] { return lora_block(x)[0]; });

  std::printf(
      "Qwen3-MoE-shaped layer, forward + backward, CPU, %lld thread(s): %lld tokens, hidden %lld, "
      "%lld experts of width %lld, top-%lld (median of %lld)\n",
      static_cast<long long>(threads), static_cast<long long>(s.tokens), static_cast<long long>(s.hidden),
      static_cast<long long>(s.experts), static_cast<long long>(s.width), static_cast<long long>(s.top_k),
      static_cast<long long>(s.reps));
  std::printf("| implementation | ms | ours is x faster |\n|---|---|---|\n");
  std::printf("| ours: SparseMoeBlock (sorted experts) | %.1f | 1.00 |\n", ours);
  for (const auto& [name, ms] : hf) {
    std::printf("| transformers 5 Qwen3MoeSparseMoeBlock, %s | %.1f | %.2f |\n", name.c_str(), ms, ms / ours);
  }
  if (hf.empty()) std::printf("| transformers (Python) | not run (--no-python or no venv) | |\n");
  std::printf("| LibTorch port of transformers' eager loop | %.1f | %.2f |\n", eager_port, eager_port / ours);
  std::printf("| dense SwiGLU MLP, same active parameters (width %lld) | %.1f | %.2f (ours / dense = %.2f) |\n",
              static_cast<long long>(s.top_k * s.width), dense_ms, dense_ms / ours, ours / dense_ms);
  std::printf("| ours, .grad kept (a microbatch after the first) | %.1f | |\n", ours_kept);
  std::printf("| dense, .grad kept | %.1f | (ours / dense = %.2f) |\n", dense_kept, ours_kept / dense_kept);
  std::printf(
      "| ours, expert LoRA r%lld on both weights (frozen base, on the rows) | %.1f | (frozen base, no LoRA: %.1f) |\n",
      static_cast<long long>(lora_rank), lora_ms, frozen_ms);
  std::printf("minor page faults per forward + backward:");
  for (const auto& [name, count] : faults) std::printf(" %s %.0f;", name, count);
  std::printf("\n");
  // The memory model's counts (fp32, s = 4): sparse s 2 k I_e + 32 k + 8 E (the experts' x G^T |
  // x U^T rows; the routing's int64 indices, orders and rows, fp32 weights; the router's
  // probabilities), dense s 4 I.
  const double model_sparse = 4.0 * 2 * s.top_k * s.width + 32.0 * s.top_k + 8.0 * s.experts;
  std::printf("bytes per token kept for the backward: ours %.0f (memory model %.0f); dense %.0f (memory model %.0f)\n",
              ours_saved, model_sparse, dense_saved, 4.0 * 4 * s.top_k * s.width);
  // PEFT's materialized adapted weights would add the expert weights' size: E 3 I H floats.
  std::printf(
      "bytes per token kept for the backward, expert LoRA: %.0f (materializing the adapted weights, as "
      "PEFT does, would keep %.0f more)\n",
      lora_saved, 4.0 * s.experts * 3 * s.width * s.hidden / static_cast<double>(s.tokens));

  // Whole decoder layers, Qwen3-MoE's and Qwen3's (the same attention with the dense MLP), in
  // fp32 and bf16, and the sparse block alone. The layer input, allocated before, is added: the
  // model counts it.
  rm::ModelConfig layer_config = config;
  layer_config.num_attention_heads = 8;
  layer_config.num_key_value_heads = 4;
  layer_config.head_dim = s.hidden / 8;
  layer_config.max_position_embeddings = std::max<int64_t>(s.tokens, 2048);
  rm::ModelConfig dense_config = layer_config;
  dense_config.architecture = rm::Architecture::kQwen3;
  roundpipe::scheduler::TransformerShape shape;
  shape.vocab = 256;
  shape.hidden = s.hidden;
  shape.intermediate = s.top_k * s.width;
  shape.num_layers = 1;
  shape.heads = layer_config.num_attention_heads;
  shape.kv_heads = layer_config.num_key_value_heads;
  shape.head_dim = layer_config.head_dim;
  shape.qk_norm = true;
  shape.experts = s.experts;
  shape.experts_per_token = s.top_k;
  shape.moe_intermediate = s.width;
  roundpipe::scheduler::DeviceMemoryOptions options;
  options.seq_len = s.tokens;
  options.repeat_kv = true;  // CPU attention repeats k and v to the query heads
  std::printf("bytes per token kept for the backward, whole decoder layer (8 heads of %lld, 4 kv heads):\n",
              static_cast<long long>(layer_config.head_dim));
  for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    const auto tensor_options = at::TensorOptions().dtype(dtype);
    options.dtype_bytes = static_cast<int64_t>(c10::elementSize(dtype));
    const at::Tensor xl = x.detach().to(dtype).requires_grad_(true);
    const double input = static_cast<double>(options.dtype_bytes * s.hidden);
    rm::MoeDecoderLayer moe_layer(layer_config, 0, tensor_options);
    rm::init_weights(*moe_layer, 0.05);
    const double moe_measured = saved_per_token([&] { return moe_layer(xl, at::Tensor())[0]; }) + input;
    rm::DecoderLayer dense_layer(dense_config, 0, tensor_options);
    rm::init_weights(*dense_layer, 0.05);
    const double dense_measured = saved_per_token([&] { return dense_layer(xl); }) + input;
    rm::SparseMoeBlock moe_block(config, 0, tensor_options);
    rm::init_weights(*moe_block, 0.05);
    const double block_measured = saved_per_token([&] { return moe_block(xl)[0]; });
    std::printf("  %s: sparse block alone %.0f (memory model %.0f)\n", c10::toString(dtype), block_measured,
                static_cast<double>(options.dtype_bytes) * 2 * s.top_k * s.width + 32.0 * s.top_k + 8.0 * s.experts);
    shape.sparse_layers = {true};
    const auto moe_model = roundpipe::scheduler::layer_memory(shape, options)[1].saved_per_token;
    shape.sparse_layers = {false};
    const auto dense_model = roundpipe::scheduler::layer_memory(shape, options)[1].saved_per_token;
    std::printf("  %s: Qwen3-MoE layer %.0f (memory model %lld); Qwen3 layer %.0f (memory model %lld)\n",
                c10::toString(dtype), moe_measured, static_cast<long long>(moe_model), dense_measured,
                static_cast<long long>(dense_model));
  }
  return 0;
}
