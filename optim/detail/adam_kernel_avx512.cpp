// AVX-512F build of the fused Adam kernel (compiled with -mavx512f -mfma -mf16c only here; called
// only after a runtime CPU check, see adam_dispatch.cpp).
#define ROUNDPIPE_ADAM_ISA avx512_isa
#include "optim/detail/adam_kernel_impl.h"
#include "optim/detail/lion_kernel_impl.h"

#include <immintrin.h>

namespace roundpipe::optim::detail {
namespace avx512_isa {
namespace {

// Note [Byte-plane dequantize]: with AVX-512 VBMI, 64 codes are dequantized at a time: the table's
// float bits are held as 4 byte planes of 256 bytes (QuantMapTable::value_bytes), each looked up
// by two 128-entry byte permutes (vpermi2b) and a blend on the code's top bit, and the 4 planes
// interleaved back into 64 floats by 8 unpacks. The unpacks work within 128-bit lanes, so the
// codes are first permuted (one vpermb) such that the 4 resulting vectors hold elements in order.
// 0.052 instead of 0.13 ns per element (cache-resident, 1 thread, AMD EPYC Zen 5); the same bits
// (the looked-up floats are the table's, then the same multiply).

/// Elements whose bytes the unpacks place at byte p = 16 L + 4 r + k (lane L, vector r, dword k)
/// of the planes: the code of element 16 r + 4 L + k goes there.
struct UnpackOrder {
  alignas(64) uint8_t index[64];
  constexpr UnpackOrder() : index{} {
    for (int lane = 0; lane < 4; ++lane) {
      for (int r = 0; r < 4; ++r) {
        for (int k = 0; k < 4; ++k) {
          index[16 * lane + 4 * r + k] = static_cast<uint8_t>(16 * r + 4 * lane + k);
        }
      }
    }
  }
};
constexpr UnpackOrder kUnpackOrder{};

__attribute__((target("avx512f,avx512bw,avx512vbmi"))) __m512i byte_plane(const uint8_t* plane, __m512i codes,
                                                                          __mmask64 high) {
  const __m512i low_half = _mm512_permutex2var_epi8(_mm512_load_si512(plane), codes, _mm512_load_si512(plane + 64));
  const __m512i high_half =
      _mm512_permutex2var_epi8(_mm512_load_si512(plane + 128), codes, _mm512_load_si512(plane + 192));
  return _mm512_mask_blend_epi8(high, low_half, high_half);
}

/// out[j] = map.values[codes[j]] * absmax for whole groups of 64 from 0; returns where it stopped.
__attribute__((target("avx512f,avx512bw,avx512vbmi"))) int64_t dequantize_vbmi(const uint8_t* codes, float absmax,
                                                                               const QuantMapTable& map, float* out,
                                                                               int64_t n) {
  const __m512 scale = _mm512_set1_ps(absmax);
  const __m512i order = _mm512_load_si512(kUnpackOrder.index);
  int64_t j = 0;
  for (; j + 64 <= n; j += 64) {
    const __m512i c = _mm512_permutexvar_epi8(order, _mm512_loadu_si512(codes + j));
    const __mmask64 high = _mm512_movepi8_mask(c);
    const __m512i b0 = byte_plane(map.value_bytes[0], c, high);
    const __m512i b1 = byte_plane(map.value_bytes[1], c, high);
    const __m512i b2 = byte_plane(map.value_bytes[2], c, high);
    const __m512i b3 = byte_plane(map.value_bytes[3], c, high);
    const __m512i w01_low = _mm512_unpacklo_epi8(b0, b1);
    const __m512i w01_high = _mm512_unpackhi_epi8(b0, b1);
    const __m512i w23_low = _mm512_unpacklo_epi8(b2, b3);
    const __m512i w23_high = _mm512_unpackhi_epi8(b2, b3);
    const __m512i f[4] = {_mm512_unpacklo_epi16(w01_low, w23_low), _mm512_unpackhi_epi16(w01_low, w23_low),
                          _mm512_unpacklo_epi16(w01_high, w23_high), _mm512_unpackhi_epi16(w01_high, w23_high)};
    for (int r = 0; r < 4; ++r) {
      _mm512_storeu_ps(out + j + 16 * r, _mm512_mul_ps(_mm512_castsi512_ps(f[r]), scale));
    }
  }
  return j;
}

/// Whether dequantize_block takes dequantize_vbmi.
bool use_vbmi() {
  static const bool kCpuHasVbmi = cpu_has_avx512_vbmi();
  return kCpuHasVbmi && avx512_vbmi_allowed();
}

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
    int64_t j = use_vbmi() ? dequantize_vbmi(codes, absmax, map, out, n) : 0;
    if (j + 16 <= n) {
      __m512 t[16];
      for (int k = 0; k < 16; ++k) {
        t[k] = _mm512_loadu_ps(map.values + 16 * k);
      }
      const __m512 scale = _mm512_set1_ps(absmax);
      for (; j + 16 <= n; j += 16) {
        const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + j)));
        _mm512_storeu_ps(out + j, _mm512_mul_ps(lookup256(t, idx), scale));
      }
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

