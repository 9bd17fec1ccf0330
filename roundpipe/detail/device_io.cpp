#include "roundpipe/detail/device_io.h"

#include <ATen/ATen.h>

#include <functional>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "base/config.h"
#include "roundpipe/detail/host_blocks.h"
#include "roundpipe/detail/trace_recorder.h"
#if ROUNDPIPE_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>

#include <optional>

#include "roundpipe/detail/cuda_streams.h"
#endif

namespace roundpipe::detail {
namespace {

enum class TensorRole { kParameter, kBuffer };

// Pairs `shell`'s tensors with `layer`'s (both recursive, same registration order: the shell is
// a clone of the layer) and calls fn(shell tensor, layer tensor, role, index within its role).
template <typename Fn>
void for_each_tensor_pair(torch::nn::Module& shell, torch::nn::Module& layer, const std::vector<at::Tensor>* buffers,
                          Fn&& fn) {
  auto sp = shell.parameters(), lp = layer.parameters();
  TORCH_INTERNAL_ASSERT(sp.size() == lp.size(), "layer shell has ", sp.size(), " parameters, the layer ", lp.size());
  for (size_t k = 0; k < sp.size(); ++k) {
    fn(sp[k], lp[k], TensorRole::kParameter, k);
    // A frozen parameter (requires_grad false: LoRA's base weights) stays frozen in the shell, so
    // backward computes, downloads and hands over no gradient for it.
    if (sp[k].requires_grad() != lp[k].requires_grad()) sp[k].requires_grad_(lp[k].requires_grad());
  }
  auto sb = shell.buffers();
  const auto lb = buffers != nullptr ? *buffers : layer.buffers();
  TORCH_INTERNAL_ASSERT(sb.size() == lb.size(), "layer shell has ", sb.size(), " buffers, the layer ", lb.size());
  for (size_t k = 0; k < sb.size(); ++k) fn(sb[k], lb[k], TensorRole::kBuffer, k);
}

}  // namespace

#if ROUNDPIPE_WITH_CUDA
namespace {

// The worker thread's streams: each worker thread serves one device, so one set per thread.
CudaStreamSet& worker_streams(c10::DeviceIndex index) {
  thread_local std::optional<CudaStreamSet> streams;
  if (!streams) streams = CudaStreamSet::create(index);
  TORCH_INTERNAL_ASSERT(streams->compute.device_index() == index, "a device worker thread changed device");
  return *streams;
}

}  // namespace

struct DeviceIo::Cuda {
  explicit Cuda(const c10::Device& device) : streams(worker_streams(device.index())), compute_guard(streams.compute) {}
  CudaStreamSet& streams;
  c10::cuda::CUDAStreamGuard compute_guard;
  std::vector<std::pair<const torch::nn::Module*, at::cuda::CUDAEvent>> pending_uploads;
  std::optional<at::cuda::CUDAEvent> layer_uploads_done;  // after the latest upload_layer's copies

  // Device tensors -> new pinned host tensors (from `pool` where it has a buffer), copied on the
  // download stream after the compute enqueued so far; returns the event that marks the copies
  // complete. With `clone`, the copies read device clones made on the compute stream first.
  std::shared_ptr<at::cuda::CUDAEvent> enqueue_download(const Activations& acts, Activations& out, bool clone,
                                                        HostBufferPool* pool) {
    out.assign(acts.size(), at::Tensor());
    Activations sources(acts.size());
    for (size_t k = 0; k < acts.size(); ++k) {
      if (!acts[k].defined()) continue;
      sources[k] = acts[k].detach();
      if (clone && sources[k].is_cuda()) sources[k] = sources[k].clone();  // on compute (the current stream)
    }
    wait_for(streams.download, streams.compute);
    {
      c10::cuda::CUDAStreamGuard guard(streams.download);
      for (size_t k = 0; k < sources.size(); ++k) {
        const auto& t = sources[k];
        if (!t.defined()) continue;
        if (!t.is_cuda()) {
          out[k] = t.clone();
          continue;
        }
        if (pool != nullptr) out[k] = pool->empty(t.sizes(), t.scalar_type());
        if (!out[k].defined()) {
          out[k] = at::empty(t.sizes(), t.options().device(c10::kCPU).pinned_memory(true).requires_grad(false));
        }
        out[k].copy_(t, /*non_blocking=*/true);
        t.record_stream(streams.download);
      }
    }
    auto done = std::make_shared<at::cuda::CUDAEvent>();
    done->record(streams.download);
    return done;
  }

