// AVX2 + FMA + F16C build of the fused Adam kernel (compiled with -mavx2 -mfma -mf16c only here;
// called only after a runtime CPU check, see adam_dispatch.cpp).
#define ROUNDPIPE_ADAM_ISA avx2_isa
#include "optim/detail/adam_kernel_impl.h"
#include "optim/detail/lion_kernel_impl.h"

#include <immintrin.h>

namespace roundpipe::optim::detail {
namespace avx2_isa {
namespace {

struct VecAvx2 {
  static constexpr int kWidth = 8;
  static constexpr uintptr_t kAlignBytes = 32;
  using reg = __m256;
  static reg load(const float* p) { return _mm256_loadu_ps(p); }
  static reg load_half(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static reg load_bf16(const uint16_t* p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  static void store(float* p, reg x) { _mm256_storeu_ps(p, x); }
  static void stream(float* p, reg x) { _mm256_stream_ps(p, x); }
  static void fence() { _mm_sfence(); }
  static reg set1(float x) { return _mm256_set1_ps(x); }
  static reg add(reg a, reg b) { return _mm256_add_ps(a, b); }
  static reg sub(reg a, reg b) { return _mm256_sub_ps(a, b); }
  static reg mul(reg a, reg b) { return _mm256_mul_ps(a, b); }
  static reg div(reg a, reg b) { return _mm256_div_ps(a, b); }
  static reg sqrt(reg a) { return _mm256_sqrt_ps(a); }
  // NaN-propagating like torch.maximum (and the scalar path): a NaN in either operand wins.
  static reg max(reg a, reg b) {
    const reg m = _mm256_max_ps(a, b);  // b when either is NaN
    return _mm256_blendv_ps(m, a, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
  }
  static reg neg(reg a) { return _mm256_xor_ps(a, _mm256_set1_ps(-0.0f)); }
  static reg fmadd(reg a, reg b, reg c) { return _mm256_fmadd_ps(a, b, c); }
  static void store_half(uint16_t* dst, reg x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
  }
  static void store_bf16(uint16_t* dst, reg x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
    // Pack 8 x 32-bit (values < 2^16) into 8 x 16-bit.
    const __m256i packed = _mm256_packus_epi32(r, r);  // per 128-bit lane: r0..r3 r0..r3
    const __m256i ordered = _mm256_permute4x64_epi64(packed, 0x08);  // lanes 0 and 2 to the low half
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm256_castsi256_si128(ordered));
  }
  static uint16_t half_from_float(float f) {
    return static_cast<uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT));
  }
  static float float_from_half(uint16_t h) { return _cvtsh_ss(h); }

  // 8-bit states (Note [8-bit Adam states], Note [Fine code lookup]): the *_scalar results, 8
  // elements at a time, table lookups by gathers.
  static void dequantize_block(const uint8_t* codes, float absmax, const QuantMapTable& map, float* out, int64_t n) {
    const __m256 scale = _mm256_set1_ps(absmax);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
      const __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + j)));
      _mm256_storeu_ps(out + j, _mm256_mul_ps(_mm256_i32gather_ps(map.values, idx, 4), scale));
    }
    dequantize_block_scalar(codes + j, absmax, map, out + j, n - j);
  }

  /// max |x[j]|, j < n, as fold_absmax_scalar.
  static float block_absmax(const float* x, int64_t n) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    __m256 part = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
      part = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(x + j), abs_mask), part);  // a NaN |x| leaves part
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, part);
    return fold_absmax_scalar(x + j, n - j, fold_absmax_scalar(lanes, 8, 0.0f));
  }

  /// Stores the codes of 8 scaled values (nearest_code).
  static void codes8(__m256 scaled, const QuantMapTable& map, uint8_t* out) {
    const __m256i bits = _mm256_castps_si256(scaled);
    const __m256i sign = _mm256_srai_epi32(bits, 31);
    const __m256i low = _mm256_set1_epi32(static_cast<int>(kFineLowBits));
    const __m256i mag = _mm256_min_epu32(_mm256_max_epu32(_mm256_and_si256(bits, _mm256_set1_epi32(0x7FFFFFFF)), low),
                                         _mm256_set1_epi32(static_cast<int>(kFineHighBits)));
    const __m256i index = _mm256_add_epi32(_mm256_srli_epi32(_mm256_sub_epi32(mag, low), kFineShift),
                                           _mm256_and_si256(sign, _mm256_set1_epi32(kFineBuckets)));
    const __m256i entry = _mm256_i32gather_epi32(reinterpret_cast<const int*>(map.fine), index, 4);
    const __m256i key = _mm256_and_si256(_mm256_xor_si256(bits, sign), _mm256_set1_epi32(0xFFFF));
    const __m256i code = _mm256_srli_epi32(_mm256_add_epi32(entry, key), 16);
    const __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(code), _mm256_extracti128_si256(code, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm_packus_epi16(words, words));
  }

  /// Both moments of a block in one loop (two independent gathers per iteration).
  static void quantize_pair(const float* m, const float* v, int64_t n, const QuantMapTable& m_map,
                            const QuantMapTable& v_map, uint8_t* m_codes, uint8_t* v_codes, float* m_absmax,
                            float* v_absmax) {
    const float m_max = block_absmax(m, n);
    const float v_max = block_absmax(v, n);
    const float m_inv = inverse_scale(m_max);
    const float v_inv = inverse_scale(v_max);
    const __m256 m_scale = _mm256_set1_ps(m_inv);
    const __m256 v_scale = _mm256_set1_ps(v_inv);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
      codes8(_mm256_mul_ps(_mm256_loadu_ps(m + j), m_scale), m_map, m_codes + j);
      codes8(_mm256_mul_ps(_mm256_loadu_ps(v + j), v_scale), v_map, v_codes + j);
    }
    quantize_scaled_scalar(m + j, n - j, m_inv, m_map, m_codes + j);
    quantize_scaled_scalar(v + j, n - j, v_inv, v_map, v_codes + j);
    *m_absmax = m_max;
    *v_absmax = v_max;
  }
};

}  // namespace
}  // namespace avx2_isa

void adam_update_avx2(const AdamTensor& t, int64_t begin, int64_t end) {
  avx2_isa::adam_update<avx2_isa::VecAvx2>(t, begin, end);
}

void lion_update_avx2(const LionTensor& t, int64_t begin, int64_t end) { avx2_isa::lion_update(t, begin, end); }

}  // namespace roundpipe::optim::detail
