// AVX-512F build of the fused Adam kernel (compiled with -mavx512f -mfma -mf16c only here; called
// only after a runtime CPU check, see adam_dispatch.cpp).
#define ROUNDPIPE_ADAM_ISA avx512_isa
#include "optim/detail/adam_kernel_impl.h"
#include "optim/detail/lion_kernel_impl.h"

#include <immintrin.h>

namespace roundpipe::optim::detail {
namespace avx512_isa {
namespace {

struct VecAvx512 {
  static constexpr int kWidth = 16;
  static constexpr uintptr_t kAlignBytes = 64;
  using reg = __m512;
  static reg load(const float* p) { return _mm512_loadu_ps(p); }
  static reg load_half(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static reg load_bf16(const uint16_t* p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
  static void store(float* p, reg x) { _mm512_storeu_ps(p, x); }
  static void stream(float* p, reg x) { _mm512_stream_ps(p, x); }
  static void fence() { _mm_sfence(); }
  static reg set1(float x) { return _mm512_set1_ps(x); }
  static reg add(reg a, reg b) { return _mm512_add_ps(a, b); }
  static reg sub(reg a, reg b) { return _mm512_sub_ps(a, b); }
  static reg mul(reg a, reg b) { return _mm512_mul_ps(a, b); }
  static reg div(reg a, reg b) { return _mm512_div_ps(a, b); }
  static reg sqrt(reg a) { return _mm512_sqrt_ps(a); }
  // NaN-propagating like torch.maximum (and the scalar path): a NaN in either operand wins.
  static reg max(reg a, reg b) {
    const reg m = _mm512_max_ps(a, b);  // b when either is NaN
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q), m, a);
  }
  static reg neg(reg a) {
    return _mm512_castsi512_ps(
        _mm512_xor_si512(_mm512_castps_si512(a), _mm512_set1_epi32(static_cast<int>(0x80000000u))));
  }
  static reg fmadd(reg a, reg b, reg c) { return _mm512_fmadd_ps(a, b, c); }
  static void store_half(uint16_t* dst, reg x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
  }
  static void store_bf16(uint16_t* dst, reg x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtepi32_epi16(r));
  }
  static uint16_t half_from_float(float f) {
    return static_cast<uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT));
  }
  static float float_from_half(uint16_t h) { return _cvtsh_ss(h); }

  // 8-bit states (Note [8-bit Adam states], Note [Fine code lookup]): the *_scalar results, 16
  // elements at a time.

  /// table[idx] for 16 indices < 256, the table in 16 registers: vpermt2ps picks within each
  /// 32-entry slice by the low 5 bits, then bits 5, 6, 7 choose among the 8 slices. A gather
  /// took 2.5x as long on the development machine (AMD EPYC, AVX-512).
  static __m512 lookup256(const __m512 (&t)[16], __m512i idx) {
    const __mmask16 b5 = _mm512_test_epi32_mask(idx, _mm512_set1_epi32(32));
    const __mmask16 b6 = _mm512_test_epi32_mask(idx, _mm512_set1_epi32(64));
    const __mmask16 b7 = _mm512_test_epi32_mask(idx, _mm512_set1_epi32(128));
    const __m512 s01 = _mm512_mask_blend_ps(b5, _mm512_permutex2var_ps(t[0], idx, t[1]), _mm512_permutex2var_ps(t[2], idx, t[3]));
    const __m512 s23 = _mm512_mask_blend_ps(b5, _mm512_permutex2var_ps(t[4], idx, t[5]), _mm512_permutex2var_ps(t[6], idx, t[7]));
    const __m512 s45 = _mm512_mask_blend_ps(b5, _mm512_permutex2var_ps(t[8], idx, t[9]), _mm512_permutex2var_ps(t[10], idx, t[11]));
    const __m512 s67 = _mm512_mask_blend_ps(b5, _mm512_permutex2var_ps(t[12], idx, t[13]), _mm512_permutex2var_ps(t[14], idx, t[15]));
    return _mm512_mask_blend_ps(b7, _mm512_mask_blend_ps(b6, s01, s23), _mm512_mask_blend_ps(b6, s45, s67));
  }

