#include "optim/adam.h"

#include <c10/util/irange.h>
#include <torch/optim/serialize.h>
#include <torch/serialize/archive.h>

#include <algorithm>
#include <cmath>
#include <utility>

#include "base/logging.h"
#include "optim/detail/adam_kernel.h"
#include "optim/detail/parallel_tasks.h"
#include "optim/detail/step_inputs.h"

namespace roundpipe::optim {

namespace {

constexpr const char* kWho = "roundpipe::optim::Adam";
// With set_streaming_stores(true), parameters from this size on (4 MiB per fp32 buffer) are
// written with non-temporal stores; see Note [Streaming stores] in detail/adam_kernel_impl.h.
constexpr int64_t kStreamingMinElements = int64_t{1} << 20;

void check_options(const AdamOptions& o, const std::string& where) {
  TORCH_CHECK(o.lr() >= 0, "roundpipe::optim::Adam: invalid learning rate lr=", o.lr(), " in ", where, "; use lr >= 0");
  TORCH_CHECK(o.eps() >= 0, "roundpipe::optim::Adam: invalid epsilon eps=", o.eps(), " in ", where, "; use eps >= 0");
  const auto [beta1, beta2] = o.betas();
  TORCH_CHECK(0 <= beta1 && beta1 < 1.0, "roundpipe::optim::Adam: invalid beta parameter at index 0: ", beta1, " in ",
              where, "; betas must lie in [0, 1)");
  TORCH_CHECK(0 <= beta2 && beta2 < 1.0, "roundpipe::optim::Adam: invalid beta parameter at index 1: ", beta2, " in ",
              where, "; betas must lie in [0, 1)");
  TORCH_CHECK(o.weight_decay() >= 0, "roundpipe::optim::Adam: invalid weight_decay=", o.weight_decay(), " in ", where,
              "; use weight_decay >= 0");
  TORCH_CHECK(o.state_dtype() == AdamStateDtype::kFloat32 || o.state_dtype() == AdamStateDtype::kInt8,
              "roundpipe::optim::Adam: invalid state_dtype=", static_cast<int>(o.state_dtype()), " in ", where,
              "; use AdamStateDtype::kFloat32 or kInt8");
  TORCH_CHECK(!(o.amsgrad() && o.state_dtype() == AdamStateDtype::kInt8),
              "roundpipe::optim::Adam: amsgrad is not supported with state_dtype int8 (8-bit states) in ", where,
              "; use amsgrad=false or state_dtype float32");
}

const char* dtype_name(AdamStateDtype d) { return d == AdamStateDtype::kInt8 ? "int8" : "float32"; }

// Note [8-bit Adam states] in detail/adam_kernel_impl.h: tensors under kMin8bitNumel keep fp32.
bool uses_8bit_states(const AdamOptions& o, const torch::Tensor& p) {
  return o.state_dtype() == AdamStateDtype::kInt8 && p.numel() >= kMin8bitNumel;
}

int64_t num_blocks(const torch::Tensor& p) { return (p.numel() + kQuantBlockSize - 1) / kQuantBlockSize; }

// The mismatch a state of the other state_dtype gives, with the fix.
[[noreturn]] void state_dtype_mismatch(const torch::Tensor& p, const char* name, const char* found,
                                       AdamStateDtype group_dtype) {
  TORCH_CHECK(false, kWho, ": state '", name, "' of a parameter of shape ", p.sizes(), " holds ", found,
              " but its param group has state_dtype ", dtype_name(group_dtype),
              (p.numel() < kMin8bitNumel ? " (parameters under 4096 elements always keep float32 states)" : ""),
              "; the state was made with the other state_dtype: keep the state_dtype an optimizer state "
              "was created with (AdamOptions::state_dtype), or start from a fresh optimizer");
}

// An 8-bit code tensor (uint8, param's shape) or absmax tensor (float32, one per block) the kernel
// can use; made contiguous on the CPU if it is not.
torch::Tensor quantized_buffer(torch::Tensor t, const torch::Tensor& p, const char* name, bool absmax) {
  TORCH_CHECK(t.defined(), kWho, ": state '", name, "' is missing for a parameter of shape ", p.sizes(),
              "; the loaded state dict does not match this optimizer (8-bit states need exp_avg, exp_avg_sq, "
              "exp_avg_absmax and exp_avg_sq_absmax)");
  const auto want = absmax ? torch::kFloat : torch::kByte;
  if (t.scalar_type() != want) {
    state_dtype_mismatch(p, name, t.scalar_type() == torch::kFloat ? "float32 moments" : "another dtype",
                         AdamStateDtype::kInt8);
  }
  const bool fits = absmax ? t.dim() == 1 && t.numel() == num_blocks(p) : t.sizes() == p.sizes();
  TORCH_CHECK(fits, kWho, ": state '", name, "' has shape ", t.sizes(), " but a parameter of shape ", p.sizes(),
              " needs ",
              (absmax ? "one float32 per " + std::to_string(kQuantBlockSize) + " elements"
                      : std::string("a uint8 code per element")),
              "; the loaded state dict does not match the parameters");
  if (!t.is_contiguous() || !t.device().is_cpu()) {
    t = t.to(torch::kCPU).contiguous();
  }
  return t;
}

// Creates (first step) or checks `state`'s moments and points `job` at them: float32 or 8-bit.
void bind_moments(AdamParamState& state, const torch::Tensor& p, const AdamOptions& options, detail::AdamTensor& job) {
  if (!uses_8bit_states(options, p)) {
    // float32 moments also for bf16 masters (Note [Kahan-compensated bf16 masters]).
    const auto moment = torch::TensorOptions().dtype(torch::kFloat);
    if (!state.exp_avg().defined() && !state.exp_avg_sq().defined()) {
      state.exp_avg(torch::zeros(p.sizes(), moment));
      state.exp_avg_sq(torch::zeros(p.sizes(), moment));
    }
    if (state.exp_avg_absmax().defined() ||
        (state.exp_avg().defined() && state.exp_avg().scalar_type() == torch::kByte)) {
      state_dtype_mismatch(p, "exp_avg", "8-bit moments", options.state_dtype());
    }
    state.exp_avg(detail::state_buffer(state.exp_avg(), p, "exp_avg", kWho));
    state.exp_avg_sq(detail::state_buffer(state.exp_avg_sq(), p, "exp_avg_sq", kWho));
    if (options.amsgrad()) {
      if (!state.max_exp_avg_sq().defined()) {
        state.max_exp_avg_sq(torch::zeros(p.sizes(), moment));
      }
      state.max_exp_avg_sq(detail::state_buffer(state.max_exp_avg_sq(), p, "max_exp_avg_sq", kWho));
    }
    job.exp_avg = state.exp_avg().data_ptr<float>();
    job.exp_avg_sq = state.exp_avg_sq().data_ptr<float>();
    job.max_exp_avg_sq = options.amsgrad() ? state.max_exp_avg_sq().data_ptr<float>() : nullptr;
    return;
  }
  const auto& signed_map = detail::signed_dynamic_map();
  const auto& unsigned_map = detail::unsigned_dynamic_map();
  if (!state.exp_avg().defined() && !state.exp_avg_sq().defined()) {
    const auto codes = torch::TensorOptions().dtype(torch::kByte);
    state.exp_avg(torch::full(p.sizes(), signed_map.zero_code, codes));
    state.exp_avg_sq(torch::full(p.sizes(), unsigned_map.zero_code, codes));
    state.exp_avg_absmax(torch::zeros({num_blocks(p)}, torch::kFloat));
    state.exp_avg_sq_absmax(torch::zeros({num_blocks(p)}, torch::kFloat));
  }
  state.exp_avg(quantized_buffer(state.exp_avg(), p, "exp_avg", false));
  state.exp_avg_sq(quantized_buffer(state.exp_avg_sq(), p, "exp_avg_sq", false));
  state.exp_avg_absmax(quantized_buffer(state.exp_avg_absmax(), p, "exp_avg_absmax", true));
  state.exp_avg_sq_absmax(quantized_buffer(state.exp_avg_sq_absmax(), p, "exp_avg_sq_absmax", true));
  auto& q = job.quantized;
  q.exp_avg_codes = state.exp_avg().data_ptr<uint8_t>();
  q.exp_avg_sq_codes = state.exp_avg_sq().data_ptr<uint8_t>();
  q.exp_avg_absmax = state.exp_avg_absmax().data_ptr<float>();
  q.exp_avg_sq_absmax = state.exp_avg_sq_absmax().data_ptr<float>();
  q.exp_avg_map = &signed_map;
  q.exp_avg_sq_map = &unsigned_map;
}

// Points `job` at `p`: a float32 master, or a bf16 master and, with kahan_sum, its Kahan
// compensation (created zero on the first step; Note [Kahan-compensated bf16 masters] in
// detail/adam_kernel_impl.h).
void bind_param(AdamParamState& state, const torch::Tensor& p, const AdamOptions& options, detail::AdamTensor& job) {
  if (p.scalar_type() != torch::kBFloat16 || !options.kahan_sum()) {
    TORCH_CHECK(!state.kahan_compensation().defined(), kWho, ": a ", p.scalar_type(), " parameter of shape ", p.sizes(),
                " in a group without kahan_sum has a state 'kahan_compensation' (made for a "
                "Kahan-compensated bfloat16 parameter); the loaded state dict does not match the parameters");
    if (p.scalar_type() == torch::kBFloat16) {
      job.param_bf16 = static_cast<uint16_t*>(p.data_ptr());  // plain rounding, no compensation
    } else {
      job.param = p.data_ptr<float>();
    }
    return;
  }
  if (!state.kahan_compensation().defined() && state.step() == 0) {
    state.kahan_compensation(torch::zeros(p.sizes(), torch::TensorOptions().dtype(torch::kBFloat16)));
  }
  torch::Tensor c = state.kahan_compensation();
  TORCH_CHECK(c.defined(), kWho, ": state 'kahan_compensation' is missing for a bfloat16 parameter of shape ",
              p.sizes(), " at step ", state.step(),
              "; the loaded state dict does not match this optimizer (it was "
              "saved from float32 parameters or without AdamOptions::kahan_sum)");
  TORCH_CHECK(c.scalar_type() == torch::kBFloat16 && c.sizes() == p.sizes(), kWho, ": state 'kahan_compensation' is ",
              c.toString(), " of shape ", c.sizes(), " but a bfloat16 parameter of shape ", p.sizes(),
              " needs bfloat16 of its shape; the loaded state dict does not match the parameters");
  if (!c.is_contiguous() || !c.device().is_cpu()) {
    c = c.to(torch::kCPU).contiguous();
    state.kahan_compensation(c);
  }
  job.param_bf16 = static_cast<uint16_t*>(p.data_ptr());
  job.compensation = static_cast<uint16_t*>(c.data_ptr());
}

// Bias corrections in double, like _single_tensor_adam's Python floats; the kernel gets them
// rounded to float exactly where ATen rounds its Scalar arguments.
detail::AdamScalars adam_scalars(const AdamOptions& options, const int64_t step_count) {
  const double lr = options.lr();
  const double beta1 = std::get<0>(options.betas());
  const double beta2 = std::get<1>(options.betas());
  const double weight_decay = options.weight_decay();
  const auto step = static_cast<double>(step_count);
  const double bias_correction1 = 1 - std::pow(beta1, step);
  const double bias_correction2 = 1 - std::pow(beta2, step);
  detail::AdamScalars s;
  s.lerp_weight = static_cast<float>(1 - beta1);
  s.beta2 = static_cast<float>(beta2);
  s.one_minus_beta2 = static_cast<float>(1 - beta2);
  s.neg_step_size = static_cast<float>(-(lr / bias_correction1));
  s.bias_correction2_sqrt = static_cast<float>(std::sqrt(bias_correction2));
  s.eps = static_cast<float>(options.eps());
  s.weight_decay = static_cast<float>(weight_decay);
  s.decay_factor = static_cast<float>(1 - lr * weight_decay);
  s.has_weight_decay = weight_decay != 0;
  s.decoupled = options.decoupled_weight_decay();
  s.amsgrad = options.amsgrad();
  s.maximize = options.maximize();
  return s;
}

// The kernel also writes the updated value into the registered compute copy, if any.
void bind_compute_copy(const torch::Tensor& copy, const torch::Tensor& p, detail::AdamTensor& job) {
  TORCH_CHECK(copy.sizes() == p.sizes() && copy.is_contiguous(),
              "roundpipe::optim::Adam: the "
              "compute copy of a parameter of shape ",
              p.sizes(), " changed shape or layout to ", copy.sizes(), "; register it again with set_compute_copy");
  job.copy = copy.data_ptr();
  job.copy_dtype = copy.scalar_type() == torch::kFloat  ? detail::CopyDtype::kFloat
                   : copy.scalar_type() == torch::kHalf ? detail::CopyDtype::kHalf
                                                        : detail::CopyDtype::kBFloat16;
}

}  // namespace

// ---- AdamOptions ---------------------------------------------------------------------------------

AdamOptions::AdamOptions(double lr) : lr_(lr) {}

bool operator==(const AdamOptions& lhs, const AdamOptions& rhs) {
  return lhs.lr() == rhs.lr() && lhs.betas() == rhs.betas() && lhs.eps() == rhs.eps() &&
         lhs.weight_decay() == rhs.weight_decay() && lhs.amsgrad() == rhs.amsgrad() &&
         lhs.maximize() == rhs.maximize() && lhs.decoupled_weight_decay() == rhs.decoupled_weight_decay() &&
         lhs.state_dtype() == rhs.state_dtype() && lhs.kahan_sum() == rhs.kahan_sum();
}

void AdamOptions::serialize(torch::serialize::OutputArchive& archive) const {
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(lr);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(betas);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(eps);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(weight_decay);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(amsgrad);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(maximize);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(decoupled_weight_decay);
  // Only when not the default, so float32 archives keep torch's layout.
  if (state_dtype() != AdamStateDtype::kFloat32) {
    archive.write("state_dtype", c10::IValue(static_cast<int64_t>(state_dtype())));
  }
  if (kahan_sum()) {
    archive.write("kahan_sum", c10::IValue(true));
  }
}

void AdamOptions::serialize(torch::serialize::InputArchive& archive) {
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, lr);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(betas_t, betas);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, eps);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, weight_decay);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, amsgrad);
  // Absent in torch::optim::Adam archives: keep the defaults so those load too.
  c10::IValue ivalue;
  if (archive.try_read("maximize", ivalue)) {
    maximize(ivalue.toBool());
  }
  if (archive.try_read("decoupled_weight_decay", ivalue)) {
    decoupled_weight_decay(ivalue.toBool());
  }
  state_dtype(archive.try_read("state_dtype", ivalue) ? static_cast<AdamStateDtype>(ivalue.toInt())
                                                      : AdamStateDtype::kFloat32);
  kahan_sum(archive.try_read("kahan_sum", ivalue) && ivalue.toBool());
}

