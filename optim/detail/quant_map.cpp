#include "optim/detail/quant_map.h"

#include <algorithm>
#include <limits>
#include <vector>

namespace roundpipe::optim::detail {
namespace {

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
  table.zero_code = quantize_code(table, 0.0f);
  return table;
}

}  // namespace

uint8_t quantize_code(const QuantMapTable& map, float x) {
  uint32_t idx = 0;
  for (uint32_t step = 128; step > 0; step >>= 1) {
    idx += map.thresholds[idx + step - 1] < x ? step : 0;
  }
  return static_cast<uint8_t>(idx);
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