  /// The codes of 16 scaled values by Note [Fine code lookup] (one gather).
  static __m128i fine_codes16(__m512 scaled, const QuantMapTable& map) {
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

  /// A map's Note [Decade code lookup] tables in registers.
  struct DecadeRegs {
    __m512i slot_lo, slot_hi;
    __m512 bound_lo, bound_hi, scale, offset, top;
    bool is_signed;
    explicit DecadeRegs(const QuantMapTable& map)
        : slot_lo(_mm512_load_si512(map.decades.slot_of_binade)),
          slot_hi(_mm512_load_si512(map.decades.slot_of_binade + 16)),
          bound_lo(_mm512_load_ps(map.decades.boundary_of_binade)),
          bound_hi(_mm512_load_ps(map.decades.boundary_of_binade + 16)),
          scale(_mm512_load_ps(map.decades.scale)),
          offset(_mm512_load_ps(map.decades.offset)),
          top(_mm512_load_ps(map.decades.top)),
          is_signed(map.is_signed) {}
  };

  /// The codes of 16 scaled values (nearest_code) by Note [Decade code lookup]; lanes set in
  /// `*ambiguous` are not (fine_codes16 gives them).
  static __m128i decade_codes16(__m512 scaled, const DecadeRegs& d, __mmask16* ambiguous) {
    const __m512i bits = _mm512_castps_si512(scaled);
    const __m512i abs_bits = _mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF));
    const __m512 a = _mm512_castsi512_ps(abs_bits);
    // The clamped exponent; the permutes read its low 5 bits (the tables are indexed mod 32).
    const __m512i binade = _mm512_min_epi32(
        _mm512_srli_epi32(_mm512_max_epi32(abs_bits, _mm512_set1_epi32(104 << 23)), 23), _mm512_set1_epi32(128));
    const __m512i slot0 = _mm512_permutex2var_epi32(d.slot_lo, binade, d.slot_hi);
    const __m512 bound = _mm512_permutex2var_ps(d.bound_lo, binade, d.bound_hi);
    const __mmask16 above = _mm512_cmp_ps_mask(bound, a, _CMP_LT_OQ);
    const __mmask16 on_bound_or_nan = _mm512_cmp_ps_mask(bound, a, _CMP_EQ_UQ);
    const __m512i slot = _mm512_mask_add_epi32(slot0, above, slot0, _mm512_set1_epi32(1));
    const __m512 f = _mm512_fmadd_ps(a, _mm512_permutexvar_ps(slot, d.scale), _mm512_permutexvar_ps(slot, d.offset));
    const __m512 from_integer =
        _mm512_sub_ps(f, _mm512_roundscale_ps(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    *ambiguous = static_cast<__mmask16>(
        on_bound_or_nan | _mm512_cmp_ps_mask(_mm512_abs_ps(from_integer), _mm512_set1_ps(0x1p-12f), _CMP_LT_OQ));
    const __m512 clamped = _mm512_min_ps(f, _mm512_permutexvar_ps(slot, d.top));
    const __mmask16 negative = _mm512_test_epi32_mask(bits, _mm512_set1_epi32(static_cast<int>(0x80000000u)));
    if (d.is_signed) {
      return _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(_mm512_mask_sub_ps(_mm512_add_ps(clamped, _mm512_set1_ps(127.0f)),
                                                                         negative, _mm512_set1_ps(128.0f), clamped)));
    }
    return _mm512_cvtepi32_epi8(_mm512_maskz_cvttps_epi32(static_cast<__mmask16>(~negative), clamped));
  }