  static void dequantize_block(const uint8_t* codes, float absmax, const QuantMapTable& map, float* out, int64_t n) {
    __m512 t[16];
    for (int k = 0; k < 16; ++k) {
      t[k] = _mm512_loadu_ps(map.values + 16 * k);
    }
    const __m512 scale = _mm512_set1_ps(absmax);
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
      const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + j)));
      _mm512_storeu_ps(out + j, _mm512_mul_ps(lookup256(t, idx), scale));
    }
    dequantize_block_scalar(codes + j, absmax, map, out + j, n - j);
  }

  /// max |x[j]|, j < n, as fold_absmax_scalar.
  static float block_absmax(const float* x, int64_t n) {
    const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF);
    __m512 part = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
      const __m512 a = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(_mm512_loadu_ps(x + j)), abs_mask));
      part = _mm512_max_ps(a, part);  // a > part ? a : part: a NaN |x| leaves part
    }
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, part);
    return fold_absmax_scalar(x + j, n - j, fold_absmax_scalar(lanes, 16, 0.0f));
  }

  /// The codes of 16 scaled values (nearest_code).
  static __m128i codes16(__m512 scaled, const QuantMapTable& map) {
    const __m512i bits = _mm512_castps_si512(scaled);
    const __m512i sign = _mm512_srai_epi32(bits, 31);
    const __m512i low = _mm512_set1_epi32(static_cast<int>(kFineLowBits));
    const __m512i mag = _mm512_min_epu32(_mm512_max_epu32(_mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF)), low),
                                         _mm512_set1_epi32(static_cast<int>(kFineHighBits)));
    const __m512i index = _mm512_add_epi32(_mm512_srli_epi32(_mm512_sub_epi32(mag, low), kFineShift),
                                           _mm512_and_si512(sign, _mm512_set1_epi32(kFineBuckets)));
    const __m512i entry = _mm512_i32gather_epi32(index, map.fine, 4);
    const __m512i key = _mm512_and_si512(_mm512_xor_si512(bits, sign), _mm512_set1_epi32(0xFFFF));
    return _mm512_cvtepi32_epi8(_mm512_srli_epi32(_mm512_add_epi32(entry, key), 16));
  }

  /// Both moments of a block in one loop (7% faster than one after the other: two independent
  /// gathers per iteration).
  static void quantize_pair(const float* m, const float* v, int64_t n, const QuantMapTable& m_map,
                            const QuantMapTable& v_map, uint8_t* m_codes, uint8_t* v_codes, float* m_absmax,
                            float* v_absmax) {
    const float m_max = block_absmax(m, n);
    const float v_max = block_absmax(v, n);
    const float m_inv = inverse_scale(m_max);
    const float v_inv = inverse_scale(v_max);
    const __m512 m_scale = _mm512_set1_ps(m_inv);
    const __m512 v_scale = _mm512_set1_ps(v_inv);
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(m_codes + j), codes16(_mm512_mul_ps(_mm512_loadu_ps(m + j), m_scale), m_map));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(v_codes + j), codes16(_mm512_mul_ps(_mm512_loadu_ps(v + j), v_scale), v_map));
    }
    quantize_scaled_scalar(m + j, n - j, m_inv, m_map, m_codes + j);
    quantize_scaled_scalar(v + j, n - j, v_inv, v_map, v_codes + j);
    *m_absmax = m_max;
    *v_absmax = v_max;
  }
};

}  // namespace
}  // namespace avx512_isa

void adam_update_avx512(const AdamTensor& t, int64_t begin, int64_t end) {
  avx512_isa::adam_update<avx512_isa::VecAvx512>(t, begin, end);
}

void lion_update_avx512(const LionTensor& t, int64_t begin, int64_t end) { avx512_isa::lion_update(t, begin, end); }

}  // namespace roundpipe::optim::detail
