// Calling one layer of a Sequential with the activations passed between layers (internal).
#pragma once

#include <torch/nn/modules/container/any.h>

#include <atomic>
#include <vector>

namespace roundpipe::detail {

using Activations = std::vector<at::Tensor>;

/// How a layer's forward takes the activations; found on the first call, then cached.
enum class CallMode : int { kUnknown = 0, kTensor, kTensors, kVector };

/// Calls `layer` with `acts`: as forward(Tensor) when there is one activation, as
/// forward(Tensor, Tensor, ...) or forward(std::vector<Tensor>) otherwise, trying in that order
/// on the first call (an argument-type mismatch is detected before the layer runs) and caching
/// the result in `mode` (shared by all threads; benign races store the same value, or, for a
/// layer called with one activation at times and several at others, a value that serves both:
/// kTensors also calls forward(Tensor) with one, kTensor is detected again with several). The
/// output may be a Tensor or a std::vector<Tensor>.
Activations call_layer(torch::nn::AnyModule& layer, const Activations& acts, std::atomic<int>& mode);

}  // namespace roundpipe::detail
