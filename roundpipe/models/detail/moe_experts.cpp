#include "roundpipe/models/detail/moe_experts.h"

#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/index_add.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/sigmoid.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/silu_backward.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <c10/util/Exception.h>
#include <dlfcn.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <atomic>
#include <functional>
#include <mutex>
#include <numeric>

#include "base/thread_budget.h"
#include "roundpipe/models/detail/grad_in_place.h"

namespace roundpipe::models::detail {
namespace {

// A weight gradient [E, ...] like `weight`, whose slices the backward overwrites for every expert
// with rows: only the slices of experts without rows are zeroed (a full zero fill of the expert
// weights' size cost ~15 ms of a ~280 ms layer; docs/benchmarks.md, "Mixture of experts").
at::Tensor expert_grad(const at::Tensor& weight, const std::vector<int64_t>& counts) {
  at::Tensor grad = at::empty_like(weight, at::MemoryFormat::Contiguous);
  for (size_t e = 0; e < counts.size(); ++e) {
    if (counts[e] == 0) grad[static_cast<int64_t>(e)].zero_();
  }
  return grad;
}

// Note [Expert gradients in place]: autograd hands an expert weight one [E, ...] gradient per
// backward pass and adds it into the weight's .grad (AccumulateGrad: grad += new). With several
// microbatches the .grad exists from the second on, and that whole fresh tensor (the layer's
// expert weights' size: 8x the dense layer's, 75 MB at moe_bench's shape) cost a page-faulting
// allocation and a second pass per microbatch, and existed beside the .grad (on a GPU, a layer's
// expert gradients twice: 1.6 GB more for one bf16 gpt-oss-20b layer). When the .grad may take it
// in place (grad_to_add_into in grad_in_place.h: a leaf weight, a contiguous .grad of its dtype,
// device and shape, no create_graph), the backward instead computes each expert's gradient into
// one reused scratch slice and adds it into the expert's slice of .grad: the same `old + new` per
// element, so the .grad is bitwise the one autograd would make (an expert without rows adds zero: -0
// becomes +0 as in grad += 0), and it returns no gradient for the weight. Otherwise (first
// microbatch, create_graph, LoRA's non-leaf sum, a .grad of another dtype) the whole gradient as
// before. As for the embedding (Note [Embedding gradient in place], token_embedding.cpp), hooks
// registered on the weight do not see the part added in place.

// The experts' gradient of one weight: written into `whole`[e] (returned to autograd), or into a
// scratch slice that finish(e) adds into `into`[e], the existing .grad (Note [Expert gradients in
// place]).
struct ExpertGrad {
  at::Tensor whole, into;
  std::vector<at::Tensor> scratch;  // one per task (Note [Experts in parallel on CPU])