double AdamOptions::get_lr() const { return lr(); }

void AdamOptions::set_lr(const double lr) { this->lr(lr); }

// ---- AdamParamState ------------------------------------------------------------------------------

bool operator==(const AdamParamState& lhs, const AdamParamState& rhs) {
  auto same = [](const torch::Tensor& a, const torch::Tensor& b) {
    return a.defined() == b.defined() && (!a.defined() || torch::equal(a, b));
  };
  return lhs.step() == rhs.step() && same(lhs.exp_avg(), rhs.exp_avg()) && same(lhs.exp_avg_sq(), rhs.exp_avg_sq()) &&
         same(lhs.max_exp_avg_sq(), rhs.max_exp_avg_sq()) && same(lhs.exp_avg_absmax(), rhs.exp_avg_absmax()) &&
         same(lhs.exp_avg_sq_absmax(), rhs.exp_avg_sq_absmax()) &&
         same(lhs.kahan_compensation(), rhs.kahan_compensation());
}

void AdamParamState::serialize(torch::serialize::OutputArchive& archive) const {
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(step);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(exp_avg);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(exp_avg_sq);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(max_exp_avg_sq);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(exp_avg_absmax);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(exp_avg_sq_absmax);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(kahan_compensation);
}

void AdamParamState::serialize(torch::serialize::InputArchive& archive) {
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(int64_t, step);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(torch::Tensor, exp_avg);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(torch::Tensor, exp_avg_sq);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(torch::Tensor, max_exp_avg_sq);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(torch::Tensor, exp_avg_absmax);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(torch::Tensor, exp_avg_sq_absmax);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(torch::Tensor, kahan_compensation);
}

