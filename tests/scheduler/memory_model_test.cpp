// The memory model (scheduler/memory_model.h) against hand computation for a tiny Llama shape:
// vocab 64, hidden 32, intermediate 64, 2 decoder layers, 4 heads / 2 kv heads of 8, fp32.
#include "scheduler/memory_model.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

namespace roundpipe::scheduler {
namespace {

TransformerShape tiny() {
  TransformerShape s;
  s.vocab = 64;
  s.hidden = 32;
  s.intermediate = 64;
  s.num_layers = 2;
  s.heads = 4;
  s.kv_heads = 2;
  s.head_dim = 8;
  return s;
}

DeviceMemoryOptions fp32(int64_t seq_len, int64_t rows) {
  DeviceMemoryOptions o;
  o.dtype_bytes = 4;
  o.seq_len = seq_len;
  o.microbatch_rows = rows;
  o.loss_chunk_bytes = 1024;  // 1024 / (64 x 4 B) = 4 tokens a chunk
  return o;
}

// By hand: q, o 32 x 32; k, v 16 x 32; gate, up, down 3 x 32 x 64; two norms of 32.
constexpr int64_t kDecoderParams = 2 * 32 * 32 + 2 * 16 * 32 + 3 * 32 * 64 + 2 * 32;  // 9,280
constexpr int64_t kParams = 64 * 32 + 2 * kDecoderParams + (32 + 64 * 32);            // 22,688
// Saved per token per decoder layer, fp32: 4h + 3q + 3kv + 4I floats + 4 heads fp32 LSE.
constexpr int64_t kDecoderSaved = 4 * (4 * 32 + 3 * 32 + 3 * 16 + 4 * 64) + 4 * 4;  // 2,128

TEST(MemoryModelTest, CountParameters_MatchesHandCount) {
  EXPECT_EQ(kParams, 22688);
  const ParameterCount full = count_parameters(tiny());
  EXPECT_EQ(full.total, kParams);
  EXPECT_EQ(full.trainable, kParams);
  TransformerShape tied = tiny();
  tied.tied_embeddings = true;
  EXPECT_EQ(count_parameters(tied).total, kParams - 64 * 32);
  // LoRA rank 2 on q and v: 2 (32 + 32) + 2 (32 + 16) per layer train; the base is frozen.
  TransformerShape lora = tiny();
  lora.lora_rank = 2;
  lora.lora_targets = {"q_proj", "v_proj"};
  const ParameterCount adapters = count_parameters(lora);
  EXPECT_EQ(adapters.trainable, 2 * (2 * 64 + 2 * 48));
  EXPECT_EQ(adapters.total, kParams + adapters.trainable);
}

TEST(MemoryModelTest, LayerMemory_MatchesClosedForm) {
  const std::vector<LayerMemory> layers = layer_memory(tiny(), fp32(16, 2));
  ASSERT_EQ(layers.size(), 4u);
  EXPECT_EQ(layers[0].param_bytes, 64 * 32 * 4);
  EXPECT_EQ(layers[0].saved_per_token, 8);
  EXPECT_EQ(layers[1].param_bytes, kDecoderParams * 4);
  EXPECT_EQ(layers[1].grad_bytes, kDecoderParams * 4);
  EXPECT_EQ(kDecoderSaved, 2128);
  EXPECT_EQ(layers[1].saved_per_token, kDecoderSaved);
  EXPECT_EQ(layers[3].param_bytes, (32 + 64 * 32) * 4);
  EXPECT_EQ(layers[3].saved_per_token, 2 * 32 * 4);
  // Head: one 4-token chunk of fp32 logits + the weight's fp32 gradient + the hidden states'
  // gradient (32 tokens x 32 x 4 B) + targets/masks 13 B a token.
  EXPECT_EQ(layers[3].head_bytes, 4 * 64 * 4 + 64 * 32 * 4 + 32 * 32 * 4 + 13 * 32);
  // bf16: 8 B a logit, 1024 / 512 = 2 tokens; Qwen3's q/k norms; CPU's repeated k/v.
  DeviceMemoryOptions bf16 = fp32(16, 2);
  bf16.dtype_bytes = 2;
  bf16.repeat_kv = true;
  TransformerShape qwen = tiny();
  qwen.qk_norm = true;
  const std::vector<LayerMemory> q = layer_memory(qwen, bf16);
  EXPECT_EQ(q[1].saved_per_token, 2 * (4 * 32 + 3 * 32 + 3 * 16 + 4 * 64) + 4 * 4 + 2 * (32 + 16) + 2 * 2 * (32 - 16));
  EXPECT_EQ(q[1].param_bytes, (kDecoderParams + 2 * 8) * 2);
  // 32 tokens in 2-token chunks: the weight's bf16 gradient and its fp32 sum over the chunks.
  EXPECT_EQ(q[3].head_bytes, 2 * 64 * 8 + 64 * 32 * (2 + 4) + 32 * 32 * 2 + 13 * 32);
  // All 32 tokens in one chunk: the one bf16 product is the gradient, no fp32 sum.
  bf16.loss_chunk_bytes = 64 * 8 * 32;
  EXPECT_EQ(layer_memory(qwen, bf16)[3].head_bytes, 32 * 64 * 8 + 64 * 32 * 2 + 32 * 32 * 2 + 13 * 32);
}

TEST(MemoryModelTest, LayerMemory_MixtureOfExperts) {
  // 4 experts of width 16, 2 per token, on the second decoder layer only.
  TransformerShape moe = tiny();
  moe.experts = 4;
  moe.experts_per_token = 2;
  moe.moe_intermediate = 16;
  moe.sparse_layers = {false, true};
  const std::vector<LayerMemory> layers = layer_memory(moe, fp32(16, 2));
  EXPECT_EQ(layers[1].param_bytes, kDecoderParams * 4);
  // Attention and norms 3,136, router 4 x 32, experts 3 x 4 x 32 x 16.
  EXPECT_EQ(layers[2].param_bytes, (3136 + 4 * 32 + 3 * 4 * 32 * 16) * 4);
  // 4 (4h + 3q + 3kv) + 4 heads + 4 (2 k I_e) + 32 k + 8 E.
  EXPECT_EQ(layers[2].saved_per_token, 4 * (4 * 32 + 3 * 32 + 3 * 16) + 16 + 4 * (2 * 2 * 16) + 32 * 2 + 8 * 4);
  EXPECT_EQ(count_parameters(moe).total, kParams - 3 * 32 * 64 + 4 * 32 + 3 * 4 * 32 * 16);

  // Expert LoRA rank 2 (PEFT's target_parameters): gate_up_proj r E (h + 2 I_e), down_proj
  // r E (I_e + h), on the sparse layer only; a layer-specific target adapts that layer only.
  moe.lora_rank = 2;
  moe.lora_targets = {"q_proj"};
  moe.lora_expert_targets = {"gate_up_proj", "mlp.experts.down_proj"};
  const int64_t q_adapters = 2 * 2 * (32 + 32);
  EXPECT_EQ(count_parameters(moe).trainable, q_adapters + 2 * 4 * (32 + 32) + 2 * 4 * (16 + 32));
  moe.lora_expert_targets = {"0.mlp.experts.down_proj"};  // layer 0 is dense: nothing
  EXPECT_EQ(count_parameters(moe).trainable, q_adapters);
  moe.lora_expert_targets = {"layers.1.mlp.experts.down_proj"};
  EXPECT_EQ(count_parameters(moe).trainable, q_adapters + 2 * 4 * (16 + 32));
}

TEST(MemoryModelTest, CountParameters_BiasesSinksAndExpertBiases) {
  // gpt-oss's extras on the tiny shape: q/k/v/o biases 32 + 16 + 16 + 32, 4 sinks; with 4 experts
  // of width 16, the router's bias 4 and the experts' gate_up 4 x 32 and down 4 x 32 biases.
  TransformerShape s = tiny();
  s.attention_bias = true;
  s.attention_sinks = true;
  EXPECT_EQ(count_parameters(s).total, kParams + 2 * (96 + 4));
  s.experts = 4;
  s.experts_per_token = 2;
  s.moe_intermediate = 16;
  s.expert_bias = true;
  const int64_t sparse_layer = 3136 + 96 + 4 + 4 * 32 + 3 * 4 * 32 * 16 + 4 + 4 * 2 * 16 + 4 * 32;
  EXPECT_EQ(count_parameters(s).total, 64 * 32 + 2 * sparse_layer + 32 + 64 * 32);
  // Llama's mlp_bias: gate and up 64 each, down 32.
  TransformerShape llama = tiny();
  llama.mlp_bias = true;
  EXPECT_EQ(count_parameters(llama).total, kParams + 2 * (64 + 64 + 32));
}

TEST(MemoryModelTest, RuntimePlan_KeepsStagesWithinTheBudget) {
  // A budget of 1.5 decoder layers' weights and gradients: no backward stage holds two decoder
  // layers, so there are more of them than without a budget.
  const DeviceMemoryOptions o = fp32(16, 1);
  const ExecutePlan unlimited = runtime_plan(tiny(), o, 1);
  const int64_t budget = 3 * kDecoderParams * 4;  // 1.5 x (weights + gradients) of a decoder layer
  const ExecutePlan cut = runtime_plan(tiny(), o, 1, budget);
  for (const StageMemory& m : stage_memory(cut, tiny(), o)) {
    EXPECT_LE(m.weights + m.grads, budget) << m.layers.to_string();
  }
  EXPECT_GT(cut.backward_stages().size(), unlimited.backward_stages().size());
}

TEST(MemoryModelTest, StageMemory_SumsTheTermsByHand) {
  // fwd [0, 2) | fused [2, 4) | bwd [0, 2); 2 rows of 16 tokens: t = 32.
  const ExecutePlan plan({{0, 2}}, {{2, 4}, {0, 2}});
  const int64_t t = 32, boundary = 2 * 2 * t * 32 * 4;
  const int64_t head = 4 * 64 * 4 + 64 * 32 * 4 + t * 32 * 4 + 13 * t;
  const std::vector<StageMemory> stages = stage_memory(plan, tiny(), fp32(16, 2));
  ASSERT_EQ(stages.size(), 3u);
  const int64_t w01 = (64 * 32 + kDecoderParams) * 4, w23 = (kDecoderParams + 32 + 64 * 32) * 4;
  EXPECT_FALSE(stages[0].backward);
  EXPECT_EQ(stages[0].total(), w01 + kDecoderSaved * t + boundary);
  EXPECT_EQ(stages[0].total(), 129792);
  EXPECT_TRUE(stages[1].fused);
  EXPECT_EQ(stages[1].saved_activations, (kDecoderSaved + 2 * 32 * 4) * t);
  EXPECT_EQ(stages[1].total(), 2 * w23 + (kDecoderSaved + 256) * t + kDecoderSaved * t + head + boundary);
  EXPECT_EQ(stages[1].total(), 265376);
  EXPECT_EQ(stages[2].total(), 2 * w01 + (8 + kDecoderSaved) * t + kDecoderSaved * t + boundary);
  // The layer grain keeps one layer's activations in a backward stage and in the fused tail (which
  // then recomputes its decoder layer: Note [Fused tail recompute]).
  DeviceMemoryOptions layer = fp32(16, 2);
  layer.layer_recompute = true;
  const std::vector<StageMemory> by_layer = stage_memory(plan, tiny(), layer);
  EXPECT_EQ(by_layer[1].saved_activations, kDecoderSaved * t);
  EXPECT_EQ(by_layer[1].total(), stages[1].total() - 256 * t);
  EXPECT_EQ(by_layer[2].total(), 2 * w01 + kDecoderSaved * t + kDecoderSaved * t + boundary);
}

// The layer inputs kept in host memory for the recomputes, by hand: t = 32 tokens, 3 microbatches.
TEST(MemoryModelTest, SavedInputBytes_ByHand) {
  const int64_t t = 32, hidden_bytes = t * 32 * 4, ids = 8 * t;
  // fwd [0, 1) | fused [1, 4) | bwd [0, 1). Stage grain: the backward stage's input (the token ids).
  const ExecutePlan plan({{0, 1}}, {{1, 4}, {0, 1}});
  DeviceMemoryOptions o = fp32(16, 2);
  EXPECT_EQ(saved_input_bytes(plan, tiny(), o, 3), 3 * ids);
  // Layer grain: the same, plus the tail's decoder 2 input (layer 2) for one microbatch.
  o.layer_recompute = true;
  EXPECT_EQ(saved_input_bytes(plan, tiny(), o, 3), 3 * ids + hidden_bytes);
  // fwd [0, 2) | fused [2, 4) | bwd [1, 2) [0, 1): stage grain keeps layer 1's input (hidden) and
  // layer 0's (ids) per microbatch; the layer grain the same (every layer before the tail), and
  // nothing in a tail of two layers.
  const ExecutePlan two({{0, 2}}, {{2, 4}, {1, 2}, {0, 1}});
  EXPECT_EQ(saved_input_bytes(two, tiny(), o, 3), 3 * (ids + hidden_bytes));
  o.layer_recompute = false;
  EXPECT_EQ(saved_input_bytes(two, tiny(), o, 3), 3 * (ids + hidden_bytes));
  // It adds to the host total.
  HostMemoryOptions h;
  h.saved_inputs = 1000;
  ParameterCount n;
  n.total = n.trainable = 10;
  EXPECT_EQ(host_memory(n, h).total(), host_memory(n, HostMemoryOptions()).total() + 1000);
}

TEST(MemoryModelTest, MaxSeqLen_OneFusedStage_SolvesTheLinearBound) {
  // One device: the size-based plan is one fused stage (cost 3B against >= 4.5B for any split).
  const ExecutePlan plan = runtime_plan(tiny(), fp32(16, 1), 1);
  ASSERT_EQ(plan.forward_stages().size(), 0u) << plan.to_string();
  ASSERT_EQ(plan.backward_stages().size(), 1u) << plan.to_string();
  // Peak(T) for T >= 4 (a full chunk), one row: weights + grads + chunk + weight-gradient
  // accumulator + T (saved 8 + 2 x 2128 + 256, one layer's recompute 2128, grad_hidden 128,
  // targets 13, boundaries 512).
  const int64_t fixed = 2 * kParams * 4 + 4 * 64 * 4 + 64 * 32 * 4;
  const int64_t per_token = (8 + 2 * kDecoderSaved + 256) + kDecoderSaved + 32 * 4 + 13 + 2 * 2 * 32 * 4;
  EXPECT_EQ(per_token, 7301);
  const int64_t budget = fixed + 100 * per_token + 5;
  EXPECT_EQ(max_seq_len(tiny(), fp32(16, 1), 1, budget, /*fixed_plan=*/true, /*granularity=*/1), 100);
  EXPECT_EQ(max_seq_len(tiny(), fp32(16, 1), 1, budget, true, 8), 96);
  EXPECT_EQ(max_seq_len(tiny(), fp32(16, 1), 1, fixed, true, 1), 0);
  // Two rows a microbatch: half the tokens per sequence.
  EXPECT_EQ(max_seq_len(tiny(), fp32(16, 2), 1, budget, true, 1), 50);
}

TEST(MemoryModelTest, MemoryAwarePlan_CutsStagesToFit) {
  const DeviceMemoryOptions o = fp32(512, 1);
  const ExecutePlan one = runtime_plan(tiny(), o, 1);
  const int64_t whole = stage_memory(one, tiny(), o).front().total();
  // Under 70% of the single stage's peak the memory-aware plan splits the layers, and every
  // stage then fits.
  const int64_t budget = whole * 7 / 10;
  ExecutePlan plan;
  ASSERT_TRUE(memory_aware_plan(tiny(), o, 1, budget, &plan));
  EXPECT_GT(plan.num_stages(), 1) << plan.to_string();
  for (const StageMemory& m : stage_memory(plan, tiny(), o)) EXPECT_LE(m.total(), budget);
  EXPECT_FALSE(memory_aware_plan(tiny(), o, 1, 1000, &plan));  // not even one layer
  EXPECT_GT(max_seq_len(tiny(), o, 1, budget, false, 64), max_seq_len(tiny(), o, 1, budget, true, 64));
}

// Note [CPU devices' host memory]: each device holds one stage's layer copies at a time.
TEST(MemoryModelTest, CpuDeviceBytes_LargestStagePerDevicePerMomentPlusOneStagesActivations) {
  // fwd [0, 2) | fused [2, 4) | bwd [0, 2), dealt round-robin in that order. Layers 0-1 are the
  // embeddings and decoder 0 (a), layers 2-3 decoder 1 and the final norm + LM head (b = a + 32).
  const ExecutePlan plan({{0, 2}}, {{2, 4}, {0, 2}});
  const int64_t a = (64 * 32 + kDecoderParams) * 4, b = (kDecoderParams + 32 + 64 * 32) * 4;
  ASSERT_EQ(a + b, kParams * 4);
  const int64_t t = 32, fused_activations = (kDecoderSaved + 256) * t + kDecoderSaved * t +
                                            (4 * 64 * 4 + 64 * 32 * 4 + t * 32 * 4 + 13 * t) + 2 * 2 * t * 32 * 4;
  // One device runs everything: the forward stage, then the larger backward stage at a time.
  CpuDeviceBytes one = cpu_device_bytes(plan, tiny(), fp32(16, 2), 1);
  EXPECT_EQ(one.forward, a + fused_activations);
  EXPECT_EQ(one.backward, b + fused_activations);
  // Two: device 0 runs the forward stage and bwd [0, 2), device 1 the fused stage.
  CpuDeviceBytes two = cpu_device_bytes(plan, tiny(), fp32(16, 2), 2);
  EXPECT_EQ(two.forward, a + fused_activations);
  EXPECT_EQ(two.backward, a + b + fused_activations);
  CpuDeviceBytes three = cpu_device_bytes(plan, tiny(), fp32(16, 2), 3);
  EXPECT_EQ(three.forward, a + fused_activations);
  EXPECT_EQ(three.backward, b + a + fused_activations);
  // Jobs computing on the host parameters (in-place masters) hold only the activations.
  CpuDeviceBytes shared = cpu_device_bytes(plan, tiny(), fp32(16, 2), 2, CpuDeviceLayers::kShared);
  EXPECT_EQ(shared.forward, fused_activations);
  EXPECT_EQ(shared.backward, fused_activations);
  // LoRA: the frozen base is shared in any step mode, so only the adapters are copied (rank 2 on
  // q and v: 2 (32 + 32) + 2 (32 + 16) per decoder layer, one in each of a and b); the adapters
  // add 2 x 2 tokens' worth of rank-2 activations per adapted projection to each decoder's saved.
  TransformerShape lora = tiny();
  lora.lora_rank = 2;
  lora.lora_targets = {"q_proj", "v_proj"};
  const int64_t adapter_bytes = (2 * 64 + 2 * 48) * 4;
  const std::vector<LayerMemory> lora_layers = layer_memory(lora, fp32(16, 2));
  EXPECT_EQ(lora_layers[0].trainable_bytes, 0);
  EXPECT_EQ(lora_layers[1].trainable_bytes, adapter_bytes);
  EXPECT_EQ(lora_layers[3].trainable_bytes, 0);
  const int64_t lora_activations = cpu_device_bytes(plan, lora, fp32(16, 2), 2, CpuDeviceLayers::kShared).backward;
  CpuDeviceBytes lora_two = cpu_device_bytes(plan, lora, fp32(16, 2), 2);
  EXPECT_EQ(lora_two.forward, adapter_bytes + lora_activations);
  EXPECT_EQ(lora_two.backward, 2 * adapter_bytes + lora_activations);
  // host_memory adds the larger moment: the forward stages' copies less the iteration's
  // gradients (not there yet), or the backward stages'.
  HostMemoryOptions o;
  o.compute_bytes = o.master_bytes = 4;
  o.async_step = false;
  o.cpu_device_bytes = {kParams * 4 + 100, 10};
  EXPECT_EQ(host_memory(ParameterCount{kParams, kParams}, o).cpu_devices, 100);
  o.cpu_device_bytes = {10, 20};
  EXPECT_EQ(host_memory(ParameterCount{kParams, kParams}, o).cpu_devices, 20);
}

// Adafactor's state (optim::Adafactor, torch.optim.Adafactor): rows + cols floats per matrix
// (per expert for the experts' 3-dimensional tensors), one per element of a vector.
TEST(MemoryModelTest, FactoredStateBytes_MatchesHandCount) {
  // Embeddings 64 + 32, final norm 32, LM head 64 + 32; per layer q 32 + 32, k, v 16 + 32 each,
  // o 32 + 32, two norms 2 x 32, gate, up, down 64 + 32 each.
  constexpr int64_t kLayer = 64 + 2 * 48 + 64 + 64 + 3 * 96;  // 576
  EXPECT_EQ(factored_state_bytes(tiny()), 4 * (96 + 32 + 96 + 2 * kLayer));
  TransformerShape tied = tiny();
  tied.tied_embeddings = true;
  EXPECT_EQ(factored_state_bytes(tied), 4 * (96 + 32 + 2 * kLayer));
  // LoRA rank 2 on q and v: A [2, 32] and B [32, 2] / [16, 2] per layer; the frozen base has none.
  TransformerShape lora = tiny();
  lora.lora_rank = 2;
  lora.lora_targets = {"q_proj", "v_proj"};
  EXPECT_EQ(factored_state_bytes(lora), 4 * 2 * ((2 + 32) + (32 + 2) + (2 + 32) + (16 + 2)));
  // Experts on layer 1: router [4, 32], gate_up 4 x [32, 32], down 4 x [16, 32] or [32, 16].
  TransformerShape moe = tiny();
  moe.experts = 4;
  moe.experts_per_token = 2;
  moe.moe_intermediate = 16;
  moe.sparse_layers = {false, true};
  EXPECT_EQ(factored_state_bytes(moe), 4 * (96 + 32 + 96 + kLayer + (kLayer - 3 * 96) + 36 + 4 * 64 + 4 * 48));
  HostMemoryOptions o;
  o.optimizer = OptimizerStateKind::kFactored;
  o.factored_state_bytes = factored_state_bytes(tiny());
  EXPECT_EQ(host_memory(ParameterCount{kParams, kParams}, o).optimizer_state, 4 * (224 + 2 * kLayer));
}

TEST(MemoryModelTest, HostMemory_TermsPerOptimizer) {
  const ParameterCount n{kParams, kParams};
  HostMemoryOptions o;
  o.compute_bytes = 4;
  o.master_bytes = 4;
  o.async_step = false;
  HostMemory h = host_memory(n, o);
  EXPECT_EQ(h.compute_copies, 4 * kParams);
  EXPECT_EQ(h.masters, 4 * kParams);  // a separate copy even at the same dtype
  EXPECT_EQ(h.grads, 4 * kParams);
  EXPECT_EQ(h.optimizer_state, 8 * kParams);
  EXPECT_EQ(h.total(), 20 * kParams);  // the live sum, no allowance (Note [Memory model])
  // bf16 compute, async: bf16 gradients, the fp32 cast buffer and a second bf16 set.
  o.compute_bytes = 2;
  o.async_step = true;
  h = host_memory(n, o);
  EXPECT_EQ(h.compute_copies, 2 * kParams);
  EXPECT_EQ(h.grads, (2 + 4 + 2) * kParams);
  // 8-bit moments: a byte each plus an fp32 scale per 256 values each.
  o.optimizer = OptimizerStateKind::kAdamInt8;
  EXPECT_EQ(host_memory(n, o).optimizer_state, 2 * (kParams + 4 * 89));
  o.optimizer = OptimizerStateKind::kOneMasterSized;
  EXPECT_EQ(host_memory(n, o).optimizer_state, 4 * kParams);
  o.optimizer = OptimizerStateKind::kNone;
  EXPECT_EQ(host_memory(n, o).optimizer_state, 0);
  // LoRA: the frozen base has its compute copy only.
  const ParameterCount lora{kParams + 448, 448};
  o.optimizer = OptimizerStateKind::kAdamFloat32;
  h = host_memory(lora, o);
  EXPECT_EQ(h.compute_copies, 2 * (kParams + 448));
  EXPECT_EQ(h.masters + h.grads + h.optimizer_state, (4 + 8 + 8) * 448);
  o.cpu_device_bytes = {0, 12345};
  EXPECT_EQ(host_memory(lora, o).total(), h.total() + 12345);
}

// bf16 masters with Kahan compensation as the compute copies (RoundPipeOptions::in_place_masters,
// sync steps): 2 (parameter) + 2 (gradient) + 2 (compensation) + moments; issue 31's 8.5 B/param
// row with 8-bit moments.
TEST(MemoryModelTest, HostMemory_InPlaceBf16MastersWithKahan) {
  const ParameterCount n{kParams, kParams};
  HostMemoryOptions o;
  o.compute_bytes = 2;
  o.master_bytes = 2;
  o.async_step = false;
  o.in_place_masters = true;
  o.kahan_sum = true;
  HostMemory h = host_memory(n, o);
  EXPECT_EQ(h.compute_copies, 2 * kParams);
  EXPECT_EQ(h.masters, 0);
  EXPECT_EQ(h.grads, 2 * kParams);
  EXPECT_EQ(h.optimizer_state, (8 + 2) * kParams);  // float32 moments + the bf16 compensation
  o.optimizer = OptimizerStateKind::kAdamInt8;
  h = host_memory(n, o);
  EXPECT_EQ(h.optimizer_state, 2 * (kParams + 4 * 89) + 2 * kParams);
  EXPECT_LE(static_cast<double>(h.total()) / kParams, 8.5);
  // fp32 in place: the master copy's 4 B/param go.
  o.compute_bytes = o.master_bytes = 4;
  o.kahan_sum = false;
  o.optimizer = OptimizerStateKind::kAdamFloat32;
  EXPECT_EQ(host_memory(n, o).total(), (4 + 4 + 8) * kParams);
  // In place needs equal dtypes and sync steps.
  o.master_bytes = 2;
  EXPECT_THROW(host_memory(n, o), c10::Error);
  o.master_bytes = 4;
  o.async_step = true;
  EXPECT_THROW(host_memory(n, o), c10::Error);
}

}  // namespace
}  // namespace roundpipe::scheduler
