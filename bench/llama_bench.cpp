// Training throughput of a Llama-style decoder (issue 6's GPU benchmark; a dedicated executable
// printing a table). Two runs side by side on the same model, data and device kind:
//   roundpipe: RoundPipe on every listed device, bf16 compute copies, fp32 master weights, bf16
//              master gradients and roundpipe::optim::Adam on the CPU, asynchronous step, full
//              recompute;
//   plain:     the whole model on one device in fp32 under bf16 autocast, torch::optim::AdamW on
//              that device, no recompute (the upper bound where the model fits).
// Reported per run: tokens/s, MFU, peak device memory (CUDA); for roundpipe, from the stage trace
// of the last iteration (roundpipe/stage_trace.h), the parameter upload bandwidth (bytes over the
// summed per-job upload spans) and the fraction of upload time hidden under compute on the same
// worker; and once the host->device bandwidth of one large pinned copy (the physical limit of
// parameter uploads); after the RoundPipe run, the process's peak host RSS and the training state
// (16 B/param) as a multiple of --mem-cap-gib. LLAMA_BENCH_TIMELINE=1 prints the per-job timeline.
//
// MFU counts model FLOPs, 6 x P per token for both runs (forward 2P + backward 4P; recompute is
// not model work: a backward stage's recompute adds 2P of hardware FLOPs per token for its
// layers, the fused stage recomputes nothing), P = parameters without the input embedding (a
// gather); attention's S^2 term is not counted. MFU = FLOPs/s / (--peak-tflops x 1e12), default
// 989 (H100 and H200 SXM dense bf16).
//
// Usage: llama_bench [--device cuda|cpu] [--hidden 2048] [--layers 16] [--heads 16] [--ffn 5632]
//                    [--vocab 32000] [--seq 2048] [--batch 8] [--micro 4] [--iters 4]
//                    [--mode both|roundpipe|plain] [--head chunked|full] [--mem-cap-gib 0]
//                    [--peak-tflops 989] [--plain-micro 1] [--optim-threads 0] [--recompute stage|layer] [--tiny]
// --recompute: RoundPipe's recompute grain in backward stages (RunConfig::recompute_grain); `layer`
// keeps one layer's activations at a time (long sequences).
// --optim-threads N: threads of RoundPipe's CPU Adam step (default 0: at::get_num_threads()).
// --plain-micro N: the plain loop accumulates gradients over N row chunks of the batch (for
// batches whose activations do not fit at once); default 1, the whole batch in one pass.
// Printed too: each timed iteration's wall time and, for roundpipe, the optimizer step's mean wall
// time on its CPU thread (the async step hides it while it is shorter than an iteration).
// --head: the RoundPipe run's loss: `chunked` (default) has the LM head compute it from the labels
// chunk by chunk (models::linear_cross_entropy; no [tokens, vocab] logits), `full` from full
// logits in loss_fn (as the plain loop always does).
// --tiny: hidden 64, 2 layers, 4 heads, ffn 128, vocab 256, seq 32, batch 4, 2 iterations on
// CPU devices (a smoke run, registered with CTest). --mem-cap-gib caps each GPU's caching
// allocator (per-process memory fraction) to mimic a smaller card, and sets RoundPipe's
// per-stage memory budget to a third of the cap.
#include <ATen/ATen.h>
#include <torch/torch.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>

#include "roundpipe/models/linear_cross_entropy.h"
#include "roundpipe/roundpipe.h"
#if ROUNDPIPE_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#endif

namespace {

namespace rp = roundpipe;
using Clock = std::chrono::steady_clock;

struct Config {
  std::string device = "cuda", mode = "both", head = "chunked", recompute = "stage";
  int64_t hidden = 2048, layers = 16, heads = 16, ffn = 5632, vocab = 32000, seq = 2048, batch = 8, micro = 4,
          iters = 4, plain_micro = 1, optim_threads = 0;
  double mem_cap_gib = 0, peak_tflops = 989;
};

// ---- The model: Embedding, decoder blocks, RMSNorm + LM head --------------------------------------

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps = 1e-5) {
  auto xf = x.to(torch::kFloat);
  return (xf * torch::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps)).to(x.scalar_type()) * weight;
}

