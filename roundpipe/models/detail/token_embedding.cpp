#include "roundpipe/models/detail/token_embedding.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>

#include <tuple>

#include "roundpipe/models/detail/grad_in_place.h"

namespace roundpipe::models::detail {
namespace {

// Note [Embedding gradient in place]:
// Autograd hands the weight of an embedding one dense [vocab, hidden] gradient per backward pass
// (zeros, then the rows of the batch's tokens) and adds it into the weight's .grad. With several
// microbatches, two vocab x hidden tensors then exist at once at the very end of the backward
// pass, when every other gradient exists too: it was the host peak of CPU-device runs (+0.4 B/param
// for a 194M Llama with a 32K vocabulary, docs/benchmarks.md), and every microbatch zero-filled and
// added a whole table. When the weight is a leaf that already has a dense .grad of the gradient's
// dtype (and grad mode is off, i.e. no create_graph), the backward here instead sums the batch's
// rows per distinct token, in token order with a rounding to the dtype after each add (what
// embedding_dense_backward does per row), and adds those sums into .grad in place (index_add_ over
// distinct rows: one rounding each, as AccumulateGrad's `grad += new_grad`); it returns no
// gradient for the weight. The .grad is bitwise the one autograd would make (tests/models/
// token_embedding_test.cpp), in O(tokens x hidden) memory and work. Otherwise (first microbatch,
// create_graph, a non-leaf weight, a sparse or other-dtype .grad) the dense gradient as before.
// Gradient hooks registered on the weight do not see the part added in place.
class EmbeddingLookup : public torch::autograd::Function<EmbeddingLookup> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& weight, const at::Tensor& ids,
                            int64_t padding_idx) {
    ctx->saved_data["weight"] = weight;  // not save_for_backward: no version check on the weight
    ctx->saved_data["ids"] = ids;
    ctx->saved_data["padding_idx"] = padding_idx;
    return at::embedding(weight, ids, padding_idx);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    const at::Tensor weight = ctx->saved_data["weight"].toTensor();
    const at::Tensor ids = ctx->saved_data["ids"].toTensor();
    const int64_t padding_idx = ctx->saved_data["padding_idx"].toInt();
    const at::Tensor& grad = grad_outputs.at(0);
    if (!ctx->needs_input_grad(0) || !grad.defined()) return {at::Tensor(), at::Tensor(), at::Tensor()};
    at::Tensor existing = grad_to_add_into(weight, grad.scalar_type(), grad.device());
    if (existing.defined()) {
      add_rows(existing, ids, grad, padding_idx);
      return {at::Tensor(), at::Tensor(), at::Tensor()};
    }
    return {at::embedding_dense_backward(grad, ids, weight.size(0), padding_idx, /*scale_grad_by_freq=*/false),
            at::Tensor(), at::Tensor()};
  }

 private:
  static void add_rows(at::Tensor& target, const at::Tensor& ids, const at::Tensor& grad, int64_t padding_idx) {
    const at::Tensor flat_ids = ids.reshape({-1}).to(at::kLong).contiguous();
    const int64_t tokens = flat_ids.numel(), width = target.size(1);
    const at::Tensor rows = grad.reshape({tokens, width}).contiguous();
    const auto unique = at::_unique2(flat_ids, /*sorted=*/true, /*return_inverse=*/true);
    const at::Tensor& distinct = std::get<0>(unique);
    const at::Tensor& slot = std::get<1>(unique);
    at::Tensor sums = at::zeros({distinct.numel(), width}, rows.options());
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, rows.scalar_type(), "embedding_lookup_backward", [&] {
      const scalar_t* in = rows.const_data_ptr<scalar_t>();
      scalar_t* out = sums.mutable_data_ptr<scalar_t>();
      const int64_t* id = flat_ids.const_data_ptr<int64_t>();
      const int64_t* at_slot = slot.const_data_ptr<int64_t>();
      for (int64_t i = 0; i < tokens; ++i) {
        if (id[i] == padding_idx) continue;
        scalar_t* sum = out + at_slot[i] * width;
        const scalar_t* row = in + i * width;
        for (int64_t j = 0; j < width; ++j) sum[j] = sum[j] + row[j];  // rounded to scalar_t each time
      }
    });
    target.index_add_(0, distinct, sums);
  }
};

}  // namespace

at::Tensor embedding_lookup(const at::Tensor& weight, const at::Tensor& ids, int64_t padding_idx) {
  return EmbeddingLookup::apply(weight, ids, padding_idx);
}

}  // namespace roundpipe::models::detail
