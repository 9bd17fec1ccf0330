#include "optim/adafactor.h"

#include <ATen/Parallel.h>
#include <c10/util/irange.h>
#include <torch/optim/serialize.h>
#include <torch/serialize/archive.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "base/thread_budget.h"
#include "optim/detail/parallel_tasks.h"
#include "optim/detail/step_inputs.h"

namespace roundpipe::optim {

namespace {

constexpr const char* kWho = "roundpipe::optim::Adafactor";

void check_options(const AdafactorOptions& o, const std::string& where) {
  TORCH_CHECK(o.lr() >= 0, kWho, ": invalid learning rate lr=", o.lr(), " in ", where, "; use lr >= 0");
  TORCH_CHECK(o.beta2_decay() <= 0, kWho, ": invalid beta2_decay=", o.beta2_decay(), " in ", where,
              "; use beta2_decay <= 0 (beta2 at step t is 1 - t^beta2_decay; torch's default is -0.8)");
  TORCH_CHECK(!o.eps1().has_value() || *o.eps1() >= 0, kWho, ": invalid eps1=", o.eps1().value_or(0), " in ", where,
              "; use eps1 >= 0, or leave it unset for float32's machine epsilon");
  TORCH_CHECK(o.eps2() >= 0, kWho, ": invalid eps2=", o.eps2(), " in ", where, "; use eps2 >= 0");
  TORCH_CHECK(o.d() >= 1.0, kWho, ": invalid clipping threshold d=", o.d(), " in ", where, "; use d >= 1");
  TORCH_CHECK(o.weight_decay() >= 0, kWho, ": invalid weight_decay=", o.weight_decay(), " in ", where,
              "; use weight_decay >= 0");
}

// Note [Adafactor blocks]: every sum (the norms of p and of the update, the row and column sums of
// g^2) is taken in double over blocks of fixed size, the blocks' partial sums added in block order;
// threads take whole blocks. So a step's result does not depend on the thread count, and the sums
// are at least as exact as torch's float reductions (the test's tolerance covers the difference).
// Within a run of elements the squares go into kLanes interleaved partial sums, combined in lane
// order (sum_squares): one serial chain of double additions per element was the step's bottleneck
// (a 4-cycle latency each, and no vectorizing a strictly ordered sum); the lanes vectorize.
constexpr int64_t kBlockElements = 16 * 1024;
constexpr int64_t kColumnBlock = 256;
// Elements per thread below which another thread does not pay (as detail::run_split).
constexpr int64_t kGrainElements = 32 * 1024;

// Runs fn(b) for blocks b in [0, blocks), `elements` in all, on up to `requested` threads
// (0: at::get_num_threads() capped by the thread budget, as detail::run_split).
template <typename Fn>
void for_blocks(int64_t blocks, int64_t elements, int64_t requested, const Fn& fn) {
  if (blocks <= 0) return;
  int64_t max_threads = requested > 0 ? requested : at::get_num_threads();
  if (requested == 0 && base::thread_budget() > 0) max_threads = std::min(max_threads, base::thread_budget());
  const int64_t tasks =
      std::clamp<int64_t>(std::min(max_threads, (elements + kGrainElements - 1) / kGrainElements), 1, blocks);
  detail::run_tasks(tasks, [&](int64_t task) {
    for (int64_t b = blocks * task / tasks; b < blocks * (task + 1) / tasks; ++b) fn(b);
  });
}

// Note [Adafactor clones]: the per-element loops (the factored update's division and square root,
// the squared sums) are compiled three times by GCC's target_clones, for AVX-512, AVX2 and the
// baseline, and the loader picks one for the CPU (an ifunc). Each operation is an IEEE operation
// in every version (-ffp-contract=off: no fused multiply-add), so the results are bitwise the same
// on every CPU; only the vector width changes. Sanitizer builds compile one version (an ifunc
// resolver runs before the sanitizer's runtime is set up).
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define ROUNDPIPE_ADAFACTOR_CLONES
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer) || __has_feature(undefined_behavior_sanitizer)
#define ROUNDPIPE_ADAFACTOR_CLONES
#endif
#endif
#ifndef ROUNDPIPE_ADAFACTOR_CLONES
#define ROUNDPIPE_ADAFACTOR_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#endif

constexpr int64_t kLanes = 8;
// Columns of a row whose updates are computed into a stack buffer at a time (update_squared_norm).
constexpr int64_t kUpdateChunk = 1024;

// sum of double(x[i])^2 over i < n: element i goes into lane i % kLanes (the tail after the last
// full group into a sum of its own), the lanes then added in order; the same for any caller.
ROUNDPIPE_ADAFACTOR_CLONES double sum_squares(const float* x, int64_t n) {
  double lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int64_t j = 0; j < kLanes; ++j) lanes[j] += double(x[i + j]) * x[i + j];
  }
  double tail = 0;
  for (; i < n; ++i) tail += double(x[i]) * x[i];
  double s = 0;
  for (const double lane : lanes) s += lane;
  return s + tail;
}

