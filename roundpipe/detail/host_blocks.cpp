#include "roundpipe/detail/host_blocks.h"

#include <ATen/ATen.h>
#include <c10/core/Storage.h>
#include <c10/util/Exception.h>
#include <c10/util/llvmMathExtras.h>
#include <c10/util/strides.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "base/config.h"
#include "base/logging.h"
#if ROUNDPIPE_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace roundpipe::detail {
namespace {

constexpr size_t kStorageAlignment = 256;

// Every page of a block is written (packing) or pinned (registering) right away: MAP_POPULATE
// faults them in in bulk, 3x faster than one fault per page under a memcpy on the development VM
// (1 GiB: 0.52 vs 0.16 GB/s, two runs each).
void* map_block(size_t bytes) {
  return ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
}

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

// One mapped block; the storages made from it share ownership, so it goes with the last of them.
class HostBlock {
 public:
  HostBlock(void* ptr, size_t bytes) : ptr_(ptr), bytes_(bytes) {}
  ~HostBlock() {
    if (unpin_) unpin_(ptr_);
    ::munmap(ptr_, bytes_);
  }
  HostBlock(const HostBlock&) = delete;
  HostBlock& operator=(const HostBlock&) = delete;

  char* data() const { return static_cast<char*>(ptr_); }
  void set_unpin(std::function<void(void*)> unpin) { unpin_ = std::move(unpin); }

 private:
  void* ptr_;
  size_t bytes_;
  std::function<void(void*)> unpin_;  // set once the block is pinned
};

bool packable(const at::Tensor& t) {
  return t.defined() && t.is_cpu() && t.layout() == c10::kStrided && !t.is_quantized() && t.has_storage() &&
         t.storage().nbytes() > 0 && t.storage().data() != nullptr;
}

// A storage of `nbytes` at `offset` in `block`, holding a reference to the block.
c10::Storage storage_in(const std::shared_ptr<HostBlock>& block, size_t offset, size_t nbytes) {
  auto* owner = new std::shared_ptr<HostBlock>(block);
  c10::DataPtr data(block->data() + offset, owner,
                    [](void* ctx) { delete static_cast<std::shared_ptr<HostBlock>*>(ctx); }, c10::Device(c10::kCPU));
  return c10::Storage(c10::Storage::use_byte_size_t(), nbytes, std::move(data), /*allocator=*/nullptr,
                      /*resizable=*/false);
}

}  // namespace

HostPinner cuda_host_pinner() {
#if ROUNDPIPE_WITH_CUDA
  HostPinner pinner;
  pinner.pin = [](void* ptr, size_t bytes) {
    const cudaError_t err = cudaHostRegister(ptr, bytes, cudaHostRegisterPortable);
    if (err == cudaSuccess) return true;
    (void)cudaGetLastError();  // clear it, so a later check of the last error does not report it
    ROUNDPIPE_LOG(Logger::get("runtime"), kWarn, "cudaHostRegister of ", bytes, " bytes of host memory failed (",
                  cudaGetErrorString(err), "); those tensors are pinned through the caching host allocator instead, "
                  "which rounds each up to a power of two (more host memory per parameter)");
    return false;
  };
  pinner.unpin = [](void* ptr) {
    // At process exit the CUDA runtime may be unloaded before the model: nothing left to undo then.
    if (cudaHostUnregister(ptr) != cudaSuccess) (void)cudaGetLastError();
  };
  return pinner;
#else
  HostPinner pinner;
  pinner.pin = [](void*, size_t) { return false; };
  return pinner;
#endif
}

HostPackStats pack_host_tensors(const std::vector<std::vector<at::Tensor>>& groups, const HostPinner& pinner) {
  at::NoGradGuard no_grad;
  HostPackStats stats;
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  // Old storage -> its copy. The old storages are kept alive until the end, so no freed
  // StorageImpl address can come back as a key for another storage.
  std::unordered_map<const c10::StorageImpl*, c10::Storage> moved;
  std::vector<c10::Storage> old_storages;

  for (const auto& group : groups) {
    std::vector<std::pair<c10::Storage, size_t>> layout;  // this group's new storages, with offsets
    std::unordered_set<const c10::StorageImpl*> in_layout;
    size_t end = 0;
    for (const auto& t : group) {
      if (!packable(t)) continue;
      const c10::Storage& s = t.storage();
      if (moved.count(s.unsafeGetStorageImpl()) || !in_layout.insert(s.unsafeGetStorageImpl()).second) continue;
      layout.emplace_back(s, end);
      end = round_up(end + s.nbytes(), kStorageAlignment);
    }
    if (layout.empty()) continue;
    const size_t bytes = round_up(end, page);
    void* ptr = map_block(bytes);
    TORCH_CHECK(ptr != MAP_FAILED, "could not map ", bytes, " bytes of host memory for a layer's compute copies (",
                std::strerror(errno), "): the host is out of memory for this model");
    auto block = std::make_shared<HostBlock>(ptr, bytes);
    for (const auto& [s, offset] : layout) std::memcpy(block->data() + offset, s.data(), s.nbytes());
    if (pinner.pin && !pinner.pin(ptr, bytes)) {
      ++stats.refused_groups;
      continue;  // the block is unmapped here; its tensors keep their storages
    }
    if (pinner.pin) block->set_unpin(pinner.unpin);
    ++stats.blocks;
    stats.block_bytes += static_cast<int64_t>(bytes);
    for (const auto& [s, offset] : layout) {
      stats.storage_bytes += static_cast<int64_t>(s.nbytes());
      stats.power_of_two_bytes += static_cast<int64_t>(c10::llvm::PowerOf2Ceil(s.nbytes()));
      moved.emplace(s.unsafeGetStorageImpl(), storage_in(block, offset, s.nbytes()));
      old_storages.push_back(s);
    }
  }

  // Repoint every tensor whose storage moved (a tensor listed twice is repointed once: the second
  // time its storage is already the new one).
  for (const auto& group : groups) {
    for (const auto& t : group) {
      if (!packable(t)) continue;
      auto it = moved.find(t.storage().unsafeGetStorageImpl());
      if (it == moved.end()) continue;
      at::Tensor view = at::empty({0}, t.options().requires_grad(false));
      view.set_(it->second, t.storage_offset(), t.sizes(), t.strides());
      t.set_data(view);
      ++stats.tensors;
    }
  }
  return stats;
}

