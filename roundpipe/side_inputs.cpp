#include "roundpipe/side_inputs.h"

#include <utility>

namespace roundpipe {
namespace {

// The calling thread's innermost scope; written only by SideInputScope on its own thread.
thread_local SideInputScope* current_scope = nullptr;

}  // namespace

std::optional<at::Tensor> side_input(const std::string& name) {
  SideInputScope* scope = current_scope;
  if (scope == nullptr) return std::nullopt;
  auto it = scope->inputs_.find(name);
  if (it == scope->inputs_.end() || !it->second.defined()) return std::nullopt;
  at::Tensor& t = it->second;
  // Moved once per scope (a stage job's microbatch), not once per layer call.
  if (scope->device_ && t.device() != *scope->device_) t = t.to(*scope->device_);
  return t;
}

SideInputScope::SideInputScope(SideInputs inputs) : inputs_(std::move(inputs)), previous_(current_scope) {
  current_scope = this;
}

SideInputScope::SideInputScope(SideInputs inputs, c10::Device device)
    : inputs_(std::move(inputs)), device_(device), previous_(current_scope) {
  current_scope = this;
}

SideInputScope::~SideInputScope() { current_scope = previous_; }

SideInputs SideInputScope::current() { return current_scope == nullptr ? SideInputs{} : current_scope->inputs_; }

}  // namespace roundpipe