  // Returns when the copies are complete, so a pool buffer is never freed while its copy is in
  // flight.
  Activations download(const Activations& acts, HostBufferPool* pool) {
    Activations out;
    enqueue_download(acts, out, /*clone=*/false, pool)->synchronize();
    return out;
  }
};
#else
struct DeviceIo::Cuda {};
#endif

// The job's span while tracing. CPU: host times. CUDA: timing events on the job's streams,
// converted at collect() against one anchor event per worker thread (so spans of one device share
// a GPU clock) recorded together with a host time.
struct DeviceIo::Trace {
  trace::StageSpan span;
  bool uploading = false, computing = false;
#if ROUNDPIPE_WITH_CUDA
  struct Anchor {
    std::shared_ptr<at::cuda::CUDAEvent> event;
    double host_ms = 0;
    int64_t origin = -1;  // the trace_origin() it belongs to (re-anchored after enable(true))
  };
  Anchor anchor;
  std::shared_ptr<at::cuda::CUDAEvent> upload_begin, upload_end, compute_begin, compute_end;
  static std::shared_ptr<at::cuda::CUDAEvent> record(const c10::cuda::CUDAStream& stream) {
    auto event = std::make_shared<at::cuda::CUDAEvent>(cudaEventDefault);
    event->record(stream);
    return event;
  }
#endif
};

DeviceIo::DeviceIo(const c10::Device& device, std::string job) : device_(device) {
#if ROUNDPIPE_WITH_CUDA
  if (device.is_cuda()) cuda_ = std::make_unique<Cuda>(device);
#endif
  if (!trace::enabled()) return;
  trace_ = std::make_unique<Trace>();
  trace_->span.device = device;
  trace_->span.worker = std::hash<std::thread::id>()(std::this_thread::get_id());
  trace_->span.job = std::move(job);
#if ROUNDPIPE_WITH_CUDA
  if (cuda_) {
    thread_local Trace::Anchor anchor;
    if (!anchor.event || anchor.origin != trace_origin()) {  // first job since enable(true)
      anchor.event = Trace::record(cuda_->streams.compute);
      anchor.host_ms = trace_host_ms();
      anchor.origin = trace_origin();
    }
    trace_->anchor = anchor;
  }
#endif
}

DeviceIo::~DeviceIo() {
#if ROUNDPIPE_WITH_CUDA
  // A job that failed between a layer's upload and its first compute leaves that upload in
  // flight; it reads the layer's pinned host copy, which the optimizer may overwrite as soon as
  // the job has ended. Wait for it (never happens on the normal path: compute waited for all).
  if (cuda_) {
    for (auto& pending : cuda_->pending_uploads) {
      try {
        pending.second.synchronize();
      } catch (...) {
        // The job is failing already; its error is the one to report.
      }
    }
  }
#endif
  if (!trace_) return;
  try {
    detail::TraceEntry entry{trace_->span, {}};
    if (!cuda_) {
      entry.span.compute_end_ms = trace_host_ms();
    }
#if ROUNDPIPE_WITH_CUDA
    if (cuda_) {
      trace_->compute_end = Trace::record(cuda_->streams.compute);
      entry.resolve = [anchor = trace_->anchor, ub = trace_->upload_begin, ue = trace_->upload_end,
                       cb = trace_->compute_begin, ce = trace_->compute_end](trace::StageSpan& span) {
        // elapsed_time() requires both events complete: the anchor too (it is on another stream
        // than the upload events, so `e` completing does not imply it).
        anchor.event->synchronize();
        auto at = [&](const std::shared_ptr<at::cuda::CUDAEvent>& e) {
          if (!e) return 0.0;
          e->synchronize();
          return anchor.host_ms + static_cast<double>(anchor.event->elapsed_time(*e));
        };
        span.upload_begin_ms = at(ub);
        span.upload_end_ms = at(ue);
        span.compute_begin_ms = at(cb);
        span.compute_end_ms = at(ce);
      };
    }
#endif
    trace_record(std::move(entry));
  } catch (...) {
    // Tracing never turns a finished job into a failure.
  }
}

// Note [Shared host parameters]:
// A CPU device computes in host memory, so its "upload" of a layer is a copy in the same memory:
// at the peak, each device's largest stage once more (Note [CPU devices' host memory] in
// scheduler/memory_model.cpp; up to a whole model copy with one device), which buys only
// isolation from writers of the host copy while the job runs (an async step publishing the next
// values, Note [Run tails]; RoundPipe::module() and parameters() wait for the tails). Where no such
// writer can exist, the shell shares the layer's parameter tensor instead (set_data(src.detach()):
// same storage, the shell's own Variable, so gradients still accumulate in the shell). The caller
// decides per parameter (StepPipeline::shareable_parameters, RunContext::cpu_shared_parameters):
//  - with RoundPipeOptions::in_place_masters or sync_steps every parameter: steps are sync only
//    (Note [In-place masters]; a sync step waits for every run's tail before it publishes), so the
//    compute copies change only between runs;
//  - otherwise, in any step mode, the frozen parameters without a master (LoRA's base weights,
//    Note [Frozen parameters]): no step ever publishes into them. One that was shared while it was
//    frozen and is trainable when the masters are created (at the first step) gets a master that
//    steps will write, so the masters' creation first waits for every run's tail.
// Results are bitwise those of the copies. Buffers are always copied: a forward may update them in
// place (batch norm's running statistics) while another job reads the same layer.
void DeviceIo::upload_layer(torch::nn::Module& shell, torch::nn::Module& layer, const std::vector<at::Tensor>* buffers,
                            const std::vector<bool>* shared) {
  at::NoGradGuard no_grad;
  int64_t bytes = 0;
  if (!cuda_) {
    TORCH_INTERNAL_ASSERT(shared == nullptr || shared->size() == layer.parameters().size(),
                          "upload_layer: the shared-parameter mask does not match the layer");
    if (trace_ && !trace_->uploading) trace_->span.upload_begin_ms = trace_host_ms();
    for_each_tensor_pair(shell, layer, buffers, [&](at::Tensor& dst, const at::Tensor& src, TensorRole role, size_t k) {
      if (role == TensorRole::kParameter && shared != nullptr && (*shared)[k]) {
        dst.set_data(src.detach());
        return;
      }
      bytes += src.nbytes();
      dst.set_data(src.detach().clone());
    });
    if (trace_) {
      trace_->uploading = true;
      trace_->span.upload_end_ms = trace_host_ms();
      trace_->span.upload_bytes += bytes;
    }
    return;
  }
#if ROUNDPIPE_WITH_CUDA
  auto& s = cuda_->streams;
  if (trace_ && !trace_->uploading) {
    trace_->uploading = true;
    trace_->upload_begin = Trace::record(s.param_upload);
  }
  {
    c10::cuda::CUDAStreamGuard guard(s.param_upload);
    for_each_tensor_pair(shell, layer, buffers, [&](at::Tensor& dst, const at::Tensor& src, TensorRole, size_t) {
      bytes += src.nbytes();
      at::Tensor copy = src.detach().to(device_, /*non_blocking=*/true, /*copy=*/true);
      copy.record_stream(s.compute);
      dst.set_data(copy);
    });
  }
  if (trace_) {
    trace_->upload_end = Trace::record(s.param_upload);
    trace_->span.upload_bytes += bytes;
  }
  at::cuda::CUDAEvent uploaded;
  uploaded.record(s.param_upload);
  cuda_->pending_uploads.emplace_back(&shell, std::move(uploaded));
  if (!cuda_->layer_uploads_done) cuda_->layer_uploads_done.emplace();
  cuda_->layer_uploads_done->record(s.param_upload);
#endif
}

void DeviceIo::before_compute(const torch::nn::Module& shell) {
  const bool first_compute = trace_ && !trace_->computing;
  if (first_compute) trace_->computing = true;
  if (!cuda_) {
    if (first_compute) trace_->span.compute_begin_ms = trace_host_ms();
    return;
  }
#if ROUNDPIPE_WITH_CUDA
  auto& pending = cuda_->pending_uploads;
  for (auto it = pending.begin(); it != pending.end(); ++it) {
    if (it->first == &shell) {
      it->second.block(cuda_->streams.compute);
      pending.erase(it);
      break;
    }
  }
  if (first_compute) trace_->compute_begin = Trace::record(cuda_->streams.compute);
#else
  (void)shell;
#endif
}

void DeviceIo::synchronize() {
#if ROUNDPIPE_WITH_CUDA
  if (cuda_) cuda_->streams.compute.synchronize();
#endif
}

void DeviceIo::wait_for_layer_uploads() {
#if ROUNDPIPE_WITH_CUDA
  if (cuda_ && cuda_->layer_uploads_done) cuda_->layer_uploads_done->synchronize();
#endif
}

Activations DeviceIo::upload(const Activations& host) {
  if (!cuda_) {
    Activations out;
    out.reserve(host.size());
    for (const auto& t : host) out.push_back(t.defined() ? t.to(device_) : t);
    return out;
  }
  Activations out(host.size());
#if ROUNDPIPE_WITH_CUDA
  auto& s = cuda_->streams;
  {
    c10::cuda::CUDAStreamGuard guard(s.activation_upload);
    for (size_t k = 0; k < host.size(); ++k) {
      if (!host[k].defined()) continue;
      out[k] = host[k].to(device_, /*non_blocking=*/true);
      if (out[k].is_cuda() && !host[k].is_cuda()) out[k].record_stream(s.compute);
    }
  }
  wait_for(s.compute, s.activation_upload);
#endif
  return out;
}

Activations DeviceIo::download(const Activations& acts, HostBufferPool* pool) {
  if (!cuda_) {
    Activations out;
    out.reserve(acts.size());
    for (const auto& t : acts) out.push_back(t.defined() ? t.detach().to(c10::kCPU) : t);
    return out;
  }
#if ROUNDPIPE_WITH_CUDA
  return cuda_->download(acts, pool);
#else
  (void)pool;
  return acts;
#endif
}

Activations DeviceIo::Pending::wait() {
  if (complete_) {
    complete_();
    complete_ = nullptr;
  }
  return std::move(host_);
}

DeviceIo::Pending DeviceIo::download_async(const Activations& acts) {
  Pending pending;
  if (!cuda_) {
    pending.host_ = download(acts);
    return pending;
  }
#if ROUNDPIPE_WITH_CUDA
  auto done = cuda_->enqueue_download(acts, pending.host_, /*clone=*/false, nullptr);
  pending.complete_ = [done] { done->synchronize(); };
#endif
  return pending;
}

DeviceIo::Pending DeviceIo::download_copy_async(const Activations& acts) {
  Pending pending;
  if (!cuda_) {
    pending.host_ = download_copy(acts);
    return pending;
  }
#if ROUNDPIPE_WITH_CUDA
  auto done = cuda_->enqueue_download(acts, pending.host_, /*clone=*/true, nullptr);
  pending.complete_ = [done] { done->synchronize(); };
#endif
  return pending;
}

Activations DeviceIo::download_copy(const Activations& acts) {
  if (!cuda_) {
    Activations out;
    out.reserve(acts.size());
    for (const auto& t : acts) {
      out.push_back(t.defined() ? (t.is_cpu() ? t.detach().clone() : t.detach().cpu()) : t);
    }
    return out;
  }
#if ROUNDPIPE_WITH_CUDA
  return cuda_->download(acts, nullptr);  // always fresh host tensors
#else
  return acts;
#endif
}

}  // namespace roundpipe::detail