// Rotary embedding on [batch, heads, seq, head_dim] (rotate-half form, base 10000).
torch::Tensor rope(const torch::Tensor& x) {
  const int64_t seq = x.size(2), half = x.size(3) / 2;
  auto opts = torch::TensorOptions().dtype(torch::kFloat).device(x.device());
  auto inv_freq = torch::pow(10000.0, -torch::arange(0, half, opts) / static_cast<double>(half));
  auto angles = torch::outer(torch::arange(seq, opts), inv_freq);  // [seq, half]
  auto cos = torch::cat({angles.cos(), angles.cos()}, -1).to(x.scalar_type());
  auto sin = torch::cat({angles.sin(), angles.sin()}, -1).to(x.scalar_type());
  auto rotated = torch::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
  return x * cos + rotated * sin;
}

struct DecoderBlockImpl : torch::nn::Cloneable<DecoderBlockImpl> {
  DecoderBlockImpl(int64_t hidden, int64_t heads, int64_t ffn) : hidden_(hidden), heads_(heads), ffn_(ffn) { reset(); }
  void reset() override {
    auto linear = [](int64_t in, int64_t out) { return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(false)); };
    attn_norm = register_parameter("attn_norm", torch::ones({hidden_}));
    mlp_norm = register_parameter("mlp_norm", torch::ones({hidden_}));
    wqkv = register_module("wqkv", linear(hidden_, 3 * hidden_));
    wo = register_module("wo", linear(hidden_, hidden_));
    w_gate = register_module("w_gate", linear(hidden_, ffn_));
    w_up = register_module("w_up", linear(hidden_, ffn_));
    w_down = register_module("w_down", linear(ffn_, hidden_));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    const int64_t b = x.size(0), s = x.size(1), hd = hidden_ / heads_;
    auto qkv = wqkv(rms_norm(x, attn_norm)).view({b, s, 3, heads_, hd}).permute({2, 0, 3, 1, 4});
    auto q = rope(qkv[0]), k = rope(qkv[1]), v = qkv[2];
    auto a = at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true);
    auto h = x + wo(a.transpose(1, 2).reshape({b, s, hidden_}));
    auto m = rms_norm(h, mlp_norm);
    return h + w_down(torch::silu(w_gate(m)) * w_up(m));
  }
  int64_t hidden_, heads_, ffn_;
  torch::Tensor attn_norm, mlp_norm;
  torch::nn::Linear wqkv{nullptr}, wo{nullptr}, w_gate{nullptr}, w_up{nullptr}, w_down{nullptr};
};
TORCH_MODULE(DecoderBlock);

struct LmHeadImpl : torch::nn::Cloneable<LmHeadImpl> {
  LmHeadImpl(int64_t hidden, int64_t vocab) : hidden_(hidden), vocab_(vocab) { reset(); }
  void reset() override {
    norm = register_parameter("norm", torch::ones({hidden_}));
    proj = register_module("proj", torch::nn::Linear(torch::nn::LinearOptions(hidden_, vocab_).bias(false)));
  }
  // With the labels (RoundPipe's label_to_last_layer, --head chunked): the summed token loss,
  // chunked over tokens (models::linear_cross_entropy), no logits materialized.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& labels = {}) {
    if (!labels.defined()) return proj(rms_norm(x, norm));
    return rp::models::linear_cross_entropy(rms_norm(x, norm), proj->weight, labels);
  }
  int64_t hidden_, vocab_;
  torch::Tensor norm;
  torch::nn::Linear proj{nullptr};

 protected:
  FORWARD_HAS_DEFAULT_ARGS({1, torch::nn::AnyValue(torch::Tensor())})
};
TORCH_MODULE(LmHead);

torch::nn::Sequential build_model(const Config& c) {
  torch::nn::Sequential model;
  model->push_back(torch::nn::Embedding(c.vocab, c.hidden));
  for (int64_t l = 0; l < c.layers; ++l) model->push_back(DecoderBlock(c.hidden, c.heads, c.ffn));
  model->push_back(LmHead(c.hidden, c.vocab));
  return model;
}