HostPackStats pack_layers(const std::vector<torch::nn::AnyModule>& layers, const HostPinner& pinner) {
  std::vector<std::vector<at::Tensor>> groups;
  for (const auto& layer : layers) {
    groups.emplace_back();
    for (const auto& p : layer.ptr()->parameters()) groups.back().push_back(p);
    for (const auto& b : layer.ptr()->buffers()) groups.back().push_back(b);
  }
  return pack_host_tensors(groups, pinner);
}

// Shared by the pool and its buffers' storages, so a buffer freed after the pool is still unmapped.
struct HostBufferPool::State {
  explicit State(HostPinner p) : pinner(std::move(p)) {}
  const HostPinner pinner;
  mutable std::mutex mutex;
  bool closed = false;                                         // guarded by mutex
  std::atomic<bool> refused{false};  // the pinner refused a buffer: hand out none from then on
  std::unordered_map<size_t, std::vector<void*>> free_buffers;  // page-rounded bytes -> buffers; guarded by mutex
  HostBufferPool::Stats stats;                                 // guarded by mutex

  void unmap(void* ptr, size_t bytes) const {
    if (pinner.unpin) pinner.unpin(ptr);
    ::munmap(ptr, bytes);
  }
  void release(void* ptr, size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mutex);
      if (!closed) {
        free_buffers[bytes].push_back(ptr);
        stats.cached_bytes += static_cast<int64_t>(bytes);
        return;
      }
      --stats.buffers;
      stats.mapped_bytes -= static_cast<int64_t>(bytes);
    }
    unmap(ptr, bytes);
  }
};

// One handed-out buffer: the context of its storage's DataPtr.
struct HostBufferPool::Buffer {
  std::shared_ptr<State> state;
  void* ptr;
  size_t bytes;  // page-rounded
};

HostBufferPool::HostBufferPool(HostPinner pinner) : state_(std::make_shared<State>(std::move(pinner))) {}

HostBufferPool::~HostBufferPool() {
  std::vector<std::pair<void*, size_t>> cached;
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    if (state_->stats.buffers > 0) {
      // Buffers are only cached until now, so this is the pool's peak.
      ROUNDPIPE_LOG(Logger::get("runtime"), kInfo, "exact-size pinned gradient buffers: ", state_->stats.buffers,
                    " buffers, ", static_cast<double>(state_->stats.mapped_bytes) / (1024.0 * 1024.0), " MiB");
    }
    state_->closed = true;
    for (auto& [bytes, ptrs] : state_->free_buffers) {
      for (void* ptr : ptrs) cached.emplace_back(ptr, bytes);
      state_->stats.buffers -= static_cast<int64_t>(ptrs.size());
      state_->stats.mapped_bytes -= static_cast<int64_t>(bytes * ptrs.size());
    }
    state_->free_buffers.clear();
    state_->stats.cached_bytes = 0;
  }
  for (const auto& [ptr, bytes] : cached) state_->unmap(ptr, bytes);
}

at::Tensor HostBufferPool::empty(at::IntArrayRef sizes, c10::ScalarType dtype) {
  const size_t nbytes = static_cast<size_t>(c10::multiply_integers(sizes)) * c10::elementSize(dtype);
  if (nbytes < kMinBytes || state_->refused.load()) return {};
  const size_t bytes = round_up(nbytes, static_cast<size_t>(::sysconf(_SC_PAGESIZE)));
  void* ptr = nullptr;
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    auto it = state_->free_buffers.find(bytes);
    if (it != state_->free_buffers.end() && !it->second.empty()) {
      ptr = it->second.back();
      it->second.pop_back();
      state_->stats.cached_bytes -= static_cast<int64_t>(bytes);
    }
  }
  if (ptr == nullptr) {
    ptr = map_block(bytes);
    TORCH_CHECK(ptr != MAP_FAILED, "could not map ", bytes, " bytes of host memory for a gradient (",
                std::strerror(errno), "): the host is out of memory for this model");
    if (state_->pinner.pin && !state_->pinner.pin(ptr, bytes)) {
      ::munmap(ptr, bytes);
      state_->refused = true;  // no mapping and registering per download once it is known to fail
      return {};
    }
    std::lock_guard<std::mutex> lock(state_->mutex);
    ++state_->stats.buffers;
    state_->stats.mapped_bytes += static_cast<int64_t>(bytes);
  }
  auto* buffer = new Buffer{state_, ptr, bytes};
  c10::DataPtr data(
      ptr, buffer,
      [](void* ctx) {
        std::unique_ptr<Buffer> b(static_cast<Buffer*>(ctx));
        b->state->release(b->ptr, b->bytes);
      },
      c10::Device(c10::kCPU));
  c10::Storage storage(c10::Storage::use_byte_size_t(), nbytes, std::move(data), /*allocator=*/nullptr,
                       /*resizable=*/false);
  at::Tensor out = at::empty({0}, at::TensorOptions().dtype(dtype));
  out.set_(storage, 0, sizes, c10::contiguous_strides(sizes));
  return out;
}

HostBufferPool::Stats HostBufferPool::stats() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->stats;
}

}  // namespace roundpipe::detail
