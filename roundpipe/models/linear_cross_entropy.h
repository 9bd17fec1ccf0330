// The LM head's projection and the cross-entropy loss fused and chunked over tokens: the loss of
// hidden states against a vocabulary-sized weight without ever holding the [tokens, vocab] logits,
// for long sequences (docs/models.md, "Long sequences"). Used by LmHead (layers.h) when it is
// given labels; usable on its own with any hidden states and output weight.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <torch/arg.h>

#include <cstdint>

namespace roundpipe::models {

/// The label value that contributes no loss (transformers' and torch.nn.CrossEntropyLoss' -100).
inline constexpr int64_t kIgnoreIndex = -100;

/// Options of linear_cross_entropy.
struct LinearCrossEntropyOptions {
  /// Bytes of the per-chunk logits buffers (fp32 logits/gradient plus, for a bf16/fp16 model, the
  /// low-precision copies the matrix products read and write). The chunk holds
  /// max(1, chunk_bytes / (vocab x bytes per logit)) tokens: loss_chunk_tokens().
  TORCH_ARG(int64_t, chunk_bytes) = int64_t{256} << 20;
  /// Targets equal to this contribute nothing to the loss or the gradients.
  TORCH_ARG(int64_t, ignore_index) = kIgnoreIndex;
};

/// Tokens per chunk for `vocab` logits of a model in `dtype` under `chunk_bytes`: a bf16/fp16
/// model needs 8 bytes a logit at the chunk's peak (the product's low-precision logits while the
/// fp32 copy is made, then the fp32 gradient and its low-precision copy for the two gradient
/// products), an fp32 model 4 (one buffer, turned into the gradient in place).
int64_t loss_chunk_tokens(int64_t vocab, c10::ScalarType dtype, int64_t chunk_bytes);

/// Summed cross-entropy of logits = hidden W^T against `targets`, computed chunk by chunk:
///   sum over positions i with targets[i] != ignore_index of logsumexp(logits[i]) - logits[i, targets[i]]
/// hidden [..., H] (any float dtype; W's dtype), weight [V, H], targets [...] (integer, the
/// target of each position: already shifted, see shift_labels). Returns a 0-dim float32 tensor.
/// The logits of a chunk are the product in the model's dtype, upcast to float32 (as
/// transformers' `logits.float()`); the loss, log-sum-exp and softmax are float32, the gradient
/// of the weight is accumulated over the chunks in float32 and cast to its dtype at the end.
///
/// When autograd records (grad mode on and hidden or weight requires grad), the gradients of
/// hidden and weight are computed during this call, chunk by chunk (docs/models.md, "Long sequences"),
/// and backward only scales them by the loss's gradient; the graph supports one backward. Without
/// autograd only the loss is computed (evaluation), one chunk's logits at a time.
/// Divide by the number of trained tokens outside (e.g. those of the whole step) for a mean.
at::Tensor linear_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
                                const LinearCrossEntropyOptions& options = {});

/// Evaluation (no autograd): a [2] float32 tensor {the summed loss of linear_cross_entropy, the
/// number of positions whose largest logit is their target}; ignored positions count in neither,
/// and a tie counts for the first largest logit (argmax). Accuracy = correct / trained tokens.
at::Tensor linear_cross_entropy_and_correct(const at::Tensor& hidden, const at::Tensor& weight,
                                            const at::Tensor& targets, const LinearCrossEntropyOptions& options = {});

/// transformers' label convention -> per-position targets: labels [B, T] (input ids, -100 where
/// ignored) shifted left by one, the last position ignored (ForCausalLMLoss's shift).
at::Tensor shift_labels(const at::Tensor& labels);

}  // namespace roundpipe::models