// ---- Adam ----------------------------------------------------------------------------------------

Adam::Adam(const std::vector<torch::optim::OptimizerParamGroup>& param_groups, AdamOptions defaults)
    : Optimizer(param_groups, std::make_unique<AdamOptions>(defaults)), isa_(best_cpu_isa()) {
  check_options(defaults, "the default options");
  for (const auto g : c10::irange(param_groups_.size())) {
    const auto& options = static_cast<const AdamOptions&>(param_groups_[g].options());
    check_options(options, "param group " + std::to_string(g));
    for (const auto& p : param_groups_[g].params()) {
      check_param(p, options);
    }
  }
  ROUNDPIPE_LOG(Logger::get("optim"), kDebug, "Adam: ", param_groups_.size(), " param group(s), kernel ",
                cpu_isa_name(isa_));
}

Adam::Adam(std::vector<torch::Tensor> params, AdamOptions defaults)
    : Adam(std::vector<torch::optim::OptimizerParamGroup>{torch::optim::OptimizerParamGroup(std::move(params))},
           std::move(defaults)) {}

void Adam::check_param(const torch::Tensor& p, const AdamOptions& /*options*/) const {
  if (p.defined() && p.scalar_type() == torch::kBFloat16) {
    detail::check_bf16_master_param(p, kWho);
    return;
  }
  detail::check_master_param(p, kWho);
}