// s[c] += double(x[c])^2 for c < n (a row's slice of the column sums).
ROUNDPIPE_ADAFACTOR_CLONES void add_squares(const float* x, double* s, int64_t n) {
  for (int64_t c = 0; c < n; ++c) s[c] += double(x[c]) * x[c];
}

// The factored update of one row's columns: u[c] = g[c] / sqrt(max(rv * cv[c] / mean, eps1^2)),
// rounded op for op as torch (the outer product, the division, the clamp, rsqrt as 1 / sqrt).
ROUNDPIPE_ADAFACTOR_CLONES void factored_updates(const float* g, const float* cv, float rv, float mean,
                                                 float eps1_squared, float* u, int64_t n) {
  for (int64_t c = 0; c < n; ++c) {
    const float v = rv * cv[c] / mean;
    u[c] = g[c] * (1.0f / std::sqrt(std::max(v, eps1_squared)));
  }
}

// p[c] = p[c] * decay (when it decays) + neg_scale * the factored update, for one row's columns.
ROUNDPIPE_ADAFACTOR_CLONES void apply_factored(float* p, const float* g, const float* cv, float rv, float mean,
                                               float eps1_squared, bool decays, float decay, float neg_scale,
                                               int64_t n) {
  for (int64_t c = 0; c < n; ++c) {
    const float v = rv * cv[c] / mean;
    const float u = g[c] * (1.0f / std::sqrt(std::max(v, eps1_squared)));
    const float kept = decays ? p[c] * decay : p[c];
    p[c] = kept + neg_scale * u;
  }
}

double sum_in_order(const std::vector<double>& partials) {
  double sum = 0;
  for (const double x : partials) sum += x;
  return sum;
}

// torch.lerp's float formula (ATen's lerp kernel): exact at weight 0 and 1.
inline float lerp(float self, float end, float weight) {
  return std::abs(weight) < 0.5f ? self + weight * (end - self) : end - (end - self) * (1 - weight);
}

// The scalars of one parameter's step, rounded as torch rounds its Python floats.
struct StepScalars {
  float beta2_weight = 1;  // one_minus_beta2_t = t^beta2_decay
  float eps1 = 0, eps1_squared = 0;
  float decay = 1;  // 1 - lr * weight_decay
  double rho = 0, eps2 = 0, d = 1;
  bool decays = false, maximize = false;
};

// sum(p^2) of `n` contiguous floats, over Note [Adafactor blocks].
double squared_norm(const float* p, int64_t n, int64_t threads) {
  const int64_t blocks = (n + kBlockElements - 1) / kBlockElements;
  std::vector<double> partial(blocks, 0.0);
  for_blocks(blocks, n, threads, [&](int64_t b) {
    const int64_t lo = b * kBlockElements;
    partial[b] = sum_squares(p + lo, std::min(n, lo + kBlockElements) - lo);
  });
  return sum_in_order(partial);
}

