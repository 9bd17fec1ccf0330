// Where the modules of roundpipe/models allocate their parameters in reset() (internal).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/TensorOptions.h>

namespace roundpipe::models::detail {

/// Parameters of a fresh module use the construction options; those of a clone (whose member
/// handles still point at the source's tensors when reset() runs) use the source's current
/// dtype and device, so a clone of a module moved with ->to() is allocated where it will live.
inline at::TensorOptions param_options(const at::Tensor& current, const at::TensorOptions& fallback) {
  return current.defined() ? current.options() : fallback;
}

}  // namespace roundpipe::models::detail
