#include "optim/detail/step_inputs.h"

#include <c10/util/Exception.h>

namespace roundpipe::optim::detail {

void check_master_param(const at::Tensor& p, const char* who) {
  TORCH_CHECK(p.defined(), who, ": got an undefined parameter tensor");
  TORCH_CHECK(p.device().is_cpu() && p.scalar_type() == at::kFloat && p.layout() == at::kStrided, who,
              ": parameters must be dense float32 CPU tensors, got ", p.toString(), " of shape ", p.sizes(), " on ",
              p.device(),
              "; keep fp32 master weights on the CPU (RoundPipeOptions().optim_dtype(torch::kFloat)) "
              "or use torch::optim's optimizers");
  TORCH_CHECK(p.is_contiguous(), who, ": parameter of shape ", p.sizes(),
              " is not contiguous; pass contiguous parameters (e.g. leaf tensors made with .contiguous())");
}

void check_bf16_master_param(const at::Tensor& p, const char* who) {
  TORCH_CHECK(p.device().is_cpu() && p.layout() == at::kStrided, who,
              ": bfloat16 master weights must be dense CPU tensors, got ", p.toString(), " of shape ", p.sizes(),
              " on ", p.device(), "; keep the masters on the CPU");
  TORCH_CHECK(p.is_contiguous(), who, ": bfloat16 parameter of shape ", p.sizes(),
              " is not contiguous; pass contiguous parameters (e.g. leaf tensors made with .contiguous())");
}

at::Tensor step_grad(const at::Tensor& p, const char* who, std::vector<at::Tensor>& keep_alive) {
  at::Tensor grad = p.grad();
  TORCH_CHECK(!grad.is_sparse(), who, " does not support sparse gradients; use torch::optim::SparseAdam");
  const auto type = grad.scalar_type();
  TORCH_CHECK(grad.device().is_cpu() && (type == at::kFloat || type == at::kHalf || type == at::kBFloat16) &&
                  grad.sizes() == p.sizes(),
              who, ": the gradient of a parameter of shape ", p.sizes(),
              " must be a float32, float16 or bfloat16 CPU tensor of the same shape, got ", grad.toString(),
              " of shape ", grad.sizes(), " on ", grad.device(),
              "; convert gradients to the master dtype before step()");
  if (!grad.is_contiguous()) {
    grad = grad.contiguous();
    keep_alive.push_back(grad);
  }
  return grad;
}

at::Tensor state_buffer(at::Tensor buffer, const at::Tensor& param, const char* name, const char* who) {
  TORCH_CHECK(buffer.defined(), who, ": state '", name, "' is missing for a parameter of shape ", param.sizes(),
              "; the loaded state dict does not match this optimizer");
  TORCH_CHECK(buffer.sizes() == param.sizes(), who, ": state '", name, "' has shape ", buffer.sizes(),
              " but its parameter has shape ", param.sizes(), "; the loaded state dict does not match the parameters");
  if (buffer.scalar_type() != at::kFloat || !buffer.is_contiguous() || !buffer.device().is_cpu()) {
    buffer = buffer.to(at::kCPU, at::kFloat).contiguous();
  }
  return buffer;
}

GradDtype grad_dtype_of(const at::Tensor& grad) {
  switch (grad.scalar_type()) {
    case at::kHalf:
      return GradDtype::kHalf;
    case at::kBFloat16:
      return GradDtype::kBFloat16;
    default:
      return GradDtype::kFloat;
  }
}

}  // namespace roundpipe::optim::detail
