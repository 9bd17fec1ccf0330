#include "optim/detail/quant_map.h"

#include <algorithm>
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
  table.zero_code = quantize_code(table, 0.0f);
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
