#include "roundpipe/recompute_data.h"

#include <c10/util/Exception.h>

#include <utility>

namespace roundpipe {
namespace {

// The calling thread's current layer pass (Note [Recompute data]); set by RecomputePassScope.
thread_local detail::RecomputeSlot* current_slot = nullptr;
thread_local detail::PassKind current_kind = detail::PassKind::kPlain;
thread_local c10::Device current_device = c10::kCPU;

}  // namespace

void save_for_recompute(const std::string& key, std::vector<at::Tensor> tensors) {
  if (current_kind != detail::PassKind::kSaves || current_slot == nullptr) return;
  for (auto& [k, v] : current_slot->entries) {
    if (k == key) {
      v = std::move(tensors);
      return;
    }
  }
  current_slot->entries.emplace_back(key, std::move(tensors));
}

std::optional<std::vector<at::Tensor>> recompute_data(const std::string& key) {
  if (current_kind != detail::PassKind::kReplays || current_slot == nullptr) return std::nullopt;
  for (const auto& [k, v] : current_slot->entries) {
    if (k != key) continue;
    std::vector<at::Tensor> out;
    out.reserve(v.size());
    for (const at::Tensor& t : v) {
      const bool moves = t.defined() && !t.device().is_cpu() && t.device() != current_device;
      out.push_back(moves ? t.to(current_device) : t);
    }
    return out;
  }
  return std::nullopt;
}

bool in_recompute() { return current_kind == detail::PassKind::kReplays; }

namespace detail {

RecomputePassScope::RecomputePassScope(RecomputeSlot* slot, PassKind kind, c10::Device device)
    : previous_slot_(current_slot), previous_kind_(current_kind), previous_device_(current_device) {
  TORCH_INTERNAL_ASSERT(kind == PassKind::kPlain || slot != nullptr, "a saving or replaying pass needs a slot");
  current_slot = slot;
  current_kind = kind;
  current_device = device;
}

RecomputePassScope::~RecomputePassScope() {
  current_slot = previous_slot_;
  current_kind = previous_kind_;
  current_device = previous_device_;
}

}  // namespace detail
}  // namespace roundpipe
