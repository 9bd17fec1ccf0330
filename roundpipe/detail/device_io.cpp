#include "roundpipe/detail/device_io.h"

#include <ATen/ATen.h>

#include <utility>
#include <vector>

#include "roundpipe/config.h"
#if ROUNDPIPE_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>

#include <optional>

#include "roundpipe/detail/cuda_streams.h"
#endif

namespace roundpipe::detail {
namespace {

// Pairs `shell`'s tensors with `layer`'s (both recursive, same registration order: the shell is
// a clone of the layer) and calls fn(shell tensor, layer tensor).
template <typename Fn>
void for_each_tensor_pair(torch::nn::Module& shell, torch::nn::Module& layer, Fn&& fn) {
  auto sp = shell.parameters(), lp = layer.parameters();
  TORCH_INTERNAL_ASSERT(sp.size() == lp.size(), "layer shell has ", sp.size(), " parameters, the layer ", lp.size());
  for (size_t k = 0; k < sp.size(); ++k) fn(sp[k], lp[k]);
  auto sb = shell.buffers(), lb = layer.buffers();
  TORCH_INTERNAL_ASSERT(sb.size() == lb.size(), "layer shell has ", sb.size(), " buffers, the layer ", lb.size());
  for (size_t k = 0; k < sb.size(); ++k) fn(sb[k], lb[k]);
}

}  // namespace

#if ROUNDPIPE_WITH_CUDA
// The worker thread's streams: each worker thread serves one device, so one set per thread.
CudaStreamSet& worker_streams(c10::DeviceIndex index) {
  thread_local std::optional<CudaStreamSet> streams;
  if (!streams) streams = CudaStreamSet::create(index);
  TORCH_INTERNAL_ASSERT(streams->compute.device_index() == index, "a device worker thread changed device");
  return *streams;
}

struct DeviceIo::Cuda {
  explicit Cuda(const c10::Device& device)
      : streams(worker_streams(device.index())), compute_guard(streams.compute) {}
  CudaStreamSet& streams;
  c10::cuda::CUDAStreamGuard compute_guard;
  std::vector<std::pair<const torch::nn::Module*, at::cuda::CUDAEvent>> pending_uploads;

  // Device tensors -> new pinned host tensors; returns when the copies are complete.
  Activations download(const Activations& acts) {
    Activations out(acts.size());
    wait_for(streams.download, streams.compute);
    {
      c10::cuda::CUDAStreamGuard guard(streams.download);
      for (size_t k = 0; k < acts.size(); ++k) {
        const auto& t = acts[k];
        if (!t.defined()) continue;
        if (!t.is_cuda()) {
          out[k] = t.detach().clone();
          continue;
        }
        out[k] = at::empty(t.sizes(), t.options().device(c10::kCPU).pinned_memory(true).requires_grad(false));
        out[k].copy_(t.detach(), /*non_blocking=*/true);
        t.record_stream(streams.download);
      }
    }
    at::cuda::CUDAEvent done;
    done.record(streams.download);
    done.synchronize();
    return out;
  }
};
#else
struct DeviceIo::Cuda {};
#endif

DeviceIo::DeviceIo(const c10::Device& device) : device_(device) {
#if ROUNDPIPE_WITH_CUDA
  if (device.is_cuda()) cuda_ = std::make_unique<Cuda>(device);
#endif
}

DeviceIo::~DeviceIo() = default;

void DeviceIo::upload_layer(torch::nn::Module& shell, torch::nn::Module& layer) {
  at::NoGradGuard no_grad;
  if (!cuda_) {
    for_each_tensor_pair(shell, layer, [](at::Tensor& dst, const at::Tensor& src) { dst.set_data(src.detach().clone()); });
    return;
  }
#if ROUNDPIPE_WITH_CUDA
  auto& s = cuda_->streams;
  {
    c10::cuda::CUDAStreamGuard guard(s.param_upload);
    for_each_tensor_pair(shell, layer, [&](at::Tensor& dst, const at::Tensor& src) {
      at::Tensor copy = src.detach().to(device_, /*non_blocking=*/true, /*copy=*/true);
      copy.record_stream(s.compute);
      dst.set_data(copy);
    });
  }
  at::cuda::CUDAEvent uploaded;
  uploaded.record(s.param_upload);
  cuda_->pending_uploads.emplace_back(&shell, std::move(uploaded));
#endif
}

void DeviceIo::before_compute(const torch::nn::Module& shell) {
#if ROUNDPIPE_WITH_CUDA
  if (!cuda_) return;
  auto& pending = cuda_->pending_uploads;
  for (auto it = pending.begin(); it != pending.end(); ++it) {
    if (it->first == &shell) {
      it->second.block(cuda_->streams.compute);
      pending.erase(it);
      return;
    }
  }
#else
  (void)shell;
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

Activations DeviceIo::download(const Activations& acts) {
  if (!cuda_) {
    Activations out;
    out.reserve(acts.size());
    for (const auto& t : acts) out.push_back(t.defined() ? t.detach().to(c10::kCPU) : t);
    return out;
  }
#if ROUNDPIPE_WITH_CUDA
  return cuda_->download(acts);
#else
  return acts;
#endif
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
  return cuda_->download(acts);  // always fresh host tensors
#else
  return acts;
#endif
}

}  // namespace roundpipe::detail
