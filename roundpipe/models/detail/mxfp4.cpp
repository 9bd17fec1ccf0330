#include "roundpipe/models/detail/mxfp4.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/index_select.h>
#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <vector>

namespace roundpipe::models::detail {
namespace {

// transformers' FP4_VALUES: the e2m1 codes 0-7, then their negatives (8-15, -0.0 included).
constexpr std::array<float, 16> kFp4Values = {+0.0f, +0.5f, +1.0f, +1.5f, +2.0f, +3.0f, +4.0f, +6.0f,
                                              -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
constexpr int64_t kBytesPerGroup = 16;   // 32 FP4 values share one scale
constexpr int64_t kGroupsPerChunk = int64_t{1} << 17;  // 4 Mi values: temporaries of ~8-24 MB

// (scale byte s, block byte b) -> (fp4[b & 15] * 2^(s - 127), fp4[b >> 4] * 2^(s - 127)) as
// [256 * 256, 2] in `dtype`, row s * 256 + b: every value transformers' ldexp can produce, each the
// exact product (in double: at most 2 significant bits, magnitudes in [2^-128, 6 * 2^128]) rounded
// once to `dtype` (overflow to inf; the double -> float step is exact in the float range).
at::Tensor dequantized_pair_table(c10::ScalarType dtype, c10::Device device) {
  std::vector<double> table(256 * 256 * 2);
  for (int s = 0; s < 256; ++s) {
    for (int b = 0; b < 256; ++b) {
      table[(s * 256 + b) * 2] = std::ldexp(static_cast<double>(kFp4Values[b & 0x0F]), s - 127);
      table[(s * 256 + b) * 2 + 1] = std::ldexp(static_cast<double>(kFp4Values[b >> 4]), s - 127);
    }
  }
  return at::from_blob(table.data(), {256 * 256, 2}, at::kDouble)
      .to(at::TensorOptions().dtype(dtype).device(device), /*non_blocking=*/false, /*copy=*/true);
}

}  // namespace

// Note [MXFP4 like transformers]: _convert_moe_packed_tensors writes lut[low nibble] to the even
// and lut[high nibble] to the odd positions of a `dtype` buffer, then `torch.ldexp(sub, exp,
// out=sub)`. With torch 2.11 that gives the exact fp4 * 2^(s - 127) rounded once to `dtype`, not
// `sub * pow(2.0, exp)` in fp32: 0.5 * 2^128 is the finite 2^127 and 0 * 2^128 is 0 (not inf and
// NaN), and float16 rounds the small values to its denormals or zero.
// There are only 256 scales x 256 bytes of outcomes, so one gather of a precomputed table of them
// (dequantized_pair_table, 512 KB in fp32) gives bitwise the same values in one pass, with no
// arithmetic on the weights (tests/models/mxfp4_test.cpp compares every byte and every scale with
// transformers). The output [E, G * 32, R] is written through a transposed view, chunk by chunk of
// rows within one expert, so no [E, R, G * 32] intermediate exists.
at::Tensor dequantize_mxfp4(const at::Tensor& blocks, const at::Tensor& scales, c10::ScalarType dtype) {
  TORCH_CHECK(blocks.defined() && scales.defined(), "dequantize_mxfp4: blocks and scales must be defined");
  TORCH_CHECK(blocks.scalar_type() == at::kByte,
              "dequantize_mxfp4: blocks must be uint8 (two FP4 values per byte), got ", blocks.scalar_type());
  TORCH_CHECK(scales.scalar_type() == at::kByte, "dequantize_mxfp4: scales must be uint8 (E8M0 exponents), got ",
              scales.scalar_type());
  TORCH_CHECK(blocks.dim() == 4 && blocks.size(3) == kBytesPerGroup,
              "dequantize_mxfp4: blocks must be [experts, rows, groups, 16] (16 bytes = 32 FP4 values per scale), "
              "got ",
              blocks.sizes());
  TORCH_CHECK(scales.dim() == 3 && scales.sizes() == blocks.sizes().slice(0, 3), "dequantize_mxfp4: scales ",
              scales.sizes(), " must be [experts, rows, groups] = ", blocks.sizes().slice(0, 3),
              " to match blocks ", blocks.sizes());
  TORCH_CHECK(blocks.device() == scales.device(), "dequantize_mxfp4: blocks are on ", blocks.device(),
              " but scales on ", scales.device());
  TORCH_CHECK(c10::isFloatingType(dtype), "dequantize_mxfp4: dtype must be a floating type, got ", dtype);

  const int64_t experts = blocks.size(0);
  const int64_t rows = blocks.size(1);
  const int64_t groups = blocks.size(2);
  const int64_t values_per_group = 2 * kBytesPerGroup;
  const c10::Device device = blocks.device();
  at::Tensor out =
      at::empty({experts, groups * values_per_group, rows}, at::TensorOptions().dtype(dtype).device(device));
  if (out.numel() == 0) return out;

  const at::Tensor table = dequantized_pair_table(dtype, device);
  const int64_t rows_per_chunk = std::max<int64_t>(1, kGroupsPerChunk / groups);
  for (int64_t e = 0; e < experts; ++e) {
    for (int64_t r0 = 0; r0 < rows; r0 += rows_per_chunk) {
      const int64_t n = std::min(rows_per_chunk, rows - r0);
      // Row of the table: scale * 256 + byte, [n, G, 16] int32.
      const at::Tensor index =
          scales[e].narrow(0, r0, n).to(at::kInt).unsqueeze(-1) * 256 + blocks[e].narrow(0, r0, n).to(at::kInt);
      const at::Tensor values = table.index_select(0, index.reshape(-1)).view({n, groups, values_per_group});
      // [G * 32, n] of expert e, seen as [n, G, 32]: the transpose(1, 2) happens in the write.
      out[e].narrow(1, r0, n).t().view({n, groups, values_per_group}).copy_(values);
    }
  }
  return out;
}

}  // namespace roundpipe::models::detail