// p = p * decay (when it decays) - scale * u(i), for u(i) given per element.
template <typename Update>
void apply_update(float* p, int64_t n, const StepScalars& sc, float neg_scale, int64_t threads, const Update& u) {
  const int64_t blocks = (n + kBlockElements - 1) / kBlockElements;
  for_blocks(blocks, n, threads, [&](int64_t b) {
    for (int64_t i = b * kBlockElements; i < std::min(n, (b + 1) * kBlockElements); ++i) {
      const float kept = sc.decays ? p[i] * sc.decay : p[i];
      p[i] = kept + neg_scale * u(i);
    }
  });
}

// -alpha / max(1, rms(u) / d), maximize folded in (negating the step equals negating g: exact).
float step_scale(double alpha, double update_sumsq, int64_t n, const StepScalars& sc) {
  const double denom = std::max(1.0, std::sqrt(update_sumsq) / (std::sqrt(double(n)) * sc.d));
  const double scale = -alpha / denom;
  return static_cast<float>(sc.maximize ? -scale : scale);
}

double step_alpha(double param_sumsq, int64_t n, const StepScalars& sc) {
  return std::max(sc.eps2, std::sqrt(param_sumsq) / std::sqrt(double(n))) * sc.rho;
}

// One unfactored parameter (0 or 1 dimension): variance of its shape.
void step_vector(float* p, const float* g, float* variance, int64_t n, const StepScalars& sc, int64_t threads) {
  const double alpha = step_alpha(squared_norm(p, n, threads), n, sc);
  auto update = [&](int64_t i) { return g[i] * (1.0f / std::sqrt(std::max(variance[i], sc.eps1_squared))); };
  const int64_t blocks = (n + kBlockElements - 1) / kBlockElements;
  std::vector<double> partial(blocks, 0.0);
  for_blocks(blocks, n, threads, [&](int64_t b) {
    float u[kUpdateChunk];
    double s = 0;
    const int64_t end = std::min(n, (b + 1) * kBlockElements);
    for (int64_t lo = b * kBlockElements; lo < end; lo += kUpdateChunk) {
      const int64_t hi = std::min(end, lo + kUpdateChunk);
      for (int64_t i = lo; i < hi; ++i) {
        variance[i] = lerp(variance[i], g[i] * g[i], sc.beta2_weight);
        u[i - lo] = update(i);
      }
      s += sum_squares(u, hi - lo);
    }
    partial[b] = s;
  });
  apply_update(p, n, sc, step_scale(alpha, sum_in_order(partial), n, sc), threads, update);
}

// One factored parameter: `batches` matrices of rows x cols, row_var [batches, rows], col_var
// [batches, cols].
class FactoredStep {
 public:
  FactoredStep(float* p, const float* g, float* row_var, float* col_var, int64_t batches, int64_t rows, int64_t cols,
               const StepScalars& sc, int64_t threads)
      : p_(p),
        g_(g),
        row_var_(row_var),
        col_var_(col_var),
        batches_(batches),
        rows_(rows),
        cols_(cols),
        sc_(sc),
        threads_(threads),
        n_(batches * rows * cols),
        rows_per_block_(std::max<int64_t>(1, kBlockElements / cols)) {}