void Adam::set_num_threads(int64_t num_threads) {
  TORCH_CHECK(num_threads >= 0, "roundpipe::optim::Adam::set_num_threads: got ", num_threads,
              "; use 0 (all intra-op threads) or a positive count");
  num_threads_ = num_threads;
}

void Adam::set_streaming_stores(bool enabled) { streaming_stores_ = enabled; }

void Adam::set_kernel_isa(CpuIsa isa) {
  TORCH_CHECK(cpu_supports(isa),
              "roundpipe::optim::Adam::set_kernel_isa: this CPU (or build) does not "
              "support '",
              cpu_isa_name(isa), "'; use best_cpu_isa()");
  isa_ = isa;
}

void Adam::set_compute_copy(const torch::Tensor& param, torch::Tensor copy) {
  TORCH_CHECK(param.defined(), "roundpipe::optim::Adam::set_compute_copy: param is undefined");
  bool found = false;
  for (const auto& group : param_groups_) {
    for (const auto& p : group.params()) {
      found = found || p.unsafeGetTensorImpl() == param.unsafeGetTensorImpl();
    }
  }
  TORCH_CHECK(found, "roundpipe::optim::Adam::set_compute_copy: the parameter of shape ", param.sizes(),
              " is not one of this optimizer's parameters");
  TORCH_CHECK(param.scalar_type() != torch::kBFloat16 || !copy.defined(),
              "roundpipe::optim::Adam::set_compute_copy: the parameter of shape ", param.sizes(),
              " is a bfloat16 master, which is its own compute copy; use the parameter "
              "itself (e.g. upload it directly) instead of registering a copy");
  if (!copy.defined()) {
    compute_copies_.erase(param.unsafeGetTensorImpl());
    return;
  }
  const auto dtype = copy.scalar_type();
  TORCH_CHECK(copy.device().is_cpu() && copy.is_contiguous() && copy.layout() == torch::kStrided &&
                  (dtype == torch::kFloat || dtype == torch::kHalf || dtype == torch::kBFloat16),
              "roundpipe::optim::Adam::set_compute_copy: the copy must be a contiguous CPU tensor of "
              "dtype float32, float16 or bfloat16, got ",
              copy.toString(), " on ", copy.device());
  TORCH_CHECK(copy.sizes() == param.sizes(), "roundpipe::optim::Adam::set_compute_copy: copy has shape ", copy.sizes(),
              " but the parameter has shape ", param.sizes());
  compute_copies_[param.unsafeGetTensorImpl()] = std::move(copy);
}

