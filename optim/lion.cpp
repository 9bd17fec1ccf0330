#include "optim/lion.h"

#include <c10/util/irange.h>
#include <torch/optim/serialize.h>
#include <torch/serialize/archive.h>

#include <string>

#include "optim/detail/lion_kernel.h"
#include "optim/detail/parallel_tasks.h"
#include "optim/detail/step_inputs.h"

namespace roundpipe::optim {

namespace {

constexpr const char* kWho = "roundpipe::optim::Lion";

void check_options(const LionOptions& o, const std::string& where) {
  TORCH_CHECK(o.lr() >= 0, kWho, ": invalid learning rate lr=", o.lr(), " in ", where, "; use lr >= 0");
  const auto [beta1, beta2] = o.betas();
  TORCH_CHECK(0 <= beta1 && beta1 <= 1.0, kWho, ": invalid beta parameter at index 0: ", beta1, " in ", where,
              "; betas must lie in [0, 1]");
  TORCH_CHECK(0 <= beta2 && beta2 <= 1.0, kWho, ": invalid beta parameter at index 1: ", beta2, " in ", where,
              "; betas must lie in [0, 1]");
  TORCH_CHECK(o.weight_decay() >= 0, kWho, ": invalid weight_decay=", o.weight_decay(), " in ", where,
              "; use weight_decay >= 0");
}

}  // namespace

// ---- LionOptions -------------------------------------------------------------------------------

LionOptions::LionOptions(double lr) : lr_(lr) {}

bool operator==(const LionOptions& lhs, const LionOptions& rhs) {
  return lhs.lr() == rhs.lr() && lhs.betas() == rhs.betas() && lhs.weight_decay() == rhs.weight_decay();
}

void LionOptions::serialize(torch::serialize::OutputArchive& archive) const {
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(lr);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(betas);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(weight_decay);
}

void LionOptions::serialize(torch::serialize::InputArchive& archive) {
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, lr);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(betas_t, betas);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, weight_decay);
}

double LionOptions::get_lr() const { return lr(); }

void LionOptions::set_lr(const double lr) { this->lr(lr); }

// ---- LionParamState ----------------------------------------------------------------------------

bool operator==(const LionParamState& lhs, const LionParamState& rhs) {
  return lhs.step() == rhs.step() && lhs.exp_avg().defined() == rhs.exp_avg().defined() &&
         (!lhs.exp_avg().defined() || torch::equal(lhs.exp_avg(), rhs.exp_avg()));
}

void LionParamState::serialize(torch::serialize::OutputArchive& archive) const {
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(step);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(exp_avg);
}

void LionParamState::serialize(torch::serialize::InputArchive& archive) {
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(int64_t, step);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(torch::Tensor, exp_avg);
}

// ---- Lion --------------------------------------------------------------------------------------

Lion::Lion(const std::vector<torch::optim::OptimizerParamGroup>& param_groups, LionOptions defaults)
    : Optimizer(param_groups, std::make_unique<LionOptions>(defaults)) {
  check_options(defaults, "the default options");
  for (const auto g : c10::irange(param_groups_.size())) {
    check_options(static_cast<const LionOptions&>(param_groups_[g].options()), "param group " + std::to_string(g));
    for (const auto& p : param_groups_[g].params()) detail::check_master_param(p, kWho);
  }
}

Lion::Lion(std::vector<torch::Tensor> params, LionOptions defaults)
    : Lion(std::vector<torch::optim::OptimizerParamGroup>{torch::optim::OptimizerParamGroup(std::move(params))},
           std::move(defaults)) {}

void Lion::set_num_threads(int64_t num_threads) {
  TORCH_CHECK(num_threads >= 0, kWho, "::set_num_threads: got ", num_threads,
              "; use 0 (all intra-op threads) or a positive count");
  num_threads_ = num_threads;
}

torch::Tensor Lion::step(LossClosure closure) {
  torch::NoGradGuard no_grad;
  torch::Tensor loss;
  if (closure != nullptr) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  std::vector<detail::LionTensor> jobs;
  std::vector<torch::Tensor> keep_alive;  // contiguous copies of non-contiguous gradients
  for (const auto g : c10::irange(param_groups_.size())) {
    const auto& options = static_cast<const LionOptions&>(param_groups_[g].options());
    check_options(options, "param group " + std::to_string(g));
    const auto [beta1, beta2] = options.betas();
    for (auto& p : param_groups_[g].params()) {
      if (!p.grad().defined()) continue;
      detail::check_master_param(p, kWho);
      const torch::Tensor grad = detail::step_grad(p, kWho, keep_alive);
      auto& slot = state_[p.unsafeGetTensorImpl()];
      if (!slot) {
        auto fresh = std::make_unique<LionParamState>();
        fresh->exp_avg(torch::zeros_like(p, torch::MemoryFormat::Contiguous));
        slot = std::move(fresh);
      }
      auto& state = static_cast<LionParamState&>(*slot);
      state.exp_avg(detail::state_buffer(state.exp_avg(), p, "exp_avg", kWho));
      state.step(state.step() + 1);
      detail::LionTensor job;
      job.param = p.data_ptr<float>();
      job.grad = grad.const_data_ptr();
      job.grad_dtype = detail::grad_dtype_of(grad);
      job.exp_avg = state.exp_avg().data_ptr<float>();
      job.numel = p.numel();
      const double lr = options.lr();
      auto& sc = job.scalars;
      sc.decay = static_cast<float>(1 - lr * options.weight_decay());
      sc.beta1 = static_cast<float>(beta1);
      sc.one_minus_beta1 = static_cast<float>(1 - beta1);
      sc.neg_lr = static_cast<float>(-lr);
      sc.beta2 = static_cast<float>(beta2);
      sc.one_minus_beta2 = static_cast<float>(1 - beta2);
      if (job.numel > 0) jobs.push_back(job);
    }
  }
  const int64_t threads = detail::run_split_jobs(jobs, num_threads_, detail::lion_update_fn(detail::best_cpu_isa()));
  if (threads > 0) last_step_threads_ = threads;
  return loss;
}

void Lion::save(torch::serialize::OutputArchive& archive) const {
  torch::optim::serialize<LionParamState, LionOptions>(archive, *this);
}

void Lion::load(torch::serialize::InputArchive& archive) {
  torch::optim::serialize<LionParamState, LionOptions>(archive, *this);
}

}  // namespace roundpipe::optim
