#include "roundpipe/models/layers.h"

#include <ATen/core/Reduction.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/cross_entropy_loss.h>
#include <ATen/ops/dropout.h>
#include <ATen/ops/embedding.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/stack.h>
#include <c10/util/Exception.h>
#include <torch/nn/modules/dropout.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <set>
#include <tuple>
#include <vector>

#include "roundpipe/models/detail/param_options.h"
#include "roundpipe/models/detail/rms_norm.h"
#include "roundpipe/models/detail/rotary.h"
#include "roundpipe/models/detail/token_embedding.h"
#include "roundpipe/models/linear_cross_entropy.h"
#include "roundpipe/models/moe.h"
#include "roundpipe/side_inputs.h"

namespace roundpipe::models {
namespace {

using detail::param_options;

// Causal attention in which query i sees keys (i - window, i] (transformers' sliding_window_overlay:
// kv_idx > q_idx - window), for q, k, v [B, heads, T, d] with as many key as query heads. Note
// [Sliding window in blocks]: the queries go in blocks of Q = max(window, kMinQueryBlock) rows;
// block [s, e) attends to keys [max(0, s - window + 1), e) through SDPA with a boolean band mask of
// Q x (Q + window - 1) at most, so no [T, T] mask or score matrix exists at any T, and the kernel
// is the flash one on CPU (it takes masks) and the memory-efficient one on CUDA. Memory and
// compute are O(T * (Q + window)); each block's output is exact softmax attention over its band,
// so the result equals the full-mask computation up to float summation order.
constexpr int64_t kMinQueryBlock = 512;

at::Tensor sliding_window_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t window,
                                    double dropout) {
  const int64_t seq = q.size(2);
  const int64_t block = std::max(window, kMinQueryBlock);
  const auto positions = at::TensorOptions().dtype(at::kLong).device(q.device());
  std::vector<at::Tensor> outputs;
  outputs.reserve(static_cast<size_t>((seq + block - 1) / block));
  for (int64_t s = 0; s < seq; s += block) {
    const int64_t e = std::min(seq, s + block);
    const int64_t ks = std::max<int64_t>(0, s - window + 1);
    const at::Tensor q_pos = at::arange(s, e, positions).unsqueeze(1);
    const at::Tensor k_pos = at::arange(ks, e, positions).unsqueeze(0);
    const at::Tensor mask = k_pos.le(q_pos).logical_and_(k_pos.gt(q_pos - window));
    outputs.push_back(at::scaled_dot_product_attention(q.narrow(2, s, e - s), k.narrow(2, ks, e - ks),
                                                       v.narrow(2, ks, e - ks), mask, dropout));
  }
  return at::cat(outputs, 2);
}

// Note [Attention sinks]: gpt-oss appends a learned logit per head to every row of the scaled,
// masked scores, subtracts the row maximum, takes the softmax and drops the sink column, so the
// rows sum to less than one (transformers' eager_attention_forward in modeling_gpt_oss.py, the
// same operations in the same order and dtype). SDPA has no sink, so this is an explicit
// computation in blocks of kSinkQueryBlock query rows over the keys they may see ([0, e), or the
// window's band), so no [T, T] score matrix exists; autograd differentiates it (the sinks too).
constexpr int64_t kSinkQueryBlock = 256;

// One block of Note [Attention sinks]: queries q [B, heads, Q, d] against keys k, v [B, heads, K, d],
// `allowed` [Q, K] saying which key each query may see.
at::Tensor sink_block(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& allowed,
                      const at::Tensor& sinks, double dropout, bool training) {
  const int64_t batch = q.size(0), heads = q.size(1), rows = q.size(2);
  const double scaling = 1.0 / std::sqrt(static_cast<double>(q.size(3)));
  const at::Tensor sink_column = sinks.to(q.scalar_type()).view({1, heads, 1, 1});
  at::Tensor scores = at::matmul(q, k.transpose(2, 3)) * scaling;
  scores = scores.masked_fill(allowed.logical_not(), -std::numeric_limits<double>::infinity());
  at::Tensor combined = at::cat({scores, sink_column.expand({batch, heads, rows, 1})}, -1);
  combined = combined - std::get<0>(combined.max(-1, /*keepdim=*/true));
  at::Tensor probs = at::softmax(combined, -1).narrow(-1, 0, k.size(2));
  if (dropout > 0) probs = at::dropout(probs, dropout, training);
  return at::matmul(probs.to(v.scalar_type()), v);
}

// [Q, K] booleans: query rows [s, e) may see key rows [ks, e): causal, and inside `window`.
at::Tensor causal_block_mask(int64_t s, int64_t e, int64_t ks, std::optional<int64_t> window,
                             const at::TensorOptions& positions) {
  const at::Tensor q_pos = at::arange(s, e, positions).unsqueeze(1);
  const at::Tensor k_pos = at::arange(ks, e, positions).unsqueeze(0);
  at::Tensor allowed = k_pos.le(q_pos);
  if (window) allowed = allowed.logical_and(k_pos.gt(q_pos - *window));
  return allowed;
}

at::Tensor sink_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& sinks,
                          std::optional<int64_t> window, double dropout, bool training) {
  const int64_t seq = q.size(2);
  const auto positions = at::TensorOptions().dtype(at::kLong).device(q.device());
  std::vector<at::Tensor> outputs;
  for (int64_t s = 0; s < seq; s += kSinkQueryBlock) {
    const int64_t e = std::min(seq, s + kSinkQueryBlock);
    const int64_t ks = window ? std::max<int64_t>(0, s - *window + 1) : 0;
    const at::Tensor allowed = causal_block_mask(s, e, ks, window, positions);
    outputs.push_back(sink_block(q.narrow(2, s, e - s), k.narrow(2, ks, e - ks), v.narrow(2, ks, e - ks), allowed,
                                 sinks, dropout, training));
  }
  return at::cat(outputs, 2);
}