// Summed token cross-entropy over a microbatch divided by the batch's token count: the sum over
// microbatches is the batch mean.
rp::LossFn token_loss(int64_t vocab, int64_t tokens) {
  return [vocab, tokens](const torch::Tensor& logits, const torch::Tensor& labels) {
    return torch::nn::functional::cross_entropy(
               logits.reshape({-1, vocab}).to(torch::kFloat), labels.reshape({-1}),
               torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum)) /
           static_cast<double>(tokens);
  };
}

// ---- Measurements -----------------------------------------------------------------------------------

struct Result {
  std::string name;
  double tokens_per_s = 0, mfu = 0, peak_gib = 0, first_loss = 0, last_loss = 0;
  double upload_gbs = -1, upload_hidden = -1;  // roundpipe only, from the stage trace
  std::vector<double> iteration_ms;             // each timed iteration's wall time
  double step_ms = -1;  // roundpipe: mean optimizer step (Adam + zero_grad) on the optimizer thread
};

// Tokens per second of the median timed iteration: the steady state, without the first timed
// iteration's one-time costs (e.g. pinning the gradient buffers) or RoundPipe's final drain of the
// last asynchronous step, both of which `tokens/s` (all timed iterations, then the drain) includes.
double steady_tokens_per_s(const Result& r, const Config& c) {
  if (r.iteration_ms.empty()) return 0;
  auto ms = r.iteration_ms;
  std::sort(ms.begin(), ms.end());
  const double median = ms.size() % 2 == 1 ? ms[ms.size() / 2] : (ms[ms.size() / 2 - 1] + ms[ms.size() / 2]) / 2;
  return static_cast<double>(c.batch * c.seq) / (median * 1e-3);
}

void print_times(const Result& r) {
  std::printf("%s iterations (ms):", r.name.c_str());
  for (double ms : r.iteration_ms) std::printf(" %.1f", ms);
  if (r.step_ms >= 0) std::printf("; optimizer step on the CPU thread: %.1f ms per step", r.step_ms);
  std::printf("\n");
}

void sync_devices(const std::vector<c10::Device>& devices) {
#if ROUNDPIPE_WITH_CUDA
  for (const auto& d : devices) {
    if (d.is_cuda()) {
      c10::cuda::CUDAGuard guard(d.index());
      c10::cuda::device_synchronize();
    }
  }
#else
  (void)devices;
#endif
}

void reset_peak(const std::vector<c10::Device>& devices) {
#if ROUNDPIPE_WITH_CUDA
  for (const auto& d : devices) {
    if (d.is_cuda()) c10::cuda::CUDACachingAllocator::resetPeakStats(d.index());
  }
#else
  (void)devices;
#endif
}

double peak_gib(const std::vector<c10::Device>& devices) {
  double peak = 0;
#if ROUNDPIPE_WITH_CUDA
  for (const auto& d : devices) {
    if (!d.is_cuda()) continue;
    auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(d.index());
    const auto& reserved = stats.reserved_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)];
    peak = std::max(peak, static_cast<double>(reserved.peak) / (1 << 30));
  }
#else
  (void)devices;
#endif
  return peak;
}

// Host->device GB/s of one 1 GiB pinned copy (median of 5): the limit for parameter uploads.
double pinned_h2d_gbs(const c10::Device& device) {
#if ROUNDPIPE_WITH_CUDA
  if (!device.is_cuda()) return 0;
  c10::cuda::CUDAGuard guard(device.index());
  const int64_t bytes = int64_t{1} << 30;
  auto host = torch::empty({bytes}, torch::TensorOptions().dtype(torch::kUInt8).pinned_memory(true));
  auto dev = torch::empty({bytes}, torch::TensorOptions().dtype(torch::kUInt8).device(device));
  std::vector<double> gbs;
  for (int rep = 0; rep < 6; ++rep) {
    at::cuda::CUDAEvent start(cudaEventDefault), stop(cudaEventDefault);
    auto stream = c10::cuda::getCurrentCUDAStream(device.index());
    start.record(stream);
    dev.copy_(host, /*non_blocking=*/true);
    stop.record(stream);
    stop.synchronize();
    if (rep > 0) gbs.push_back(static_cast<double>(bytes) / (start.elapsed_time(stop) * 1e-3) / 1e9);
  }
  std::sort(gbs.begin(), gbs.end());
  return gbs[gbs.size() / 2];
#else
  (void)device;
  return 0;
#endif
}

