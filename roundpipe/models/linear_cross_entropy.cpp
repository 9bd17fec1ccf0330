#include "roundpipe/models/linear_cross_entropy.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <string>
#include <utility>

namespace roundpipe::models {

// Note [Fused head and loss]: the logits of a long sequence do not fit anywhere (80K tokens x
// 152K vocabulary is 46 GiB in fp32), so linear_cross_entropy never holds more than one chunk of
// them. With autograd it works as Liger's fused linear cross-entropy and the Python original's
// chunked loss do: during the forward, each chunk's logits are turned in place into their gradient
// (softmax - one_hot, rows of ignored targets zero), which is multiplied out at once into the
// chunk's rows of grad_hidden (g W) and added into grad_weight (g^T x, accumulated in fp32); the
// chunk's buffers are then reused by the next. backward() scales both by the loss's gradient.
// Recomputing the chunks in backward instead would cost a second pass of the head's largest
// matrix product (2 of its 3 products again) to save grad_hidden [tokens, H] and grad_weight
// [V, H] between forward and backward; RoundPipe runs the head in the fused tail stage, where
// backward follows the loss at once, so holding them costs nothing extra there.

namespace {

constexpr int64_t kLowPrecisionBytesPerLogit = 8;  // fp32 buffer + a 2-byte copy, + 2 at the cast
constexpr int64_t kFp32BytesPerLogit = 4;

struct Chunk {
  at::Tensor logits;  // [n, V] float32
  at::Tensor target;  // [n] int64, ignored rows mapped to 0
  at::Tensor valid;   // [n] bool
};

// The chunk's logits in float32 (the product in the model's dtype, then upcast, as transformers'
// `logits.float()`), and its targets.
Chunk chunk_logits(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& targets, int64_t ignore_index) {
  Chunk c;
  c.logits = at::mm(x, weight.t());
  if (c.logits.scalar_type() != at::kFloat) c.logits = c.logits.to(at::kFloat);
  c.valid = targets.ne(ignore_index);
  c.target = at::where(c.valid, targets, at::zeros({}, targets.options()));
  return c;
}

// Adds the chunk's summed loss into `loss` (0-dim float32) and returns the log-sum-exp per row.
at::Tensor add_chunk_loss(const Chunk& c, at::Tensor& loss) {
  at::Tensor lse = at::logsumexp(c.logits, {1});
  at::Tensor picked = c.logits.gather(1, c.target.unsqueeze(1)).squeeze(1);
  loss.add_(((lse - picked) * c.valid).sum());
  return lse;
}

// sum [V, h] fp32 += g_lp^T [V, rows] x [rows, h], the product in the model's dtype, in blocks of
// vocabulary rows of about 8 MiB of fp32 (Note [Head gradient memory]).
void add_product_in_blocks(at::Tensor& sum, const at::Tensor& g_lp, const at::Tensor& x) {
  const int64_t vocab = sum.size(0);
  const int64_t block = std::max<int64_t>(1, (int64_t{8} << 20) / (sum.size(1) * 4));
  for (int64_t begin = 0; begin < vocab; begin += block) {
    const int64_t rows = std::min(block, vocab - begin);
    sum.narrow(0, begin, rows).add_(at::mm(g_lp.narrow(1, begin, rows).t(), x));
  }
}

class LinearCrossEntropyFunction : public torch::autograd::Function<LinearCrossEntropyFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor& targets, int64_t chunk, int64_t ignore_index) {
    const int64_t n = x.size(0);
    const bool low_precision = weight.scalar_type() != at::kFloat;
    // A frozen head (LoRA, a frozen embedding tied to it) needs no weight gradient: neither its
    // fp32 V x h accumulator nor a third of the head's products.
    const bool weight_grad = ctx->needs_input_grad(1);
    at::Tensor loss = at::zeros({}, x.options().dtype(at::kFloat));
    at::Tensor grad_x = at::empty_like(x, at::MemoryFormat::Contiguous);
    // Note [Head gradient memory]: the weight's gradient is summed over the chunks in fp32 (an
    // fp32 model: in place by addmm_). A bf16/fp16 model with one chunk needs no fp32 sum: the one
    // product in the model's dtype is the gradient (bitwise what the fp32 sum would round back
    // to). With several chunks each product is added into the fp32 sum in blocks of vocabulary
    // rows (add_product_in_blocks), so neither the product nor its fp32 upcast (add_ with a bf16
    // operand materializes one) ever exists as a whole V x h tensor: ~2.5 V h 4 bytes less at the
    // head's peak.
    const bool sum_in_fp32 = weight_grad && (!low_precision || n > chunk);
    at::Tensor grad_w = sum_in_fp32 ? at::zeros(weight.sizes(), weight.options().dtype(at::kFloat)) : at::Tensor();
    for (int64_t begin = 0; begin < n; begin += chunk) {
      const int64_t rows = std::min(chunk, n - begin);
      const at::Tensor xc = x.narrow(0, begin, rows);
      Chunk c = chunk_logits(xc, weight, targets.narrow(0, begin, rows), ignore_index);
      const at::Tensor lse = add_chunk_loss(c, loss);
      // d loss / d logits = softmax - one_hot(target), zero on ignored rows; made in place.
      at::Tensor& g = c.logits;
      g.sub_(lse.unsqueeze(1)).exp_().mul_(c.valid.unsqueeze(1));
      g.scatter_add_(1, c.target.unsqueeze(1), c.valid.to(at::kFloat).neg().unsqueeze(1));
      const at::Tensor g_lp = low_precision ? g.to(weight.scalar_type()) : g;
      if (low_precision) g.reset();  // the fp32 buffer is not needed for the products
      at::Tensor grad_rows = grad_x.narrow(0, begin, rows);
      at::mm_out(grad_rows, g_lp, weight);
      if (!weight_grad) continue;
      if (!low_precision) {
        grad_w.addmm_(g_lp.t(), xc);
      } else if (!sum_in_fp32) {
        grad_w = at::mm(g_lp.t(), xc);  // the only chunk: its product is the gradient
      } else {
        add_product_in_blocks(grad_w, g_lp, xc);  // the product in the model's dtype, summed in fp32
      }
    }
    ctx->saved_data["grad_x"] = grad_x;
    if (weight_grad)
      ctx->saved_data["grad_w"] = sum_in_fp32 && low_precision ? grad_w.to(weight.scalar_type()) : grad_w;
    return loss;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    TORCH_CHECK(ctx->saved_data.count("grad_x") != 0,
                "linear_cross_entropy: backward ran twice through the same loss; its gradients are computed in the "
                "forward and consumed by the first backward (no retain_graph / double backward)");
    at::Tensor grad_x = ctx->saved_data["grad_x"].toTensor();
    const auto w = ctx->saved_data.find("grad_w");
    at::Tensor grad_w = w != ctx->saved_data.end() ? w->second.toTensor() : at::Tensor();  // none: frozen
    ctx->saved_data.erase("grad_x");
    ctx->saved_data.erase("grad_w");
    const at::Tensor& scale = grad_outputs.at(0);
    if (scale.defined()) {
      grad_x.mul_(scale);
      if (grad_w.defined()) grad_w.mul_(scale);
    }
    return {grad_x, grad_w, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// The summed loss, and with `correct` defined (0-dim float32) the count of rows whose argmax is
// their target added into it.
at::Tensor loss_only(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& targets, int64_t chunk,
                     int64_t ignore_index, at::Tensor correct = {}) {
  at::NoGradGuard no_grad;
  at::Tensor loss = at::zeros({}, x.options().dtype(at::kFloat));
  for (int64_t begin = 0; begin < x.size(0); begin += chunk) {
    const int64_t rows = std::min(chunk, x.size(0) - begin);
    const Chunk c = chunk_logits(x.narrow(0, begin, rows), weight, targets.narrow(0, begin, rows), ignore_index);
    add_chunk_loss(c, loss);
    if (correct.defined()) correct.add_((c.logits.argmax(1).eq(c.target) & c.valid).sum().to(at::kFloat));
  }
  return loss;
}

void check_arguments(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
                     const LinearCrossEntropyOptions& options) {
  TORCH_CHECK(hidden.defined() && weight.defined() && targets.defined(),
              "linear_cross_entropy: hidden, weight and targets must be defined tensors");
  TORCH_CHECK(weight.dim() == 2, "linear_cross_entropy: weight must be [vocab, hidden], got ", weight.sizes());
  TORCH_CHECK(hidden.dim() >= 1 && hidden.size(-1) == weight.size(1), "linear_cross_entropy: hidden ", hidden.sizes(),
              " does not end in the weight's hidden size ", weight.size(1));
  TORCH_CHECK(at::isFloatingType(hidden.scalar_type()) && hidden.scalar_type() == weight.scalar_type(),
              "linear_cross_entropy: hidden (", hidden.scalar_type(), ") and weight (", weight.scalar_type(),
              ") must have the same floating-point dtype");
  TORCH_CHECK(!at::isFloatingType(targets.scalar_type()) && !at::isComplexType(targets.scalar_type()) &&
                  targets.scalar_type() != at::kBool,
              "linear_cross_entropy: targets must hold integer token ids, got ", targets.scalar_type());
  TORCH_CHECK(targets.sizes() == hidden.sizes().slice(0, hidden.dim() - 1), "linear_cross_entropy: targets ",
              targets.sizes(), " must have hidden's shape without its last dimension, ",
              hidden.sizes().slice(0, hidden.dim() - 1), " (one target per position; see shift_labels)");
  TORCH_CHECK(options.chunk_bytes() > 0, "linear_cross_entropy: chunk_bytes must be positive, got ",
              options.chunk_bytes());
  TORCH_CHECK(hidden.device() == weight.device() && hidden.device() == targets.device(),
              "linear_cross_entropy: hidden (", hidden.device(), "), weight (", weight.device(), ") and targets (",
              targets.device(), ") must be on one device");
  if (targets.device().is_cpu() && targets.numel() > 0) {
    // On a GPU an out-of-range target is a device-side assert in the gather, as in torch's
    // cross_entropy; checking it here would synchronize the device.
    const at::Tensor kept = targets.masked_select(targets.ne(options.ignore_index()));
    if (kept.numel() > 0) {
      const int64_t lo = kept.min().item<int64_t>(), hi = kept.max().item<int64_t>();
      TORCH_CHECK(lo >= 0 && hi < weight.size(0), "linear_cross_entropy: targets must lie in [0, ", weight.size(0),
                  ") or equal ignore_index ", options.ignore_index(), "; got values in [", lo, ", ", hi, "]");
    }
  }
}

}  // namespace

int64_t loss_chunk_tokens(int64_t vocab, c10::ScalarType dtype, int64_t chunk_bytes) {
  TORCH_CHECK(vocab > 0, "loss_chunk_tokens: vocab must be positive, got ", vocab);
  const int64_t per_logit =
      dtype == at::kFloat || dtype == at::kDouble ? kFp32BytesPerLogit : kLowPrecisionBytesPerLogit;
  return std::max<int64_t>(1, chunk_bytes / (vocab * per_logit));
}

at::Tensor linear_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
                                const LinearCrossEntropyOptions& options) {
  check_arguments(hidden, weight, targets, options);
  const at::Tensor x = hidden.reshape({-1, hidden.size(-1)}).contiguous();
  const at::Tensor t = targets.reshape({-1}).to(at::kLong);
  const int64_t chunk = loss_chunk_tokens(weight.size(0), weight.scalar_type(), options.chunk_bytes());
  const bool records = at::GradMode::is_enabled() && (hidden.requires_grad() || weight.requires_grad());
  if (!records) return loss_only(x, weight, t, chunk, options.ignore_index());
  return LinearCrossEntropyFunction::apply(x, weight, t, chunk, options.ignore_index());
}

at::Tensor linear_cross_entropy_and_correct(const at::Tensor& hidden, const at::Tensor& weight,
                                            const at::Tensor& targets, const LinearCrossEntropyOptions& options) {
  check_arguments(hidden, weight, targets, options);
  const at::Tensor x = hidden.reshape({-1, hidden.size(-1)}).contiguous();
  const at::Tensor t = targets.reshape({-1}).to(at::kLong);
  const int64_t chunk = loss_chunk_tokens(weight.size(0), weight.scalar_type(), options.chunk_bytes());
  at::Tensor correct = at::zeros({}, x.options().dtype(at::kFloat));
  const at::Tensor loss = loss_only(x, weight, t, chunk, options.ignore_index(), correct);
  return at::stack({loss, correct});
}

at::Tensor shift_labels(const at::Tensor& labels) {
  TORCH_CHECK(labels.defined() && labels.dim() == 2, "shift_labels: labels must be [batch, seq], got ",
              labels.defined() ? c10::str(labels.sizes()) : std::string("an undefined tensor"));
  return at::constant_pad_nd(labels.to(at::kLong), {0, 1}, kIgnoreIndex).narrow(1, 1, labels.size(1));
}

}  // namespace roundpipe::models