// Note [Packed attention]: a packed row holds several sequences side by side, told apart by the
// side input kSegmentIds [B, T] (roundpipe/side_inputs.h). Query i of a row sees key j iff j <= i,
// j is in i's segment, and (on a sliding layer) i - window < j: block-diagonal causal attention,
// so no sequence sees another, and each sequence computes as it would alone (its positions, the
// side input kPositionIds, restart at 0 for the rotary embedding). Queries go in blocks of
// kMinQueryBlock rows (or the window, if larger) against the keys they may see, through SDPA with
// a boolean [B, 1, Q, K] mask (or sink_block), so no [T, T] mask exists. Without kSegmentIds
// nothing changes: the is_causal fast path and the unpacked window and sink paths are kept.

// [B, 1, Q, K]: whether query rows [q_start, q_start + Q) and key rows [k_start, k_start + K) of
// `segments` [B, T] are in the same segment.
at::Tensor same_segment(const at::Tensor& segments, int64_t q_start, int64_t q_len, int64_t k_start, int64_t k_len) {
  const at::Tensor q_seg = segments.narrow(1, q_start, q_len).unsqueeze(2);
  const at::Tensor k_seg = segments.narrow(1, k_start, k_len).unsqueeze(1);
  return q_seg.eq(k_seg).unsqueeze(1);
}

at::Tensor packed_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& segments,
                            std::optional<int64_t> window, const at::Tensor& sinks, double dropout, bool training) {
  const int64_t seq = q.size(2);
  const int64_t block = std::max(window.value_or(0), kMinQueryBlock);
  const auto positions = at::TensorOptions().dtype(at::kLong).device(q.device());
  std::vector<at::Tensor> outputs;
  outputs.reserve(static_cast<size_t>((seq + block - 1) / block));
  for (int64_t s = 0; s < seq; s += block) {
    const int64_t e = std::min(seq, s + block);
    const int64_t ks = window ? std::max<int64_t>(0, s - *window + 1) : 0;
    const at::Tensor allowed =
        causal_block_mask(s, e, ks, window, positions).logical_and(same_segment(segments, s, e - s, ks, e - ks));
    const at::Tensor qb = q.narrow(2, s, e - s), kb = k.narrow(2, ks, e - ks), vb = v.narrow(2, ks, e - ks);
    outputs.push_back(sinks.defined() ? sink_block(qb, kb, vb, allowed, sinks, dropout, training)
                                      : at::scaled_dot_product_attention(qb, kb, vb, allowed, dropout));
  }
  return at::cat(outputs, 2);
}

// The side input `name` ([B, T] integer) for hidden states x [B, T, ...], or an undefined tensor.
at::Tensor packed_side_input(const char* name, const at::Tensor& x, int64_t layer_index) {
  std::optional<at::Tensor> t = side_input(name);
  if (!t) return {};
  TORCH_CHECK(
      t->dim() == 2 && t->size(0) == x.size(0) && t->size(1) == x.size(1) && !at::isFloatingType(t->scalar_type()),
      "Attention (layer ", layer_index, "): side input '", name, "' must be an integer tensor [batch, seq] = [",
      x.size(0), ", ", x.size(1), "], got ", t->scalar_type(), " ", t->sizes(),
      " (docs/models.md, \"Packed sequences\")");
  return t->device() == x.device() ? *t : t->to(x.device());
}

