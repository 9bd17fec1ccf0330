// layer_seed: the seed of each layer's forward on each microbatch under RoundPipe's per-layer RNG
// scheme (docs/user-guide.md, "Dropout and reproducibility"). Declared apart from
// roundpipe/round_pipe.h so that the runtime's internals can use it without including the facade.
#pragma once

#include <cstdint>

namespace roundpipe {

/// The seed a layer's forward on a microbatch runs with (docs/user-guide.md, "Dropout and reproducibility"). A plain loop that
/// calls torch::manual_seed(layer_seed(seed, iteration, microbatch, layer)) before each layer
/// reproduces RoundPipe's dropout masks exactly. `iteration` counts forward_backward calls from 0.
uint64_t layer_seed(uint64_t base_seed, int64_t iteration, int64_t microbatch, int64_t layer);

}  // namespace roundpipe
