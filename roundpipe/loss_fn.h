// LossFn: the per-microbatch loss callback of RoundPipe::forward_backward (roundpipe/round_pipe.h).
// Its own header so that the runtime's internals (roundpipe/detail/) can name it without
// including the RoundPipe facade they implement.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>

namespace roundpipe {

/// Computes a microbatch's loss from the model output and that microbatch's rows of the label.
/// Runs on a device worker thread. Normalize inside it (e.g. sum-reduced loss / full batch size).
using LossFn = std::function<at::Tensor(const at::Tensor& output, const at::Tensor& label)>;

}  // namespace roundpipe