// Which of the keys at positions [k_start, k_start + K) the queries at positions
// [q_start, q_start + Q) see: [Q, K] boolean, key j visible from query i iff i - window < j <= i.
// With `left_padding` [B] defined, [B, 1, Q, K]: row b's padding keys (positions below
// left_padding[b]) are not visible either (Note [Left-padded generation]).
//
// Note [Left-padded generation]: no query sees a row's padding keys. A padding query would then
// see no key at all, and softmax over nothing is NaN, which a masked-out value still spreads
// through the product (0 * NaN); so a padding query sees itself. transformers' sdpa path unmasks
// such rows for the same reason. The rotary positions restart at 0 on each row's first real token
// (AttentionImpl::project), as transformers derives them from the attention mask; rotary attention
// depends only on q - k, so a shift changes the logits by rounding alone (the batched tests pass
// without it; the mask is what they test).
at::Tensor visible_keys(int64_t q_start, int64_t q_len, int64_t k_start, int64_t k_len, std::optional<int64_t> window,
                        c10::Device device, const at::Tensor& left_padding = {}) {
  const auto positions = at::TensorOptions().dtype(at::kLong).device(device);
  const at::Tensor q_pos = at::arange(q_start, q_start + q_len, positions).unsqueeze(1);
  const at::Tensor k_pos = at::arange(k_start, k_start + k_len, positions).unsqueeze(0);
  at::Tensor allowed = k_pos.le(q_pos);
  if (window) allowed = allowed.logical_and(k_pos.gt(q_pos - *window));
  if (!left_padding.defined()) return allowed;
  const at::Tensor real_key = k_pos.ge(left_padding.unsqueeze(1)).unsqueeze(1);  // [B, 1, K]
  return allowed.unsqueeze(0).logical_and(real_key.logical_or(k_pos.eq(q_pos).unsqueeze(0))).unsqueeze(1);
}

}  // namespace

// ---- Linear --------------------------------------------------------------------------------------

LinearImpl::LinearImpl(int64_t in_features, int64_t out_features, bool bias, const at::TensorOptions& options)
    : in_features_(in_features), out_features_(out_features), has_bias_(bias), options_(options) {
  TORCH_CHECK(in_features > 0 && out_features > 0, "Linear: in_features = ", in_features,
              " and out_features = ", out_features, " must be positive");
  reset();
}

void LinearImpl::reset() {
  const auto options = param_options(weight, options_);
  weight = register_parameter("weight", at::empty({out_features_, in_features_}, options));
  if (has_bias_) bias = register_parameter("bias", at::empty({out_features_}, param_options(bias, options_)));
  if (lora_rank_ > 0) {
    // A clone gets its own adapters (Cloneable::clone then copies their values).
    const auto lora_options = lora_A ? lora_A->weight.options() : options;
    lora_A = register_module("lora_A", std::make_shared<LinearImpl>(in_features_, lora_rank_, false, lora_options));
    lora_B = register_module("lora_B", std::make_shared<LinearImpl>(lora_rank_, out_features_, false, lora_options));
  }
}

at::Tensor LinearImpl::forward(const at::Tensor& x) {
  at::Tensor y = at::linear(x, weight, bias);
  if (lora_rank_ == 0) return y;
  // PEFT's LoRA Linear: result + lora_B(lora_A(dropout(x))) * scaling.
  const at::Tensor h = lora_dropout_ > 0 ? at::dropout(x, lora_dropout_, is_training()) : x;
  return y + lora_B->forward(lora_A->forward(h)) * (lora_alpha_ / static_cast<double>(lora_rank_));
}

void LinearImpl::enable_lora(int64_t rank, double alpha, double dropout) {
  TORCH_CHECK(rank > 0, "LoRA rank must be > 0, got ", rank);
  TORCH_CHECK(dropout >= 0 && dropout < 1, "LoRA dropout must be in [0, 1), got ", dropout);
  TORCH_CHECK(lora_rank_ == 0, "this Linear already has LoRA adapters (rank ", lora_rank_, ")");
  lora_rank_ = rank;
  lora_alpha_ = alpha;
  lora_dropout_ = dropout;
  const auto options = weight.options().requires_grad(false);
  lora_A = register_module("lora_A", std::make_shared<LinearImpl>(in_features_, rank, false, options));
  lora_B = register_module("lora_B", std::make_shared<LinearImpl>(rank, out_features_, false, options));
}

void LinearImpl::merge_lora() {
  if (lora_rank_ == 0) return;
  {
    at::NoGradGuard no_grad;
    const double scaling = lora_alpha_ / static_cast<double>(lora_rank_);
    weight.add_(at::matmul(lora_B->weight, lora_A->weight).to(weight.scalar_type()), scaling);
  }
  unregister_module("lora_A");
  unregister_module("lora_B");
  lora_A.reset();
  lora_B.reset();
  lora_rank_ = 0;
}