  void run() {
    const double alpha = step_alpha(squared_norm(p_, n_, threads_), n_, sc_);
    update_row_var();
    update_col_var();
    row_mean_.resize(batches_);
    for (int64_t b = 0; b < batches_; ++b) {
      double s = 0;
      for (int64_t r = 0; r < rows_; ++r) s += row_var_[b * rows_ + r];
      row_mean_[b] = std::max(static_cast<float>(s / double(rows_)), sc_.eps1);
    }
    const double update_sumsq = update_squared_norm();
    const float neg_scale = step_scale(alpha, update_sumsq, n_, sc_);
    for_blocks(row_blocks(), n_, threads_, [&](int64_t blk) {
      for (int64_t r = blk * rows_per_block_; r < std::min(total_rows(), (blk + 1) * rows_per_block_); ++r) {
        const int64_t b = r / rows_;
        apply_factored(p_ + r * cols_, g_ + r * cols_, col_var_ + b * cols_, row_var_[r], row_mean_[b],
                       sc_.eps1_squared, sc_.decays, sc_.decay, neg_scale, cols_);
      }
    });
  }

 private:
  int64_t total_rows() const { return batches_ * rows_; }
  int64_t row_blocks() const { return (total_rows() + rows_per_block_ - 1) / rows_per_block_; }

  // row_var.lerp_(mean over columns of g^2): one row per loop, rows split into blocks.
  void update_row_var() {
    for_blocks(row_blocks(), n_, threads_, [&](int64_t blk) {
      for (int64_t r = blk * rows_per_block_; r < std::min(total_rows(), (blk + 1) * rows_per_block_); ++r) {
        const double s = sum_squares(g_ + r * cols_, cols_);
        row_var_[r] = lerp(row_var_[r], static_cast<float>(s / double(cols_)), sc_.beta2_weight);
      }
    });
  }

  // col_var.lerp_(mean over rows of g^2): a block of columns of one matrix per loop, walked row by row.
  void update_col_var() {
    const int64_t col_blocks = (cols_ + kColumnBlock - 1) / kColumnBlock;
    for_blocks(batches_ * col_blocks, n_, threads_, [&](int64_t blk) {
      const int64_t b = blk / col_blocks, c0 = (blk % col_blocks) * kColumnBlock;
      const int64_t c1 = std::min(cols_, c0 + kColumnBlock);
      double s[kColumnBlock] = {};
      for (int64_t r = 0; r < rows_; ++r) add_squares(g_ + (b * rows_ + r) * cols_ + c0, s, c1 - c0);
      for (int64_t c = c0; c < c1; ++c) {
        float& cv = col_var_[b * cols_ + c];
        cv = lerp(cv, static_cast<float>(s[c - c0] / double(rows_)), sc_.beta2_weight);
      }
    });
  }

  double update_squared_norm() const {
    std::vector<double> partial(row_blocks(), 0.0);
    for_blocks(row_blocks(), n_, threads_, [&](int64_t blk) {
      // The updates of up to kUpdateChunk columns at a time into a buffer (a vectorized loop), then
      // their squares summed by lanes.
      float u[kUpdateChunk];
      double s = 0;
      for (int64_t r = blk * rows_per_block_; r < std::min(total_rows(), (blk + 1) * rows_per_block_); ++r) {
        const int64_t b = r / rows_;
        for (int64_t c0 = 0; c0 < cols_; c0 += kUpdateChunk) {
          const int64_t c1 = std::min(cols_, c0 + kUpdateChunk);
          factored_updates(g_ + r * cols_ + c0, col_var_ + b * cols_ + c0, row_var_[r], row_mean_[b], sc_.eps1_squared,
                           u, c1 - c0);
          s += sum_squares(u, c1 - c0);
        }
      }
      partial[blk] = s;
    });
    return sum_in_order(partial);
  }

  float* p_;
  const float* g_;
  float* row_var_;
  float* col_var_;
  int64_t batches_, rows_, cols_;
  StepScalars sc_;
  int64_t threads_, n_, rows_per_block_;
  std::vector<float> row_mean_;  // per batch: max(mean(row_var), eps1)
};