std::vector<std::pair<const void*, int64_t>> Adam::gradient_identities() const {
  std::vector<std::pair<const void*, int64_t>> gradients;
  for (const auto& group : param_groups_) {
    for (const auto& p : group.params()) {
      if (p.grad().defined()) {
        gradients.emplace_back(p.grad().unsafeGetTensorImpl(), static_cast<int64_t>(p.grad()._version()));
      }
    }
  }
  return gradients;
}

void Adam::scale_next_gradients(float factor) { gradient_factor_ = GradientFactor{factor, gradient_identities()}; }

std::optional<float> Adam::next_gradient_factor() const {
  return gradient_factor_ ? std::optional<float>(gradient_factor_->factor) : std::nullopt;
}

torch::Tensor Adam::step(LossClosure closure) {
  torch::NoGradGuard no_grad;
  torch::Tensor loss = {};
  if (closure != nullptr) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  // scale_next_gradients(): used by this step only, and only on the gradients it was set for.
  const std::optional<GradientFactor> factor = std::exchange(gradient_factor_, std::nullopt);
  TORCH_CHECK(!factor || factor->gradients == gradient_identities(), kWho, "::step: scale_next_gradients(",
              factor ? factor->factor : 1.0f,
              ") was called for other gradients than the parameters have now (a gradient was replaced, modified, "
              "added or removed since, e.g. a step GradScaler skipped followed by a new iteration); call it (or "
              "clip_grad_norm) again right before step(). Nothing was updated; the factor is dropped");
  const float grad_factor = factor ? factor->factor : 1.0f;

  std::vector<detail::AdamTensor> jobs;
  std::vector<torch::Tensor> keep_alive;  // contiguous copies of non-contiguous grads
  for (const auto g : c10::irange(param_groups_.size())) {
    auto& group = param_groups_[g];
    const auto& options = static_cast<const AdamOptions&>(group.options());
    check_options(options, "param group " + std::to_string(g));
    for (auto& p : group.params()) {
      if (!p.grad().defined()) {
        continue;
      }
      check_param(p, options);
      const torch::Tensor grad = detail::step_grad(p, kWho, keep_alive);

      auto& slot = state_[p.unsafeGetTensorImpl()];
      if (!slot) {
        slot = std::make_unique<AdamParamState>();
      }
      auto& state = static_cast<AdamParamState&>(*slot);
      detail::AdamTensor job;
      bind_moments(state, p, options, job);
      bind_param(state, p, options, job);
      state.step(state.step() + 1);

      job.grad = grad.const_data_ptr();
      job.grad_dtype = detail::grad_dtype_of(grad);
      job.numel = p.numel();
      job.streaming_stores = streaming_stores_ && job.numel >= kStreamingMinElements;
      job.scalars = adam_scalars(options, state.step());
      job.scalars.grad_factor = grad_factor;
      if (auto copy = compute_copies_.find(p.unsafeGetTensorImpl()); copy != compute_copies_.end()) {
        bind_compute_copy(copy->second, p, job);
      }
      if (job.numel > 0) {
        jobs.push_back(job);
      }
    }
  }
  if (jobs.empty()) {
    return loss;
  }

  // Split the concatenation of all parameters into equal contiguous element ranges, one thread
  // each (Note [Why not at::parallel_for]).
  last_step_threads_ = detail::run_split_jobs(jobs, num_threads_, detail::adam_update_fn(isa_));
  return loss;
}

