// TokenEmbedding's lookup with a gradient that accumulates in place (internal; Note [Embedding
// gradient in place] in token_embedding.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace roundpipe::models::detail {

/// at::embedding(weight, ids, padding_idx) (padding_idx -1: none), differentiable in `weight`.
/// Its weight gradient equals at::embedding's bitwise; when the weight already has a dense .grad
/// of its dtype it is added into that .grad in place, rows of the batch's tokens only.
at::Tensor embedding_lookup(const at::Tensor& weight, const at::Tensor& ids, int64_t padding_idx);

}  // namespace roundpipe::models::detail