  ExpertGrad(const torch::autograd::AutogradContext* ctx, size_t input, const at::Tensor& weight,
             const std::vector<int64_t>& counts, int64_t tasks)
      : into(ctx->needs_input_grad(input) ? grad_to_add_into(weight, weight.scalar_type(), weight.device())
                                          : at::Tensor()) {
    if (into.defined()) {
      for (int64_t t = 0; t < tasks; ++t) scratch.push_back(at::empty(weight.sizes().slice(1), weight.options()));
      for (size_t e = 0; e < counts.size(); ++e) {
        if (counts[e] == 0) into[static_cast<int64_t>(e)].add_(0);  // what grad += new does to it
      }
    } else if (ctx->needs_input_grad(input)) {
      whole = expert_grad(weight, counts);
    }
  }
  bool defined() const { return whole.defined() || into.defined(); }
  // Where expert e's gradient is written by task `task`.
  at::Tensor target(int64_t e, int64_t task) const {
    return into.defined() ? scratch[static_cast<size_t>(task)] : whole[e];
  }
  // After target(e, task) is written.
  void finish(int64_t e, int64_t task) const {
    if (into.defined()) into[e].add_(scratch[static_cast<size_t>(task)]);
  }
};

// Note [Routing weights in the experts]: the experts multiply each row of their output by its
// routing weight (`row_weights` [M], optional) inside the per-expert loop, as transformers
// multiplies an expert's output by top_k_weights: y = (y_u.to(w) * w).to(x), in w's dtype (fp32
// for Mixtral's products, else the model's), and add the weighted rows into their tokens there.
// In the backward the weight's gradient sum(g * y_u) is taken as rowsum((g D) * act), where
// y_u = act D^T, so the unweighted rows are never kept: g D [n, I] is the GEMM the SwiGLU
// derivative needs anyway (d_act = w (g D)), and D's gradient is g^T (w act). gpt-oss's
// y_u = glu D + d (D stored [I, H]) adds g d: rowsum((g D^T) * glu) + g d.

// Note [Experts in parallel on CPU]: an expert's GEMMs are small (rows ~ tokens k / E), and a
// small GEMM scales badly over threads: at moe_bench's shape (2048 tokens, 64 experts of width
// 192, top-8) the 448 GEMMs of a forward + backward took 317 ms with MKL on 2 threads each and
// 342 ms on 1, but 157 ms when two threads each ran half the experts on one thread (a 2-core
// Xeon VM, 2026-12-03). So on CPU the experts run in parallel, one thread per expert, on an
// OpenMP team of the caller's intra-op threads: the team LibTorch's own kernels use (libgomp's
// GOMP_parallel, what `#pragma omp parallel` compiles to, found at run time in the OpenMP runtime
// LibTorch loaded; this library is not compiled with OpenMP: Note [Why not at::parallel_for] in
// optim/detail/parallel_tasks.h). Inside the team's region ATen's kernels and MKL run on their
// calling thread (nested regions get one thread), and no other thread competes for the cores: a
// pool of threads of our own beside the team was slower than the serial loop (the team's
// threads spin after each region; 293 against 251 ms). Each team thread takes the caller's
// thread-local state (grad mode, dispatch keys: at::ThreadLocalStateGuard) and the next expert of
// the group from a shared counter.
// Results stay bitwise those of the serial loop with one intra-op thread: every expert is
// computed alone on one thread, whichever it is, and what experts share is added in expert order
// on the caller. The experts are taken in groups of consecutive experts of at most max(tokens,
// largest count) rows; a group's experts write their output rows (forward) or input-row
// gradients (backward) into a buffer of the group's rows, which the caller then adds into the
// tokens with one index_add_ in row order: per token the same sums in the same order as one
// index_add_ per expert (CPU index_add_ adds an index's rows in order). So the extra memory is one
// buffer of at most max(tokens, largest count) rows of H, the output's size, never [M, H]. Each
// thread has its own weight-gradient scratch (Note [Expert gradients in place]); everything else
// an expert writes is its own slice. On CUDA, inside a parallel region and with one thread the
// loop is serial, each expert its own group (CUDA's index_add_ of one expert's rows, whose tokens
// are distinct, stays deterministic; a group's repeated tokens would make it depend on the order
// of atomic adds).

// libgomp's entry points, from the OpenMP runtime LibTorch already loaded (Note [Experts in
// parallel on CPU]); null without one.
struct Gomp {
  void (*parallel)(void (*)(void*), void*, unsigned, unsigned) = nullptr;  // what `#pragma omp parallel` calls
  int (*thread_num)() = nullptr;
  bool available() const { return parallel != nullptr && thread_num != nullptr; }
};

const Gomp& gomp() {
  static const Gomp kGomp = [] {
    Gomp g;
    g.parallel =
        reinterpret_cast<void (*)(void (*)(void*), void*, unsigned, unsigned)>(dlsym(RTLD_DEFAULT, "GOMP_parallel"));
    g.thread_num = reinterpret_cast<int (*)()>(dlsym(RTLD_DEFAULT, "omp_get_thread_num"));
    return g;
  }();
  return kGomp;
}

// Runs fn(thread) on each thread of an OpenMP team of at most `tasks` threads (the caller is
// thread 0), as `#pragma omp parallel num_threads(tasks)` would; rethrows the first exception.
void run_team(int64_t tasks, const std::function<void(int64_t)>& fn) {
  struct Shared {
    const std::function<void(int64_t)>* fn;
    std::mutex mutex;
    std::exception_ptr error;  // guarded by mutex
  } shared{&fn, {}, {}};
  gomp().parallel(
      [](void* data) {
        auto* s = static_cast<Shared*>(data);
        try {
          (*s->fn)(gomp().thread_num());
        } catch (...) {
          std::lock_guard<std::mutex> lock(s->mutex);
          if (!s->error) s->error = std::current_exception();
        }
      },
      &shared, static_cast<unsigned>(tasks), 0);
  if (shared.error) std::rethrow_exception(shared.error);
}

// Threads for the experts of x's device: 1 on a GPU, inside a parallel region or without
// libgomp, else ATen's intra-op threads (capped by the caller's base::thread_budget) and at most
// the experts with rows.
int64_t expert_tasks(const at::Tensor& x, const std::vector<int64_t>& counts) {
  if (!x.device().is_cpu() || !gomp().available() || at::in_parallel_region()) return 1;
  int64_t threads = at::get_num_threads();
  if (base::thread_budget() > 0) threads = std::min(threads, base::thread_budget());
  const auto with_rows = std::count_if(counts.begin(), counts.end(), [](int64_t n) { return n > 0; });
  return std::max<int64_t>(1, std::min<int64_t>(threads, with_rows));
}

// One expert's rows: expert e, rows [offset, offset + n) of the sorted rows, `local` their first
// row in the group's buffer, `task` the thread's index (< tasks).
struct ExpertRows {
  int64_t e, offset, n, local, task;
};

// The most rows a group of experts has (the group buffer's rows): with several tasks
// max(tokens, the largest count), serially the largest count (each expert its own group).
int64_t expert_group_rows(const std::vector<int64_t>& counts, int64_t tokens, int64_t tasks) {
  const int64_t largest = counts.empty() ? 0 : *std::max_element(counts.begin(), counts.end());
  return tasks > 1 ? std::max(tokens, largest) : largest;
}

// Runs expert(rows) for every expert with rows, in groups of consecutive experts of at most
// `group_rows` rows (one expert alone may be the group), then combine(begin, rows) on the caller
// for the group's sorted rows [begin, begin + rows) (Note [Experts in parallel on CPU]): with
// tasks > 1 a group's experts on `tasks` threads, with tasks == 1 serially, each expert its own
// group.
void for_each_expert(const std::vector<int64_t>& counts, int64_t tasks, int64_t group_rows,
                     const std::function<void(const ExpertRows&)>& expert,
                     const std::function<void(int64_t, int64_t)>& combine) {
  const size_t experts = counts.size();
  std::vector<int64_t> offsets(experts + 1, 0);
  for (size_t e = 0; e < experts; ++e) offsets[e + 1] = offsets[e] + counts[e];
  size_t first = 0;
  while (first < experts) {
    // the group: experts [first, last), at least one, at most group_rows rows unless one alone exceeds it
    size_t last = first + 1;
    while (tasks > 1 && last < experts && offsets[last + 1] - offsets[first] <= group_rows) ++last;
    const int64_t begin = offsets[first], rows = offsets[last] - begin;
    if (rows > 0) {
      if (tasks <= 1) {
        expert({static_cast<int64_t>(first), begin, rows, 0, 0});
      } else {
        std::atomic<size_t> next{first};
        const at::ThreadLocalState state;
        run_team(tasks, [&](int64_t task) {
          const at::ThreadLocalStateGuard guard(state);
          for (size_t e = next++; e < last; e = next++) {
            if (counts[e] > 0) expert({static_cast<int64_t>(e), offsets[e], counts[e], offsets[e] - begin, task});
          }
        });
      }
      combine(begin, rows);
    }
    first = last;
  }
}

// One expert's rows of a token-indexed tensor: rows token_of_row[offset .. offset + n) of `t`.
at::Tensor gather_rows(const at::Tensor& t, const at::Tensor& token_of_row, int64_t offset, int64_t n) {
  return t.index_select(0, token_of_row.narrow(0, offset, n));
}

// Each row's output times its routing weight in the weights' dtype, cast back to the rows'
// (Note [Routing weights in the experts]), in place.
void weigh(at::Tensor& ye, const at::Tensor& row_weights, int64_t offset, int64_t n) {
  if (!row_weights.defined()) return;
  const at::Tensor w = row_weights.narrow(0, offset, n).unsqueeze(1);
  if (w.scalar_type() == ye.scalar_type()) {
    ye.mul_(w);
  } else {
    ye.copy_((ye.to(w.scalar_type()) * w).to(ye.scalar_type()));
  }
}

// A custom autograd function takes no undefined tensor (its VariableInfo needs a device): an
// absent optional tensor (row weights, LoRA factors) goes in as an empty one and is undefined
// again inside. (With no rows at all, empty row weights change nothing.)
at::Tensor or_empty(const at::Tensor& t, const at::Tensor& like) { return t.defined() ? t : like.new_empty({0}); }
at::Tensor none_if_empty(const at::Tensor& t) { return t.numel() > 0 ? t : at::Tensor(); }

// The factors a custom function got (empty ones: none).
ExpertLora lora_of(const at::Tensor& a, const at::Tensor& b, double scaling) {
  return a.numel() > 0 ? ExpertLora{a, b, scaling} : ExpertLora{};
}

// Note [Expert LoRA on the rows] (moe_experts.h): out [n, out] += scaling (rows A_e^T) B_e^T.
void lora_forward(const ExpertLora& l, const at::Tensor& rows, int64_t e, at::Tensor& out) {
  if (l.defined()) out.addmm_(at::mm(rows, l.a[e].t()), l.b[e].t(), 1, l.scaling);
}

// The factors' gradients of one weight, [E, r, in] and [E, out, r] (zero for experts without
// rows), each only if it is needed.
struct LoraGrads {
  at::Tensor a, b;
  LoraGrads(const torch::autograd::AutogradContext* ctx, size_t a_input, size_t b_input, const ExpertLora& l) {
    if (!l.defined()) return;
    if (ctx->needs_input_grad(a_input)) a = at::zeros_like(l.a, at::MemoryFormat::Contiguous);
    if (ctx->needs_input_grad(b_input)) b = at::zeros_like(l.b, at::MemoryFormat::Contiguous);
  }
};

// Expert e's LoRA backward of one weight, whose output rows have the gradient d [n, out] and
// whose input rows were `rows` [n, in]: d B_e [n, r] (the input rows' LoRA gradient is
// scaling (d B_e) A_e: lora_input_grad), dA_e = scaling (d B_e)^T rows, dB_e = scaling d^T (rows
// A_e^T), as autograd through PEFT's W + scaling B A would give them.
at::Tensor lora_d_b(const ExpertLora& l, const at::Tensor& d, int64_t e) {
  return l.defined() ? at::mm(d, l.b[e]) : at::Tensor();
}
void lora_input_grad(const ExpertLora& l, const at::Tensor& d_b, int64_t e, at::Tensor& d_rows) {
  if (l.defined()) d_rows.addmm_(d_b, l.a[e], 1, l.scaling);
}
void lora_weight_grads(const ExpertLora& l, const at::Tensor& d, const at::Tensor& d_b, const at::Tensor& rows,
                       int64_t e, LoraGrads& grads) {
  if (grads.a.defined()) grads.a[e].copy_(at::mm(d_b.t(), rows).mul_(l.scaling));
  if (grads.b.defined()) grads.b[e].copy_(at::mm(d.t(), at::mm(rows, l.a[e].t())).mul_(l.scaling));
}

// out [N, H] += each expert's (weighted) output rows, added into their tokens expert by expert;
// `gate_up_rows` [M, 2I] receives x G^T | x U^T when defined.
void experts_forward(const at::Tensor& x, const at::Tensor& token_of_row, const at::Tensor& gate_up,
                     const at::Tensor& down, const std::vector<int64_t>& counts, const at::Tensor& row_weights,
                     const ExpertLora& gate_up_lora, const ExpertLora& down_lora, at::Tensor& out,
                     const at::Tensor& gate_up_rows) {
  const int64_t inter = down.size(2);
  const int64_t tasks = expert_tasks(x, counts);
  const int64_t group_rows = expert_group_rows(counts, x.size(0), tasks);
  const at::Tensor y = at::empty({group_rows, out.size(1)}, x.options());  // a group's output rows
  for_each_expert(
      counts, tasks, group_rows,
      [&](const ExpertRows& r) {
        const at::Tensor xe = gather_rows(x, token_of_row, r.offset, r.n);
        at::Tensor gu =
            gate_up_rows.defined() ? gate_up_rows.narrow(0, r.offset, r.n) : at::empty({r.n, 2 * inter}, x.options());
        at::mm_out(gu, xe, gate_up[r.e].t());
        lora_forward(gate_up_lora, xe, r.e, gu);
        const at::Tensor act = at::silu(gu.narrow(1, 0, inter)) * gu.narrow(1, inter, inter);
        at::Tensor ye = y.narrow(0, r.local, r.n);
        at::mm_out(ye, act, down[r.e].t());
        lora_forward(down_lora, act, r.e, ye);
        weigh(ye, row_weights, r.offset, r.n);
      },
      [&](int64_t begin, int64_t rows) {
        out.index_add_(0, token_of_row.narrow(0, begin, rows), y.narrow(0, 0, rows));
      });
}

class SwigluExperts : public torch::autograd::Function<SwigluExperts> {
 public:
  // `row_weights`: undefined, or [M] (Note [Routing weights in the experts]).
  // Arguments 6-11: the LoRA factors of gate_up and down and their scalings (Note [Expert LoRA on
  // the rows]; empty tensors without, as row_weights: or_empty).
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& token_of_row,
                            const at::Tensor& gate_up, const at::Tensor& down, const at::Tensor& row_weights,
                            const std::vector<int64_t>& counts, const at::Tensor& gate_up_a,
                            const at::Tensor& gate_up_b, const at::Tensor& down_a, const at::Tensor& down_b,
                            double gate_up_scaling, double down_scaling) {
    const ExpertLora gate_up_lora = lora_of(gate_up_a, gate_up_b, gate_up_scaling);
    const ExpertLora down_lora = lora_of(down_a, down_b, down_scaling);
    at::Tensor out = at::zeros({x.size(0), x.size(1)}, x.options());
    at::Tensor gate_up_rows = at::empty({token_of_row.size(0), 2 * down.size(2)}, x.options());
    experts_forward(x, token_of_row, gate_up, down, counts, none_if_empty(row_weights), gate_up_lora, down_lora, out,
                    gate_up_rows);
    ctx->save_for_backward(
        {x, token_of_row, gate_up, down, gate_up_rows, row_weights, gate_up_a, gate_up_b, down_a, down_b});
    ctx->saved_data["counts"] = counts;
    ctx->saved_data["gate_up_scaling"] = gate_up_scaling;
    ctx->saved_data["down_scaling"] = down_scaling;
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const at::Tensor& token_of_row = saved[1];
    const at::Tensor& gate_up = saved[2];
    const at::Tensor& down = saved[3];
    const at::Tensor& gate_up_rows = saved[4];
    const at::Tensor row_weights = none_if_empty(saved[5]);
    const ExpertLora gate_up_lora = lora_of(saved[6], saved[7], ctx->saved_data["gate_up_scaling"].toDouble());
    const ExpertLora down_lora = lora_of(saved[8], saved[9], ctx->saved_data["down_scaling"].toDouble());
    // needs_input_grad counts the tensor arguments only (counts is not one)
    LoraGrads gate_up_lora_grads(ctx, 5, 6, gate_up_lora);
    LoraGrads down_lora_grads(ctx, 7, 8, down_lora);
    const std::vector<int64_t> counts = ctx->saved_data["counts"].toIntVector();
    const at::Tensor grad_out = grad_outputs.at(0).contiguous();
    const int64_t inter = down.size(2);
    at::Tensor grad_x = ctx->needs_input_grad(0) ? at::zeros_like(x, at::MemoryFormat::Contiguous) : at::Tensor();
    const int64_t tasks = expert_tasks(x, counts);
    const int64_t group_rows = expert_group_rows(counts, x.size(0), tasks);
    const ExpertGrad grad_gate_up(ctx, 2, gate_up, counts, tasks);
    const ExpertGrad grad_down(ctx, 3, down, counts, tasks);
    at::Tensor grad_weights =
        row_weights.defined() && ctx->needs_input_grad(4) ? at::empty_like(row_weights) : at::Tensor();
    // bf16/fp16: the elementwise SwiGLU derivative in fp32 (autograd's silu_backward computes in
    // fp32 too), the products in the model's dtype.
    const bool low_precision = x.scalar_type() != at::kFloat && x.scalar_type() != at::kDouble;
    const at::ScalarType compute = low_precision ? at::kFloat : x.scalar_type();
    // a group's input-row gradients (Note [Experts in parallel on CPU])
    const at::Tensor dx = grad_x.defined() ? at::empty({group_rows, x.size(1)}, x.options()) : at::Tensor();
    for_each_expert(
        counts, tasks, group_rows,
        [&](const ExpertRows& r) {
          const int64_t e = r.e, offset = r.offset, n = r.n;
          const at::Tensor g = gather_rows(grad_out, token_of_row, offset, n);  // [n, H]
          const at::Tensor gu = gate_up_rows.narrow(0, offset, n);
          const at::Tensor gate = gu.narrow(1, 0, inter).to(compute);
          const at::Tensor up = gu.narrow(1, inter, inter).to(compute);
          const at::Tensor silu = at::silu(gate);
          // transformers computes act(gate) * up in the model's dtype: the same rounding here.
          at::Tensor act = low_precision ? at::silu(gu.narrow(1, 0, inter)) * gu.narrow(1, inter, inter) : silu * up;
          at::Tensor d_act = at::mm(g, down[e]);  // g D [n, I]
          const at::Tensor g_down_b = lora_d_b(down_lora, g, e);
          lora_input_grad(down_lora, g_down_b, e, d_act);
          d_act = d_act.to(compute);
          if (row_weights.defined()) {
            const at::Tensor w = row_weights.narrow(0, offset, n);
            const at::Tensor wc = w.to(compute).unsqueeze(1);
            if (grad_weights.defined()) {
              at::Tensor gw = grad_weights.narrow(0, offset, n);
              gw.copy_((d_act * act.to(compute)).sum(1));
            }
            d_act.mul_(wc);
            act = (act.to(compute) * wc).to(x.scalar_type());
          }
          if (grad_down.defined()) {
            at::Tensor gd = grad_down.target(e, r.task);
            at::mm_out(gd, g.t(), act);
            grad_down.finish(e, r.task);
          }
          if (down_lora.defined()) lora_weight_grads(down_lora, g, g_down_b, act, e, down_lora_grads);
          at::Tensor d_gu = at::empty({n, 2 * inter}, gate.options());
          at::Tensor d_gate = d_gu.narrow(1, 0, inter);
          at::Tensor d_up = d_gu.narrow(1, inter, inter);
          // silu_backward: g sig (1 + x (1 - sig)), fused, each writing its half of d_gu.
          at::silu_backward_out(d_gate, d_act * up, gate);
          at::mul_out(d_up, d_act, silu);
          if (low_precision) d_gu = d_gu.to(x.scalar_type());
          const at::Tensor xe =
              grad_gate_up.defined() || gate_up_lora.defined() ? gather_rows(x, token_of_row, offset, n) : at::Tensor();
          if (grad_gate_up.defined()) {
            at::Tensor gg = grad_gate_up.target(e, r.task);
            at::mm_out(gg, d_gu.t(), xe);
            grad_gate_up.finish(e, r.task);
          }
          const at::Tensor d_gu_b = lora_d_b(gate_up_lora, d_gu, e);
          if (gate_up_lora.defined()) lora_weight_grads(gate_up_lora, d_gu, d_gu_b, xe, e, gate_up_lora_grads);
          if (grad_x.defined()) {
            at::Tensor dxe = dx.narrow(0, r.local, n);
            at::mm_out(dxe, d_gu, gate_up[e]);
            lora_input_grad(gate_up_lora, d_gu_b, e, dxe);
          }
        },
        [&](int64_t begin, int64_t rows) {
          if (grad_x.defined()) grad_x.index_add_(0, token_of_row.narrow(0, begin, rows), dx.narrow(0, 0, rows));
        });
    return {grad_x,       at::Tensor(),         grad_gate_up.whole,   grad_down.whole,   grad_weights,
            at::Tensor(), gate_up_lora_grads.a, gate_up_lora_grads.b, down_lora_grads.a, down_lora_grads.b,
            at::Tensor(), at::Tensor()};
  }
};

// gpt-oss: one expert's rows. `h` = x W + b [n, 2I] (kept for the backward); returns the GLU output.
at::Tensor clamped_glu(const at::Tensor& h, double alpha, double limit) {
  const at::Tensor gate = h.slice(1, 0, h.size(1), 2).clamp_max(limit);
  const at::Tensor up = h.slice(1, 1, h.size(1), 2).clamp(-limit, limit);
  const at::Tensor glu = gate * at::sigmoid(gate * alpha);
  return (up + 1) * glu;
}

void clamped_forward(const at::Tensor& x, const at::Tensor& token_of_row, const at::Tensor& gate_up,
                     const at::Tensor& gate_up_bias, const at::Tensor& down, const at::Tensor& down_bias,
                     const std::vector<int64_t>& counts, double alpha, double limit, const at::Tensor& row_weights,
                     const ExpertLora& gate_up_lora, const ExpertLora& down_lora, at::Tensor& out,
                     const at::Tensor& gate_up_rows) {
  const int64_t width = gate_up.size(2);
  const int64_t tasks = expert_tasks(x, counts);
  const int64_t group_rows = expert_group_rows(counts, x.size(0), tasks);
  const at::Tensor y = at::empty({group_rows, out.size(1)}, x.options());  // a group's output rows
  for_each_expert(
      counts, tasks, group_rows,
      [&](const ExpertRows& r) {
        const int64_t e = r.e, offset = r.offset, n = r.n;
        at::Tensor h = gate_up_rows.defined() ? gate_up_rows.narrow(0, offset, n) : at::empty({n, width}, x.options());
        // transformers: x @ W + b (a product, then the bias added).
        const at::Tensor xe = gather_rows(x, token_of_row, offset, n);
        at::mm_out(h, xe, gate_up[e]);
        lora_forward(gate_up_lora, xe, e, h);
        h.add_(gate_up_bias[e]);
        const at::Tensor glu = clamped_glu(h, alpha, limit);
        at::Tensor ye = y.narrow(0, r.local, n);
        at::mm_out(ye, glu, down[e]);
        lora_forward(down_lora, glu, e, ye);
        ye.add_(down_bias[e]);
        weigh(ye, row_weights, offset, n);
      },
      [&](int64_t begin, int64_t rows) {
        out.index_add_(0, token_of_row.narrow(0, begin, rows), y.narrow(0, 0, rows));
      });
}

class ClampedGluExperts : public torch::autograd::Function<ClampedGluExperts> {
 public:
  // Arguments 10-15: the LoRA factors and scalings, as SwigluExperts' 6-11.
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& token_of_row,
                            const at::Tensor& gate_up, const at::Tensor& gate_up_bias, const at::Tensor& down,
                            const at::Tensor& down_bias, const at::Tensor& row_weights,
                            const std::vector<int64_t>& counts, double alpha, double limit, const at::Tensor& gate_up_a,
                            const at::Tensor& gate_up_b, const at::Tensor& down_a, const at::Tensor& down_b,
                            double gate_up_scaling, double down_scaling) {
    const ExpertLora gate_up_lora = lora_of(gate_up_a, gate_up_b, gate_up_scaling);
    const ExpertLora down_lora = lora_of(down_a, down_b, down_scaling);
    at::Tensor out = at::zeros({x.size(0), down.size(2)}, x.options());
    at::Tensor rows = at::empty({token_of_row.size(0), gate_up.size(2)}, x.options());
    clamped_forward(x, token_of_row, gate_up, gate_up_bias, down, down_bias, counts, alpha, limit,
                    none_if_empty(row_weights), gate_up_lora, down_lora, out, rows);
    ctx->save_for_backward(
        {x, token_of_row, gate_up, down, down_bias, rows, row_weights, gate_up_a, gate_up_b, down_a, down_b});
    ctx->saved_data["counts"] = counts;
    ctx->saved_data["gate_up_scaling"] = gate_up_scaling;
    ctx->saved_data["down_scaling"] = down_scaling;
    ctx->saved_data["alpha"] = alpha;
    ctx->saved_data["limit"] = limit;
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const at::Tensor& token_of_row = saved[1];
    const at::Tensor& gate_up = saved[2];
    const at::Tensor& down = saved[3];
    const at::Tensor& down_bias = saved[4];
    const at::Tensor& rows = saved[5];
    const at::Tensor row_weights = none_if_empty(saved[6]);
    const ExpertLora gate_up_lora = lora_of(saved[7], saved[8], ctx->saved_data["gate_up_scaling"].toDouble());
    const ExpertLora down_lora = lora_of(saved[9], saved[10], ctx->saved_data["down_scaling"].toDouble());
    // needs_input_grad counts the tensor arguments only (counts, alpha, limit are not)
    LoraGrads gate_up_lora_grads(ctx, 7, 8, gate_up_lora);
    LoraGrads down_lora_grads(ctx, 9, 10, down_lora);
    const std::vector<int64_t> counts = ctx->saved_data["counts"].toIntVector();
    const double alpha = ctx->saved_data["alpha"].toDouble();
    const double limit = ctx->saved_data["limit"].toDouble();
    const at::Tensor grad_out = grad_outputs.at(0).contiguous();
    const bool low_precision = x.scalar_type() != at::kFloat && x.scalar_type() != at::kDouble;
    const at::ScalarType compute = low_precision ? at::kFloat : x.scalar_type();
    const int64_t width = gate_up.size(2);
    at::Tensor grad_x = ctx->needs_input_grad(0) ? at::zeros_like(x, at::MemoryFormat::Contiguous) : at::Tensor();
    const int64_t tasks = expert_tasks(x, counts);
    const int64_t group_rows = expert_group_rows(counts, x.size(0), tasks);
    const ExpertGrad grad_gate_up(ctx, 2, gate_up, counts, tasks);
    at::Tensor grad_gate_up_bias =
        ctx->needs_input_grad(3) ? at::zeros({gate_up.size(0), width}, gate_up.options()) : at::Tensor();
    const ExpertGrad grad_down(ctx, 4, down, counts, tasks);
    at::Tensor grad_down_bias =
        ctx->needs_input_grad(5) ? at::zeros({down.size(0), down.size(2)}, down.options()) : at::Tensor();
    at::Tensor grad_weights =
        row_weights.defined() && ctx->needs_input_grad(6) ? at::empty_like(row_weights) : at::Tensor();
    // a group's input-row gradients (Note [Experts in parallel on CPU])
    const at::Tensor dx = grad_x.defined() ? at::empty({group_rows, x.size(1)}, x.options()) : at::Tensor();
    for_each_expert(
        counts, tasks, group_rows,
        [&](const ExpertRows& r) {
          const int64_t e = r.e, offset = r.offset, n = r.n;
          const at::Tensor g = gather_rows(grad_out, token_of_row, offset, n);  // [n, H]
          const at::Tensor h = rows.narrow(0, offset, n);
          at::Tensor glu = clamped_glu(h, alpha, limit);  // transformers' rounding of the GLU
          at::Tensor d_out = at::mm(g, down[e].t());      // g D^T [n, I]
          const at::Tensor g_down_b = lora_d_b(down_lora, g, e);
          lora_input_grad(down_lora, g_down_b, e, d_out);
          d_out = d_out.to(compute);
          at::Tensor gy = g;  // the gradient of the weighted rows
          if (row_weights.defined()) {
            // y = (y_u.to(w) * w).to(x), y_u = glu D + d: sum(g * y_u) = rowsum((g D^T) * glu) + g d.
            const at::Tensor wc = row_weights.narrow(0, offset, n).to(compute).unsqueeze(1);
            if (grad_weights.defined()) {
              at::Tensor gw = grad_weights.narrow(0, offset, n);
              gw.copy_((d_out * glu.to(compute)).sum(1) + at::mv(g.to(compute), down_bias[e].to(compute)));
            }
            d_out.mul_(wc);
            gy = (g.to(compute) * wc).to(x.scalar_type());
          }
          if (grad_down.defined()) {
            at::Tensor gd = grad_down.target(e, r.task);
            at::mm_out(gd, glu.t(), gy);
            grad_down.finish(e, r.task);
          }
          if (down_lora.defined()) {
            // the weighted rows' gradient gy through B: (g B) w, as gy = g w
            const at::Tensor gy_b = row_weights.defined() ? lora_d_b(down_lora, gy, e) : g_down_b;
            lora_weight_grads(down_lora, gy, gy_b, glu, e, down_lora_grads);
          }
          if (grad_down_bias.defined()) grad_down_bias[e].copy_(gy.sum(0));
          const at::Tensor hf = h.to(compute);
          const at::Tensor g_raw = hf.slice(1, 0, width, 2);
          const at::Tensor u_raw = hf.slice(1, 1, width, 2);
          const at::Tensor gc = g_raw.clamp_max(limit);
          const at::Tensor u = u_raw.clamp(-limit, limit);
          const at::Tensor sig = at::sigmoid(gc * alpha);
          // As torch's clamp backward: the gradient passes where min <= x <= max.
          const at::Tensor d_g = d_out * (u + 1) * (sig + gc * alpha * sig * (1 - sig)) * g_raw.le(limit);
          const at::Tensor d_u = d_out * (gc * sig) * u_raw.ge(-limit).logical_and(u_raw.le(limit));
          at::Tensor d_h = at::empty({n, width}, hf.options());
          d_h.slice(1, 0, width, 2).copy_(d_g);
          d_h.slice(1, 1, width, 2).copy_(d_u);
          if (low_precision) d_h = d_h.to(x.scalar_type());
          const at::Tensor xe =
              grad_gate_up.defined() || gate_up_lora.defined() ? gather_rows(x, token_of_row, offset, n) : at::Tensor();
          if (grad_gate_up.defined()) {
            at::Tensor gg = grad_gate_up.target(e, r.task);
            at::mm_out(gg, xe.t(), d_h);
            grad_gate_up.finish(e, r.task);
          }
          const at::Tensor d_h_b = lora_d_b(gate_up_lora, d_h, e);
          if (gate_up_lora.defined()) lora_weight_grads(gate_up_lora, d_h, d_h_b, xe, e, gate_up_lora_grads);
          if (grad_gate_up_bias.defined()) grad_gate_up_bias[e].copy_(d_h.sum(0));
          if (grad_x.defined()) {
            at::Tensor dxe = dx.narrow(0, r.local, n);
            at::mm_out(dxe, d_h, gate_up[e].t());
            lora_input_grad(gate_up_lora, d_h_b, e, dxe);
          }
        },
        [&](int64_t begin, int64_t rows) {
          if (grad_x.defined()) grad_x.index_add_(0, token_of_row.narrow(0, begin, rows), dx.narrow(0, 0, rows));
        });
    return {grad_x,
            at::Tensor(),
            grad_gate_up.whole,
            grad_gate_up_bias,
            grad_down.whole,
            grad_down_bias,
            grad_weights,
            at::Tensor(),
            at::Tensor(),
            at::Tensor(),
            gate_up_lora_grads.a,
            gate_up_lora_grads.b,
            down_lora_grads.a,
            down_lora_grads.b,
            at::Tensor(),
            at::Tensor()};
  }
};

