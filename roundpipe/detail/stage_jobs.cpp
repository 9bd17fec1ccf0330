#include "roundpipe/detail/stage_jobs.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/autograd.h>

#include <sstream>

#include "roundpipe/detail/layer_rng.h"

namespace roundpipe::detail {
namespace {

// An error received from an upstream job through a channel: propagated unchanged.
struct UpstreamError {
  std::exception_ptr error;
};

const Activations& await(const ChannelPtr& channel) {
  try {
    return channel->get();
  } catch (...) {
    throw UpstreamError{std::current_exception()};
  }
}

// Where a job is, for error messages.
struct Position {
  const char* phase;
  scheduler::LayerRange stage;
  int64_t layer = -1;
  int64_t microbatch = -1;
  const char* step = "";
};

// Runs `body`; on failure fails every output channel and rethrows, wrapping a local error with
// the job's position (upstream errors pass through unchanged, so the root cause is reported).
template <typename Body>
void guarded(RunContext& ctx, const c10::Device& device, Position& pos, const std::vector<ChannelPtr>& outputs,
             Body&& body) {
  std::exception_ptr error;
  try {
    amp::AutocastState::Guard autocast(ctx.autocast);
    body();
    return;
  } catch (const UpstreamError& upstream) {
    error = upstream.error;
  } catch (const std::exception& e) {
    const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
    std::ostringstream msg;
    msg << "RoundPipe '" << ctx.model_name << "': " << pos.phase << " stage " << pos.stage.to_string() << " on "
        << device;
    if (pos.layer >= 0) msg << ", layer " << ctx.model->names[pos.layer];
    if (pos.microbatch >= 0) msg << ", microbatch " << pos.microbatch;
    if (*pos.step) msg << " (" << pos.step << ")";
    msg << ": " << (c10_error ? c10_error->what_without_backtrace() : e.what());
    error = std::make_exception_ptr(c10::Error(msg.str()));
  }
  for (const auto& channel : outputs) {
    if (channel) channel->fail(error);
  }
  std::rethrow_exception(error);
}

bool is_float(const at::Tensor& t) { return t.defined() && at::isFloatingType(t.scalar_type()); }

Activations to_device(const Activations& acts, const c10::Device& device) {
  Activations out;
  out.reserve(acts.size());
  for (const auto& t : acts) out.push_back(t.defined() ? t.to(device, /*non_blocking=*/false) : t);
  return out;
}

// A host copy that later in-place writes cannot alter.
Activations host_copy(const Activations& acts) {
  Activations out;
  out.reserve(acts.size());
  for (const auto& t : acts) out.push_back(t.defined() ? (t.is_cpu() ? t.detach().clone() : t.detach().cpu()) : t);
  return out;
}

Activations detached_host(const Activations& acts) {
  Activations out;
  out.reserve(acts.size());
  for (const auto& t : acts) out.push_back(t.defined() ? t.detach().to(c10::kCPU) : t);
  return out;
}

// Fresh leaves for recompute/backward: floating tensors require grad when `need_grad`.
Activations make_leaves(const Activations& acts, const c10::Device& device, bool need_grad) {
  Activations out;
  out.reserve(acts.size());
  for (const auto& t : acts) {
    if (!t.defined()) {
      out.push_back(t);
      continue;
    }
    auto leaf = t.detach().to(device);
    if (leaf.data_ptr() == t.data_ptr()) leaf = leaf.clone();  // never share storage with a saved input
    if (need_grad && is_float(leaf)) leaf.requires_grad_(true);
    out.push_back(leaf);
  }
  return out;
}

Activations leaf_grads(const Activations& leaves) {
  Activations grads;
  grads.reserve(leaves.size());
  for (const auto& t : leaves) grads.push_back(t.defined() && t.requires_grad() ? t.grad() : at::Tensor());
  return grads;
}

// Backward through `outputs` with `grads`, pairing by position and skipping outputs that need no
// gradient or received none.
void backward_paired(const Activations& outputs, const Activations& grads, const c10::Device& device) {
  TORCH_CHECK(outputs.size() == grads.size(), "recompute produced ", outputs.size(),
              " output tensors but the next stage sent gradients for ", grads.size(),
              ": a layer's output structure must not depend on whether it is recomputed");
  std::vector<at::Tensor> outs, gs;
  for (size_t k = 0; k < outputs.size(); ++k) {
    if (outputs[k].defined() && outputs[k].requires_grad() && grads[k].defined()) {
      outs.push_back(outputs[k]);
      gs.push_back(grads[k].to(device));
    }
  }
  if (!outs.empty()) torch::autograd::backward(outs, gs);
}

std::vector<torch::nn::AnyModule> clone_layers(const RunContext& ctx, scheduler::LayerRange r,
                                               const c10::Device& device, Position& pos) {
  std::vector<torch::nn::AnyModule> clones;
  pos.step = "copying the layer to the device";
  for (int64_t l = r.begin; l < r.end; ++l) {
    pos.layer = l;
    if (ctx.wait_layer_ready) {
      pos.step = "waiting for the optimizer";
      ctx.wait_layer_ready(l);
      pos.step = "copying the layer to the device";
    }
    torch::nn::AnyModule clone;
    run_rng_isolated([&] { clone = ctx.model->layers[l].clone(device); });
    for (auto& p : clone.ptr()->parameters()) {
      if (p.grad().defined()) p.mutable_grad().reset();
    }
    clones.push_back(std::move(clone));
  }
  pos.layer = -1;
  pos.step = "";
  return clones;
}

Activations run_layer(RunContext& ctx, torch::nn::AnyModule& layer, int64_t l, int64_t j, const Activations& acts,
                      const c10::Device& device) {
  if (!ctx.preserve_rng) return call_layer(layer, acts, ctx.model->call_modes[l]);
  Activations out;
  run_seeded(device, layer_seed(ctx.seed, ctx.iteration, j, l),
             [&] { out = call_layer(layer, acts, ctx.model->call_modes[l]); });
  return out;
}

std::vector<at::Tensor> buffer_copies(torch::nn::AnyModule& layer) {
  std::vector<at::Tensor> out;
  for (const auto& b : layer.ptr()->buffers()) out.push_back(b.detach().to(c10::kCPU).clone());
  return out;
}

std::vector<at::Tensor> param_grads(torch::nn::AnyModule& layer) {
  std::vector<at::Tensor> out;
  for (const auto& p : layer.ptr()->parameters()) out.push_back(p.grad().defined() ? p.grad().to(c10::kCPU) : at::Tensor());
  return out;
}

}  // namespace

void run_forward_stage(RunContext& ctx, size_t stage, scheduler::LayerRange r, c10::Device device) {
  Position pos{"forward", r};
  std::vector<ChannelPtr> outputs;
  if (stage < ctx.fwd_out.size()) outputs.insert(outputs.end(), ctx.fwd_out[stage].begin(), ctx.fwd_out[stage].end());
  for (int64_t l = r.begin; l < r.end; ++l) {
    outputs.insert(outputs.end(), ctx.saved[l].begin(), ctx.saved[l].end());
    outputs.push_back(ctx.buffer_snapshot[l]);
  }
  guarded(ctx, device, pos, outputs, [&] {
    auto clones = clone_layers(ctx, r, device, pos);
    for (int64_t l = r.begin; l < r.end; ++l) {
      if (ctx.buffer_snapshot[l]) ctx.buffer_snapshot[l]->set(buffer_copies(clones[l - r.begin]));
    }
    at::NoGradGuard no_grad;
    for (int64_t j = 0; j < ctx.num_microbatch; ++j) {
      pos.microbatch = j;
      Activations acts = to_device(stage == 0 ? ctx.inputs[j] : await(ctx.fwd_out[stage - 1][j]), device);
      for (int64_t l = r.begin; l < r.end; ++l) {
        pos.layer = l;
        if (!ctx.saved[l].empty()) ctx.saved[l][j]->set(host_copy(acts));
        acts = run_layer(ctx, clones[l - r.begin], l, j, acts, device);
      }
      pos.layer = -1;
      if (stage < ctx.fwd_out.size()) {
        ctx.fwd_out[stage][j]->set(detached_host(acts));
      } else {
        ctx.outputs[j] = to_device(acts, ctx.output_device);
      }
    }
    for (int64_t l = r.begin; l < r.end; ++l) ctx.buffers[l] = buffer_copies(clones[l - r.begin]);
  });
}

void run_fused_stage(RunContext& ctx, scheduler::LayerRange r, c10::Device device) {
  Position pos{"fused", r};
  std::vector<ChannelPtr> outputs(ctx.bwd_grad[0].begin(), ctx.bwd_grad[0].end());
  guarded(ctx, device, pos, outputs, [&] {
    auto clones = clone_layers(ctx, r, device, pos);
    const size_t fwd_stages = ctx.fwd_out.size();
    for (int64_t j = 0; j < ctx.num_microbatch; ++j) {
      pos.microbatch = j;
      Activations leaves =
          r.begin == 0 ? to_device(ctx.inputs[j], device) : make_leaves(await(ctx.fwd_out[fwd_stages - 1][j]), device, true);
      Activations acts = leaves;
      for (int64_t l = r.begin; l < r.end; ++l) {
        pos.layer = l;
        acts = run_layer(ctx, clones[l - r.begin], l, j, acts, device);
      }
      pos.layer = -1;
      pos.step = "loss_fn";
      TORCH_CHECK(acts.size() == 1, "the last layer returned ", acts.size(),
                  " tensors; loss_fn takes one output tensor");
      at::Tensor label = ctx.labels[j].defined() ? ctx.labels[j].to(device) : ctx.labels[j];
      at::Tensor loss = (*ctx.loss_fn)(acts[0], label);
      TORCH_CHECK(loss.defined() && loss.numel() == 1, "loss_fn must return a one-element tensor, got ",
                  loss.defined() ? c10::str(loss.sizes()) : "an undefined tensor");
      pos.step = "backward";
      loss.backward();
      pos.step = "";
      ctx.losses[j] = loss.detach().to(c10::kCPU).reshape({});
      if (r.begin > 0) ctx.bwd_grad[0][j]->set(detached_host(leaf_grads(leaves)));
    }
    pos.microbatch = -1;
    for (int64_t l = r.begin; l < r.end; ++l) {
      ctx.grads[l] = param_grads(clones[l - r.begin]);
      ctx.buffers[l] = buffer_copies(clones[l - r.begin]);
    }
  });
}

void run_backward_stage(RunContext& ctx, size_t stage, scheduler::LayerRange r, c10::Device device) {
  Position pos{"backward", r};
  std::vector<ChannelPtr> outputs;
  if (r.begin > 0) outputs.assign(ctx.bwd_grad[stage].begin(), ctx.bwd_grad[stage].end());
  guarded(ctx, device, pos, outputs, [&] {
    auto clones = clone_layers(ctx, r, device, pos);
    {
      // Recompute starts from the buffers the forward started from, and evolves them in the same
      // microbatch order; the results are discarded (Note [Buffers in recompute]).
      at::NoGradGuard no_grad;
      for (int64_t l = r.begin; l < r.end; ++l) {
        const Activations& snapshot = await(ctx.buffer_snapshot[l]);
        auto buffers = clones[l - r.begin].ptr()->buffers();
        for (size_t k = 0; k < buffers.size(); ++k) buffers[k].copy_(snapshot[k]);
      }
    }
    for (int64_t j = 0; j < ctx.num_microbatch; ++j) {
      pos.microbatch = j;
      Activations grads = await(ctx.bwd_grad[stage - 1][j]);
      if (ctx.grain == RecomputeGrain::kStage) {
        Activations leaves = make_leaves(await(ctx.saved[r.begin][j]), device, r.begin > 0);
        Activations acts = leaves;
        pos.step = "recompute";
        for (int64_t l = r.begin; l < r.end; ++l) {
          pos.layer = l;
          acts = run_layer(ctx, clones[l - r.begin], l, j, acts, device);
        }
        pos.layer = -1;
        pos.step = "backward";
        backward_paired(acts, grads, device);
        grads = leaf_grads(leaves);
      } else {
        for (int64_t l = r.end - 1; l >= r.begin; --l) {
          pos.layer = l;
          Activations leaves = make_leaves(await(ctx.saved[l][j]), device, l > 0);
          pos.step = "recompute";
          Activations acts = run_layer(ctx, clones[l - r.begin], l, j, leaves, device);
          pos.step = "backward";
          backward_paired(acts, grads, device);
          grads = leaf_grads(leaves);
        }
        pos.layer = -1;
      }
      pos.step = "";
      if (r.begin > 0) ctx.bwd_grad[stage][j]->set(detached_host(grads));
    }
    pos.microbatch = -1;
    for (int64_t l = r.begin; l < r.end; ++l) ctx.grads[l] = param_grads(clones[l - r.begin]);
  });
}

}  // namespace roundpipe::detail