// The process's peak resident host memory in GiB (Linux VmHWM), 0 where unknown.
double host_peak_rss_gib() {
  std::FILE* f = std::fopen("/proc/self/status", "r");
  if (f == nullptr) return 0;
  char line[256];
  long long kib = 0;
  while (std::fgets(line, sizeof line, f) != nullptr) {
    if (std::sscanf(line, "VmHWM: %lld kB", &kib) == 1) break;
  }
  std::fclose(f);
  return static_cast<double>(kib) / (1 << 20);
}

// build_model(c)'s parameter count, without building it (a model built only to count would raise
// the host's peak RSS by 4 B/param); checked against the built model by flop_params.
int64_t param_count(const Config& c, bool with_embedding) {
  const int64_t block = 2 * c.hidden + 4 * c.hidden * c.hidden + 3 * c.hidden * c.ffn;
  return (with_embedding ? c.vocab * c.hidden : 0) + c.layers * block + c.hidden + c.hidden * c.vocab;
}

// Parameters counted in FLOPs: all but layer 0, the input embedding (a gather).
int64_t flop_params(torch::nn::Sequential model, const Config& c) {
  int64_t n = 0;
  for (size_t l = 1; l < model->size(); ++l) {
    for (const auto& p : model[l]->parameters()) n += p.numel();
  }
  TORCH_INTERNAL_ASSERT(n == param_count(c, /*with_embedding=*/false), "llama_bench: param_count is off");
  return n;
}

struct Batch {
  torch::Tensor tokens, labels;
};

Batch make_batch(const Config& c, int64_t step) {
  torch::manual_seed(500 + step);
  auto tokens = torch::randint(c.vocab, {c.batch, c.seq + 1}, torch::kLong);
  return {tokens.narrow(1, 0, c.seq).contiguous(), tokens.narrow(1, 1, c.seq).contiguous()};
}

