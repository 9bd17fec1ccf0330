// Block-wise 8-bit quantization tables for optim::Adam's 8-bit states (internal; LibTorch-free so
// the per-ISA kernel TUs can use them). The public side is optim/quantized_state.h.
#pragma once

#include <cstdint>

namespace roundpipe::optim::detail {

/// Elements per quantization block (one float32 absmax each).
inline constexpr int64_t kQuantBlock = 256;

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
/// thresholds[k] = (values[k] + values[k + 1]) * 0.5f (float) and thresholds[255] = +inf; a tie
/// goes to the lower code. The search is branch-free (8 halving steps over 256 thresholds).
struct QuantMapTable {
  float values[256];
  float thresholds[256];
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