  /// codes[j] = the code of x[j] * scale for j < n16 (a multiple of 16, at most kQuantBlock):
  /// Note [Decade code lookup] for all, then the gather for the vectors with an ambiguous lane
  /// (one branch per block instead of one per vector, which cost a quarter of the step).
  static void quantize_vectors(const float* x, int64_t n16, __m512 scale, const QuantMapTable& map, const DecadeRegs& d,
                               uint8_t* codes) {
    __mmask16 ambiguous[kQuantBlock / 16];
    __mmask16 any = 0;
    for (int64_t j = 0; j < n16; j += 16) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + j),
                       decade_codes16(_mm512_mul_ps(_mm512_loadu_ps(x + j), scale), d, &ambiguous[j / 16]));
      any = static_cast<__mmask16>(any | ambiguous[j / 16]);
    }
    if (any != 0) {
      for (int64_t j = 0; j < n16; j += 16) {
        if (ambiguous[j / 16] != 0) {
          _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + j),
                           fine_codes16(_mm512_mul_ps(_mm512_loadu_ps(x + j), scale), map));
        }
      }
    }
  }

  /// codes[j] = the code of x[j] * inv for j < n (at most kQuantBlock): quantize_vectors, then
  /// quantize_scaled_scalar for the last n % 16.
  static void quantize_scaled(const float* x, int64_t n, float inv, const QuantMapTable& map, const DecadeRegs& d,
                              uint8_t* codes) {
    const int64_t n16 = n - n % 16;
    quantize_vectors(x, n16, _mm512_set1_ps(inv), map, d, codes);
    quantize_scaled_scalar(x + n16, n - n16, inv, map, codes + n16);
  }

  /// Both moments of a block (Note [8-bit Adam states]).
  static void quantize_pair(const float* m, const float* v, int64_t n, const QuantMapTable& m_map,
                            const QuantMapTable& v_map, uint8_t* m_codes, uint8_t* v_codes, float* m_absmax,
                            float* v_absmax) {
    const float m_max = block_absmax(m, n);
    const float v_max = block_absmax(v, n);
    const float m_inv = inverse_scale(m_max);
    const float v_inv = inverse_scale(v_max);
    quantize_scaled(m, n, m_inv, m_map, DecadeRegs(m_map), m_codes);
    quantize_scaled(v, n, v_inv, v_map, DecadeRegs(v_map), v_codes);
    *m_absmax = m_max;
    *v_absmax = v_max;
  }
};

}  // namespace
}  // namespace avx512_isa

void adam_update_avx512(const AdamTensor& t, int64_t begin, int64_t end) {
  avx512_isa::adam_update<avx512_isa::VecAvx512>(t, begin, end);
}

void quantize_scaled_avx512(const float* x, int64_t n, const QuantMapTable& map, uint8_t* codes) {
  using V = avx512_isa::VecAvx512;
  const V::DecadeRegs decades(map);
  for (int64_t lo = 0; lo < n; lo += kQuantBlock) {
    V::quantize_scaled(x + lo, std::min<int64_t>(kQuantBlock, n - lo), 1.0f, map, decades, codes + lo);
  }
}

void lion_update_avx512(const LionTensor& t, int64_t begin, int64_t end) { avx512_isa::lion_update(t, begin, end); }

}  // namespace roundpipe::optim::detail
