// The memory model of a pipelined decoder-only transformer: per stage the peak bytes a device holds
// (weights, gradients, saved activations, one layer's recompute, the chunked LM head/loss), the
// longest sequence that fits a device, and the host's training state per parameter. Pure
// arithmetic on the model's shape (the formulas: memory_model.cpp; docs/user-guide.md, "Planning
// memory"); `roundpipe plan` and `roundpipe train`'s refusal use it, before any weight exists.
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "scheduler/execute_plan.h"
#include "scheduler/partitioner.h"

namespace roundpipe::scheduler {

/// Shape of a decoder-only transformer, in Hugging Face config.json terms.
struct TransformerShape {
  int64_t vocab = 0;
  int64_t hidden = 0;
  int64_t intermediate = 0;  ///< dense MLP width
  int64_t num_layers = 0;    ///< decoder layers
  int64_t heads = 0;
  int64_t kv_heads = 0;
  int64_t head_dim = 0;
  bool qk_norm = false;  ///< RMSNorm on q and k per head (Qwen3)
  bool attention_bias = false;
  bool attention_sinks = false;  ///< a learned sink logit per head (gpt-oss)
  bool mlp_bias = false;         ///< biases on the dense MLP's gate/up/down (Llama's mlp_bias)
  bool tied_embeddings = false;
  // Mixture of experts (0 experts: dense).
  int64_t experts = 0;
  int64_t experts_per_token = 0;
  int64_t moe_intermediate = 0;
  /// Biases on the router and the experts' gate_up/down projections (gpt-oss).
  bool expert_bias = false;
  /// Per decoder layer, whether it has experts; empty with experts > 0: every layer has.
  std::vector<bool> sparse_layers;
  // LoRA: rank 0 = every parameter trains; else only rank-r adapters on `lora_targets`
  // (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj) train, the base is frozen.
  int64_t lora_rank = 0;
  std::vector<std::string> lora_targets;
  /// Expert weights with adapters (LoraOptions::target_parameters: gate_up_proj, down_proj, or a
  /// layer's "3.mlp.experts.down_proj"): r E (in + out) parameters each per sparse layer.
  std::vector<std::string> lora_expert_targets;

  int64_t q_dim() const { return heads * head_dim; }
  int64_t kv_dim() const { return kv_heads * head_dim; }
};

/// Parameter counts (tied embeddings counted once).
struct ParameterCount {
  int64_t total = 0;
  int64_t trainable = 0;
};
ParameterCount count_parameters(const TransformerShape& shape);

/// What a run does on its devices.
struct DeviceMemoryOptions {
  int64_t dtype_bytes = 2;                        ///< compute dtype (model.dtype)
  int64_t seq_len = 2048;                         ///< tokens per sequence
  int64_t microbatch_rows = 1;                    ///< sequences per microbatch
  bool layer_recompute = false;                   ///< run.recompute: layer (else stage)
  int64_t loss_chunk_bytes = int64_t{256} << 20;  ///< run.loss_chunk_mib
  /// k and v repeated to the query heads before attention (CPU devices; CUDA's SDPA broadcasts).
  bool repeat_kv = false;
  /// Microbatches whose boundary tensors (stage input and output) a device holds at once: the
  /// running one and the one whose download is still in flight (docs/benchmarks.md, "Memory model").
  int64_t inflight_microbatches = 2;

