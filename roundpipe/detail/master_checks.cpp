#include "roundpipe/detail/master_checks.h"

#include <c10/util/Exception.h>

namespace roundpipe::detail {

void check_master_dtype(c10::ScalarType dtype, const std::string& what) {
  TORCH_CHECK(c10::isFloatingType(dtype), what, " is ", dtype, ": master weights need a floating-point dtype, e.g. "
              "RoundPipeOptions().optim_dtype(torch::kFloat32)");
  TORCH_CHECK(dtype != c10::kHalf, what, " is float16 (torch::kHalf): float16 master weights lose small updates "
              "(and overflow above 65504), so training stalls or diverges. Keep float32 masters (RoundPipeOptions()."
              "optim_dtype(torch::kFloat32)) with float16 compute copies, and scale the loss with "
              "roundpipe::amp::GradScaler");
}

void check_parameter_master_dtypes(const std::vector<std::vector<at::Tensor>>& params) {
  for (size_t l = 0; l < params.size(); ++l) {
    for (size_t k = 0; k < params[l].size(); ++k) {
      if (!params[l][k].requires_grad()) continue;
      check_master_dtype(params[l][k].scalar_type(), "the master copy of layer " + std::to_string(l) +
                                                         "'s parameter " + std::to_string(k) +
                                                         " (in the parameter's own dtype: RoundPipeOptions::"
                                                         "optim_dtype is unset)");
    }
  }
}

// Note [Untouched masters]:
// RoundPipe moves the gradients from the compute copies into the master copies before a step
// function runs, and writes the masters back after it. An optimizer built on the compute copies
// (module()->parameters(), or RoundPipe::parameters() outside an OptimizerCtx) therefore finds
// no gradient and does nothing, and the masters' gradients pile up: training silently stops.
// Every optimizer step or zero_grad on the masters bumps a master's version counter or replaces,
// clears or writes its .grad, so a step function that changes none of these while gradients are
// pending did not train. One such step is legitimate (GradScaler skipping an overflowed step
// still zeroes gradients, but a step function may also accumulate on purpose), so the error
// comes after kUntouchedStepsLimit of them in a row; an empty step function is not checked.

std::vector<MasterWatch::Snapshot> MasterWatch::snapshot() const {
  std::vector<Snapshot> out;
  for (const auto& layer : *masters_) {
    for (const auto& m : layer) {
      if (!m.defined()) continue;
      Snapshot s;
      s.data = m.unsafeGetTensorImpl()->storage().data();
      s.version = m._version();
      if (m.grad().defined()) {
        s.grad = m.grad().unsafeGetTensorImpl();
        s.grad_version = m.grad()._version();
      }
      out.push_back(s);
    }
  }
  return out;
}

std::function<void()> MasterWatch::wrap(std::function<void()> step_fn) {
  if (!step_fn) return step_fn;
  return [this, fn = std::move(step_fn)] {
    const std::vector<Snapshot> before = snapshot();
    fn();
    bool pending = false;
    for (const auto& s : before) pending = pending || s.grad != nullptr;
    const std::vector<Snapshot> after = snapshot();
    bool touched = after.size() != before.size();
    for (size_t i = 0; !touched && i < before.size(); ++i) {
      touched = before[i].data != after[i].data || before[i].version != after[i].version ||
                before[i].grad != after[i].grad || before[i].grad_version != after[i].grad_version;
    }
    untouched_steps_ = pending && !touched ? untouched_steps_ + 1 : 0;
    const int64_t untouched = untouched_steps_;
    // Reported once: a step queued before the caller saw this error counts afresh.
    if (untouched >= kUntouchedStepsLimit) untouched_steps_ = 0;
    TORCH_CHECK(untouched < kUntouchedStepsLimit, "RoundPipe::step: the step function left every master "
                "weight and its gradient untouched in ", untouched, " consecutive steps with gradients "
                "pending: is the optimizer built on the compute copies (module()->parameters(), or "
                "RoundPipe::parameters() outside an OptimizerCtx)? They never hold gradients when it runs, so it "
                "does nothing. Build it on model.optim_parameters(), or construct it inside a "
                "roundpipe::OptimizerCtx scope (docs/errors.md)");
  };
}

}  // namespace roundpipe::detail
