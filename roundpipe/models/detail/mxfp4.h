// MXFP4 dequantization of gpt-oss's released expert weights (`*_blocks` + `*_scales` tensors), as
// transformers' integrations/mxfp4.py convert_moe_packed_tensors does when loading them with
// `Mxfp4Config(dequantize=True)`. Used by the checkpoint loader; training runs on the result.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

namespace roundpipe::models::detail {

/// Dequantizes MXFP4 expert weights: `blocks` uint8 [E, R, G, 16] holds two FP4 (e2m1) values per
/// byte, the low nibble at the even position and the high nibble at the odd one, so a row holds
/// G * 32 values; `scales` uint8 [E, R, G] holds one E8M0 exponent per group of 32 values (value =
/// fp4 * 2^(scale - 127), rounded once to `dtype`). Returns [E, G * 32, R] contiguous in `dtype` (a
/// floating type) on the inputs' device: transformers' `convert_moe_packed_tensors(blocks, scales,
/// dtype=dtype)`, bitwise, -0.0, overflow to inf and scale byte 255 (2^128) included. A table lookup
/// per byte on the CPU, in parallel (ATen's intra-op threads), writing the output once, already
/// transposed: no temporary beyond a 1 MB table. Inputs on another device are dequantized on the
/// CPU and the result copied back. Throws c10::Error for other dtypes, ranks or shapes, naming
/// them. Thread-safe (no shared state).
at::Tensor dequantize_mxfp4(const at::Tensor& blocks, const at::Tensor& scales, c10::ScalarType dtype);

}  // namespace roundpipe::models::detail