void LinearImpl::share_weight(const at::Tensor& weight_tensor) {
  TORCH_CHECK(weight_tensor.sizes() == weight.sizes(), "Linear::share_weight: tensor of shape ", weight_tensor.sizes(),
              " cannot replace a weight of shape ", weight.sizes());
  parameters_["weight"] = weight_tensor;
  weight = weight_tensor;
}

// ---- RMSNorm -------------------------------------------------------------------------------------

RMSNormImpl::RMSNormImpl(int64_t dim, double eps, const at::TensorOptions& options, bool weight_in_fp32)
    : dim_(dim), eps_(eps), options_(options), weight_in_fp32_(weight_in_fp32) {
  TORCH_CHECK(dim > 0 && eps > 0, "RMSNorm: dim = ", dim, " and eps = ", eps, " must be positive");
  reset();
}

void RMSNormImpl::reset() { weight = register_parameter("weight", at::empty({dim_}, param_options(weight, options_))); }

at::Tensor RMSNormImpl::forward(const at::Tensor& x) {
  // Note [RMSNorm saved tensors]: autograd's expression, keeping only x and the per-row rsqrt.
  return detail::rms_norm(x, weight, eps_, weight_in_fp32_);
}

RMSNorm make_rms_norm(const ModelConfig& config, int64_t dim, const at::TensorOptions& options) {
  return RMSNorm(dim, config.rms_norm_eps, options, /*weight_in_fp32=*/config.traits().norm_weight_fp32);
}

// ---- TokenEmbedding ------------------------------------------------------------------------------

TokenEmbeddingImpl::TokenEmbeddingImpl(int64_t num_embeddings, int64_t dim, std::optional<int64_t> padding_idx,
                                       const at::TensorOptions& options)
    : num_embeddings_(num_embeddings), dim_(dim), padding_idx_(padding_idx), options_(options) {
  TORCH_CHECK(num_embeddings > 0 && dim > 0, "TokenEmbedding: num_embeddings = ", num_embeddings, " and dim = ", dim,
              " must be positive");
  TORCH_CHECK(!padding_idx || (*padding_idx >= 0 && *padding_idx < num_embeddings),
              "TokenEmbedding: padding_idx = ", padding_idx.value_or(-1), " is outside [0, ", num_embeddings, ")");
  reset();
}

void TokenEmbeddingImpl::reset() {
  weight = register_parameter("weight", at::empty({num_embeddings_, dim_}, param_options(weight, options_)));
}

at::Tensor TokenEmbeddingImpl::forward(const at::Tensor& ids) {
  return detail::embedding_lookup(weight, ids, padding_idx_.value_or(-1));  // Note [Embedding gradient in place]
}

// ---- Embedding (pipeline layer 0) ----------------------------------------------------------------

EmbeddingImpl::EmbeddingImpl(const ModelConfig& config, const at::TensorOptions& options)
    : config_(config), options_(options) {
  reset();
}

void EmbeddingImpl::reset() {
  const auto options = embed_tokens ? param_options(embed_tokens->weight, options_) : options_;
  embed_tokens = register_module(
      "embed_tokens", TokenEmbedding(config_.vocab_size, config_.hidden_size, config_.pad_token_id, options));
}

at::Tensor EmbeddingImpl::forward(const at::Tensor& input_ids) {
  TORCH_CHECK(!at::isFloatingType(input_ids.scalar_type()) && input_ids.dim() == 2,
              "Embedding: the model input must be integer token ids of shape [batch, seq], got ",
              input_ids.scalar_type(), " ", input_ids.sizes());
  return embed_tokens(input_ids);
}

// ---- Attention -----------------------------------------------------------------------------------

AttentionImpl::AttentionImpl(const ModelConfig& config, int64_t layer_index, const at::TensorOptions& options)
    : config_(config), layer_index_(layer_index), options_(options) {
  reset();
}

