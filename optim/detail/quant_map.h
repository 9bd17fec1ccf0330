// Block-wise 8-bit quantization tables for optim::Adam's 8-bit states (internal; LibTorch-free so
// the per-ISA kernel TUs can use them). The public side is optim/quantized_state.h.
#pragma once

#include <cstdint>

namespace roundpipe::optim::detail {

/// Elements per quantization block (one float32 absmax each).
inline constexpr int64_t kQuantBlock = 256;

/// Bucket lookup of Note [Dynamic quantization map]: |x| clamped to [2^-27, 2], its float bits
/// above the top kLutMantissaBits mantissa bits select a bucket:
/// bucket = (clamp(bits & 0x7FFFFFFF, kLutLowBits, kLutHighBits) - kLutLowBits) >> (23 - kLutMantissaBits).
inline constexpr int kLutMantissaBits = 6;
inline constexpr uint32_t kLutLowBits = 100u << 23;   ///< bits of 2^-27
inline constexpr uint32_t kLutHighBits = 128u << 23;  ///< bits of 2.0f
inline constexpr int kLutBuckets = static_cast<int>((kLutHighBits - kLutLowBits) >> (23 - kLutMantissaBits)) + 1;
/// Thresholds compared after the bucket lookup (the most any bucket holds; checked when built).
inline constexpr int kLutProbes = 3;

/// A 256-entry quantization map and its decision thresholds.
///
/// Note [Dynamic quantization map]: the dynamic (non-linear) map of Dettmers et al. 2021 as
/// bitsandbytes' `create_dynamic_map(signed, max_exponent_bits=7, total_bits=8)` builds it: for
/// i = 0..6, the 2^i (signed) or 2^(i+1) (unsigned) midpoints of linspace(0.1, 1) scaled by
/// 10^(i-6) (and their negatives when signed), plus 0 and 1; sorted. Signed: 127 negative values
/// down to -0.99297, 0 at code 127, 127 positive values, 1 at code 255. Unsigned: 0 at code 0,
/// 254 positive values from 3.25e-7, 1 at code 255. We compute it in double and round each value
/// to float once (bitsandbytes computes it in float32 through torch.linspace, so its values may
/// differ from ours in the last bit; tests compare both). A value x (already divided by its
/// block's absmax) is quantized to the nearest map value: code = #{k : thresholds[k] < x} where
/// thresholds[k] = (values[k] + values[k + 1]) * 0.5f (float) and thresholds[255..] = +inf; a tie
/// goes to the lower code. Fast path (same result): the bucket of |x| (kLutMantissaBits mantissa
/// bits) gives base = #{thresholds below the bucket} from lut[sign bit of x], then
/// code = base + #{k < kLutProbes : thresholds[base + k] < x}. Branch-free: a binary search whose
/// `?:` GCC compiled to branches made the first version 100x slower than fp32 Adam, a branch-free
/// binary search 25x.
struct QuantMapTable {
  float values[256];
  float thresholds[256 + kLutProbes];
  uint8_t lut[2][kLutBuckets];  ///< [sign bit of x][bucket of |x|] -> base
  uint8_t zero_code;  ///< code of 0.0 (127 signed, 0 unsigned)
};

/// Signed dynamic map (exp_avg).
const QuantMapTable& signed_dynamic_map();
/// Unsigned dynamic map (exp_avg_sq).
const QuantMapTable& unsigned_dynamic_map();

/// The code of `x` under `map` (Note [Dynamic quantization map]). Out of line on purpose: the
/// per-ISA kernel TUs use their own copy (nearest_code, Note [Per-ISA namespaces]).
uint8_t quantize_code(const QuantMapTable& map, float x);

}  // namespace roundpipe::optim::detail
