// Checks shared by roundpipe::optim's optimizers on the tensors a step reads (internal).
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

#include "optim/detail/adam_kernel.h"

namespace roundpipe::optim::detail {

/// Throws c10::Error unless `p` is a dense, contiguous float32 CPU tensor. `who` names the
/// optimizer in the message (e.g. "roundpipe::optim::Adam").
void check_master_param(const at::Tensor& p, const char* who);

/// Throws c10::Error unless the bfloat16 parameter `p` (an Adam bf16 master with Kahan
/// compensation) is dense, contiguous and on the CPU.
void check_bf16_master_param(const at::Tensor& p, const char* who);

/// `p`'s gradient (which must be defined), checked: dense, on the CPU, float32 / float16 /
/// bfloat16, `p`'s shape. A non-contiguous one is copied and the copy kept in `keep_alive`.
at::Tensor step_grad(const at::Tensor& p, const char* who, std::vector<at::Tensor>& keep_alive);

/// An optimizer state tensor the kernel can use: defined and of `param`'s shape (else c10::Error
/// naming `name`: a loaded state dict that does not match), made fp32, contiguous and on the CPU
/// if it is not (states loaded from an archive may come in another layout).
at::Tensor state_buffer(at::Tensor buffer, const at::Tensor& param, const char* name, const char* who);

/// The kernel's name for `grad`'s dtype (one step_grad accepted).
GradDtype grad_dtype_of(const at::Tensor& grad);

}  // namespace roundpipe::optim::detail