// Note [Clip norms in pieces]: at::linalg_vector_norm of a bf16/fp16 tensor with a float32 result
// converts the whole tensor to float32 first (PyTorch 2.11 on CPU: +4 bytes per element, measured
// from Python as +381 MiB of peak RSS for 100M bf16 elements), and clip_grad_norm runs when every
// gradient and the optimizer state are alive: the largest gradient's copy (the embedding's or the
// LM head's, 131 MB for a 32K x 1024 table, 2.1 GB for Llama-3-8B's 128K x 4096) landed on the
// run's peak host memory (issue 31: 0.7 B/param of a 194M-parameter bf16 run). So a contiguous
// 16-bit gradient of more than kClipNormPiece elements is normed in pieces of kClipNormPiece
// (each converted alone: at most 16 MiB at a time), and the pieces' norms join the list of
// per-tensor norms, which torch's clip_grad_norm_ combines as the norm of the norms: the total is
// exactly torch's clip_grad_norm_ of the gradients' float32 values given as pieces (tested that
// way). It is not bitwise torch's norm of the whole tensors: ATen reduces one tensor in one
// sequential float32 pass, whose rounding error grows with the tensor (-0.4% at 50M N(0, 1)
// elements, against +7e-5 in pieces of 2^22, measured against a float64 norm), so the pieces are
// also closer to the exact norm.
// Float32 gradients (no copy is made) and 16-bit ones up to a piece are normed whole, bitwise
// torch's.
namespace {

void append_norms(const torch::Tensor& grad, std::vector<torch::Tensor>& norms) {
  const bool half = grad.scalar_type() == torch::kBFloat16 || grad.scalar_type() == torch::kHalf;
  if (!half || grad.numel() <= kClipNormPiece || !grad.is_contiguous()) {
    // float32 accumulation and result for every gradient dtype
    norms.push_back(at::linalg_vector_norm(grad, 2, std::nullopt, false, torch::kFloat));
    return;
  }
  const torch::Tensor flat = grad.view({-1});
  for (int64_t lo = 0; lo < flat.numel(); lo += kClipNormPiece) {
    const torch::Tensor piece = flat.slice(0, lo, std::min(lo + kClipNormPiece, flat.numel()));
    norms.push_back(at::linalg_vector_norm(piece, 2, std::nullopt, false, torch::kFloat));
  }
}

}  // namespace