// A loaded (or fresh) state tensor as the kernel needs it: `shape`, contiguous fp32 CPU.
torch::Tensor state_tensor(torch::Tensor t, at::IntArrayRef shape, const torch::Tensor& p, const char* name) {
  TORCH_CHECK(t.defined(), kWho, ": state '", name, "' is missing for a parameter of shape ", p.sizes(),
              "; the loaded state dict does not match this optimizer");
  TORCH_CHECK(t.sizes() == shape, kWho, ": state '", name, "' has shape ", t.sizes(), " but a parameter of shape ",
              p.sizes(), " needs ", shape, "; the loaded state dict does not match the parameters");
  if (t.scalar_type() != at::kFloat || !t.is_contiguous() || !t.device().is_cpu()) {
    t = t.to(at::kCPU, at::kFloat).contiguous();
  }
  return t;
}

StepScalars scalars_for(const AdafactorOptions& o, int64_t step) {
  StepScalars sc;
  const double t = static_cast<double>(step);
  sc.beta2_weight = static_cast<float>(std::pow(t, o.beta2_decay()));
  const double eps1 = o.eps1().value_or(std::numeric_limits<float>::epsilon());
  sc.eps1 = static_cast<float>(eps1);
  sc.eps1_squared = static_cast<float>(eps1 * eps1);
  sc.decays = o.weight_decay() != 0;
  sc.decay = static_cast<float>(1 - o.lr() * o.weight_decay());
  sc.rho = std::min(o.lr(), 1 / std::pow(t, 0.5));
  sc.eps2 = o.eps2();
  sc.d = o.d();
  sc.maximize = o.maximize();
  return sc;
}

}  // namespace

// ---- AdafactorOptions --------------------------------------------------------------------------

AdafactorOptions::AdafactorOptions(double lr) : lr_(lr) {}

bool operator==(const AdafactorOptions& lhs, const AdafactorOptions& rhs) {
  return lhs.lr() == rhs.lr() && lhs.beta2_decay() == rhs.beta2_decay() && lhs.eps1() == rhs.eps1() &&
         lhs.eps2() == rhs.eps2() && lhs.d() == rhs.d() && lhs.weight_decay() == rhs.weight_decay() &&
         lhs.maximize() == rhs.maximize();
}

void AdafactorOptions::serialize(torch::serialize::OutputArchive& archive) const {
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(lr);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(beta2_decay);
  archive.write("eps1", eps1_.has_value() ? c10::IValue(*eps1_) : c10::IValue());
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(eps2);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(d);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(weight_decay);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(maximize);
}

void AdafactorOptions::serialize(torch::serialize::InputArchive& archive) {
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, lr);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, beta2_decay);
  c10::IValue eps1;
  if (archive.try_read("eps1", eps1)) {
    eps1_ = eps1.isNone() ? std::nullopt : std::optional<double>(eps1.toDouble());
  }
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, eps2);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, d);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, weight_decay);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, maximize);
}

double AdafactorOptions::get_lr() const { return lr(); }

void AdafactorOptions::set_lr(const double lr) { this->lr(lr); }

// ---- AdafactorParamState -----------------------------------------------------------------------

bool operator==(const AdafactorParamState& lhs, const AdafactorParamState& rhs) {
  auto same = [](const torch::Tensor& a, const torch::Tensor& b) {
    return a.defined() == b.defined() && (!a.defined() || torch::equal(a, b));
  };
  return lhs.step() == rhs.step() && same(lhs.row_var(), rhs.row_var()) && same(lhs.col_var(), rhs.col_var()) &&
         same(lhs.variance(), rhs.variance());
}

void AdafactorParamState::serialize(torch::serialize::OutputArchive& archive) const {
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(step);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(row_var);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(col_var);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(variance);
}

void AdafactorParamState::serialize(torch::serialize::InputArchive& archive) {
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(int64_t, step);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(torch::Tensor, row_var);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(torch::Tensor, col_var);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(torch::Tensor, variance);
}

// ---- Adafactor ---------------------------------------------------------------------------------

