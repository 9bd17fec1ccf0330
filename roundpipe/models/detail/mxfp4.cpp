#include "roundpipe/models/detail/mxfp4.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
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
constexpr int64_t kValuesPerGroup = 2 * kBytesPerGroup;
constexpr int64_t kTileRows = 128;  // rows per parallel task: 128 consecutive outputs of 32 rows

// (scale byte s, block byte b) -> (fp4[b & 15] * 2^(s - 127), fp4[b >> 4] * 2^(s - 127)) as
// [256 * 256, 2] in `dtype`, row s * 256 + b: every value transformers' ldexp can produce, each the
// exact product (in double: at most 2 significant bits, magnitudes in [2^-128, 6 * 2^128]) rounded
// once to `dtype` (overflow to inf; the double -> float step is exact in the float range).
at::Tensor dequantized_pair_table(c10::ScalarType dtype) {
  std::vector<double> table(256 * 256 * 2);
  for (int s = 0; s < 256; ++s) {
    for (int b = 0; b < 256; ++b) {
      table[(s * 256 + b) * 2] = std::ldexp(static_cast<double>(kFp4Values[b & 0x0F]), s - 127);
      table[(s * 256 + b) * 2 + 1] = std::ldexp(static_cast<double>(kFp4Values[b >> 4]), s - 127);
    }
  }
  return at::from_blob(table.data(), {256 * 256, 2}, at::kDouble)
      .to(dtype, /*non_blocking=*/false, /*copy=*/true);
}

// Writes expert e's rows [r0, r1) of the [E, G * 32, R] output from the [65536, 2] table: group g
// of row r comes from table row scale * 256 + byte. The loops go over a tile of rows inside each
// group so that the 32 output rows a group feeds are written in runs of consecutive elements.
template <typename T>
void dequantize_rows(const uint8_t* blocks, const uint8_t* scales, const T* table, T* out, int64_t e, int64_t r0,
                     int64_t r1, int64_t rows, int64_t groups) {
  T* out_e = out + e * groups * kValuesPerGroup * rows;
  for (int64_t g = 0; g < groups; ++g) {
    T* out_g = out_e + g * kValuesPerGroup * rows;
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t group_index = (e * rows + r) * groups + g;
      const uint8_t* bytes = blocks + group_index * kBytesPerGroup;
      const T* scaled = table + static_cast<int64_t>(scales[group_index]) * 256 * 2;
      T* dst = out_g + r;
      for (int64_t j = 0; j < kBytesPerGroup; ++j) {
        const T* pair = scaled + static_cast<int64_t>(bytes[j]) * 2;
        dst[(2 * j) * rows] = pair[0];
        dst[(2 * j + 1) * rows] = pair[1];
      }
    }
  }
}

}  // namespace

// Note [MXFP4 like transformers]: _convert_moe_packed_tensors writes lut[low nibble] to the even
// and lut[high nibble] to the odd positions of a `dtype` buffer, then `torch.ldexp(sub, exp,
// out=sub)`. With torch 2.11 that gives the exact fp4 * 2^(s - 127) rounded once to `dtype`, not
// `sub * pow(2.0, exp)` in fp32: 0.5 * 2^128 is the finite 2^127 and 0 * 2^128 is 0 (not inf and
// NaN), and float16 rounds the small values to its denormals or zero. There are only 256 scales x
// 256 bytes of outcomes, so a lookup in a precomputed table of them (dequantized_pair_table, 512 KB
// in fp32) gives bitwise the same values with no arithmetic on the weights
// (tests/models/mxfp4_test.cpp compares every byte and every scale with transformers). The loop
// writes the [E, G * 32, R] output directly (the transpose(1, 2) happens in the write, so no
// [E, R, G * 32] intermediate exists), in parallel over tiles of kTileRows rows of one expert. It
// runs on the CPU, where checkpoints are read; inputs on another device go through the CPU.
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

  const c10::Device device = blocks.device();
  if (device.type() != c10::kCPU) return dequantize_mxfp4(blocks.cpu(), scales.cpu(), dtype).to(device);
  const int64_t experts = blocks.size(0);
  const int64_t rows = blocks.size(1);
  const int64_t groups = blocks.size(2);
  at::Tensor out = at::empty({experts, groups * kValuesPerGroup, rows}, at::TensorOptions().dtype(dtype));
  if (out.numel() == 0) return out;

  const at::Tensor blocks_c = blocks.contiguous();
  const at::Tensor scales_c = scales.contiguous();
  const at::Tensor table = dequantized_pair_table(dtype);
  const int64_t tiles = (rows + kTileRows - 1) / kTileRows;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "dequantize_mxfp4", [&] {
    const uint8_t* block_data = blocks_c.data_ptr<uint8_t>();
    const uint8_t* scale_data = scales_c.data_ptr<uint8_t>();
    const scalar_t* table_data = table.data_ptr<scalar_t>();
    scalar_t* out_data = out.data_ptr<scalar_t>();
    at::parallel_for(0, experts * tiles, 1, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t e = task / tiles;
        const int64_t r0 = (task % tiles) * kTileRows;
        dequantize_rows(block_data, scale_data, table_data, out_data, e, r0, std::min(rows, r0 + kTileRows), rows,
                        groups);
      }
    });
  });
  return out;
}

}  // namespace roundpipe::models::detail
