// Host <-> device transfers of one stage job, and the stream its compute runs on (internal).
#pragma once

#include <c10/core/Device.h>
#include <torch/nn/module.h>

#include <functional>
#include <memory>
#include <string>

#include "roundpipe/detail/layer_call.h"

namespace roundpipe::detail {

class HostBufferPool;

// Note [Stage streams]:
// On a CUDA device a stage job uses four streams of its worker (CudaStreamSet): parameter upload,
// activation upload, compute and download, ordered only by CUDA events, never by host syncs
// except where a result must be complete in host memory.
//  - Parameters: each layer's tensors are copied host -> device on the parameter-upload stream
//    (from pinned host memory, so the copies are asynchronous) as soon as the job starts, and
//    one event per layer is recorded after them. Compute waits for that event right before the
//    layer's first kernel, so the upload of layer l+1 overlaps the compute of layer l. Uploads of
//    a job begin only when its worker starts it, after the previous job on that worker has its
//    results in host memory: there is no cross-job prefetch (docs/user-guide.md, "Limitations").
//  - Activations come in on the activation-upload stream (event -> compute) and go out on the
//    download stream (compute event -> download) into pinned host memory; the job waits for the
//    download's event before it hands the host tensor to another job, and it first enqueues the
//    next microbatch's compute, so the copies overlap it (Note [Deferred hand-over]).
//  - Memory: a tensor allocated on one stream and used on another is record_stream()-ed on the
//    user's stream: uploads on compute, downloaded device tensors on download. Without that the
//    caching allocator could hand the block of a released parameter (the shell is emptied when
//    the job ends) to the next upload while kernels that read it are still queued on compute.
//    Host tensors from the caching host allocator (activations) are protected by it: it records an
//    event per asynchronous copy and reuses a block only after them. The parameters' host copies
//    are registered blocks that live as long as the model's tensors, and gradients land in the
//    model's HostBufferPool; neither is read by an asynchronous copy after it could be freed
//    (Note [Exact-size pinned host memory]).
// On CPU devices every method is a plain host operation and there are no streams.

/// One per stage job, created and used on the job's worker thread only. On CUDA the compute
/// stream is the current stream while it lives. With trace::enabled(), it records the job's
/// span (roundpipe/stage_trace.h) under the name `job`.
class DeviceIo {
 public:
  explicit DeviceIo(const c10::Device& device, std::string job = {});
  ~DeviceIo();
  DeviceIo(const DeviceIo&) = delete;
  DeviceIo& operator=(const DeviceIo&) = delete;

  const c10::Device& device() const { return device_; }

  /// Points `shell`'s parameters and buffers (recursively, in registration order) at copies of
  /// `layer`'s current values on the device; with `buffers`, the buffers are copies of those host
  /// tensors instead (a backward stage's snapshot: it never reads the model's buffers, which the
  /// caller may write meanwhile, Note [Run tails]). On a CPU device, where `shared[k]` is true the
  /// shell shares the layer's parameter k (in layer.parameters() order) instead of copying it
  /// (Note [Shared host parameters]); CUDA devices always copy. CUDA: asynchronous; call
  /// `before_compute(shell)` before the shell's first use.
  void upload_layer(torch::nn::Module& shell, torch::nn::Module& layer,
                    const std::vector<at::Tensor>* buffers = nullptr, const std::vector<bool>* shared = nullptr);
  /// Makes compute wait for `shell`'s upload (once; later calls are free). CPU: no-op.
  void before_compute(const torch::nn::Module& shell);

  /// Waits until the job's compute so far has finished (CUDA: the compute stream; CPU: no-op).
  void synchronize();
  /// Waits until every upload_layer copy so far is complete in device memory, without waiting
  /// for compute (CUDA: an event recorded on the parameter-upload stream; CPU: no-op, the copies
  /// are complete on return).
  void wait_for_layer_uploads();

  /// Host tensors -> device, ready for compute. CPU: the tensors themselves (no copy).
  Activations upload(const Activations& host);
  /// Device tensors -> host (detached), complete on return. CPU: the tensors detached, no copy.
  /// CUDA: into `pool`'s exact-size buffers where it has one (parameter gradients), else into
  /// pinned memory from the caching host allocator.
  Activations download(const Activations& acts, HostBufferPool* pool = nullptr);
  /// Like `download`, but always a fresh host copy that later in-place writes cannot alter.
  Activations download_copy(const Activations& acts);

  /// A download that may still be in flight (Note [Deferred hand-over], stage_jobs.cpp).
  class Pending {
   public:
    /// The host tensors, complete. Call once.
    Activations wait();

   private:
    friend class DeviceIo;
    Activations host_;
    std::function<void()> complete_;  // CUDA: waits for the copies' event; CPU: empty
  };
  /// Like `download`, but returns before the copies complete. CUDA: enqueued on the download
  /// stream after the compute enqueued so far. CPU: complete on return, as `download`.
  Pending download_async(const Activations& acts);
  /// Like `download_copy`, but returns before the copies complete. CUDA: as `download_async`,
  /// from a device clone made on the compute stream first, so later kernels that write the
  /// tensors in place cannot alter the copy. CPU: complete on return, as `download_copy`.
  Pending download_copy_async(const Activations& acts);

 private:
  c10::Device device_;
  struct Cuda;
  std::unique_ptr<Cuda> cuda_;  // CUDA devices only
  struct Trace;
  std::unique_ptr<Trace> trace_;  // while tracing
};

}  // namespace roundpipe::detail
