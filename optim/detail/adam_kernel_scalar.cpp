// Portable fallback of the fused Adam kernel (no vector loop), compiled with baseline flags.
#define ROUNDPIPE_ADAM_ISA scalar_isa
#include "optim/detail/adam_kernel_impl.h"
#include "optim/detail/lion_kernel_impl.h"

namespace roundpipe::optim::detail {
namespace scalar_isa {
namespace {

/// IEEE fp32 -> fp16, round to nearest even (the FP16 library's algorithm, as c10::Half uses).
uint16_t half_from_float_soft(float f) {
  const float scale_to_inf = 0x1.0p+112f;
  const float scale_to_zero = 0x1.0p-110f;
  float base = (std::fabs(f) * scale_to_inf) * scale_to_zero;
  const uint32_t w = float_bits(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & UINT32_C(0x80000000);
  uint32_t bias = shl1_w & UINT32_C(0xFF000000);
  if (bias < UINT32_C(0x71000000)) {
    bias = UINT32_C(0x71000000);
  }
  base = float_from_bits((bias >> 1) + UINT32_C(0x07800000)) + base;
  const uint32_t bits = float_bits(base);
  const uint32_t exp_bits = (bits >> 13) & UINT32_C(0x00007C00);
  const uint32_t mantissa_bits = bits & UINT32_C(0x00000FFF);
  const uint32_t nonsign = exp_bits + mantissa_bits;
  return static_cast<uint16_t>((sign >> 16) | (shl1_w > UINT32_C(0xFF000000) ? UINT16_C(0x7E00) : nonsign));
}

struct NoVec {
  static constexpr int kWidth = 0;
  static uint16_t half_from_float(float f) { return half_from_float_soft(f); }
  static float float_from_half(uint16_t h) { return float_from_half_soft(h); }
  static void dequantize_block(const uint8_t* codes, float absmax, const QuantMapTable& map, float* out, int64_t n) {
    dequantize_block_scalar(codes, absmax, map, out, n);
  }
  static void quantize_pair(const float* m, const float* v, int64_t n, const QuantMapTable& m_map,
                            const QuantMapTable& v_map, uint8_t* m_codes, uint8_t* v_codes, float* m_absmax,
                            float* v_absmax) {
    *m_absmax = quantize_block_scalar(m, n, m_map, m_codes);
    *v_absmax = quantize_block_scalar(v, n, v_map, v_codes);
  }
};

}  // namespace
}  // namespace scalar_isa

void adam_update_scalar(const AdamTensor& t, int64_t begin, int64_t end) {
  scalar_isa::adam_update<scalar_isa::NoVec>(t, begin, end);
}

void lion_update_scalar(const LionTensor& t, int64_t begin, int64_t end) { scalar_isa::lion_update(t, begin, end); }

}  // namespace roundpipe::optim::detail
