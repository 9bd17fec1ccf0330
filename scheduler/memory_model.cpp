#include "scheduler/memory_model.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <limits>
#include <string>

namespace roundpipe::scheduler {

// Note [Memory model]:
// Symbols: h hidden, I intermediate, q = heads x head_dim, kv = kv_heads x head_dim, V vocab,
// s = bytes of the compute dtype, t = tokens of one microbatch (rows x seq_len), E experts, k
// experts per token, I_e the experts' width, r the LoRA rank.
//
// Device, per stage (what one stage job holds at its peak; jobs on a device run one at a time):
//  - weights: the stage's compute copies: embeddings V h; a decoder layer h q + 2 h kv + q h
//    (+ q + 2 kv + h biases) + 2 h norms (+ 2 head_dim for Qwen3's q/k norms, + heads for
//    gpt-oss's sinks) + 3 h I (dense MLP; + 2 I + h with mlp_bias) or E h + 3 E h I_e (experts,
//    all E of them: a stage uploads every expert of its layers, whichever a microbatch hits;
//    gpt-oss adds the router's E and the experts' E (2 I_e + h) biases); the head h + V h (a tied
//    head uploads the embedding again). Times s. LoRA adds r (in + out) per adapted projection.
//    The same counts give the host's N (below): every parameter, all experts included.
//  - gradients (backward stages): s x the trainable parameters of its layers (LoRA: adapters only).
//  - saved activations, per token per decoder layer, what eager autograd keeps between the forward
//    and the backward (counted tensor by tensor from models/layers.cpp):
//      s (4h + 3q + 3kv + 4I) + 4 heads
//    4h: the layer input, the input norm's output, the residual after attention, the
//    post-attention norm's output; 3q + 3kv: q and k before the rotary embedding (q + kv), q, k
//    and v into attention (q + 2 kv), the attention output (q); 4I: gate, SiLU(gate), up, their
//    product; 4 heads: the attention's fp32 log-sum-exp (flash/efficient kernels: no [t, t]
//    score matrix). Qwen3's q/k norms keep their inputs too: + s (q + kv). CPU devices
//    repeat k and v to the query heads before attention (CUDA's SDPA broadcasts them):
//    + s 2 (q - kv). An MoE layer replaces 4I by s 2 k I_e + 32 k + 8 E (the k experts' x G^T | x U^T
//    rows; the routing's int64 top-k indices, sort order and row tokens and its fp32 weights;
//    the router's probabilities: Note [Sorted experts] in roundpipe/models/detail/moe_experts.h
//    keeps no [t k, h] tensor; bench/moe_bench measures 12,807 B/token against this count's
//    13,056 for 8 experts of width 192 per token in fp32). LoRA:
//    + s r per adapted projection (the A output B's gradient needs). Embeddings keep the token
//    ids (8 B/token), the head's final norm its input and output (2 h s).
//    This is the reference's count (../shared/reference/longseq-memory.md §2: ~88 KiB per token
//    per layer for Qwen3-1.7B in bf16) and docs/benchmarks.md's measured ~1,220 floats per token
//    per layer for the 64-wide, 4-head/2-kv-head CPU model of longseq_bench.
//    A stage keeps them for one microbatch at a time: with the stage grain a backward stage
//    recomputes all its layers before its backward (sum over its layers) and the fused tail
//    does not recompute (sum); with the layer grain both go one layer at a time (the largest:
//    the fused tail recomputes its layers but the last, Note [Fused tail recompute] in
//    roundpipe/detail/stage_jobs.cpp), the layers' inputs waiting in host memory.
//  - recompute: one layer's intermediates on top: in a forward stage the live tensors of the
//    running layer (no autograd), in a backward stage the gradients of the layer being
//    back-propagated; both bounded by that layer's saved activations (the largest of the stage).
//  - head (the stage with the LM head, training): models::linear_cross_entropy's working set:
//    one chunk of logits buffers, min(C, t) V p with p = 4 B/logit for an fp32 model and 8 for
//    bf16/fp16 and C = max(1, loss_chunk_bytes / (V p)) tokens; the weight's gradient V h s, plus
//    its fp32 sum V h 4 when a bf16/fp16 model's t tokens span several chunks (none with LoRA: the
//    head is frozen; Note [Head gradient memory] in roundpipe/models/linear_cross_entropy.cpp);
//    the hidden states' gradient t h s; targets and masks 13 t.
//  - boundary: the stage's input and output hidden states (2 t h s) for each in-flight
//    microbatch (2: the running one and the one whose results are still being downloaded).
// The runtime's partitioner (size-based, launcher: deterministic) does not see activations; that
// is why `roundpipe plan` reports both the runtime's plan and a memory-aware one.
//
// Host (training state, per trainable parameter unless said; N = all parameters):
//  - compute copies: s N (LoRA's frozen base included: its only copy);
//  - masters: m (the master dtype's bytes): a separate copy even when m == s
//    (StepPipeline::masters clones);
//  - gradients: s (the compute gradients handed over, which become the master's .grad when the
//    dtypes match) + m when they differ (the persistent cast buffer, Note [Gradient hand-over]),
//    unless the optimizer reads the compute dtype (RoundPipeOptions::master_grad_dtype:
//    grads_in_compute_dtype, the launcher's default for bf16/fp16 compute with Adam)
//    + s in async mode (the next iteration's gradients while the step holds the previous ones);
//  - optimizer state: Adam/AdamW 2 m; int8 states 2 + 8 / 256 (one fp32 scale per 256 values
//    per moment); Lion m; SGD with momentum m; SGD 0; Adafactor 4 (rows + cols) per matrix, 4
//    per vector element (factored_state_bytes: the model's tensors, not a count per parameter);
//  - saved inputs (saved_input_bytes): the layer inputs kept in host memory for the recomputes,
//    t h s each (the first layer's: the token ids, 8 t): the input of every backward stage but
//    the fused tail (with the layer grain, of every layer before the tail) for all M
//    microbatches of the step (the forward runs ahead of the backward, so all may be waiting at
//    once), and with the layer grain the fused tail's inputs of its layers but the first and the
//    last, for one microbatch. At long sequences this is the term that grows: Qwen3-1.7B at 73K
//    tokens, bf16, is 0.3 GB per kept input.
//  - no allowance above the live sum: the launcher's allocator policy returns freed blocks to the
//    OS and checkpoints stream the optimizer state (Note [Host allocator policy], Note [Checkpoint
//    host memory]). Before them the peak came while the final checkpoint serialized the optimizer
//    state twice with the steps' freed temporaries still held by glibc, an allowance of 1.5 x the
//    optimizer state (fitted on 125M parameters). Measured since (bench/host_memory_bench.py, 194M
//    parameters, fp32 AdamW, docs/benchmarks.md "Memory model"): the live sum predicts the peak
//    within +6% on one CPU device and overestimates it by ~20% on two (the second device's clones
//    are counted whole, they are not all alive at once).
//  - CPU devices: each device keeps clones of the layers of the stages it runs (its shells) and
//    one stage's activations at a time: the weights of the layers of every stage dealt to it
//    (round-robin in plan order) + the largest stage's activation terms.

namespace {

int64_t adapted(const TransformerShape& shape, const char* name) {
  return std::count(shape.lora_targets.begin(), shape.lora_targets.end(), name) > 0 ? 1 : 0;
}

// Whether target_parameters entry `target` adapts expert weight `weight` of decoder layer `index`
// (PEFT's suffix match; a numeric component names one layer).
bool adapts_expert(const std::string& target, const std::string& weight, int64_t index) {
  if (target != weight && (target.size() <= weight.size() ||
                           target.compare(target.size() - weight.size() - 1, std::string::npos, "." + weight) != 0)) {
    return false;
  }
  size_t start = 0;
  while (start < target.size()) {
    const size_t end = std::min(target.find('.', start), target.size());
    const std::string part = target.substr(start, end - start);
    if (!part.empty() && std::all_of(part.begin(), part.end(), [](char c) { return c >= '0' && c <= '9'; })) {
      return std::stoll(part) == index;
    }
    start = end + 1;
  }
  return true;
}

int64_t adapted_experts(const TransformerShape& shape, const std::string& weight, int64_t index) {
  for (const std::string& t : shape.lora_expert_targets) {
    if (adapts_expert(t, weight, index)) return 1;
  }
  return 0;
}

bool is_sparse(const TransformerShape& shape, int64_t decoder_index) {
  if (shape.experts <= 0) return false;
  return shape.sparse_layers.empty() || shape.sparse_layers.at(static_cast<size_t>(decoder_index));
}

// The seven dense projections of a decoder layer, with their in/out widths (LoRA targets by name).
struct Projection {
  const char* name;
  int64_t in, out;
  bool mlp;
};

std::array<Projection, 7> dense_projections(const TransformerShape& shape) {
  const int64_t h = shape.hidden, q = shape.q_dim(), kv = shape.kv_dim(), I = shape.intermediate;
  return {{{"q_proj", h, q, false},
           {"k_proj", h, kv, false},
           {"v_proj", h, kv, false},
           {"o_proj", q, h, false},
           {"gate_proj", h, I, true},
           {"up_proj", h, I, true},
           {"down_proj", I, h, true}}};
}

struct DecoderParams {
  int64_t base = 0;
  int64_t adapters = 0;
  int64_t adapted_projections = 0;
};

DecoderParams decoder_params(const TransformerShape& shape, int64_t index) {
  const int64_t h = shape.hidden, q = shape.q_dim(), kv = shape.kv_dim();
  DecoderParams p;
  p.base = h * q + 2 * h * kv + q * h + 2 * h;
  if (shape.attention_bias) p.base += q + 2 * kv + h;
  if (shape.qk_norm) p.base += 2 * shape.head_dim;
  if (shape.attention_sinks) p.base += shape.heads;
  const bool sparse = is_sparse(shape, index);
  if (sparse) {
    const int64_t experts = shape.experts, width = shape.moe_intermediate;
    p.base += experts * h + 3 * experts * h * width;
    if (shape.expert_bias) p.base += experts + experts * (2 * width + h);
  } else {
    p.base += 3 * h * shape.intermediate;
    if (shape.mlp_bias) p.base += 2 * shape.intermediate + h;
  }
  if (shape.lora_rank > 0) {
    const int64_t r = shape.lora_rank;
    for (const Projection& pr : dense_projections(shape)) {
      if (!adapted(shape, pr.name) || (pr.mlp && sparse)) continue;  // experts are not adapted
      p.adapters += r * (pr.in + pr.out);
      ++p.adapted_projections;
    }
    if (sparse) {
      const int64_t e = shape.experts, mi = shape.moe_intermediate;
      p.adapters += adapted_experts(shape, "gate_up_proj", index) * r * e * (h + 2 * mi);
      p.adapters += adapted_experts(shape, "down_proj", index) * r * e * (mi + h);
    }
  }
  return p;
}

int64_t decoder_saved_per_token(const TransformerShape& shape, int64_t index, const DeviceMemoryOptions& o,
                                int64_t adapted_projections) {
  const int64_t s = o.dtype_bytes, h = shape.hidden, q = shape.q_dim(), kv = shape.kv_dim();
  int64_t bytes = s * (4 * h + 3 * q + 3 * kv) + 4 * shape.heads;
  if (shape.qk_norm) bytes += s * (q + kv);
  if (o.repeat_kv) bytes += s * 2 * (q - kv);
  if (is_sparse(shape, index)) {
    bytes +=
        s * 2 * shape.experts_per_token * shape.moe_intermediate + 32 * shape.experts_per_token + 8 * shape.experts;
  } else {
    bytes += s * 4 * shape.intermediate;
  }
  return bytes + s * shape.lora_rank * adapted_projections;
}

void check_shape(const TransformerShape& shape) {
  TORCH_CHECK(shape.vocab > 0 && shape.hidden > 0 && shape.num_layers >= 0 && shape.heads > 0 && shape.kv_heads > 0 &&
                  shape.head_dim > 0,
              "memory model: the shape needs positive vocab, hidden, heads, kv_heads and head_dim, got vocab ",
              shape.vocab, ", hidden ", shape.hidden, ", heads ", shape.heads, ", kv_heads ", shape.kv_heads,
              ", head_dim ", shape.head_dim);
}

// Floats of Adafactor's state for decoder layer `index`'s trainable tensors (the tensors of
// decoder_params, their shapes as models:: allocates them).
int64_t decoder_factored_floats(const TransformerShape& shape, int64_t index) {
  const int64_t h = shape.hidden, q = shape.q_dim(), kv = shape.kv_dim(), I = shape.intermediate;
  const int64_t e = shape.experts, w = shape.moe_intermediate;
  const bool sparse = is_sparse(shape, index);
  int64_t floats = 0;
  if (shape.lora_rank > 0) {  // the adapters only: A [r, in], B [out, r]
    const int64_t r = shape.lora_rank, er = e * r;
    for (const Projection& pr : dense_projections(shape)) {
      if (adapted(shape, pr.name) && !(pr.mlp && sparse)) floats += 2 * r + pr.in + pr.out;
    }
    if (sparse) {  // A [E r, in], B [out, E r]
      floats += adapted_experts(shape, "gate_up_proj", index) * (2 * er + h + 2 * w);
      floats += adapted_experts(shape, "down_proj", index) * (2 * er + w + h);
    }
    return floats;
  }
  floats = (q + h) + 2 * (kv + h) + (h + q) + 2 * h;  // q, k, v, o projections; the two norms
  if (shape.attention_bias) floats += q + 2 * kv + h;
  if (shape.qk_norm) floats += 2 * shape.head_dim;
  if (shape.attention_sinks) floats += shape.heads;
  if (sparse) {
    floats += (e + h) + e * (h + 2 * w) + e * (w + h);           // router [E, h]; gate_up, down per expert
    if (shape.expert_bias) floats += e + (e + 2 * w) + (e + h);  // router bias; [E, 2w], [E, h]
  } else {
    floats += 3 * (I + h);  // gate, up [I, h]; down [h, I]
    if (shape.mlp_bias) floats += 2 * I + h;
  }
  return floats;
}

}  // namespace

ParameterCount count_parameters(const TransformerShape& shape) {
  check_shape(shape);
  const int64_t embedding = shape.vocab * shape.hidden;
  const int64_t head = shape.hidden + (shape.tied_embeddings ? 0 : embedding);
  ParameterCount count;
  count.total = embedding + head;
  for (int64_t i = 0; i < shape.num_layers; ++i) {
    const DecoderParams p = decoder_params(shape, i);
    count.total += p.base + p.adapters;
    count.trainable += p.adapters;
  }
  if (shape.lora_rank == 0) count.trainable = count.total;
  return count;
}

std::vector<LayerMemory> layer_memory(const TransformerShape& shape, const DeviceMemoryOptions& o) {
  check_shape(shape);
  TORCH_CHECK(o.dtype_bytes > 0 && o.seq_len > 0 && o.microbatch_rows > 0 && o.loss_chunk_bytes > 0 &&
                  o.inflight_microbatches > 0,
              "memory model: dtype_bytes, seq_len, microbatch_rows, loss_chunk_bytes and inflight_microbatches must "
              "be positive");
  const int64_t s = o.dtype_bytes, h = shape.hidden, V = shape.vocab, t = o.tokens();
  const bool full = shape.lora_rank == 0;
  std::vector<LayerMemory> layers;
  LayerMemory embedding;
  embedding.param_bytes = V * h * s;
  embedding.grad_bytes = embedding.trainable_bytes = full ? embedding.param_bytes : 0;
  embedding.saved_per_token = 8;
  layers.push_back(embedding);
  for (int64_t i = 0; i < shape.num_layers; ++i) {
    const DecoderParams p = decoder_params(shape, i);
    LayerMemory layer;
    layer.param_bytes = (p.base + p.adapters) * s;
    layer.grad_bytes = layer.trainable_bytes = (full ? p.base + p.adapters : p.adapters) * s;
    layer.saved_per_token = decoder_saved_per_token(shape, i, o, p.adapted_projections);
    layers.push_back(layer);
  }
  LayerMemory head;
  head.param_bytes = (h + V * h) * s;
  head.grad_bytes = head.trainable_bytes = full ? head.param_bytes : 0;
  head.saved_per_token = 2 * h * s;
  const int64_t per_logit = s >= 4 ? 4 : 8;  // models::loss_chunk_tokens
  const int64_t chunk = std::max<int64_t>(1, o.loss_chunk_bytes / (V * per_logit));
  // The weight's gradient of a microbatch (none for a frozen head): the product in the model's
  // dtype, plus the fp32 sum when a bf16/fp16 model's tokens span several chunks.
  const int64_t weight_grad = !full ? 0 : V * h * s + (s < 4 && t > chunk ? V * h * 4 : 0);
  head.head_bytes = std::min(chunk, t) * V * per_logit + weight_grad + t * h * s + 13 * t;
  layers.push_back(head);
  return layers;
}

std::vector<StageMemory> stage_memory(const ExecutePlan& plan, const TransformerShape& shape,
                                      const DeviceMemoryOptions& o) {
  const std::vector<LayerMemory> layers = layer_memory(shape, o);
  plan.validate(static_cast<int64_t>(layers.size()), RunType::kFused);  // embeddings, decoders, head
  const int64_t t = o.tokens();
  auto one = [&](const LayerRange& r, bool backward, bool fused) {
    StageMemory m;
    m.backward = backward;
    m.fused = fused;
    m.layers = r;
    int64_t sum_saved = 0, max_saved = 0;
    for (int64_t l = r.begin; l < r.end; ++l) {
      const LayerMemory& layer = layers[static_cast<size_t>(l)];
      m.weights += layer.param_bytes;
      if (backward) m.grads += layer.grad_bytes;
      sum_saved += layer.saved_per_token * t;
      max_saved = std::max(max_saved, layer.saved_per_token * t);
      if (backward) m.head += layer.head_bytes;
    }
    if (backward) m.saved_activations = o.layer_recompute ? max_saved : sum_saved;
    m.recompute = max_saved;
    m.boundary = o.inflight_microbatches * 2 * t * shape.hidden * o.dtype_bytes;
    return m;
  };
  std::vector<StageMemory> out;
  for (const LayerRange& r : plan.forward_stages()) out.push_back(one(r, false, false));
  bool first = true;
  for (const LayerRange& r : plan.backward_stages()) {
    out.push_back(one(r, true, first));
    first = false;
  }
  return out;
}

// Note [CPU devices' host memory]:
// On a CPU device a stage job copies its layers' trainable parameters into its shells
// (DeviceIo::upload_layer clones them; frozen ones such as LoRA's base are shared, Note [Shared
// host parameters] in roundpipe/detail/device_io.cpp) and frees the copies when it ends (Note
// [Layer shells]); a device runs one job at a time.
// So at any moment each device holds at most one stage's layer copies, and the peak is the sum
// over devices of the largest stage each one runs, taken separately for the two moments of an
// iteration: the forward stages (the iteration's gradients do not exist yet) and the backward
// and fused stages (they are being produced). host_memory() adds whichever moment is larger with
// the gradients it finds there. An earlier model counted every layer a device ever copies at once
// (as if the copies were cached): 21.8 B/param predicted for 17.7 measured (194M parameters,
// fp32, sync, 2 devices; docs/benchmarks.md, "Host memory per parameter and the allocator").
// With CpuDeviceLayers::kShared (in-place masters) the jobs compute on every host parameter:
// only the activations remain.
CpuDeviceBytes cpu_device_bytes(const ExecutePlan& plan, const TransformerShape& shape,
                                const DeviceMemoryOptions& options, int64_t num_devices, CpuDeviceLayers layer_source) {
  TORCH_CHECK(num_devices > 0, "cpu_device_bytes: num_devices must be positive, got ", num_devices);
  const std::vector<LayerMemory> layers = layer_memory(shape, options);
  std::vector<LayerRange> ranges = plan.forward_stages();
  const size_t forward_stages = ranges.size();
  ranges.insert(ranges.end(), plan.backward_stages().begin(), plan.backward_stages().end());
  std::vector<int64_t> largest_forward(static_cast<size_t>(num_devices), 0);
  std::vector<int64_t> largest_backward(static_cast<size_t>(num_devices), 0);
  for (size_t i = 0; i < ranges.size(); ++i) {
    int64_t bytes = 0;
    for (int64_t l = ranges[i].begin; l < ranges[i].end; ++l) bytes += layers[static_cast<size_t>(l)].trainable_bytes;
    auto& largest = i < forward_stages ? largest_forward : largest_backward;
    int64_t& slot = largest[i % static_cast<size_t>(num_devices)];
    slot = std::max(slot, bytes);
  }
  int64_t activations = 0;
  for (const StageMemory& m : stage_memory(plan, shape, options)) {
    activations = std::max(activations, m.saved_activations + m.recompute + m.head + m.boundary);
  }
  CpuDeviceBytes out;
  for (int64_t d = 0; d < num_devices && layer_source == CpuDeviceLayers::kTrainableCopied; ++d) {
    out.forward += largest_forward[static_cast<size_t>(d)];
    out.backward += largest_backward[static_cast<size_t>(d)];
  }
  out.forward += activations;
  out.backward += activations;
  return out;
}

ExecutePlan runtime_plan(const TransformerShape& shape, const DeviceMemoryOptions& options, int64_t num_devices,
                         int64_t memory_budget_bytes) {
  const std::vector<LayerMemory> layers = layer_memory(shape, options);
  std::vector<int64_t> bytes, grads;
  for (const LayerMemory& l : layers) {
    bytes.push_back(l.param_bytes);
    grads.push_back(l.grad_bytes);
  }
  return partition(size_based_costs(bytes, grads), RunType::kFused,
                   PartitionOptions()
                       .set_min_stages(std::max<int64_t>(1, num_devices))
                       .set_memory_budget_bytes(memory_budget_bytes));
}

bool memory_aware_plan(const TransformerShape& shape, const DeviceMemoryOptions& options, int64_t num_devices,
                       int64_t device_bytes, ExecutePlan* plan) {
  const std::vector<LayerMemory> layers = layer_memory(shape, options);
  const int64_t t = options.tokens();
  std::vector<int64_t> bytes, grads;
  int64_t max_saved = 0;
  for (const LayerMemory& l : layers) {
    bytes.push_back(l.param_bytes);
    grads.push_back(l.grad_bytes);
    max_saved = std::max(max_saved, l.saved_per_token * t);
  }
  std::vector<LayerCost> costs = size_based_costs(bytes, grads);
  // Additive per layer: weights (+ gradients + saved activations + the head); the rest of a
  // stage's peak (one layer's recompute, the boundary tensors) comes off the budget. With the
  // layer grain a stage keeps one layer's activations, not their sum, but counting them per
  // layer keeps the stages small at long sequences, where one layer a stage fits longest (the
  // size-based partition packs layers by time within the budget, not by memory).
  for (size_t l = 0; l < costs.size(); ++l) {
    costs[l].backward_bytes = bytes[l] + grads[l] + layers[l].saved_per_token * t + layers[l].head_bytes;
  }
  const int64_t fixed = max_saved + options.inflight_microbatches * 2 * t * shape.hidden * options.dtype_bytes;
  if (device_bytes - fixed <= 0) return false;
  try {
    *plan = partition(costs, RunType::kFused,
                      PartitionOptions()
                          .set_min_stages(std::max<int64_t>(1, num_devices))
                          .set_memory_budget_bytes(device_bytes - fixed));
  } catch (const c10::Error&) {
    return false;  // a layer alone does not fit
  }
  for (const StageMemory& m : stage_memory(*plan, shape, options)) {
    if (m.total() > device_bytes) return false;
  }
  return true;
}

int64_t max_seq_len(const TransformerShape& shape, DeviceMemoryOptions options, int64_t num_devices,
                    int64_t device_bytes, bool fixed_plan, int64_t granularity, int64_t memory_budget_bytes) {
  TORCH_CHECK(granularity > 0, "max_seq_len: granularity must be positive, got ", granularity);
  const ExecutePlan fixed = runtime_plan(shape, options, num_devices, memory_budget_bytes);
  auto fits = [&](int64_t seq_len) {
    options.seq_len = seq_len;
    if (!fixed_plan) {
      ExecutePlan plan;
      return memory_aware_plan(shape, options, num_devices, device_bytes, &plan);
    }
    for (const StageMemory& m : stage_memory(fixed, shape, options)) {
      if (m.total() > device_bytes) return false;
    }
    return true;
  };
  // Peaks grow with the sequence: double to a length that does not fit, then bisect (in units).
  constexpr int64_t kMaxUnits = int64_t{1} << 24;
  int64_t lo = 0, hi = 1;
  while (hi <= kMaxUnits && fits(hi * granularity)) {
    lo = hi;
    hi *= 2;
  }
  if (hi > kMaxUnits) return lo * granularity;
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (fits(mid * granularity)) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo * granularity;
}

int64_t factored_state_bytes(const TransformerShape& shape) {
  check_shape(shape);
  int64_t floats = 0;
  if (shape.lora_rank == 0) {
    floats += shape.vocab + shape.hidden;                                               // embeddings [V, h]
    floats += shape.hidden + (shape.tied_embeddings ? 0 : shape.vocab + shape.hidden);  // final norm, LM head
  }
  for (int64_t i = 0; i < shape.num_layers; ++i) floats += decoder_factored_floats(shape, i);
  return 4 * floats;
}

int64_t saved_input_bytes(const ExecutePlan& plan, const TransformerShape& shape, const DeviceMemoryOptions& o,
                          int64_t num_microbatch) {
  TORCH_CHECK(num_microbatch > 0, "saved_input_bytes: num_microbatch must be positive, got ", num_microbatch);
  const int64_t t = o.tokens();
  auto input_bytes = [&](int64_t l) { return l == 0 ? 8 * t : t * shape.hidden * o.dtype_bytes; };
  const auto& backward = plan.backward_stages();
  if (backward.empty()) return 0;
  const LayerRange tail = backward.front();
  int64_t per_microbatch = 0;
  for (int64_t l = 0; l < tail.begin; ++l) {
    bool kept = o.layer_recompute;
    for (size_t i = 1; i < backward.size(); ++i) kept = kept || backward[i].begin == l;
    if (kept) per_microbatch += input_bytes(l);
  }
  int64_t tail_kept = 0;
  if (o.layer_recompute) {
    for (int64_t l = tail.begin + 1; l + 1 < tail.end; ++l) tail_kept += input_bytes(l);
  }
  return per_microbatch * num_microbatch + tail_kept;
}

HostMemory host_memory(const ParameterCount& params, const HostMemoryOptions& o) {
  TORCH_CHECK(o.compute_bytes > 0 && o.master_bytes > 0, "host memory model: dtype bytes must be positive");
  TORCH_CHECK(!o.in_place_masters || (o.master_bytes == o.compute_bytes && !o.async_step),
              "host memory model: in-place masters are the compute copies (master_bytes == compute_bytes) and "
              "need sync steps");
  const int64_t n = params.trainable, s = o.compute_bytes, m = o.master_bytes;
  HostMemory h;
  h.compute_copies = params.total * s;
  h.masters = o.in_place_masters ? 0 : n * m;
  h.grads = n * s + (s != m && !o.grads_in_compute_dtype ? n * m : 0) + (o.async_step ? n * s : 0);
  switch (o.optimizer) {
    case OptimizerStateKind::kNone:
      break;
    case OptimizerStateKind::kOneMasterSized:
      h.optimizer_state = n * m;
      break;
    case OptimizerStateKind::kAdamFloat32:
      h.optimizer_state = 2 * n * 4;  // float32 moments whatever the master dtype (optim::Adam)
      break;
    case OptimizerStateKind::kAdamInt8:
      h.optimizer_state = 2 * (n + 4 * ((n + 255) / 256));
      break;
    case OptimizerStateKind::kFactored:
      h.optimizer_state = o.factored_state_bytes;
      break;
  }
  if (o.kahan_sum) h.optimizer_state += n * m;
  // Note [CPU devices' host memory]: during the forward stages the iteration's own gradients
  // (n * s) are not there yet.
  h.cpu_devices = std::max<int64_t>({0, o.cpu_device_bytes.backward, o.cpu_device_bytes.forward - n * s});
  h.saved_inputs = o.saved_inputs;
  return h;
}

}  // namespace roundpipe::scheduler
