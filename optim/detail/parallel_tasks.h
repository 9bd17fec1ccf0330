// Multi-threaded execution of a fixed number of independent tasks (internal to roundpipe::optim).
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

namespace roundpipe::optim::detail {

// Note [Why not at::parallel_for]: the PyPI LibTorch is an OpenMP build, where at::parallel_for
// is an inline `#pragma omp parallel` in ATen's headers. In a translation unit compiled without
// -fopenmp the pragma is ignored and the loop silently runs on one thread (measured: our Adam
// took the same time with 1 and 2 threads while ATen's own kernels scaled). Compiling with
// -fopenmp instead would link the system libgomp next to the copy bundled in the wheel: two
// OpenMP runtimes with two thread pools. So the optimizer has its own pool of helper threads.

/// Runs fn(0), ..., fn(tasks - 1): task 0 on the caller's thread, the others on a process-wide
/// pool of helper threads (one per hardware thread, started on first use). Returns when all have
/// finished; rethrows the first task's exception. `tasks <= 1` runs inline. Any thread may call
/// it; concurrent callers share the pool.
void run_tasks(int64_t tasks, const std::function<void(int64_t)>& fn);

/// The elements of one optimizer step: tensors of `numels[i]` elements, concatenated, split into
/// equal contiguous ranges, one task each, and `fn(i, lo, hi)` called for every piece (elements
/// [lo, hi) of tensor i). Tasks: `requested` threads when > 0, else at::get_num_threads() capped by
/// the calling thread's base::thread_budget (Note [Optimizer thread budget] in the runtime), and
/// at most one per 32K elements. Returns the number of tasks run (>= 1; 0 when there is nothing).
int64_t run_split(const std::vector<int64_t>& numels, int64_t requested,
                  const std::function<void(size_t, int64_t, int64_t)>& fn);

/// run_split over kernel jobs (each with a `numel`): update(jobs[i], lo, hi) for every piece.
template <typename Job, typename Update>
int64_t run_split_jobs(const std::vector<Job>& jobs, int64_t requested, Update update) {
  std::vector<int64_t> numels;
  numels.reserve(jobs.size());
  for (const Job& job : jobs) numels.push_back(job.numel);
  return run_split(numels, requested, [&](size_t j, int64_t lo, int64_t hi) { update(jobs[j], lo, hi); });
}

}  // namespace roundpipe::optim::detail
