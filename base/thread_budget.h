// A per-thread cap on the helper threads that CPU work started from the calling thread may use.
// RoundPipe's runtime sets it on its optimizer thread when it drives GPUs; roundpipe::optim::Adam
// reads it (docs/optimizer.md, "Threads").
#pragma once

#include <cstdint>

namespace roundpipe::base {

/// The calling thread's cap on helper threads (0: none).
int64_t thread_budget();
/// Sets the calling thread's cap (0: none).
void set_thread_budget(int64_t threads);

}  // namespace roundpipe::base