// token_of_row int64 [M], counts summing to M, row_weights undefined or floating [M].
void check_rows(const at::Tensor& token_of_row, const std::vector<int64_t>& counts, const at::Tensor& row_weights) {
  TORCH_CHECK(token_of_row.dim() == 1 && token_of_row.scalar_type() == at::kLong,
              "experts: token_of_row must be int64 [M], got ", token_of_row.scalar_type(), " ", token_of_row.sizes());
  const int64_t rows = token_of_row.size(0);
  const int64_t total = std::accumulate(counts.begin(), counts.end(), int64_t{0});
  TORCH_CHECK(total == rows, "experts: the counts sum to ", total, " but token_of_row has ", rows, " rows");
  TORCH_CHECK(!row_weights.defined() || (row_weights.dim() == 1 && row_weights.size(0) == rows &&
                                         at::isFloatingType(row_weights.scalar_type())),
              "experts: row_weights must be floating [", rows, "], got ",
              row_weights.defined() ? c10::str(row_weights.sizes()) : std::string("undefined"));
}

// LoRA factors of a [E, out, in] (swiglu) or [E, in, out] (gpt-oss: `in_out`) weight.
void check_lora(const ExpertLora& l, const at::Tensor& weight, bool in_out, const char* name) {
  if (!l.defined()) return;
  const int64_t in = weight.size(in_out ? 1 : 2), out = weight.size(in_out ? 2 : 1);
  TORCH_CHECK(l.b.defined() && l.a.dim() == 3 && l.b.dim() == 3 && l.a.size(0) == weight.size(0) &&
                  l.b.size(0) == weight.size(0) && l.a.size(2) == in && l.b.size(1) == out &&
                  l.b.size(2) == l.a.size(1),
              "experts: the LoRA factors of ", name, " ", weight.sizes(), " must be A [E, r, ", in, "] and B [E, ", out,
              ", r], got ", l.a.sizes(), " and ", l.b.defined() ? c10::str(l.b.sizes()) : std::string("undefined"));
  TORCH_CHECK(l.a.scalar_type() == weight.scalar_type() && l.b.scalar_type() == weight.scalar_type(),
              "experts: the LoRA factors of ", name, " must have the weight's dtype ", weight.scalar_type());
}

