// Exact-size, page-locked host memory for the model's compute copies (internal).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/modules/container/any.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

namespace roundpipe::detail {

// Note [Exact-size pinned host memory]:
// On CUDA, uploads are asynchronous only from page-locked host memory, so the compute copies of
// the model's parameters and buffers live there. `Tensor::pin_memory()` takes that memory from
// CUDA's caching host allocator, which rounds every block up to a power of two (c10's
// PowerOf2Ceil): a 4096 x 11008 bf16 weight (86 MiB) takes 128 MiB, 1.33x over a Llama-2-7B block,
// and the host bytes per parameter are what bound the largest model (docs/benchmarks.md).
// Instead, RoundPipe packs each layer's tensors into one block of their exact size (each storage
// at a 256-byte offset, the block rounded to whole pages), allocated with mmap and page-locked
// with cudaHostRegister; every tensor keeps its identity (set_data) and becomes a view of its
// block. A storage shared by several tensors (tied weights, views) is copied once, so they still
// alias. The block is unregistered and unmapped when the last tensor viewing it is freed.
//  - The caching host allocator records an event per asynchronous copy and delays reusing a block
//    until its copies are done; registered memory has no such guard. None is needed: a block lives
//    as long as the model's tensors, which nothing replaces while a stage job may read them
//    (RoundPipe::module / parameters wait for every run's jobs first), and overwrites are ordered
//    by the step pipeline (Note [Async step protocol]), as they were before.
//  - A block the pinner refuses (cudaHostRegister fails: e.g. a locked-memory limit) is dropped
//    and its tensors are left as they were; RoundPipe then pins them through pin_memory().

/// How a host block is page-locked. `pin(ptr, bytes)` returns false when it could not be (the
/// block is then freed and its tensors left unchanged); `unpin(ptr)` runs before a pinned block
/// is unmapped, from whichever thread frees its last tensor, and must not throw. Either may be
/// empty (nothing to do).
struct HostPinner {
  std::function<bool(void* ptr, size_t bytes)> pin;
  std::function<void(void* ptr)> unpin;
};

/// cudaHostRegister (portable: pinned for every device) / cudaHostUnregister. A failed
/// registration is logged (runtime logger, warn) and reported as false. Builds without CUDA:
/// a pinner that refuses every block.
HostPinner cuda_host_pinner();

struct HostPackStats {
  int64_t blocks = 0;            // blocks made and pinned
  int64_t refused_groups = 0;    // groups whose block the pinner refused (tensors unchanged)
  int64_t tensors = 0;           // tensors now viewing a block
  int64_t storage_bytes = 0;     // bytes of the distinct storages copied into blocks
  int64_t block_bytes = 0;       // bytes mapped for the blocks (page-rounded)
  int64_t power_of_two_bytes = 0;  // what pin_memory() would have taken for the same storages
};

/// Moves the CPU tensors of each group into one new exact-size block per group, pinned by
/// `pinner` (Note [Exact-size pinned host memory]). Skipped: undefined tensors, tensors not on the
/// CPU, tensors with no bytes, and storages met in an earlier group or earlier in this call (the
/// first group that holds a storage owns it; a tensor viewing it elsewhere is repointed too).
/// Values, sizes, strides, dtypes and requires_grad are unchanged. Call it while nothing else
/// uses the tensors (RoundPipe's constructor).
HostPackStats pack_host_tensors(const std::vector<std::vector<at::Tensor>>& groups, const HostPinner& pinner);

/// pack_host_tensors with one group per layer: its parameters and buffers (recursively). What
/// RoundPipe's constructor packs on CUDA runs.
HostPackStats pack_layers(const std::vector<torch::nn::AnyModule>& layers, const HostPinner& pinner);

/// Exact-size pinned host buffers, reused by size: the destinations of CUDA jobs' parameter-gradient
/// downloads, which the caching host allocator would round up to powers of two (Note [Exact-size
/// pinned host memory]). A buffer returns to the pool when its last tensor is freed and is
/// handed out again for the same page-rounded size; nothing tracks asynchronous copies reading
/// it, so a tensor from the pool must not be freed while such a copy is in flight (gradient
/// downloads are complete before the tensor is handed over; nothing in RoundPipe uploads them).
/// Thread-safety: `empty` and `stats` from any thread; a tensor from it may be freed on any
/// thread. Lifetime: cached buffers are unmapped with the pool, which logs (info) how many it
/// mapped and their bytes, its peak; a buffer in use when the pool goes is unmapped when its
/// last tensor is freed.
class HostBufferPool {
 public:
  /// Tensors of fewer bytes than this come from the caching host allocator (`empty` returns an
  /// undefined tensor): its rounding costs little on them, and a page per buffer would cost more.
  static constexpr size_t kMinBytes = 256 * 1024;

  explicit HostBufferPool(HostPinner pinner);
  ~HostBufferPool();
  HostBufferPool(const HostBufferPool&) = delete;
  HostBufferPool& operator=(const HostBufferPool&) = delete;

  /// An uninitialized contiguous CPU tensor in a pinned buffer of its exact bytes (page-rounded),
  /// or an undefined tensor when it is smaller than kMinBytes or the pinner has refused a buffer
  /// (then, and from then on: the caller falls back to the caching host allocator).
  at::Tensor empty(at::IntArrayRef sizes, c10::ScalarType dtype);

  struct Stats {
    int64_t buffers = 0;       // mapped buffers, in use or cached
    int64_t mapped_bytes = 0;  // their bytes
    int64_t cached_bytes = 0;  // bytes of the buffers waiting for reuse
  };
  Stats stats() const;

 private:
  struct State;
  struct Buffer;
  std::shared_ptr<State> state_;
};

}  // namespace roundpipe::detail
