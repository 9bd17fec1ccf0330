// Checks shared by roundpipe::optim's optimizers on the tensors a step reads (internal).
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

#include "optim/detail/adam_kernel.h"

namespace roundpipe::optim::detail {

/// Throws c10::Error unless `p` is a dense, contiguous float32 CPU tensor. `who` names the
/// optimizer in the message (e.g. "roundpipe::optim::Adam").
void check_master_param(const at::Tensor& p, const char* who);

/// `p`'s gradient (which must be defined), checked: dense, on the CPU, float32 / float16 /
/// bfloat16, `p`'s shape. A non-contiguous one is copied and the copy kept in `keep_alive`.
at::Tensor step_grad(const at::Tensor& p, const char* who, std::vector<at::Tensor>& keep_alive);

/// The kernel's name for `grad`'s dtype (one step_grad accepted).
GradDtype grad_dtype_of(const at::Tensor& grad);

}  // namespace roundpipe::optim::detail