double clip_grad_norm(Adam& optimizer, double max_norm) {
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> norms;
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& p : group.params()) {
      if (p.grad().defined()) {
        append_norms(p.grad(), norms);
      }
    }
  }
  if (norms.empty()) {
    return 0.0;
  }
  // As torch::nn::utils::clip_grad_norm_, operation for operation (float32 tensors throughout).
  const torch::Tensor total = norms.size() == 1 ? norms[0] : torch::stack(norms).norm(2);
  const torch::Tensor coefficient = torch::clamp(max_norm / (total + 1e-6), std::nullopt, 1.0);
  optimizer.scale_next_gradients(coefficient.item<float>());
  return total.item<double>();
}

template <typename Self, typename Archive>
void Adam::serialize(Self& self, Archive& archive) {
  torch::optim::serialize<AdamParamState, AdamOptions>(archive, self);
}

void Adam::save(torch::serialize::OutputArchive& archive) const { serialize(*this, archive); }

void Adam::load(torch::serialize::InputArchive& archive) {
  // What we have, to restore if the archive does not fit: torch's loader overwrites the state of
  // the archive's parameters and every group's options, and keeps the other states.
  std::vector<std::unique_ptr<torch::optim::OptimizerOptions>> options_before;
  for (const auto& group : param_groups_) {
    options_before.push_back(group.options().clone());
  }
  auto state_before = std::move(state_);
  state_.clear();
  const auto restore = [&] {
    state_ = std::move(state_before);
    for (const auto g : c10::irange(param_groups_.size())) {
      param_groups_[g].set_options(options_before[g]->clone());
    }
  };
  try {
    serialize(*this, archive);
  } catch (...) {
    restore();
    throw;
  }
  for (const auto g : c10::irange(param_groups_.size())) {
    // Read before any restore(): it replaces (frees) the loaded options object.
    const auto& loaded_options = static_cast<const AdamOptions&>(param_groups_[g].options());
    const auto& wanted_options = static_cast<const AdamOptions&>(*options_before[g]);
    const bool loaded_kahan = loaded_options.kahan_sum(), wanted_kahan = wanted_options.kahan_sum();
    const auto loaded = loaded_options.state_dtype();
    const auto wanted = wanted_options.state_dtype();
    if (loaded_kahan != wanted_kahan) {
      restore();
      TORCH_CHECK(false, "roundpipe::optim::Adam::load: param group ", g, " of the archive has kahan_sum ",
                  loaded_kahan ? "true" : "false", " but this optimizer's group ", g, " has kahan_sum ",
                  wanted_kahan ? "true" : "false", "; construct the optimizer with AdamOptions().kahan_sum(",
                  loaded_kahan ? "true" : "false",
                  ") (and parameters of the dtype it was saved with) to resume from this archive (the optimizer was "
                  "left unchanged)");
    }
    if (loaded != wanted) {
      restore();
      TORCH_CHECK(false, "roundpipe::optim::Adam::load: param group ", g, " of the archive has state_dtype ",
                  dtype_name(loaded), " but this optimizer's group ", g, " has state_dtype ", dtype_name(wanted),
                  "; construct the optimizer with AdamOptions().state_dtype(AdamStateDtype::",
                  loaded == AdamStateDtype::kInt8 ? "kInt8" : "kFloat32",
                  ") to resume from this archive (the optimizer was left unchanged)");
    }
  }
  for (auto& [key, value] : state_before) {
    if (state_.find(key) == state_.end()) {
      state_[key] = std::move(value);
    }
  }
}

}  // namespace roundpipe::optim
