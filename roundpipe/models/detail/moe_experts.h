// The expert MLPs of a mixture-of-experts layer over token rows sorted by expert (internal to
// roundpipe/models/moe.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace roundpipe::models::detail {

/// SwiGLU experts (Qwen3-MoE, Mixtral) over the tokens x [N, H]: the M = sum(counts) (token,
/// slot) rows are sorted by expert, row r being token token_of_row[r] (int64 [M]); rows
/// [o_e, o_e + counts[e]), where o_e is the sum of the counts before e, go through expert e:
///   y_r = (silu(x_t G_e^T) * (x_t U_e^T)) D_e^T,   t = token_of_row[r],
/// with gate_up [E, 2I, H] (G_e its first I rows, U_e the next I) and down [E, H, I], as
/// transformers' Qwen3MoeExperts / MixtralExperts. `row_weights` [M] (optional): each y_r is
/// multiplied by its routing weight, in the weights' dtype, then cast to x's (Note [Routing
/// weights in the experts]). Returns out [N, H] in x's dtype: each token's y_r summed expert by
/// expert, as transformers' index_add_ loop (zeros for a token without rows).
///
/// Note [Sorted experts]: one GEMM pair per expert that has rows, on that expert's rows gathered
/// from x, its output added into their tokens; an expert with none costs nothing. No [M, H] tensor
/// is made in the forward or the backward (the gathered rows live one expert at a time, the
/// outputs and their gradients one expert at a time on a GPU and one group of experts of at most
/// max(N, the largest count) rows on CPU, where the experts run in parallel: Note [Experts in
/// parallel on CPU] in moe_experts.cpp): on CPU each [M, H] tensor of a realistic layer is a fresh
/// mmap whose pages fault on first touch, every call (docs/benchmarks.md, "Mixture of experts").
/// Under autograd a custom function writes each expert's weight gradient straight into its slice
/// of one [E, ...] gradient (zero for experts without rows), where autograd over `weight[e]` would
/// make a full-size zero tensor per expert and sum them. The forward keeps x G^T and x U^T
/// ([M, 2I]) for the backward, and x itself. `counts` are host integers: on a GPU the caller syncs
/// once to get them (moe.cpp replays them in recompute).
///
/// Note [Expert LoRA on the rows]: a weight may carry LoRA factors (ExpertLora, PEFT's
/// target_parameters): it then acts as W_e + scaling B_e A_e, computed on each expert's rows as
/// x W_e^T + scaling (x A_e^T) B_e^T (gpt-oss's [in, out] weights: x W_e + the same), never as the
/// adapted [E, out, in] weight PEFT materializes. The backward gives A and B their gradients from
/// the rows (dB_e = scaling d^T (x A_e^T), dA_e = scaling (d B_e)^T x, d the output rows'
/// gradient) and the rows theirs through W_e and the factors; the base weight gets a gradient
/// only if it requires one. So a LoRA layer keeps neither the adapted weights (the expert weights'
/// size, in the forward until the backward) nor a full-size weight gradient (in the backward), and
/// costs r (in + out) more multiply-adds per row and weight instead of E out in r for the adapted
/// weights.
struct ExpertLora {
  at::Tensor a;  ///< [E, r, in] (PEFT's lora_A [E r, in] reshaped), the weight's dtype
  at::Tensor b;  ///< [E, out, r] (PEFT's lora_B [out, r E], its columns j E + e as B_e[:, j])
  double scaling = 0;
  bool defined() const { return a.defined(); }
};

at::Tensor swiglu_experts(const at::Tensor& x, const at::Tensor& token_of_row, const at::Tensor& gate_up,
                          const at::Tensor& down, const std::vector<int64_t>& counts,
                          const at::Tensor& row_weights = {}, const ExpertLora& gate_up_lora = {},
                          const ExpertLora& down_lora = {});

/// The threads the experts of a layer on x's device run on, `counts` its rows per expert: 1 on a
/// GPU, else up to ATen's intra-op threads (Note [Experts in parallel on CPU] in moe_experts.cpp).
int64_t expert_threads(const at::Tensor& x, const std::vector<int64_t>& counts);

/// swiglu_experts on rows already sorted by expert: x [M, H] -> y [M, H] (row r is its own token).
at::Tensor sorted_swiglu_experts(const at::Tensor& x, const at::Tensor& gate_up, const at::Tensor& down,
                                 const std::vector<int64_t>& counts, const at::Tensor& row_weights = {});

/// gpt-oss experts, the same way (token rows gathered, weighted outputs added into their tokens):
/// gate_up [E, H, 2I], gate_up_bias [E, 2I], down [E, I, H], down_bias [E, H]:
///   h = x_t W_e + b_e; g = h[:, 0::2].clamp(max = limit); u = h[:, 1::2].clamp(-limit, limit);
///   y_r = ((u + 1) * g * sigmoid(alpha * g)) D_e + d_e,
/// as transformers' GptOssExperts (no gradient where a clamp is active). Keeps h ([M, 2I]).
at::Tensor clamped_glu_experts(const at::Tensor& x, const at::Tensor& token_of_row, const at::Tensor& gate_up,
                               const at::Tensor& gate_up_bias, const at::Tensor& down, const at::Tensor& down_bias,
                               const std::vector<int64_t>& counts, double alpha, double limit,
                               const at::Tensor& row_weights = {}, const ExpertLora& gate_up_lora = {},
                               const ExpertLora& down_lora = {});

}  // namespace roundpipe::models::detail
