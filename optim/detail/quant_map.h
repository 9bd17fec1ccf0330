// Block-wise 8-bit quantization tables for optim::Adam's 8-bit states (internal; LibTorch-free so
// the per-ISA kernel TUs can use them). The public side is optim/quantized_state.h.
#pragma once

#include <cstdint>

namespace roundpipe::optim::detail {

/// Elements per quantization block (one float32 absmax each).
inline constexpr int64_t kQuantBlock = 256;

/// The code lookup (Note [Fine code lookup]): |x| clamped to [2^-23, 2], its float bits
/// above the low kFineShift bits select a bucket holding at most one threshold:
/// bucket = (clamp(bits & 0x7FFFFFFF, kFineLowBits, kFineHighBits) - kFineLowBits) >> kFineShift.
inline constexpr int kFineShift = 16;  ///< 7 mantissa bits select the bucket; the low 16 are the key
inline constexpr uint32_t kFineLowBits = 104u << 23;   ///< bits of 2^-23
inline constexpr uint32_t kFineHighBits = 128u << 23;  ///< bits of 2.0f
inline constexpr int kFineBuckets = static_cast<int>((kFineHighBits - kFineLowBits) >> kFineShift) + 1;

/// Note [Decade code lookup]: the AVX-512 kernel's code lookup without a gather (a 16-lane gather
/// took three quarters of the 8-bit step on the development machine, an AMD EPYC Zen 5). The map's
/// positive thresholds are regular inside each decade: decade i (i = 0..6, scale s = 10^(i-6)) holds
/// n_i values s * (0.1 + (j + 0.5) * h), h = 0.9 / n_i, whose thresholds lie at s * (0.1 + (j + 1) *
/// h) up to float rounding; the threshold below a decade's first value and the one below 1.0 are
/// irregular ("boundaries", at most one per binade of |x|). So the count P of positive thresholds
/// below a = |x| is
///   e    = clamp(exponent bits of a, 104, 128)  (2^-23 <= a < 2^-22 and everything below is e = 104)
///   slot = slot_of_binade[e % 32] + (boundary_of_binade[e % 32] < a)
///   F    = a * scale[slot] + offset[slot]        (one fma; offset includes the thresholds below the decade)
///   P    = trunc(min(F, top[slot]))              (top: the decade's last count + 0.5)
/// where slot 0 is below the first boundary and slot 8 above the last (scale 0, offset count + 0.5).
/// Then code = trunc(127 + min(F, top)) (signed map, x >= 0), trunc(128 - min(F, top)) (signed,
/// x < 0: the negative thresholds mirror the first 127 positive ones; F is not within 2^-12 of an
/// integer there, so this is 127 - P, and 0 above the last boundary), P (unsigned, x >= 0) or 0
/// (unsigned, x < 0). The tables are indexed by e mod 32 so that the exponent needs no subtraction.
/// The float rounding of F and of the thresholds matters only where F is within 2^-12 of an
/// integer, where a equals a boundary (then a negative x would also need the tie rule), and for NaN:
/// those lanes ("ambiguous") take Note [Fine code lookup] instead (after a block, the kernel
/// gathers the codes of each vector that has one: about 1% of vectors, 0.05% of elements).
/// AdamInt8Test.Avx512CodeLookupEqualsTheScalarOneForEveryFloat compares it with quantize_code for
/// all 2^32 floats of both maps (the ambiguous lanes are 0.4% of the bit patterns, nearly all NaNs;
/// with a band of 2^-30 instead of 2^-12 it finds 671 wrong codes, with 2^-16 none).
struct DecadeLookup {
  alignas(64) int32_t slot_of_binade[32];
  alignas(64) float boundary_of_binade[32];  ///< +inf where the binade holds no boundary
  alignas(64) float scale[16];
  alignas(64) float offset[16];
  alignas(64) float top[16];
};

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
/// goes to the lower code. Fast path (same result): Note [Fine code lookup]. History: a binary
/// search whose `?:` GCC compiled to branches made the first version 100x slower than fp32 Adam,
/// a branch-free binary search 25x, a coarser bucket table (6 mantissa bits, then up to 3
/// threshold compares) 11x; the fine table with vector kernels: see docs/optimizer.md.
struct QuantMapTable {
  float values[256];
  float thresholds[256];  ///< thresholds[255] = +inf
  /// [sign bit of x * kFineBuckets + fine bucket of |x|] -> base << 16 | (0xFFFF - limit) (Note [Fine code lookup]).
  uint32_t fine[2 * kFineBuckets];
  /// Byte q of values[k]'s float bits at [q][k] (little endian): the AVX-512 VBMI dequantize
  /// looks up 64 codes per byte permute (Note [Byte-plane dequantize] in adam_kernel_avx512.cpp).
  alignas(64) uint8_t value_bytes[4][256];
  DecadeLookup decades;  ///< Note [Decade code lookup]
  uint8_t zero_code;     ///< code of 0.0 (127 signed, 0 unsigned)
  bool is_signed;
};

/// Note [Fine code lookup]: the code of Note [Dynamic quantization map] from one table entry (one
/// gather per vector in the kernels, one load per element in scalar code). The buckets are 2^16 consecutive float bit
/// patterns of |x| (7 mantissa bits, 2^-23..2; below and above clamp to the end buckets), fine
/// enough that each holds at most one threshold (checked when built; the end buckets none). With
/// key = the low 16 bits of |x|'s bits, complemented (0xFFFF - key) when x is negative:
///   code = base + (key > limit) = (entry + key) >> 16,  entry = base << 16 | (0xFFFF - limit)
/// (the sum carries into bit 16 exactly when key > limit) where base = #{thresholds below the
/// bucket} (x >= 0: below its smallest magnitude; x < 0: below -(its largest magnitude)) and limit =
/// the key of the bucket's threshold, or 0xFFFF when it has none (no key exceeds it). Within a bucket a threshold t < x compares as its
/// key < x's key (x >= 0) or as |x|'s low bits < |t|'s (x < 0, hence the complement); a tie is not
/// counted. Verified equal to the previous lookup (a coarser bucket table, then up to three
/// threshold compares) for all 2^32 floats of both maps when it was written (a throw-away
/// program); the tests pin the codes. In code (each kernel TU has its own copy, Note [Per-ISA
/// namespaces]; quant_map.cpp's quantize_code is the reference):
///   mag = bits & 0x7FFFFFFF, clamped to [kFineLowBits, kFineHighBits]
///   entry = fine[((mag - kFineLowBits) >> kFineShift) + (bits >> 31) * kFineBuckets]
///   key = (bits ^ (bits >> 31 arithmetic)) & 0xFFFF
///   code = (entry + key) >> 16
/// Signed dynamic map (exp_avg).
const QuantMapTable& signed_dynamic_map();
/// Unsigned dynamic map (exp_avg_sq).
const QuantMapTable& unsigned_dynamic_map();

/// The code of `x` under `map` (Note [Dynamic quantization map]): fine_code of x's bits. Out of
/// line on purpose: the per-ISA kernel TUs use their own copy (Note [Per-ISA namespaces]).
uint8_t quantize_code(const QuantMapTable& map, float x);

}  // namespace roundpipe::optim::detail