Result run_roundpipe(const Config& c, const std::vector<c10::Device>& devices) {
  torch::manual_seed(1);
  auto net = build_model(c);
  const int64_t p = flop_params(net, c);
  net->to(torch::kBFloat16);
  // bf16 gradients go to the optimizer uncast: no fp32 gradient buffers (4 B/param of host memory)
  // and no cast pass in the step (optim::Adam widens them in its own pass).
  auto options = rp::RoundPipeOptions()
                     .devices(devices)
                     .optim_dtype(torch::kFloat)
                     .master_grad_dtype(torch::kBFloat16)
                     .label_to_last_layer(c.head == "chunked")
                     .name("llama");
  // Under a memory cap the default budget (half the device's total memory) would ignore the cap:
  // give stages a third of it, leaving the rest for activations.
  if (c.mem_cap_gib > 0) options.device_memory_budget_bytes(static_cast<int64_t>(c.mem_cap_gib * (1 << 30) / 3));
  rp::RoundPipe model(net, options);
  auto optimizer = [&] {
    rp::OptimizerCtx ctx;
    return rp::optim::Adam(model.parameters(), rp::optim::AdamOptions(1e-4));
  }();
  if (c.optim_threads > 0) optimizer.set_num_threads(c.optim_threads);
  rp::RunConfig cfg;
  cfg.num_microbatch = c.micro;
  cfg.recompute_grain = c.recompute == "layer" ? rp::RecomputeGrain::kLayer : rp::RecomputeGrain::kStage;
  const double batch_tokens = static_cast<double>(c.batch * c.seq);
  const rp::LossFn loss_fn = c.head == "chunked"
                                 ? rp::LossFn([batch_tokens](const torch::Tensor& summed, const torch::Tensor&) {
                                     return summed / batch_tokens;
                                   })
                                 : token_loss(c.vocab, c.batch * c.seq);
  Result r;
  r.name = "roundpipe";
  double seconds = 0;
  std::atomic<int64_t> step_us{0}, steps{0};  // written by the optimizer thread
  for (int64_t it = 0; it <= c.iters; ++it) {  // iteration 0 warms up (allocator, shells)
    auto batch = make_batch(c, it);
    if (it == 1) {
      sync_devices(devices);
      reset_peak(devices);
    }
    // The last iteration is traced (roundpipe/stage_trace.h): upload bandwidth and overlap.
    if (it == c.iters) rp::trace::enable(true);
    const auto t0 = Clock::now();
    auto loss = model.forward_backward({batch.tokens}, batch.labels, loss_fn, cfg);
    model.step([&, it] {
      const auto s0 = Clock::now();
      optimizer.step();
      optimizer.zero_grad();
      if (it > 0) {
        step_us += std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - s0).count();
        ++steps;
      }
    });
    const double value = loss.item<double>();
    const double took = std::chrono::duration<double>(Clock::now() - t0).count();
    if (it > 0) seconds += took, r.iteration_ms.push_back(took * 1e3);
    if (it == 0) r.first_loss = value;
    r.last_loss = value;
  }
  const auto t_sync = Clock::now();
  model.synchronize();  // the last iteration's backward may still run (overlap_backward)
  seconds += std::chrono::duration<double>(Clock::now() - t_sync).count();
  rp::trace::enable(false);
  if (steps > 0) r.step_ms = static_cast<double>(step_us) / 1e3 / static_cast<double>(steps);
  const auto spans = rp::trace::collect();
  double bytes = 0, upload_ms = 0;
  for (const auto& s : spans) {
    bytes += static_cast<double>(s.upload_bytes);
    upload_ms += s.upload_end_ms - s.upload_begin_ms;
  }
  if (upload_ms > 0) r.upload_gbs = bytes / (upload_ms * 1e-3) / 1e9;
  r.upload_hidden = rp::trace::upload_overlap_fraction(spans);
  if (std::getenv("LLAMA_BENCH_TIMELINE") != nullptr) {
    std::printf("timeline of the last iteration (ms): job, worker, upload [begin, end], compute [begin, end], MB\n");
    for (const auto& s : spans) {
      std::printf("  %-24s %-6s %8.2f %8.2f %8.2f %8.2f %8.1f\n", s.job.c_str(), s.device.str().c_str(),
                  s.upload_begin_ms, s.upload_end_ms, s.compute_begin_ms, s.compute_end_ms,
                  static_cast<double>(s.upload_bytes) / 1e6);
    }
  }
  const double tokens = static_cast<double>(c.iters * c.batch * c.seq);
  r.tokens_per_s = tokens / seconds;
  r.mfu = 6.0 * static_cast<double>(p) * r.tokens_per_s / (c.peak_tflops * 1e12);
  r.peak_gib = peak_gib(devices);
  return r;
}

