#include "optim/quantized_state.h"

#include "optim/detail/quant_map.h"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstring>

namespace roundpipe::optim {
namespace {

static_assert(kQuantBlockSize == detail::kQuantBlock, "one block size for the API and the kernel");

const detail::QuantMapTable& table_of(QuantMap map) {
  return map == QuantMap::kSignedDynamic ? detail::signed_dynamic_map() : detail::unsigned_dynamic_map();
}

int64_t num_blocks(int64_t numel) { return (numel + kQuantBlockSize - 1) / kQuantBlockSize; }

}  // namespace

at::Tensor dynamic_quant_map(QuantMap map) {
  at::Tensor out = at::empty({256}, at::kFloat);
  std::memcpy(out.data_ptr<float>(), table_of(map).values, sizeof(float) * 256);
  return out;
}

std::pair<at::Tensor, at::Tensor> quantize_blockwise(const at::Tensor& x, QuantMap map) {
  TORCH_CHECK(x.defined() && x.device().is_cpu() && x.scalar_type() == at::kFloat,
              "roundpipe::optim::quantize_blockwise: expected a float32 CPU tensor, got ",
              x.defined() ? x.toString() : std::string("an undefined tensor"));
  const at::Tensor src = x.contiguous();
  const int64_t n = src.numel();
  at::Tensor codes = at::empty(src.sizes(), at::kByte);
  at::Tensor absmax = at::empty({num_blocks(n)}, at::kFloat);
  const auto& table = table_of(map);
  const float* in = src.const_data_ptr<float>();
  uint8_t* out = codes.data_ptr<uint8_t>();
  float* scale = absmax.data_ptr<float>();
  for (int64_t b = 0; b < absmax.numel(); ++b) {
    const int64_t lo = b * kQuantBlockSize;
    const int64_t hi = std::min(n, lo + kQuantBlockSize);
    float a = 0.0f;
    for (int64_t i = lo; i < hi; ++i) {
      a = a < std::fabs(in[i]) ? std::fabs(in[i]) : a;
    }
    const float inv = a > 0.0f ? 1.0f / a : 0.0f;
    for (int64_t i = lo; i < hi; ++i) {
      out[i] = detail::quantize_code(table, in[i] * inv);
    }
    scale[b] = a;
  }
  return {codes, absmax};
}

at::Tensor dequantize_blockwise(const at::Tensor& codes, const at::Tensor& absmax, QuantMap map) {
  TORCH_CHECK(codes.defined() && codes.device().is_cpu() && codes.scalar_type() == at::kByte,
              "roundpipe::optim::dequantize_blockwise: codes must be a uint8 CPU tensor, got ",
              codes.defined() ? codes.toString() : std::string("an undefined tensor"));
  TORCH_CHECK(absmax.defined() && absmax.device().is_cpu() && absmax.scalar_type() == at::kFloat &&
                  absmax.numel() == num_blocks(codes.numel()),
              "roundpipe::optim::dequantize_blockwise: absmax must be a float32 CPU tensor of ",
              num_blocks(codes.numel()), " elements (one per ", kQuantBlockSize, " codes), got ",
              absmax.defined() ? absmax.toString() : std::string("an undefined tensor"), " of ",
              absmax.defined() ? absmax.numel() : 0, " elements");
  const at::Tensor c = codes.contiguous();
  const at::Tensor s = absmax.contiguous();
  at::Tensor out = at::empty(c.sizes(), at::kFloat);
  const auto& table = table_of(map);
  const uint8_t* in = c.const_data_ptr<uint8_t>();
  const float* scale = s.const_data_ptr<float>();
  float* dst = out.data_ptr<float>();
  for (int64_t i = 0; i < c.numel(); ++i) {
    dst[i] = table.values[in[i]] * scale[i / kQuantBlockSize];
  }
  return out;
}

}  // namespace roundpipe::optim
