// roundpipe::optim: block-wise 8-bit quantization of optimizer states (Dettmers et al. 2021, as
// bitsandbytes does it), used by optim::Adam with AdamStateDtype::kInt8. These functions expose
// the exact map and rounding the Adam kernel uses, for tests, tools and checkpoint inspection.
// The layout and the map are described in docs/optimizer.md, "8-bit states".
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <utility>

namespace roundpipe::optim {

/// Elements per quantization block; each block has one float32 absmax per state.
inline constexpr int64_t kQuantBlockSize = 256;
/// Parameters with fewer elements keep float32 states even with AdamStateDtype::kInt8
/// (bitsandbytes' min_8bit_size): for them the absmax and map tables would save little.
inline constexpr int64_t kMin8bitNumel = 4096;

/// The two dynamic quantization maps (bitsandbytes' create_dynamic_map(signed=true / false)).
enum class QuantMap {
  kSignedDynamic,    ///< exp_avg: values in [-0.993, 1], 0 at code 127
  kUnsignedDynamic,  ///< exp_avg_sq: values in [0, 1], 0 at code 0
};

/// The map's 256 values, sorted ascending (code k stands for value k), as a float32 tensor.
at::Tensor dynamic_quant_map(QuantMap map);

/// x (a float32 tensor, any shape) -> (codes: uint8 of x's shape, absmax: float32
/// [ceil(numel / kQuantBlockSize)]), each block of kQuantBlockSize consecutive elements scaled by
/// its absmax and rounded to the nearest map value: exactly what Adam's kernel stores.
std::pair<at::Tensor, at::Tensor> quantize_blockwise(const at::Tensor& x, QuantMap map);

/// The float32 tensor of codes' shape that (codes, absmax) stand for: map[code] * absmax[block].
at::Tensor dequantize_blockwise(const at::Tensor& codes, const at::Tensor& absmax, QuantMap map);

}  // namespace roundpipe::optim