Result run_plain(const Config& c, const c10::Device& device) {
  torch::manual_seed(1);
  auto net = build_model(c);
  const int64_t p = flop_params(net, c);
  net->to(device);
  torch::optim::AdamW optimizer(net->parameters(), torch::optim::AdamWOptions(1e-4).weight_decay(0));
  const auto loss_fn = token_loss(c.vocab, c.batch * c.seq);
  Result r;
  r.name = "plain";
  double seconds = 0;
  for (int64_t it = 0; it <= c.iters; ++it) {
    auto batch = make_batch(c, it);
    if (it == 1) {
      sync_devices({device});
      reset_peak({device});
    }
    const auto t0 = Clock::now();
    optimizer.zero_grad();
    torch::Tensor loss = torch::zeros({}, torch::TensorOptions().device(device));
    // --plain-micro: gradient accumulation over row chunks (the same mean loss: token_loss divides
    // by the whole batch's tokens).
    const auto tokens = batch.tokens.to(device).chunk(c.plain_micro), labels = batch.labels.to(device).chunk(c.plain_micro);
    for (size_t m = 0; m < tokens.size(); ++m) {
      torch::Tensor part;
      {
        rp::amp::AutocastGuard autocast(device.type(), torch::kBFloat16);
        part = loss_fn(net->forward(tokens[m]), labels[m]);
      }
      part.backward();
      loss += part.detach();
    }
    optimizer.step();
    const double value = loss.item<double>();
    const double took = std::chrono::duration<double>(Clock::now() - t0).count();
    if (it > 0) seconds += took, r.iteration_ms.push_back(took * 1e3);
    if (it == 0) r.first_loss = value;
    r.last_loss = value;
  }
  const double tokens = static_cast<double>(c.iters * c.batch * c.seq);
  r.tokens_per_s = tokens / seconds;
  r.mfu = 6.0 * static_cast<double>(p) * r.tokens_per_s / (c.peak_tflops * 1e12);
  r.peak_gib = peak_gib({device});
  return r;
}

