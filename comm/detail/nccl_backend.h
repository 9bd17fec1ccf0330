// The NCCL backend of comm::ProcessGroup, in a translation unit of its own: NCCL's c10d header is
// only usable with CUDA (internal).
#pragma once

#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <cstdint>

namespace c10d {
class Backend;
class Store;
}  // namespace c10d

namespace roundpipe::comm::detail {

/// Whether the NCCL backend is compiled in (exactly when LibTorch has CUDA).
bool nccl_compiled_in();

/// A ProcessGroupNCCL over `store`. Throws c10::Error when this build has no CUDA path.
c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store, int64_t rank,
                                                    int64_t world_size, std::chrono::milliseconds timeout);

}  // namespace roundpipe::comm::detail