bool requires_grad(const ExpertLora& l) { return l.defined() && (l.a.requires_grad() || l.b.requires_grad()); }

}  // namespace

at::Tensor clamped_glu_experts(const at::Tensor& x, const at::Tensor& token_of_row, const at::Tensor& gate_up,
                               const at::Tensor& gate_up_bias, const at::Tensor& down, const at::Tensor& down_bias,
                               const std::vector<int64_t>& counts, double alpha, double limit,
                               const at::Tensor& row_weights, const ExpertLora& gate_up_lora,
                               const ExpertLora& down_lora) {
  TORCH_CHECK(x.dim() == 2 && gate_up.dim() == 3 && down.dim() == 3 && gate_up_bias.dim() == 2 && down_bias.dim() == 2,
              "experts: expected x [N, H], gate_up [E, H, 2I], gate_up_bias [E, 2I], down [E, I, H], down_bias [E, H]");
  const int64_t experts = gate_up.size(0);
  TORCH_CHECK(static_cast<int64_t>(counts.size()) == experts && gate_up.size(1) == x.size(1) &&
                  gate_up.size(2) == 2 * down.size(1) && down.size(2) == x.size(1) &&
                  gate_up_bias.size(1) == gate_up.size(2) && down_bias.size(1) == down.size(2),
              "experts: inconsistent shapes x ", x.sizes(), ", gate_up ", gate_up.sizes(), ", down ", down.sizes());
  check_rows(token_of_row, counts, row_weights);
  check_lora(gate_up_lora, gate_up, /*in_out=*/true, "gate_up");
  check_lora(down_lora, down, /*in_out=*/true, "down");
  const at::Tensor xc = x.contiguous();
  const at::Tensor tc = token_of_row.contiguous();
  const at::Tensor wc = row_weights.defined() ? row_weights.contiguous() : row_weights;
  const bool records = at::GradMode::is_enabled() &&
                       (x.requires_grad() || gate_up.requires_grad() || gate_up_bias.requires_grad() ||
                        down.requires_grad() || down_bias.requires_grad() || (wc.defined() && wc.requires_grad()) ||
                        requires_grad(gate_up_lora) || requires_grad(down_lora));
  if (records) {
    return ClampedGluExperts::apply(xc, tc, gate_up, gate_up_bias, down, down_bias, or_empty(wc, xc), counts, alpha,
                                    limit, or_empty(gate_up_lora.a, xc), or_empty(gate_up_lora.b, xc),
                                    or_empty(down_lora.a, xc), or_empty(down_lora.b, xc), gate_up_lora.scaling,
                                    down_lora.scaling);
  }
  at::Tensor out = at::zeros({x.size(0), down.size(2)}, x.options());
  clamped_forward(xc, tc, gate_up, gate_up_bias, down, down_bias, counts, alpha, limit, wc, gate_up_lora, down_lora,
                  out, at::Tensor());
  return out;
}