Adafactor::Adafactor(const std::vector<torch::optim::OptimizerParamGroup>& param_groups, AdafactorOptions defaults)
    : Optimizer(param_groups, std::make_unique<AdafactorOptions>(defaults)) {
  check_options(defaults, "the default options");
  for (const auto g : c10::irange(param_groups_.size())) {
    check_options(static_cast<const AdafactorOptions&>(param_groups_[g].options()), "param group " + std::to_string(g));
    for (const auto& p : param_groups_[g].params()) detail::check_master_param(p, kWho);
  }
}

Adafactor::Adafactor(std::vector<torch::Tensor> params, AdafactorOptions defaults)
    : Adafactor(std::vector<torch::optim::OptimizerParamGroup>{torch::optim::OptimizerParamGroup(std::move(params))},
                std::move(defaults)) {}

void Adafactor::set_num_threads(int64_t num_threads) {
  TORCH_CHECK(num_threads >= 0, kWho, "::set_num_threads: got ", num_threads,
              "; use 0 (all intra-op threads) or a positive count");
  num_threads_ = num_threads;
}

torch::Tensor Adafactor::step(LossClosure closure) {
  torch::NoGradGuard no_grad;
  torch::Tensor loss;
  if (closure != nullptr) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  for (const auto g : c10::irange(param_groups_.size())) {
    const auto& options = static_cast<const AdafactorOptions&>(param_groups_[g].options());
    check_options(options, "param group " + std::to_string(g));
    for (auto& p : param_groups_[g].params()) {
      if (!p.grad().defined()) continue;
      detail::check_master_param(p, kWho);
      std::vector<torch::Tensor> keep_alive;
      torch::Tensor grad = detail::step_grad(p, kWho, keep_alive);
      if (grad.scalar_type() != torch::kFloat) grad = grad.to(torch::kFloat);
      const bool factored = p.dim() > 1;
      std::vector<int64_t> row_shape = p.sizes().vec(), col_shape = p.sizes().vec();
      if (factored) {
        row_shape.back() = 1;
        col_shape[col_shape.size() - 2] = 1;
      }
      auto& slot = state_[p.unsafeGetTensorImpl()];
      if (!slot) {
        auto fresh = std::make_unique<AdafactorParamState>();
        if (factored) {
          fresh->row_var(torch::zeros(row_shape));
          fresh->col_var(torch::zeros(col_shape));
        } else {
          fresh->variance(torch::zeros_like(p, torch::MemoryFormat::Contiguous));
        }
        slot = std::move(fresh);
      }
      auto& state = static_cast<AdafactorParamState&>(*slot);
      state.step(state.step() + 1);
      const StepScalars sc = scalars_for(options, state.step());
      if (factored) {
        state.row_var(state_tensor(state.row_var(), row_shape, p, "row_var"));
        state.col_var(state_tensor(state.col_var(), col_shape, p, "col_var"));
        if (p.numel() == 0) continue;
        const int64_t rows = p.size(-2), cols = p.size(-1);
        FactoredStep(p.data_ptr<float>(), grad.const_data_ptr<float>(), state.row_var().data_ptr<float>(),
                     state.col_var().data_ptr<float>(), p.numel() / (rows * cols), rows, cols, sc, num_threads_)
            .run();
      } else {
        state.variance(state_tensor(state.variance(), p.sizes(), p, "variance"));
        if (p.numel() == 0) continue;
        step_vector(p.data_ptr<float>(), grad.const_data_ptr<float>(), state.variance().data_ptr<float>(), p.numel(),
                    sc, num_threads_);
      }
    }
  }
  return loss;
}

void Adafactor::save(torch::serialize::OutputArchive& archive) const {
  torch::optim::serialize<AdafactorParamState, AdafactorOptions>(archive, *this);
}

void Adafactor::load(torch::serialize::InputArchive& archive) {
  torch::optim::serialize<AdafactorParamState, AdafactorOptions>(archive, *this);
}

}  // namespace roundpipe::optim