  int64_t tokens() const { return seq_len * microbatch_rows; }
};

/// One pipeline layer (0 = embeddings, 1..L = decoder layers, L+1 = norm + LM head).
struct LayerMemory {
  int64_t param_bytes = 0;      ///< compute copy on the device
  int64_t grad_bytes = 0;       ///< gradients of its trainable parameters (backward stages)
  int64_t trainable_bytes = 0;  ///< the trainable parameters' part of param_bytes
  int64_t saved_per_token = 0;  ///< bytes autograd keeps per token between forward and backward
  int64_t head_bytes = 0;       ///< the LM head/loss working set (last layer only; see the Note)
};

/// The pipeline's layers with their memory at `options` (the head's working set depends on the
/// tokens of a microbatch).
std::vector<LayerMemory> layer_memory(const TransformerShape& shape, const DeviceMemoryOptions& options);

/// Peak device bytes of one stage, by term.
struct StageMemory {
  bool backward = false;  ///< a backward stage (the first of them is the fused tail)
  bool fused = false;
  LayerRange layers{0, 0};
  int64_t weights = 0;
  int64_t grads = 0;
  int64_t saved_activations = 0;  ///< kept for backward during one microbatch
  int64_t recompute = 0;          ///< one layer's intermediates (forward transient or backward grads)
  int64_t head = 0;               ///< chunked LM head + loss
  int64_t boundary = 0;           ///< stage inputs/outputs of the in-flight microbatches
  int64_t total() const { return weights + grads + saved_activations + recompute + head + boundary; }
};

/// Host bytes CPU devices hold while `plan` runs, at the two moments of an iteration (stages are
/// dealt to the devices round-robin in plan order; a device runs one stage at a time, holding the
/// copies of that stage's layers until it ends; docs/benchmarks.md, "Host memory per parameter and the allocator").
struct CpuDeviceBytes {
  /// While the forward stages run: per device the layer copies (trainable parameters) of its
  /// largest forward stage, summed, plus the largest stage's activations.
  int64_t forward = 0;
  /// While the backward and fused stages run: the same over those stages.
  int64_t backward = 0;
};
/// Which parameters CPU devices' stage jobs copy, computing on the host parameters themselves for
/// the rest: the trainable ones (the default; frozen parameters such as LoRA's base are shared in
/// any step mode) or none (RoundPipeOptions::in_place_masters or sync_steps). docs/benchmarks.md, "Host memory
/// per parameter and the allocator".
enum class CpuDeviceLayers { kTrainableCopied, kShared };
CpuDeviceBytes cpu_device_bytes(const ExecutePlan& plan, const TransformerShape& shape,
                                const DeviceMemoryOptions& options, int64_t num_devices,
                                CpuDeviceLayers layer_source = CpuDeviceLayers::kTrainableCopied);

/// The peak of every stage of `plan` (forward stages, then backward stages as in ExecutePlan),
/// training (RunType::kFused plans).
std::vector<StageMemory> stage_memory(const ExecutePlan& plan, const TransformerShape& shape,
                                      const DeviceMemoryOptions& options);

/// The plan the runtime builds for these layers before any time is measured (the launcher's
/// deterministic plan): partition(size_based_costs(weights, grads), kFused) on `num_devices`, each
/// stage within `memory_budget_bytes` by the partitioner's byte costs (RoundPipe's
/// device_memory_budget_bytes: by default half the smallest GPU's memory, unlimited on CPU devices).
ExecutePlan runtime_plan(const TransformerShape& shape, const DeviceMemoryOptions& options, int64_t num_devices,
                         int64_t memory_budget_bytes = std::numeric_limits<int64_t>::max());

/// A plan whose every stage fits `device_bytes` by this model (stages cut by activation bytes as
/// well as weights), or false when even one layer per stage does not fit.
bool memory_aware_plan(const TransformerShape& shape, const DeviceMemoryOptions& options, int64_t num_devices,
                       int64_t device_bytes, ExecutePlan* plan);

/// The longest seq_len (a multiple of `granularity`) whose peak fits `device_bytes`, 0 if none.
/// `fixed_plan`: with the runtime's plan (runtime_plan with `memory_budget_bytes`); otherwise with
/// memory_aware_plan at each length.
int64_t max_seq_len(const TransformerShape& shape, DeviceMemoryOptions options, int64_t num_devices,
                    int64_t device_bytes, bool fixed_plan, int64_t granularity = 1024,
                    int64_t memory_budget_bytes = std::numeric_limits<int64_t>::max());

/// Which optimizer keeps which state per trainable parameter.
enum class OptimizerStateKind {
  kNone,            ///< SGD without momentum
  kOneMasterSized,  ///< Lion's momentum, SGD's momentum buffer
  kAdamFloat32,     ///< Adam/AdamW exp_avg + exp_avg_sq in float32 (also with bf16 masters)
  kAdamInt8,        ///< block-wise 8-bit moments: 1 B each + an fp32 scale per 256 values
  kFactored,        ///< Adafactor: HostMemoryOptions::factored_state_bytes (factored_state_bytes())
};

/// Bytes of Adafactor's fp32 second moment for the trainable parameters of `shape`: (rows + cols)
/// x 4 per matrix (a tensor of 3 dimensions: per matrix of its trailing two), 4 per element of a
/// vector (norms, biases), as optim::Adafactor and torch.optim.Adafactor keep it.
int64_t factored_state_bytes(const TransformerShape& shape);

/// Host bytes of the layer inputs a training run of `plan` keeps for its recomputes (Note [Memory
/// model], host): the input of every backward stage but the fused tail (with the layer grain,
/// of every layer before the tail) for all `num_microbatch` microbatches, and with the layer
/// grain the fused tail's kept inputs of one microbatch.
int64_t saved_input_bytes(const ExecutePlan& plan, const TransformerShape& shape, const DeviceMemoryOptions& options,
                          int64_t num_microbatch);

struct HostMemoryOptions {
  int64_t compute_bytes = 2;  ///< model.dtype
  int64_t master_bytes = 4;   ///< model.master_dtype
  OptimizerStateKind optimizer = OptimizerStateKind::kAdamFloat32;
  bool async_step = true;  ///< run.step_mode: async (a second gradient set in flight)
  /// RoundPipeOptions::in_place_masters: the compute copy is the master (master_bytes must equal
  /// compute_bytes; sync steps only).
  bool in_place_masters = false;
  /// RoundPipeOptions::master_grad_dtype set to the compute dtype: the step hands the compute
  /// gradients to the optimizer as they are, with no master-dtype gradient buffers.
  bool grads_in_compute_dtype = false;
  /// optim::AdamOptions::kahan_sum: a compensation buffer in the master dtype per trainable
  /// parameter (bf16 masters).
  bool kahan_sum = false;
  /// Host bytes the CPU devices' stage jobs hold (their "device" memory is host memory):
  /// cpu_device_bytes(); zero with GPUs.
  CpuDeviceBytes cpu_device_bytes;
  int64_t factored_state_bytes = 0;  ///< kFactored's optimizer state: factored_state_bytes(shape)
  int64_t saved_inputs = 0;          ///< saved_input_bytes()
};

/// Predicted peak host bytes, by term (formulas in memory_model.cpp).
struct HostMemory {
  int64_t compute_copies = 0;
  int64_t masters = 0;
  int64_t grads = 0;
  int64_t optimizer_state = 0;  ///< moments, factored statistics, Kahan compensation
  /// What the CPU devices add at the peak: the backward stages' bytes (the gradients are all
  /// counted), or the forward stages' less the iteration's gradients, which do not exist yet.
  int64_t cpu_devices = 0;
  /// The layer inputs kept for the recompute (saved_input_bytes()).
  int64_t saved_inputs = 0;
  int64_t total() const { return compute_copies + masters + grads + optimizer_state + cpu_devices + saved_inputs; }
};
HostMemory host_memory(const ParameterCount& params, const HostMemoryOptions& options);

}  // namespace roundpipe::scheduler