void AttentionImpl::reset() {
  const auto options = q_proj ? param_options(q_proj->weight, options_) : options_;
  const int64_t h = config_.hidden_size;
  const int64_t d = config_.head_dim;
  const bool bias = config_.attention_bias;
  q_proj = register_module("q_proj", Linear(h, config_.num_attention_heads * d, bias, options));
  k_proj = register_module("k_proj", Linear(h, config_.num_key_value_heads * d, bias, options));
  v_proj = register_module("v_proj", Linear(h, config_.num_key_value_heads * d, bias, options));
  o_proj = register_module("o_proj", Linear(config_.num_attention_heads * d, h, bias, options));
  if (config_.traits().qk_norm) {
    q_norm = register_module("q_norm", RMSNorm(d, config_.rms_norm_eps, options));
    k_norm = register_module("k_norm", RMSNorm(d, config_.rms_norm_eps, options));
  }
  if (config_.traits().attention_sinks) {
    sinks = register_parameter("sinks", at::empty({config_.num_attention_heads}, param_options(sinks, options)));
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> AttentionImpl::project(const at::Tensor& x, int64_t start,
                                                                      const at::Tensor& left_padding) {
  TORCH_CHECK(x.dim() == 3 && x.size(2) == config_.hidden_size, "Attention (layer ", layer_index_,
              "): expected hidden states [batch, seq, ", config_.hidden_size, "], got ", x.sizes());
  const int64_t batch = x.size(0);
  const int64_t seq = x.size(1);
  const int64_t d = config_.head_dim;
  at::Tensor q = q_proj(x).view({batch, seq, -1, d});
  at::Tensor k = k_proj(x).view({batch, seq, -1, d});
  at::Tensor v = v_proj(x).view({batch, seq, -1, d}).transpose(1, 2);
  if (q_norm) {
    q = q_norm(q);
    k = k_norm(k);
  }
  q = q.transpose(1, 2);
  k = k.transpose(1, 2);
  at::Tensor cos, sin;
  {
    at::NoGradGuard no_grad;
    const at::Tensor positions = packed_side_input(kPositionIds, x, layer_index_);
    if (positions.defined()) {
      std::tie(cos, sin) = detail::rotary_cos_sin_at(config_.rope, d, positions + start, x.scalar_type());
    } else if (left_padding.defined()) {
      // A padding slot's own position is clamped to 0; nothing real attends to it.
      const at::Tensor indices =
          at::arange(start, start + seq, at::TensorOptions().dtype(at::kLong).device(x.device()));
      const at::Tensor rows = (indices.unsqueeze(0) - left_padding.unsqueeze(1)).clamp_min(0);
      std::tie(cos, sin) = detail::rotary_cos_sin_at(config_.rope, d, rows, x.scalar_type());
    } else {
      std::tie(cos, sin) = detail::rotary_cos_sin(config_.rope, d, seq, x.device(), x.scalar_type(), start);
    }
  }
  return {detail::apply_rotary(q, cos, sin), detail::apply_rotary(k, cos, sin), v};
}

std::optional<int64_t> AttentionImpl::window() const {
  return config_.layer_uses_sliding_window(layer_index_) ? config_.sliding_window : std::nullopt;
}

at::Tensor AttentionImpl::attend_causal(at::Tensor q, at::Tensor k, at::Tensor v, const at::Tensor& segments) {
  const int64_t seq = q.size(2);
  const int64_t groups = config_.num_attention_heads / config_.num_key_value_heads;
  const double dropout = is_training() ? config_.attention_dropout : 0.0;
  if (segments.defined()) {  // Note [Packed attention]
    if (groups > 1) {
      k = k.repeat_interleave(groups, 1);
      v = v.repeat_interleave(groups, 1);
    }
    return packed_attention(q, k, v, segments, window(), sinks, dropout, is_training());
  }
  if (sinks.defined()) {
    if (groups > 1) {
      k = k.repeat_interleave(groups, 1);
      v = v.repeat_interleave(groups, 1);
    }
    return sink_attention(q, k, v, sinks, window(), dropout, is_training());
  }
  const bool windowed = config_.layer_uses_sliding_window(layer_index_) && seq > *config_.sliding_window;
  // Like transformers' sdpa path: CUDA lets SDPA broadcast the key/value heads (enable_gqa);
  // elsewhere they are repeated, which every SDPA backend accepts. The windowed path passes masks,
  // which not every CUDA kernel combines with enable_gqa, so it repeats them too.
  const bool gqa_in_sdpa = groups > 1 && q.is_cuda() && !windowed;
  if (groups > 1 && !gqa_in_sdpa) {
    k = k.repeat_interleave(groups, 1);
    v = v.repeat_interleave(groups, 1);
  }
  return windowed ? sliding_window_attention(q, k, v, *config_.sliding_window, dropout)
                  : at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, dropout, /*is_causal=*/true,
                                                     /*scale=*/std::nullopt, /*enable_gqa=*/gqa_in_sdpa);
}

at::Tensor AttentionImpl::forward(const at::Tensor& x) {
  auto [q, k, v] = project(x, /*start=*/0);
  const at::Tensor attn = attend_causal(q, k, v, packed_side_input(kSegmentIds, x, layer_index_));
  return o_proj(attn.transpose(1, 2).reshape({x.size(0), x.size(1), -1}));
}

// Note [Cached attention]: the first forward into an empty cache (the prompt) computes exactly as
// forward() does (so its logits are those of a plain forward) and keeps its keys and values.
// Later forwards attend from their positions [start, start + T) to the cached keys followed by
// their own, with the mask of visible_keys (causal, and the window on sliding layers; the sinks of
// gpt-oss through the same block as training). A sliding layer then keeps only its last
// window - 1 keys: no later query can see an older one, so its cache never grows past the window.
at::Tensor AttentionImpl::forward_cached(const at::Tensor& x, LayerKvCache& cache) {
  const int64_t start = cache.length;
  TORCH_CHECK(!side_input(kSegmentIds) && !side_input(kPositionIds), "Attention (layer ", layer_index_,
              "): cached generation takes one sequence per row: run it without the side inputs of a packed batch "
              "(docs/models.md, \"Packed sequences\")");
  const at::Tensor& pad = cache.left_padding;
  TORCH_CHECK(
      !pad.defined() ||
          (pad.dim() == 1 && pad.size(0) == x.size(0) && pad.scalar_type() == at::kLong && pad.device() == x.device()),
      "Attention (layer ", layer_index_, "): the cache's left_padding must be int64 [batch = ", x.size(0), "] on ",
      x.device(), ", got ", pad.defined() ? pad.toString() : "", " ", pad.defined() ? pad.sizes() : at::IntArrayRef{});
  auto [q, k, v] = project(x, start, pad);
  const int64_t seq = q.size(2);
  at::Tensor attn;
  if (start == 0 && !pad.defined()) {
    attn = attend_causal(q, k, v, /*segments=*/{});
  } else {
    if (start > 0) {
      TORCH_CHECK(cache.k.defined() && cache.k.size(0) == x.size(0), "Attention (layer ", layer_index_,
                  "): the cache of ", start, " tokens holds no keys of batch size ", x.size(0));
      k = at::cat({cache.k, k}, 2);
      v = at::cat({cache.v, v}, 2);
    }
    const int64_t key_start = start + seq - k.size(2);
    const at::Tensor allowed = visible_keys(start, seq, key_start, k.size(2), window(), x.device(), pad);
    const int64_t groups = config_.num_attention_heads / config_.num_key_value_heads;
    const at::Tensor keys = groups > 1 ? k.repeat_interleave(groups, 1) : k;
    const at::Tensor values = groups > 1 ? v.repeat_interleave(groups, 1) : v;
    attn = sinks.defined() ? sink_block(q, keys, values, allowed, sinks, /*dropout=*/0.0, /*training=*/false)
                           : at::scaled_dot_product_attention(q, keys, values, allowed);
  }
  cache.length = start + seq;
  if (const std::optional<int64_t> w = window()) {
    const int64_t keep = std::min(k.size(2), *w - 1);
    k = k.narrow(2, k.size(2) - keep, keep);
    v = v.narrow(2, v.size(2) - keep, keep);
  }
  cache.k = k;
  cache.v = v;
  return o_proj(attn.transpose(1, 2).reshape({x.size(0), seq, -1}));
}

// ---- Mlp -----------------------------------------------------------------------------------------

MlpImpl::MlpImpl(const ModelConfig& config, const at::TensorOptions& options) : config_(config), options_(options) {
  reset();
}

void MlpImpl::reset() {
  const auto options = gate_proj ? param_options(gate_proj->weight, options_) : options_;
  const int64_t h = config_.hidden_size;
  const int64_t f = config_.intermediate_size;
  gate_proj = register_module("gate_proj", Linear(h, f, config_.mlp_bias, options));
  up_proj = register_module("up_proj", Linear(h, f, config_.mlp_bias, options));
  down_proj = register_module("down_proj", Linear(f, h, config_.mlp_bias, options));
}

at::Tensor MlpImpl::forward(const at::Tensor& x) { return down_proj(at::silu(gate_proj(x)) * up_proj(x)); }

// ---- DecoderLayer --------------------------------------------------------------------------------

DecoderLayerImpl::DecoderLayerImpl(const ModelConfig& config, int64_t layer_index, const at::TensorOptions& options)
    : config_(config), layer_index_(layer_index), options_(options) {
  TORCH_CHECK(layer_index >= 0 && layer_index < config.num_hidden_layers, "DecoderLayer: layer_index = ", layer_index,
              " is outside [0, num_hidden_layers = ", config.num_hidden_layers, ")");
  reset();
}

void DecoderLayerImpl::reset() {
  const auto options = input_layernorm ? param_options(input_layernorm->weight, options_) : options_;
  input_layernorm = register_module("input_layernorm", make_rms_norm(config_, config_.hidden_size, options));
  self_attn = register_module("self_attn", Attention(config_, layer_index_, options));
  post_attention_layernorm =
      register_module("post_attention_layernorm", make_rms_norm(config_, config_.hidden_size, options));
  mlp = register_module("mlp", Mlp(config_, options));
}

at::Tensor DecoderLayerImpl::forward(const at::Tensor& hidden) {
  const at::Tensor h = hidden + self_attn(input_layernorm(hidden));
  return h + mlp(post_attention_layernorm(h));
}

at::Tensor DecoderLayerImpl::forward_cached(const at::Tensor& hidden, LayerKvCache& cache) {
  const at::Tensor h = hidden + self_attn->forward_cached(input_layernorm(hidden), cache);
  return h + mlp(post_attention_layernorm(h));
}

// ---- LmHead --------------------------------------------------------------------------------------

LmHeadImpl::LmHeadImpl(const ModelConfig& config, const at::TensorOptions& options)
    : config_(config), options_(options), router_aux_loss_coef_(config.router_aux_loss_coef) {
  reset();
}

void LmHeadImpl::reset() {
  const auto options = norm ? param_options(norm->weight, options_) : options_;
  norm = register_module("norm", make_rms_norm(config_, config_.hidden_size, options));
  lm_head = register_module("lm_head", Linear(config_.hidden_size, config_.vocab_size, /*bias=*/false, options));
}

at::Tensor LmHeadImpl::cross_entropy_sum(const at::Tensor& h, const at::Tensor& targets) {
  const bool with_correct = report_correct_ && !is_training() && !at::GradMode::is_enabled();
  if (lm_head->has_lora() || lm_head->bias.defined()) {
    // The fused path multiplies by the weight alone; the adapters' and the bias' terms would need
    // their own products per chunk. The same summed loss from full logits.
    const at::Tensor logits = lm_head(h).reshape({-1, lm_head->weight.size(0)}).to(at::kFloat);
    const at::Tensor t = targets.reshape({-1}).to(at::kLong);
    const at::Tensor loss = at::cross_entropy_loss(logits, t, /*weight=*/{}, at::Reduction::Sum, kIgnoreIndex);
    if (!with_correct) return loss;
    const at::Tensor correct = (logits.argmax(1).eq(t) & t.ne(kIgnoreIndex)).sum().to(at::kFloat);
    return at::stack({loss, correct}).unsqueeze(0);
  }
  const auto options = LinearCrossEntropyOptions().chunk_bytes(loss_chunk_bytes_);
  if (with_correct) return linear_cross_entropy_and_correct(h, lm_head->weight, targets, options).unsqueeze(0);
  return linear_cross_entropy(h, lm_head->weight, targets, options);
}

namespace {

// hidden [B, T, H] -> [B, 1, H] at kLogitPositions' row positions when that side input is set.
at::Tensor at_logit_positions(const at::Tensor& hidden) {
  const std::optional<at::Tensor> positions = side_input(kLogitPositions);
  if (!positions) return hidden;
  TORCH_CHECK(positions->dim() == 1 && positions->size(0) == hidden.size(0) && !positions->is_floating_point(),
              "LmHead: the side input '", kLogitPositions, "' must be integer [batch = ", hidden.size(0), "], got ",
              positions->sizes());
  TORCH_CHECK(positions->numel() == 0 ||
                  (positions->min().item<int64_t>() >= 0 && positions->max().item<int64_t>() < hidden.size(1)),
              "LmHead: a position of the side input '", kLogitPositions, "' is outside [0, ", hidden.size(1), ")");
  const at::Tensor index = positions->to(at::kLong).view({-1, 1, 1}).expand({hidden.size(0), 1, hidden.size(2)});
  return hidden.gather(1, index);
}

}  // namespace

at::Tensor LmHeadImpl::forward(const at::Tensor& hidden, const at::Tensor& second, const at::Tensor& third) {
  if (!config_.is_moe()) {
    TORCH_CHECK(!third.defined(), "LmHead: a dense model's head takes (hidden, targets); a third tensor was given");
    if (!second.defined()) return lm_head(norm(at_logit_positions(hidden)));
    return cross_entropy_sum(norm(hidden), second);
  }
  const at::Tensor& stats = second;
  const at::Tensor& targets = third;
  TORCH_CHECK(!stats.defined() || (stats.dim() == 2 && stats.size(0) == 2 && stats.size(1) == config_.num_experts),
              "LmHead: a mixture-of-experts head takes (hidden, router statistics [2, ", config_.num_experts,
              "], targets); got statistics of shape ", stats.sizes(),
              " (are the layers MoeDecoderLayers of this config?)");
  if (!targets.defined()) return lm_head(norm(at_logit_positions(hidden)));
  const at::Tensor h = norm(hidden);
  at::Tensor loss = cross_entropy_sum(h, targets);
  const int64_t sparse_layers = config_.num_sparse_layers();
  if (!is_training() || !stats.defined() || sparse_layers == 0) return loss;
  const int64_t tokens = hidden.numel() / hidden.size(-1);
  const at::Tensor weighted_aux = router_aux_loss(stats, tokens, sparse_layers) * static_cast<double>(tokens);
  if (router_loss_log_) router_loss_log_->add(weighted_aux, tokens);
  if (router_aux_loss_coef_ == 0.0) return loss;
  return loss + weighted_aux * router_aux_loss_coef_;
}

void LmHeadImpl::set_loss_chunk_bytes(int64_t bytes) {
  TORCH_CHECK(bytes > 0, "LmHead: loss chunk bytes must be positive, got ", bytes);
  loss_chunk_bytes_ = bytes;
}

void LmHeadImpl::set_router_aux_loss_coef(double coef) {
  TORCH_CHECK(coef >= 0 && std::isfinite(coef), "LmHead: router_aux_loss_coef must be finite and >= 0, got ", coef);
  router_aux_loss_coef_ = coef;
}

// ---- randomness ----------------------------------------------------------------------------------

namespace {

// Whether `m` is a `DropoutKind` (torch::nn's dropout modules) with p > 0.
template <typename DropoutKind>
bool drops(const torch::nn::Module* m) {
  const auto* d = dynamic_cast<const DropoutKind*>(m);
  return d != nullptr && d->options.p() > 0;
}

}  // namespace

bool draws_in_training(const torch::nn::Module& module) {
  for (const auto& m : module.modules(/*include_self=*/true)) {
    if (const auto* attention = dynamic_cast<const AttentionImpl*>(m.get())) {
      if (attention->dropout() > 0) return true;
    } else if (const auto* linear = dynamic_cast<const LinearImpl*>(m.get())) {
      if (linear->lora_dropout() > 0) return true;
    } else if (drops<torch::nn::DropoutImpl>(m.get()) || drops<torch::nn::Dropout2dImpl>(m.get()) ||
               drops<torch::nn::Dropout3dImpl>(m.get()) || drops<torch::nn::AlphaDropoutImpl>(m.get()) ||
               drops<torch::nn::FeatureAlphaDropoutImpl>(m.get())) {
      return true;
    }
  }
  return false;
}

// ---- init ----------------------------------------------------------------------------------------

void init_weights(torch::nn::Module& module, double std) {
  at::NoGradGuard no_grad;
  // A tied weight is initialised once, by its first owner (the embedding, whose padding row
  // must stay zero).
  std::set<const void*> done;
  auto init_one = [std, &done](torch::nn::Module& m) {
    for (const auto& p : m.parameters(/*recurse=*/false)) {
      if (!done.insert(p.unsafeGetTensorImpl()).second) return;
    }
    if (auto* linear = dynamic_cast<LinearImpl*>(&m)) {
      linear->weight.normal_(0.0, std);
      if (linear->bias.defined()) linear->bias.zero_();
    } else if (auto* embedding = dynamic_cast<TokenEmbeddingImpl*>(&m)) {
      embedding->weight.normal_(0.0, std);
      if (embedding->padding_idx()) embedding->weight[*embedding->padding_idx()].zero_();
    } else if (auto* norm = dynamic_cast<RMSNormImpl*>(&m)) {
      norm->weight.fill_(1.0);
    } else if (auto* experts = dynamic_cast<ExpertsImpl*>(&m)) {
      experts->gate_up_proj.normal_(0.0, std);
      experts->down_proj.normal_(0.0, std);
      if (experts->gate_up_proj_bias.defined()) experts->gate_up_proj_bias.zero_();
      if (experts->down_proj_bias.defined()) experts->down_proj_bias.zero_();
    } else if (auto* attention = dynamic_cast<AttentionImpl*>(&m)) {
      if (attention->sinks.defined()) attention->sinks.normal_(0.0, std);
    }
  };
  init_one(module);
  for (const auto& child : module.modules(/*include_self=*/false)) init_one(*child);
  // gpt-oss's router bias is drawn like its weight (GptOssPreTrainedModel._init_weights), after the
  // Linear pass zeroed it.
  auto router_bias = [std](torch::nn::Module& m) {
    if (auto* block = dynamic_cast<SparseMoeBlockImpl*>(&m)) {
      if (block->gate && block->gate->bias.defined()) block->gate->bias.normal_(0.0, std);
    }
  };
  router_bias(module);
  for (const auto& child : module.modules(/*include_self=*/false)) router_bias(*child);
}

}  // namespace roundpipe::models
