#include "comm/detail/nccl_backend.h"

#include <c10/util/Exception.h>

#include "base/config.h"  // ROUNDPIPE_WITH_CUDA: without it the NCCL path silently compiled out

#if ROUNDPIPE_WITH_CUDA
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#else
#include <torch/csrc/distributed/c10d/Backend.hpp>
#endif

namespace roundpipe::comm::detail {

bool nccl_compiled_in() { return ROUNDPIPE_WITH_CUDA == 1; }

c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store, int64_t rank,
                                                    int64_t world_size, std::chrono::milliseconds timeout) {
#if ROUNDPIPE_WITH_CUDA
  auto opts = c10d::ProcessGroupNCCL::Options::create();
  opts->timeout = timeout;
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, static_cast<int>(rank), static_cast<int>(world_size),
                                                     opts);
#else
  (void)store;
  (void)rank;
  (void)world_size;
  (void)timeout;
  TORCH_CHECK(false, "backend nccl: this RoundPipe build has no CUDA path (LibTorch without CUDA); use backend gloo");
#endif
}

}  // namespace roundpipe::comm::detail