Config parse(int argc, char** argv) {
  Config c;
  std::map<std::string, int64_t*> ints = {{"--hidden", &c.hidden}, {"--layers", &c.layers}, {"--heads", &c.heads},
                                          {"--ffn", &c.ffn},       {"--vocab", &c.vocab},   {"--seq", &c.seq},
                                          {"--batch", &c.batch},   {"--micro", &c.micro},   {"--iters", &c.iters},
                                          {"--plain-micro", &c.plain_micro}, {"--optim-threads", &c.optim_threads}};
  for (int i = 1; i < argc; ++i) {
    const std::string key = argv[i];
    if (key == "--tiny") {
      c.device = "cpu";
      c.hidden = 64, c.layers = 2, c.heads = 4, c.ffn = 128, c.vocab = 256, c.seq = 32, c.batch = 4, c.iters = 2;
      continue;
    }
    TORCH_CHECK(i + 1 < argc, "llama_bench: ", key, " needs a value");
    const std::string value = argv[++i];
    if (ints.count(key)) {
      *ints[key] = std::stoll(value);
    } else if (key == "--device") {
      c.device = value;
    } else if (key == "--mode") {
      c.mode = value;
    } else if (key == "--head") {
      c.head = value;
    } else if (key == "--recompute") {
      c.recompute = value;
    } else if (key == "--mem-cap-gib") {
      c.mem_cap_gib = std::stod(value);
    } else if (key == "--peak-tflops") {
      c.peak_tflops = std::stod(value);
    } else {
      TORCH_CHECK(false, "llama_bench: unknown option ", key, " (see the usage in bench/llama_bench.cpp)");
    }
  }
  TORCH_CHECK(c.device == "cuda" || c.device == "cpu", "llama_bench: --device must be cuda or cpu, got ", c.device);
  TORCH_CHECK(c.mode == "both" || c.mode == "roundpipe" || c.mode == "plain",
              "llama_bench: --mode must be both, roundpipe or plain, got ", c.mode);
  TORCH_CHECK(c.recompute == "stage" || c.recompute == "layer", "llama_bench: --recompute must be stage or layer, got ",
              c.recompute);
  TORCH_CHECK(c.head == "chunked" || c.head == "full", "llama_bench: --head must be chunked or full, got ", c.head);
  TORCH_CHECK(c.plain_micro >= 1 && c.plain_micro <= c.batch, "llama_bench: --plain-micro must be in [1, --batch], got ",
              c.plain_micro);
  TORCH_CHECK(c.hidden % c.heads == 0 && (c.hidden / c.heads) % 2 == 0,
              "llama_bench: --hidden must be a multiple of --heads with an even head size");
  return c;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Config c = parse(argc, argv);
    std::vector<c10::Device> devices;
    if (c.device == "cuda") {
      const int64_t n = rp::cuda_device_count();
      if (n == 0) {
        std::printf("llama_bench: no CUDA device visible; run with --device cpu (or --tiny) here\n");
        return 0;
      }
      for (int64_t i = 0; i < n; ++i) devices.emplace_back(c10::kCUDA, static_cast<c10::DeviceIndex>(i));
#if ROUNDPIPE_WITH_CUDA
      if (c.mem_cap_gib > 0) {
        for (const auto& d : devices) {
          size_t free_bytes = 0, total_bytes = 0;
          c10::cuda::CUDAGuard guard(d.index());
          C10_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
          const double fraction = std::min(1.0, c.mem_cap_gib * (1 << 30) / static_cast<double>(total_bytes));
          (void)at::empty({1}, at::TensorOptions().device(d));  // the caching allocator must exist first
          c10::cuda::CUDACachingAllocator::setMemoryFraction(fraction, d.index());
        }
      }
#endif
    } else {
      devices.assign(2, c10::Device(c10::kCPU));
    }
    const int64_t total = param_count(c, /*with_embedding=*/true), counted = param_count(c, false);
    std::printf("llama_bench: %lld parameters (%lld in FLOP count), hidden %lld, %lld blocks, seq %lld, batch %lld "
                "(%lld microbatches), %zu x %s\n",
                static_cast<long long>(total), static_cast<long long>(counted),
                static_cast<long long>(c.hidden), static_cast<long long>(c.layers), static_cast<long long>(c.seq),
                static_cast<long long>(c.batch), static_cast<long long>(c.micro), devices.size(), c.device.c_str());
    if (devices[0].is_cuda()) {
      std::printf("pinned host->device copy (1 GiB): %.1f GB/s\n", pinned_h2d_gbs(devices[0]));
    }
    std::vector<Result> results;
    if (c.mode != "plain") {
      results.push_back(run_roundpipe(c, devices));
      // Host memory of the RoundPipe run (the scale limit once the GPU no longer is), and its
      // training state by the usual mixed-precision accounting (ZeRO: 16 B/param = 2 bf16
      // weights + 2 bf16 gradients + 12 fp32 master, m, v), as a multiple of the GPU cap.
      const double rss = host_peak_rss_gib();
      const double state_gib = 16.0 * static_cast<double>(total) / (1 << 30);
      std::printf("host memory (roundpipe): peak RSS %.1f GiB = %.1f B/param; training state at 16 B/param %.1f GiB",
                  rss, rss * (1 << 30) / static_cast<double>(total), state_gib);
      if (c.mem_cap_gib > 0) std::printf(" = %.2f x the %.0f GiB cap", state_gib / c.mem_cap_gib, c.mem_cap_gib);
      std::printf("\n");
    }
    if (c.mode != "roundpipe") results.push_back(run_plain(c, devices[0]));
    std::printf("%-10s %-12s %-8s %-14s %-12s %-12s %-14s %-14s %-14s\n", "run", "tokens/s", "MFU", "peak_mem_GiB",
                "loss_first", "loss_last", "upload_GB/s", "upload_hidden", "steady_tok/s");
    bool finite = true;
    for (const auto& r : results) {
      std::printf("%-10s %-12.1f %-8.3f %-14.2f %-12.4f %-12.4f %-14.2f %-14.2f %-14.1f\n", r.name.c_str(),
                  r.tokens_per_s, r.mfu, r.peak_gib, r.first_loss, r.last_loss, r.upload_gbs, r.upload_hidden,
                  steady_tokens_per_s(r, c));
      finite = finite && std::isfinite(r.first_loss) && std::isfinite(r.last_loss);
    }
    for (const auto& r : results) print_times(r);
    if (results.size() == 2) {
      std::printf("roundpipe / plain tokens/s: %.3f (steady state: %.3f)\n", results[0].tokens_per_s / results[1].tokens_per_s,
                  steady_tokens_per_s(results[0], c) / steady_tokens_per_s(results[1], c));
    }
    if (!finite) {
      std::fprintf(stderr, "llama_bench: a loss was not finite\n");
      return 1;
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "llama_bench: %s\n", e.what());
    return 1;
  }
}
