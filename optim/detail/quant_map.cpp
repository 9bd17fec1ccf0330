#include "optim/detail/quant_map.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

namespace roundpipe::optim::detail {
namespace {

// Note [Fine code lookup] (quant_map.h).
uint8_t fine_code(const QuantMapTable& map, uint32_t bits) {
  uint32_t mag = bits & 0x7FFFFFFFu;
  mag = mag < kFineLowBits ? kFineLowBits : (mag > kFineHighBits ? kFineHighBits : mag);
  const uint32_t index = ((mag - kFineLowBits) >> kFineShift) + (bits >> 31) * static_cast<uint32_t>(kFineBuckets);
  const uint32_t key = (bits ^ static_cast<uint32_t>(static_cast<int32_t>(bits) >> 31)) & 0xFFFFu;
  const uint32_t entry = map.fine[index];
  return static_cast<uint8_t>((entry + key) >> 16);
}

float float_of(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Note [Decade code lookup]: the tables for the map `table` (thresholds filled in), built by the
// construction below (kScale, n_i values per decade); aborts if the thresholds do not have the
// structure the lookup assumes.
DecadeLookup build_decades(const QuantMapTable& table, bool is_signed, const double (&scales)[7]) {
  DecadeLookup d{};
  const float* t = table.thresholds;
  const int first_positive = is_signed ? 127 : 0;
  const int positives = 255 - first_positive;
  float boundary[8];
  int k = first_positive;  // the boundary below decade i's first value
  for (int i = 0; i < 7; ++i) {
    const int n = is_signed ? 1 << i : 1 << (i + 1);
    const double step = 0.9 / n;
    const int below = k - first_positive + 1;  // thresholds <= the boundary
    boundary[i] = t[k];
    d.scale[1 + i] = static_cast<float>(1.0 / (scales[i] * step));
    d.offset[1 + i] = static_cast<float>(-0.1 / step + below);
    d.top[1 + i] = static_cast<float>(below + n - 1) + 0.5f;
    k += n;
  }
  if (k != 254 || !(t[k] > 0.0f) || !(t[first_positive] > 0.0f) ||
      (first_positive > 0 && t[first_positive - 1] >= 0.0f)) {
    std::abort();
  }
  boundary[7] = t[254];  // between the last decade's largest value and 1
  for (int slot : {0, 8, 9, 10, 11, 12, 13, 14, 15}) {
    d.scale[slot] = 0.0f;
    d.offset[slot] = (slot == 0 ? 0.0f : static_cast<float>(positives)) + 0.5f;  // trunc -> the count, never ambiguous
    d.top[slot] = d.offset[slot];
  }
  // Entry b: the clamped exponent in [104, 128] that is b mod 32 (entries 1..7, exponents
  // 129..135, are never read; they repeat entry 0's).
  for (int b = 0; b < 32; ++b) {
    const int exponent = b >= 8 ? 96 + b : 128;
    const float lo = exponent == 104 ? 0.0f : std::ldexp(1.0f, exponent - 127);
    const float hi = exponent >= 128 ? std::numeric_limits<float>::infinity() : std::ldexp(1.0f, exponent - 126);
    int slot = 0;
    int inside = 0;
    d.boundary_of_binade[b] = std::numeric_limits<float>::infinity();
    for (const float bound : boundary) {
      slot += bound < lo ? 1 : 0;
      if (bound >= lo && bound < hi) {
        d.boundary_of_binade[b] = bound;
        ++inside;
      }
    }
    if (inside > 1) {
      std::abort();
    }
    d.slot_of_binade[b] = slot;
  }
  return d;
}

// Note [Dynamic quantization map]. Compiled with -ffp-contract=off: the Python reference in
// tests/optim/adam_int8_test.cpp performs the same double operations and must get the same bits.
QuantMapTable build(bool is_signed) {
  constexpr double kScale[7] = {1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0};
  std::vector<double> data;
  for (int i = 0; i < 7; ++i) {
    const int fraction_items = is_signed ? (1 << i) + 1 : (1 << (i + 1)) + 1;
    const double start = 0.1;
    const double step = (1.0 - start) / (fraction_items - 1);
    std::vector<double> boundaries(fraction_items);
    for (int k = 0; k < fraction_items; ++k) {
      boundaries[k] = k == fraction_items - 1 ? 1.0 : start + k * step;
    }
    for (int k = 0; k + 1 < fraction_items; ++k) {
      const double mean = (boundaries[k] + boundaries[k + 1]) / 2.0;
      data.push_back(kScale[i] * mean);
      if (is_signed) {
        data.push_back(-(kScale[i] * mean));
      }
    }
  }
  data.push_back(0.0);
  data.push_back(1.0);
  QuantMapTable table{};
  std::vector<float> values(data.begin(), data.end());
  std::sort(values.begin(), values.end());
  // 256 entries by construction (2 * 127 + 2 signed, 254 + 2 unsigned).
  std::copy(values.begin(), values.end(), table.values);
  for (int k = 0; k < 255; ++k) {
    table.thresholds[k] = (table.values[k] + table.values[k + 1]) * 0.5f;
  }
  table.thresholds[255] = std::numeric_limits<float>::infinity();
  const auto count_below = [&](float x) {
    return static_cast<int>(std::lower_bound(table.thresholds, table.thresholds + 256, x) - table.thresholds);
  };
  const auto count_upto = [&](float x) {
    return static_cast<int>(std::upper_bound(table.thresholds, table.thresholds + 256, x) - table.thresholds);
  };
  // Each bucket's magnitudes [lo, hi]: base = #{thresholds < lo} (x >= 0), #{thresholds < -hi}
  // (x < 0); at most one threshold inside.
  const auto bits_of = [](float f) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof(u));
    return u;
  };
  for (int b = 0; b < kFineBuckets; ++b) {
    const uint32_t first = kFineLowBits + (static_cast<uint32_t>(b) << kFineShift);
    const bool end_bucket = b == 0 || b == kFineBuckets - 1;
    const float lo = b == 0 ? 0.0f : float_of(first);
    // The top bucket takes every larger magnitude; thresholds[255..] = inf are not thresholds.
    const float hi = b == kFineBuckets - 1 ? std::numeric_limits<float>::max()
                                           : float_of(first + (1u << kFineShift) - 1);
    for (int negative = 0; negative < 2; ++negative) {
      const int base = negative ? count_below(-hi) : count_below(lo);
      const int inside = negative ? count_upto(-lo) - base : count_upto(hi) - base;
      if (inside > 1 || (inside == 1 && end_bucket)) {
        std::abort();  // a build-time property of the maps and kFineShift
      }
      uint32_t limit = 0xFFFFu;
      if (inside == 1) {
        const uint32_t t = bits_of(table.thresholds[base]) & 0xFFFFu;
        limit = negative ? 0xFFFFu - t : t;
      }
      table.fine[negative * kFineBuckets + b] = (static_cast<uint32_t>(base) << 16) | (0xFFFFu - limit);
    }
  }
  for (int k = 0; k < 256; ++k) {
    const uint32_t bits = bits_of(table.values[k]);
    for (int q = 0; q < 4; ++q) {
      table.value_bytes[q][k] = static_cast<uint8_t>(bits >> (8 * q));
    }
  }
  table.decades = build_decades(table, is_signed, kScale);
  table.zero_code = quantize_code(table, 0.0f);
  table.is_signed = is_signed;
  return table;
}

}  // namespace

uint8_t quantize_code(const QuantMapTable& map, float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return fine_code(map, bits);
}

const QuantMapTable& signed_dynamic_map() {
  static const QuantMapTable table = build(true);
  return table;
}

const QuantMapTable& unsigned_dynamic_map() {
  static const QuantMapTable table = build(false);
  return table;
}

}  // namespace roundpipe::optim::detail
