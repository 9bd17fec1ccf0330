#include "optim/detail/quant_map.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

namespace roundpipe::optim::detail {
namespace {

// The bucket of x's float bits (quant_map.h); the kernel TUs have their own copy.
inline uint32_t lut_bucket(uint32_t bits) {
  uint32_t mag = bits & 0x7FFFFFFFu;
  mag = mag < kLutLowBits ? kLutLowBits : (mag > kLutHighBits ? kLutHighBits : mag);
  return (mag - kLutLowBits) >> (23 - kLutMantissaBits);
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
  for (int k = 255; k < 256 + kLutProbes; ++k) {
    table.thresholds[k] = std::numeric_limits<float>::infinity();
  }
  // Each bucket's magnitudes [lo, hi]: base = #{thresholds < lo} (x >= 0), #{thresholds < -hi}
  // (x < 0); the thresholds inside must fit in kLutProbes.
  const auto count_below = [&](float x) {
    return static_cast<int>(std::lower_bound(table.thresholds, table.thresholds + 256, x) - table.thresholds);
  };
  const auto count_upto = [&](float x) {
    return static_cast<int>(std::upper_bound(table.thresholds, table.thresholds + 256, x) - table.thresholds);
  };
  for (int b = 0; b < kLutBuckets; ++b) {
    const uint32_t first = kLutLowBits + (static_cast<uint32_t>(b) << (23 - kLutMantissaBits));
    const float lo = b == 0 ? 0.0f : float_of(first);
    const float hi = b == kLutBuckets - 1 ? std::numeric_limits<float>::infinity()
                                          : float_of(first + (1u << (23 - kLutMantissaBits)) - 1);
    table.lut[0][b] = static_cast<uint8_t>(count_below(lo));
    table.lut[1][b] = static_cast<uint8_t>(count_below(-hi));
    if (count_upto(hi) - count_below(lo) > kLutProbes || count_upto(-lo) - count_below(-hi) > kLutProbes) {
      std::abort();  // a build-time property of the maps and kLutMantissaBits
    }
  }
  table.zero_code = quantize_code(table, 0.0f);
  return table;
}

}  // namespace

uint8_t quantize_code(const QuantMapTable& map, float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  const uint32_t bucket = lut_bucket(bits);
  const uint32_t base = map.lut[bits >> 31][bucket];
  uint32_t code = base;
  for (int k = 0; k < kLutProbes; ++k) {
    code += static_cast<uint32_t>(map.thresholds[base + k] < x);
  }
  return static_cast<uint8_t>(code);
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
