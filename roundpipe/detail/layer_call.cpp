#include "roundpipe/detail/layer_call.h"

#include <c10/util/Exception.h>

#include <string>

namespace roundpipe::detail {
namespace {

bool is_signature_mismatch(const c10::Error& e) {
  const std::string msg = e.msg();
  return msg.rfind("Expected argument #", 0) == 0 || msg.find("forward() method expects") != std::string::npos;
}

torch::nn::AnyValue invoke(torch::nn::AnyModule& layer, const Activations& acts, CallMode mode) {
  switch (mode) {
    case CallMode::kTensor:
      return layer.any_forward(acts.at(0));
    case CallMode::kTensors:
      // A layer with default arguments is called with fewer tensors at times (a head that takes the
      // label in training, not in forward(inputs)).
      if (acts.size() == 1) return layer.any_forward(acts[0]);
      if (acts.size() == 2) return layer.any_forward(acts[0], acts[1]);
      if (acts.size() == 3) return layer.any_forward(acts[0], acts[1], acts[2]);
      if (acts.size() == 4) return layer.any_forward(acts[0], acts[1], acts[2], acts[3]);
      break;
    case CallMode::kVector:
      return layer.any_forward(acts);
    case CallMode::kUnknown:
      break;
  }
  TORCH_CHECK(false, "Expected argument #0: no call mode for ", acts.size(), " activations");
}

Activations to_activations(torch::nn::AnyValue&& value) {
  if (auto* t = value.try_get<at::Tensor>()) return {std::move(*t)};
  if (auto* v = value.try_get<std::vector<at::Tensor>>()) return std::move(*v);
  TORCH_CHECK(false, "a layer returned a value of type ", c10::demangle(value.type_info().name()),
              ": layers must return a torch::Tensor or a std::vector<torch::Tensor>");
}

}  // namespace

Activations call_layer(torch::nn::AnyModule& layer, const Activations& acts, std::atomic<int>& mode) {
  auto cached = static_cast<CallMode>(mode.load(std::memory_order_relaxed));
  // kTensor was found with one activation; more (a label appended) need detecting again.
  if (cached == CallMode::kTensor && acts.size() != 1) cached = CallMode::kUnknown;
  if (cached != CallMode::kUnknown) return to_activations(invoke(layer, acts, cached));
  std::vector<CallMode> candidates;
  if (acts.size() == 1) candidates.push_back(CallMode::kTensor);
  if (acts.size() >= 2 && acts.size() <= 4) candidates.push_back(CallMode::kTensors);
  candidates.push_back(CallMode::kVector);
  std::string tried;
  for (CallMode candidate : candidates) {
    try {
      auto out = invoke(layer, acts, candidate);
      mode.store(static_cast<int>(candidate), std::memory_order_relaxed);
      return to_activations(std::move(out));
    } catch (const c10::Error& e) {
      if (!is_signature_mismatch(e)) throw;
      tried += std::string("\n  ") + e.msg();
    }
  }
  TORCH_CHECK(false, "cannot call the layer with ", acts.size(), " activation tensor(s): its forward() must take ",
              "torch::Tensor, several torch::Tensor arguments, or std::vector<torch::Tensor>. Tried:", tried);
}

}  // namespace roundpipe::detail
