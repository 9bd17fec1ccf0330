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
};

}  // namespace
}  // namespace avx512_isa

void adam_update_avx512(const AdamTensor& t, int64_t begin, int64_t end) {
  avx512_isa::adam_update<avx512_isa::VecAvx512>(t, begin, end);
}

void lion_update_avx512(const LionTensor& t, int64_t begin, int64_t end) { avx512_isa::lion_update(t, begin, end); }

}  // namespace roundpipe::optim::detail
