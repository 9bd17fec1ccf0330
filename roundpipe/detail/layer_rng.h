// Per-layer RNG seeding shared by forward and recompute (internal). See Note [Layer RNG].
#pragma once

#include <c10/core/Device.h>

#include <cstdint>
#include <functional>

namespace roundpipe::detail {

/// Runs `fn` with the default generator of `device` seeded with `seed`, and restores that
/// generator's previous state afterwards (also on exceptions), so the caller's random stream is
/// untouched. CPU devices share one generator: a process-wide mutex is held for the whole of
/// `fn`, which serializes seeded layer forwards across CPU workers. On CUDA the mutex is per
/// device and covers only the host-side launch of `fn`'s kernels. Returns whether `fn` drew
/// random numbers (the seeded generator's state moved).
bool run_seeded(const c10::Device& device, uint64_t seed, const std::function<void()>& fn);

/// Runs `fn` as it is; returns whether the default generator of `device` moved meanwhile (by
/// `fn`, or by another thread's draws: a false "yes" is possible, a false "no" is not).
bool run_noting_draws(const c10::Device& device, const std::function<void()>& fn);

/// Runs `fn` holding the CPU generator's mutex and restores the CPU generator's state afterwards:
/// for work that draws random numbers we do not want (Cloneable::clone() calls reset(), which
/// re-initializes parameters from the default CPU generator before copying the values over).
void run_rng_isolated(const std::function<void()>& fn);

}  // namespace roundpipe::detail
