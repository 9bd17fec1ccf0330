// Side inputs: per-row tensors that travel beside a batch's activations to every layer (a packed
// batch's positions and segment ids), without being passed from layer to layer. RoundPipe splits
// them into microbatches like its inputs and gives each layer pass its microbatch's rows, in forward
// stages, the fused tail and recompute alike (docs/architecture.md, "Side inputs").
//
//   {
//     roundpipe::SideInputScope side({{"segment_ids", ids}, {"positions", pos}});
//     loss = model.forward_backward({tokens}, labels, loss_fn);  // or a plain model->forward(x)
//   }
//   // inside a layer's forward:
//   if (auto ids = roundpipe::side_input("segment_ids")) { ... *ids is [rows, ...] on x's device ... }
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <map>
#include <optional>
#include <string>

namespace roundpipe {

/// Named side inputs of a batch; each tensor has the batch's rows along dim 0.
using SideInputs = std::map<std::string, at::Tensor>;

/// The calling thread's side input `name`, on the device of the current scope (the pass's device
/// inside RoundPipe; where the tensor is, outside it), or nullopt when no scope is active or it
/// holds no such name. Each tensor is moved at most once per scope.
std::optional<at::Tensor> side_input(const std::string& name);

/// Installs side inputs on the calling thread for the scope's lifetime (nestable: the previous
/// scope is restored after). On the caller's thread it is also what RoundPipe::forward_backward and
/// forward pass to their layers: they split every tensor along dim 0 into the call's microbatches
/// (it must have the inputs' rows) and install each microbatch's rows on the worker for each of its
/// layer passes, moved to the pass's device, as they do with the caller's autocast state.
/// Thread-safety: the scope and what side_input returns belong to the thread that made the scope;
/// `inputs` is copied (tensor handles), so it need not outlive the scope.
class SideInputScope {
 public:
  explicit SideInputScope(SideInputs inputs);
  /// Inside RoundPipe: tensors are moved to `device` when first read.
  SideInputScope(SideInputs inputs, c10::Device device);
  ~SideInputScope();
  SideInputScope(const SideInputScope&) = delete;
  SideInputScope& operator=(const SideInputScope&) = delete;

  /// The side inputs of the innermost scope on the calling thread (empty when none).
  static SideInputs current();

 private:
  friend std::optional<at::Tensor> side_input(const std::string& name);
  SideInputs inputs_;  // as given; on device_ once read, if device_ is set
  std::optional<c10::Device> device_;
  SideInputScope* previous_;
};

}  // namespace roundpipe