at::Tensor swiglu_experts(const at::Tensor& x, const at::Tensor& token_of_row, const at::Tensor& gate_up,
                          const at::Tensor& down, const std::vector<int64_t>& counts, const at::Tensor& row_weights,
                          const ExpertLora& gate_up_lora, const ExpertLora& down_lora) {
  TORCH_CHECK(x.dim() == 2 && gate_up.dim() == 3 && down.dim() == 3, "experts: expected x [N, H], gate_up [E, 2I, H], ",
              "down [E, H, I], got ", x.sizes(), ", ", gate_up.sizes(), ", ", down.sizes());
  const int64_t experts = gate_up.size(0);
  TORCH_CHECK(down.size(0) == experts && static_cast<int64_t>(counts.size()) == experts &&
                  gate_up.size(1) == 2 * down.size(2) && gate_up.size(2) == x.size(1) && down.size(1) == x.size(1),
              "experts: inconsistent shapes x ", x.sizes(), ", gate_up ", gate_up.sizes(), ", down ", down.sizes(),
              ", ", counts.size(), " counts");
  check_rows(token_of_row, counts, row_weights);
  check_lora(gate_up_lora, gate_up, /*in_out=*/false, "gate_up");
  check_lora(down_lora, down, /*in_out=*/false, "down");
  const at::Tensor xc = x.contiguous();
  const at::Tensor tc = token_of_row.contiguous();
  const at::Tensor wc = row_weights.defined() ? row_weights.contiguous() : row_weights;
  const bool records = at::GradMode::is_enabled() && (x.requires_grad() || gate_up.requires_grad() ||
                                                      down.requires_grad() || (wc.defined() && wc.requires_grad()) ||
                                                      requires_grad(gate_up_lora) || requires_grad(down_lora));
  if (records) {
    return SwigluExperts::apply(xc, tc, gate_up, down, or_empty(wc, xc), counts, or_empty(gate_up_lora.a, xc),
                                or_empty(gate_up_lora.b, xc), or_empty(down_lora.a, xc), or_empty(down_lora.b, xc),
                                gate_up_lora.scaling, down_lora.scaling);
  }
  at::Tensor out = at::zeros({x.size(0), x.size(1)}, x.options());
  experts_forward(xc, tc, gate_up, down, counts, wc, gate_up_lora, down_lora, out, at::Tensor());
  return out;
}

int64_t expert_threads(const at::Tensor& x, const std::vector<int64_t>& counts) { return expert_tasks(x, counts); }

at::Tensor sorted_swiglu_experts(const at::Tensor& x, const at::Tensor& gate_up, const at::Tensor& down,
                                 const std::vector<int64_t>& counts, const at::Tensor& row_weights) {
  TORCH_CHECK(x.dim() == 2, "experts: expected x [M, H], got ", x.sizes());
  return swiglu_experts(x, at::arange(x.size(0), x.options().dtype(at::kLong)), gate_up, down, counts, row_weights);
}

}  // namespace roundpipe::models::detail
