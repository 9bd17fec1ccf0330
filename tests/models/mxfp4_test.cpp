#include "roundpipe/models/detail/mxfp4.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "tests/common/python_oracle.h"
#include "tests/common/tensor_compare.h"
#include "tests/common/test_macros.h"
#include "tests/models/hf_oracle.h"

namespace roundpipe::testing {
namespace {

using models::detail::dequantize_mxfp4;

// The e2m1 values of codes 0-15 (the MX spec's table; transformers' FP4_VALUES).
constexpr float kFp4[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                            -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

at::Tensor zeros_u8(at::IntArrayRef sizes) { return at::zeros(sizes, at::kByte); }

// Byte 0x21 with scale byte 128: low nibble 1 -> 0.5 * 2 = 1.0 at the even position, high nibble
// 2 -> 1.0 * 2 = 2.0 at the odd one; and the layout: [E, R, G, 16] -> [E, G * 32, R].
TEST(Mxfp4Test, HandBuilt_NibbleOrderScaleAndTranspose) {
  at::Tensor blocks = zeros_u8({1, 2, 2, 16});
  at::Tensor scales = at::full({1, 2, 2}, 127, at::kByte);
  blocks[0][0][0][0] = 0x21;
  scales[0][0][0] = 128;
  blocks[0][1][1][3] = 0x9F;  // row 1, group 1, byte 3: low 0xF -> -6, high 0x9 -> -0.5
  scales[0][1][1] = 126;      // * 0.5
  const at::Tensor out = dequantize_mxfp4(blocks, scales, at::kFloat);
  ASSERT_EQ(out.sizes(), (std::vector<int64_t>{1, 64, 2}));
  EXPECT_TRUE(out.is_contiguous());
  at::Tensor expected = at::zeros({1, 64, 2});
  expected[0][0][0] = 1.0;
  expected[0][1][0] = 2.0;
  expected[0][32 + 6][1] = -3.0;
  expected[0][32 + 7][1] = -0.25;
  // Zeros at the negative code keep their sign: every other value of row 1 group 1 is +0.
  EXPECT_TRUE(tensors_equal(out, expected)) << out;
}

// Every byte with scale 127 (2^0): even position = fp4[low nibble], odd = fp4[high nibble],
// negative codes and -0.0 included; the same values scaled by 2^-3 in bfloat16.
TEST(Mxfp4Test, AllBytes_NegativeCodesAndSignedZero) {
  const at::Tensor bytes = at::arange(256, at::kInt).to(at::kByte).view({1, 16, 1, 16});  // row r: bytes 16r..16r+15
  for (const auto& [dtype, scale_byte] : {std::pair{at::kFloat, 127}, {at::kBFloat16, 124}}) {
    const at::Tensor out = dequantize_mxfp4(bytes, at::full({1, 16, 1}, scale_byte, at::kByte), dtype);
    ASSERT_EQ(out.sizes(), (std::vector<int64_t>{1, 32, 16}));
    const at::Tensor values = out.to(at::kFloat);
    const float scale = std::ldexp(1.0f, scale_byte - 127);
    for (int b = 0; b < 256; ++b) {
      const int row = b / 16;
      const int col = b % 16;
      const float lo = values[0][2 * col][row].item<float>();
      const float hi = values[0][2 * col + 1][row].item<float>();
      EXPECT_EQ(lo, kFp4[b & 15] * scale) << "byte " << b;
      EXPECT_EQ(hi, kFp4[b >> 4] * scale) << "byte " << b;
      EXPECT_EQ(std::signbit(lo), std::signbit(kFp4[b & 15])) << "byte " << b;
      EXPECT_EQ(std::signbit(hi), std::signbit(kFp4[b >> 4])) << "byte " << b;
    }
  }
}

// Scale bytes at the ends of E8M0, against the exact fp4 * 2^(s - 127) in fp32 (std::ldexp: exact,
// inf on overflow): 0 gives 2^-127 multiples (fp32 denormals), 254 and 255 overflow the larger
// codes to inf while 0.5 * 2^128 = 2^127 stays finite and zeros stay (signed) zeros, as
// transformers' torch.ldexp gives.
TEST(Mxfp4Test, ExtremeScales_DenormalsAndOverflow) {
  const at::Tensor bytes = at::arange(256, at::kInt).to(at::kByte).view({1, 1, 16, 16});
  for (const int scale_byte : {0, 1, 2, 126, 127, 128, 253, 254, 255}) {
    const at::Tensor out = dequantize_mxfp4(bytes, at::full({1, 1, 16}, scale_byte, at::kByte), at::kFloat);
    at::Tensor expected = at::empty({1, 512, 1});
    for (int b = 0; b < 256; ++b) {
      expected[0][2 * b][0] = std::ldexp(kFp4[b & 15], scale_byte - 127);
      expected[0][2 * b + 1][0] = std::ldexp(kFp4[b >> 4], scale_byte - 127);
    }
    EXPECT_TRUE(tensors_equal(out, expected)) << "scale byte " << scale_byte;
  }
  const at::Tensor top = dequantize_mxfp4(bytes, at::full({1, 1, 16}, 255, at::kByte), at::kFloat);
  EXPECT_EQ(top[0][0][0].item<float>(), 0.0f);                      // 0 * 2^128
  EXPECT_EQ(top[0][2][0].item<float>(), std::ldexp(1.0f, 127));     // 0.5 * 2^128 (byte 1, low nibble)
  EXPECT_TRUE(std::isinf(top[0][4][0].item<float>()));             // 1.0 * 2^128 (byte 2)
  const at::Tensor bottom = dequantize_mxfp4(bytes, at::full({1, 1, 16}, 0, at::kByte), at::kFloat);
  EXPECT_EQ(bottom[0][2][0].item<float>(), std::ldexp(1.0f, -128));  // 0.5 * 2^-127
}

// Random blocks and every scale byte against transformers' convert_moe_packed_tensors, bitwise, in
// float32, bfloat16 and float16: several experts, partial and whole tiles of 128 rows, gpt-oss's 90
// groups (every scale byte meets every FP4 code).
void random_matches_transformers(c10::Device device) {
  ROUNDPIPE_REQUIRE_TRANSFORMERS();
  at::manual_seed(7);
  const std::vector<std::vector<int64_t>> shapes = {{3, 5, 4}, {2, 300, 90}};  // [E, R, G]
  TensorMap inputs;
  for (size_t i = 0; i < shapes.size(); ++i) {
    std::vector<int64_t> block_shape = shapes[i];
    block_shape.push_back(16);
    inputs["blocks" + std::to_string(i)] = at::randint(0, 256, block_shape, at::kByte);
    inputs["scales" + std::to_string(i)] = at::randint(0, 256, shapes[i], at::kByte);
  }
  {  // the claim above, on the larger case: all 256 x 16 (scale, code) pairs occur
    const at::Tensor scale16 = inputs.at("scales1").to(at::kLong).unsqueeze(-1) * 16;
    const at::Tensor bytes = inputs.at("blocks1").to(at::kLong);
    const at::Tensor pairs =
        at::cat({(scale16 + bytes.bitwise_and(15)).reshape(-1), (scale16 + bytes.div(16, "floor")).reshape(-1)});
    ASSERT_GT(pairs.bincount({}, 4096).min().item<int64_t>(), 0);
  }
  const TensorMap hf = run_python(
      "from transformers.integrations.mxfp4 import convert_moe_packed_tensors\n"
      "for i in range(" + std::to_string(shapes.size()) + "):\n"
      "    for dtype in (torch.float32, torch.bfloat16, torch.float16):\n"
      "        outputs[f'{i}.{dtype}'] = convert_moe_packed_tensors(inputs[f'blocks{i}'], inputs[f'scales{i}'],\n"
      "                                                             dtype=dtype)\n",
      inputs);
  for (size_t i = 0; i < shapes.size(); ++i) {
    const at::Tensor blocks = inputs.at("blocks" + std::to_string(i)).to(device);
    const at::Tensor scales = inputs.at("scales" + std::to_string(i)).to(device);
    for (const auto& [dtype, name] :
         {std::pair{at::kFloat, "torch.float32"}, {at::kBFloat16, "torch.bfloat16"}, {at::kHalf, "torch.float16"}}) {
      const at::Tensor ours = dequantize_mxfp4(blocks, scales, dtype);
      const std::string key = std::to_string(i) + "." + name;
      ASSERT_EQ(ours.device(), device);
      ASSERT_EQ(ours.sizes(), (std::vector<int64_t>{shapes[i][0], shapes[i][2] * 32, shapes[i][1]})) << key;
      EXPECT_TRUE(ours.is_contiguous());
      EXPECT_TRUE(tensors_equal(ours.cpu(), hf.at(key))) << key;
    }
  }
}
ROUNDPIPE_DEVICE_TEST(Mxfp4Test, Random_MatchesTransformersBitwise, random_matches_transformers)

TEST(Mxfp4Test, Empty_GivesEmptyOutput) {
  const at::Tensor out = dequantize_mxfp4(zeros_u8({2, 0, 3, 16}), zeros_u8({2, 0, 3}), at::kBFloat16);
  EXPECT_EQ(out.sizes(), (std::vector<int64_t>{2, 96, 0}));
  EXPECT_EQ(out.scalar_type(), at::kBFloat16);
}

TEST(Mxfp4Test, BadInputs_NameShapesAndDtypes) {
  EXPECT_THROW_WITH(dequantize_mxfp4(at::zeros({1, 2, 3, 16}, at::kInt), zeros_u8({1, 2, 3}), at::kFloat),
                    "blocks must be uint8 (two FP4 values per byte), got Int");
  EXPECT_THROW_WITH(dequantize_mxfp4(zeros_u8({1, 2, 3, 16}), at::zeros({1, 2, 3}), at::kFloat),
                    "scales must be uint8 (E8M0 exponents), got Float");
  EXPECT_THROW_WITH(dequantize_mxfp4(zeros_u8({1, 2, 3, 8}), zeros_u8({1, 2, 3}), at::kFloat),
                    "blocks must be [experts, rows, groups, 16] (16 bytes = 32 FP4 values per scale), got [1, 2, 3, 8]");
  EXPECT_THROW_WITH(dequantize_mxfp4(zeros_u8({2, 3, 16}), zeros_u8({2, 3}), at::kFloat), "got [2, 3, 16]");
  EXPECT_THROW_WITH(dequantize_mxfp4(zeros_u8({1, 2, 3, 16}), zeros_u8({1, 3, 2}), at::kFloat),
                    "scales [1, 3, 2] must be [experts, rows, groups] = [1, 2, 3] to match blocks [1, 2, 3, 16]");
  EXPECT_THROW_WITH(dequantize_mxfp4(zeros_u8({1, 2, 3, 16}), zeros_u8({1, 2, 3}), at::kInt),
                    "dtype must be a floating type, got Int");
}

}  // namespace
}  // namespace roundpipe::testing
