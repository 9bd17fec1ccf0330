// The body of the fused Adam kernel, included once per ISA translation unit (adam_kernel_*.cpp)
// after that TU defines ROUNDPIPE_ADAM_ISA (a namespace name) and a vector traits type. Everything
// here lives in that per-ISA namespace so the linker can never merge an AVX-512 copy of an inline
// function into the scalar path (see Note [Per-ISA namespaces]).
//
// Note [Per-ISA namespaces]: inline functions compiled with different -m flags in several TUs are
// one entity to the linker, which keeps an arbitrary copy; if it kept the AVX-512 one, a CPU
// without AVX-512 would fault in the "scalar" path. ATen avoids this with its CPU_CAPABILITY
// namespace; we do the same with ROUNDPIPE_ADAM_ISA.
//
// Note [Adam element order]: the operations mirror PyTorch's `_single_tensor_adam` kernel by
// kernel so the results agree to float rounding: lerp_ (ATen's lerp_vec: fma with weight or
// weight-1), mul_ + addcmul_, sqrt / bias_correction2_sqrt + eps, addcdiv_ (value*m/denom).
// Every ISA performs the same IEEE operations in the same order (fma where ATen's vector code
// fuses, explicit std::fma in scalar code, -ffp-contract=off everywhere), so all ISAs produce
// bitwise-identical results. A gradient factor (Adam::scale_next_gradients) multiplies the widened
// gradient first, the one float32 multiply that clip_grad_norm_'s mul_ would have applied to a
// float32 gradient before the step (skipped when the factor is 1, which changes no value).
//
// Note [Streaming stores]: for parameters much larger than the last-level cache, ordinary stores
// make the core read every written line first (write-allocate): 12 extra bytes per parameter on
// top of the 28 the update needs. Non-temporal stores skip that read. They need vector-aligned
// addresses, so the kernel peels scalar elements until `param` is aligned and streams only when
// exp_avg, exp_avg_sq (and max_exp_avg_sq) are then aligned too; the compute copy and small
// tensors (whose lines we want to keep in cache) use ordinary stores. Results are bitwise the same.
//
// Note [8-bit Adam states]: with AdamStateDtype::kInt8 (docs/optimizer.md, "8-bit states"), m and
// v live as one uint8 code per element plus one float absmax per kQuantBlock (256) elements, as
// in bitsandbytes' block-wise 8-bit Adam. Per block: m = signed_map[code] * absmax and v =
// unsigned_map[code] * absmax into two 256-float stack buffers; the fp32 update runs on the block
// exactly as on fp32 states (same vector loop and element order, so p is bitwise what fp32 Adam
// would compute from these m, v); then each buffer's new absmax = max |x| is stored and every
// element re-quantized: code = nearest map value of x * (1 / absmax) (x * 0 when absmax is 0; Note
// [Dynamic quantization map]). Codes and absmax are integers and IEEE float operations, so every
// ISA gives the same bits. Threads split at any element: a range updates the blocks that start in
// it, so each block is updated by exactly one thread.
//
// Note [Kahan-compensated bf16 masters]: with AdamOptions::kahan_sum (docs/optimizer.md, "bf16
// masters with Kahan summation") a parameter may be bfloat16, and its state adds a bf16
// compensation c of the parameter's shape (zero at first). Per element, everything in float32:
//   p = float(p_bf16)                                  (exact)
//   s = (-step_size * m) / denom                       (Note [Adam element order] on p, with
//                                                       float32 or 8-bit moments)
//   u = decoupled weight decay ? (p * (1 - lr*wd) - p) + s : s
//   y = u + float(c_bf16)
//   p_bf16 = bf16(p + y)                               (round to nearest even, NaN -> 0x7FC0)
//   c_bf16 = bf16(y - (float(p_bf16) - p))
// so the part of u that bf16 rounding drops is carried to the next step instead of lost (plain
// bf16 rounding cancels any |u| below half an ulp of p). The moments are computed exactly as for
// a float32 master holding p. Implementation: the unchanged float32 pass runs on blocks of up to
// kQuantBlock widened elements with write_update (it stores u where it would store p; for 8-bit
// states these are the quantization blocks), then kahan_add applies the last three lines with the
// same widening loads and RNE stores as the bf16 compute copy, so every ISA gives the same bits.
// Without kahan_sum (plain bf16 masters, no compensation buffer) the float32 pass updates the
// widened p as it would a float32 master, and the result is rounded to nearest even once:
//   p_bf16 = bf16(float32 Adam step of float(p_bf16))
// i.e. exactly a float32 master that is re-read from its bf16 rounding before every step, which
// is also what torch's fused AdamW computes for bf16 parameters (math in float32, one rounding),
// here with float32 (or 8-bit) moments. Every |update| below half an ulp of p is lost.
#pragma once

#ifndef ROUNDPIPE_ADAM_ISA
#error "define ROUNDPIPE_ADAM_ISA before including adam_kernel_impl.h"
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "optim/detail/adam_kernel.h"

namespace roundpipe::optim::detail::ROUNDPIPE_ADAM_ISA {

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

/// c10::BFloat16's round-to-nearest-even (NaN -> 0x7FC0).
inline uint16_t bf16_from_float(float f) {
  if (std::isnan(f)) {
    return UINT16_C(0x7FC0);
  }
  const uint32_t u = float_bits(f);
  return static_cast<uint16_t>((u + ((u >> 16) & 1u) + UINT32_C(0x7FFF)) >> 16);
}

inline float float_from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

/// bf16 -> float is exact: the bf16 bits are the float's upper half.
inline float float_from_bf16(uint16_t h) { return float_from_bits(static_cast<uint32_t>(h) << 16); }

/// fp16 -> float, exact (the FP16 library's algorithm, as c10::Half uses); for the scalar TU,
/// which has no F16C.
inline float float_from_half_soft(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t sign = w & UINT32_C(0x80000000);
  const uint32_t two_w = w + w;
  const float normalized = float_from_bits((two_w >> 4) + (UINT32_C(0xE0) << 23)) * 0x1.0p-112f;
  const float denormalized = float_from_bits((two_w >> 17) | (UINT32_C(126) << 23)) - 0.5f;
  const uint32_t magnitude = two_w < (UINT32_C(1) << 27) ? float_bits(denormalized) : float_bits(normalized);
  return float_from_bits(sign | magnitude);
}

/// Gradient element i of `t`, widened to float.
template <typename V>
inline float grad_element(const AdamTensor& t, int64_t i) {
  switch (t.grad_dtype) {
    case GradDtype::kHalf:
      return V::float_from_half(static_cast<const uint16_t*>(t.grad)[i]);
    case GradDtype::kBFloat16:
      return float_from_bf16(static_cast<const uint16_t*>(t.grad)[i]);
    case GradDtype::kFloat:
      break;
  }
  return static_cast<const float*>(t.grad)[i];
}

/// One element of Note [Adam element order], scalar. `lerp_coeff`/`lerp_from_grad` come from
/// ATen's lerp: weight < 0.5 ? m + w*(g-m) : g + (w-1)*(g-m).
template <typename V>
inline void adam_element(const AdamTensor& t, int64_t i, float lerp_coeff, bool lerp_from_grad, float beta2,
                         float one_minus_beta2, float neg_step, float bc2_sqrt, float eps) {
  const AdamScalars& s = t.scalars;
  float g = grad_element<V>(t, i);
  if (s.grad_factor != 1.0f) {
    g = g * s.grad_factor;
  }
  if (s.maximize) {
    g = -g;
  }
  const float p0 = t.param[i];
  float p = p0;
  if (s.has_weight_decay) {
    if (s.decoupled) {
      p = p * s.decay_factor;
    } else {
      g = std::fma(p, s.weight_decay, g);
    }
  }
  float m = t.exp_avg[i];
  m = std::fma(lerp_coeff, g - m, lerp_from_grad ? g : m);
  float v = t.exp_avg_sq[i] * beta2;
  v = v + (one_minus_beta2 * g) * g;
  float vd = v;
  if (s.amsgrad) {
    const float old = t.max_exp_avg_sq[i];
    vd = std::isnan(old) ? old : (old > v ? old : v);  // torch.maximum: NaN propagates
    t.max_exp_avg_sq[i] = vd;
  }
  const float denom = std::sqrt(vd) / bc2_sqrt + eps;
  const float step = (neg_step * m) / denom;
  t.exp_avg[i] = m;
  t.exp_avg_sq[i] = v;
  if (t.write_update) {  // Note [Kahan-compensated bf16 masters]: u
    t.param[i] = s.has_weight_decay && s.decoupled ? (p - p0) + step : step;
    return;
  }
  p = p + step;
  t.param[i] = p;
  switch (t.copy_dtype) {
    case CopyDtype::kNone:
      break;
    case CopyDtype::kFloat:
      static_cast<float*>(t.copy)[i] = p;
      break;
    case CopyDtype::kHalf:
      static_cast<uint16_t*>(t.copy)[i] = V::half_from_float(p);
      break;
    case CopyDtype::kBFloat16:
      static_cast<uint16_t*>(t.copy)[i] = bf16_from_float(p);
      break;
  }
}

/// A vector of gradient elements from i on, widened to float.
template <typename V, GradDtype G>
inline typename V::reg load_grad(const AdamTensor& t, int64_t i) {
  if constexpr (G == GradDtype::kHalf) {
    return V::load_half(static_cast<const uint16_t*>(t.grad) + i);
  } else if constexpr (G == GradDtype::kBFloat16) {
    return V::load_bf16(static_cast<const uint16_t*>(t.grad) + i);
  } else {
    return V::load(static_cast<const float*>(t.grad) + i);
  }
}

/// The vector part of `adam_update`: whole vectors from `i` on; returns where it stopped.
template <typename V, bool kStream, GradDtype G>
int64_t adam_vector_loop(const AdamTensor& t, int64_t i, int64_t end, float lerp_coeff, bool lerp_from_grad) {
  const AdamScalars& s = t.scalars;
  using reg = typename V::reg;
  const auto put = [](float* dst, reg x) {
    if constexpr (kStream) {
      V::stream(dst, x);
    } else {
      V::store(dst, x);
    }
  };
  const reg coeff = V::set1(lerp_coeff);
  const reg beta2 = V::set1(s.beta2);
  const reg omb2 = V::set1(s.one_minus_beta2);
  const reg neg_step = V::set1(s.neg_step_size);
  const reg bc2s = V::set1(s.bias_correction2_sqrt);
  const reg eps = V::set1(s.eps);
  const reg wd = V::set1(s.weight_decay);
  const reg decay = V::set1(s.decay_factor);
  const bool scaled = s.grad_factor != 1.0f;
  const reg grad_factor = V::set1(s.grad_factor);
  for (; i + V::kWidth <= end; i += V::kWidth) {
    reg g = load_grad<V, G>(t, i);
    if (scaled) {
      g = V::mul(g, grad_factor);
    }
    if (s.maximize) {
      g = V::neg(g);
    }
    const reg p0 = V::load(t.param + i);
    reg p = p0;
    if (s.has_weight_decay) {
      if (s.decoupled) {
        p = V::mul(p, decay);
      } else {
        g = V::fmadd(p, wd, g);
      }
    }
    reg m = V::load(t.exp_avg + i);
    m = V::fmadd(coeff, V::sub(g, m), lerp_from_grad ? g : m);
    reg v = V::mul(V::load(t.exp_avg_sq + i), beta2);
    v = V::add(v, V::mul(V::mul(omb2, g), g));
    reg vd = v;
    if (s.amsgrad) {
      vd = V::max(V::load(t.max_exp_avg_sq + i), v);
      put(t.max_exp_avg_sq + i, vd);
    }
    const reg denom = V::add(V::div(V::sqrt(vd), bc2s), eps);
    const reg step = V::div(V::mul(neg_step, m), denom);
    put(t.exp_avg + i, m);
    put(t.exp_avg_sq + i, v);
    if (t.write_update) {  // Note [Kahan-compensated bf16 masters]: u
      put(t.param + i, s.has_weight_decay && s.decoupled ? V::add(V::sub(p, p0), step) : step);
      continue;
    }
    p = V::add(p, step);
    put(t.param + i, p);
    switch (t.copy_dtype) {
      case CopyDtype::kNone:
        break;
      case CopyDtype::kFloat:
        V::store(static_cast<float*>(t.copy) + i, p);
        break;
      case CopyDtype::kHalf:
        V::store_half(static_cast<uint16_t*>(t.copy) + i, p);
        break;
      case CopyDtype::kBFloat16:
        V::store_bf16(static_cast<uint16_t*>(t.copy) + i, p);
        break;
    }
  }
  return i;
}

/// The vector loop for the gradient dtype of `t`.
template <typename V, bool kStream>
int64_t adam_vector_loop_any(const AdamTensor& t, int64_t i, int64_t end, float lerp_coeff, bool lerp_from_grad) {
  switch (t.grad_dtype) {
    case GradDtype::kHalf:
      return adam_vector_loop<V, kStream, GradDtype::kHalf>(t, i, end, lerp_coeff, lerp_from_grad);
    case GradDtype::kBFloat16:
      return adam_vector_loop<V, kStream, GradDtype::kBFloat16>(t, i, end, lerp_coeff, lerp_from_grad);
    case GradDtype::kFloat:
      break;
  }
  return adam_vector_loop<V, kStream, GradDtype::kFloat>(t, i, end, lerp_coeff, lerp_from_grad);
}

/// The kernel. `V` provides: kWidth (0 = no vector loop), kAlignBytes, reg, load, load_half and
/// load_bf16 (widening loads), store, stream (non-temporal store), fence, set1, add, sub, mul,
/// div, sqrt, max (NaN-propagating, b on ties), neg, fmadd(a, b, c) = a*b + c, store_half,
/// store_bf16; static half_from_float / float_from_half for scalar elements; and for 8-bit states
/// dequantize_block (as dequantize_block_scalar) and quantize_pair (quantize_block_scalar of m and
/// of v, their absmax stored through the two pointers).
template <typename V>
void adam_update_fp32(const AdamTensor& t, int64_t begin, int64_t end) {
  const AdamScalars& s = t.scalars;
  const float w = s.lerp_weight;
  const bool lerp_from_grad = !(std::fabs(w) < 0.5f);
  const float lerp_coeff = lerp_from_grad ? w - 1.0f : w;
  int64_t i = begin;
  if constexpr (V::kWidth > 0) {
    bool stream = false;
    if (t.streaming_stores) {
      const auto apart = [&](const float* other) {
        return other == nullptr ||
               (reinterpret_cast<uintptr_t>(other) - reinterpret_cast<uintptr_t>(t.param)) % V::kAlignBytes == 0;
      };
      stream = reinterpret_cast<uintptr_t>(t.param) % sizeof(float) == 0 && apart(t.exp_avg) && apart(t.exp_avg_sq) &&
               apart(t.max_exp_avg_sq);
      for (; stream && i < end && reinterpret_cast<uintptr_t>(t.param + i) % V::kAlignBytes != 0; ++i) {
        adam_element<V>(t, i, lerp_coeff, lerp_from_grad, s.beta2, s.one_minus_beta2, s.neg_step_size,
                        s.bias_correction2_sqrt, s.eps);
      }
    }
    if (stream) {
      i = adam_vector_loop_any<V, true>(t, i, end, lerp_coeff, lerp_from_grad);
      V::fence();
    } else {
      i = adam_vector_loop_any<V, false>(t, i, end, lerp_coeff, lerp_from_grad);
    }
  }
  for (; i < end; ++i) {
    adam_element<V>(t, i, lerp_coeff, lerp_from_grad, s.beta2, s.one_minus_beta2, s.neg_step_size,
                    s.bias_correction2_sqrt, s.eps);
  }
}

/// out[j] = map.values[codes[j]] * absmax for j < n (Note [8-bit Adam states]); the scalar
/// version, and the vector ones' tail.
inline void dequantize_block_scalar(const uint8_t* codes, float absmax, const QuantMapTable& map, float* out,
                                    int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    out[j] = map.values[codes[j]] * absmax;
  }
}

/// Note [Fine code lookup] (quant_map.h), this ISA's copy: the code of the float with bits `bits`.
inline uint8_t nearest_code(const QuantMapTable& map, uint32_t bits) {
  uint32_t mag = bits & 0x7FFFFFFFu;
  mag = mag < kFineLowBits ? kFineLowBits : (mag > kFineHighBits ? kFineHighBits : mag);
  const uint32_t index = ((mag - kFineLowBits) >> kFineShift) + (bits >> 31) * static_cast<uint32_t>(kFineBuckets);
  const uint32_t key = (bits ^ static_cast<uint32_t>(static_cast<int32_t>(bits) >> 31)) & 0xFFFFu;
  const uint32_t entry = map.fine[index];
  return static_cast<uint8_t>((entry + key) >> 16);
}

/// max |x[j]| over j < n folded into `absmax` as `absmax < |x| ? |x| : absmax` (NaN ignored); the
/// maximum is one value whatever the order, so the vector versions may fold in any order.
inline float fold_absmax_scalar(const float* x, int64_t n, float absmax) {
  for (int64_t j = 0; j < n; ++j) {
    const float a = std::fabs(x[j]);
    absmax = absmax < a ? a : absmax;
  }
  return absmax;
}

/// 1 / absmax, or 0 for an all-zero block (its codes become the code of 0).
inline float inverse_scale(float absmax) { return absmax > 0.0f ? 1.0f / absmax : 0.0f; }

/// codes[j] = code of x[j] * inv for j < n.
inline void quantize_scaled_scalar(const float* x, int64_t n, float inv, const QuantMapTable& map, uint8_t* codes) {
  for (int64_t j = 0; j < n; ++j) {
    codes[j] = nearest_code(map, float_bits(x[j] * inv));
  }
}

/// Quantizes x[0, n) into `codes`; returns the block's absmax (Note [8-bit Adam states]). Scalar.
inline float quantize_block_scalar(const float* x, int64_t n, const QuantMapTable& map, uint8_t* codes) {
  const float absmax = fold_absmax_scalar(x, n, 0.0f);
  quantize_scaled_scalar(x, n, inverse_scale(absmax), map, codes);
  return absmax;
}

/// Bytes of one element of the gradient / compute copy.
inline int64_t grad_bytes(GradDtype d) { return d == GradDtype::kFloat ? 4 : 2; }
inline int64_t copy_bytes(CopyDtype d) { return d == CopyDtype::kFloat ? 4 : 2; }

/// dst[j] = float(src[j]) for j < n (bf16 bits to float, exact).
template <typename V>
void widen_bf16(const uint16_t* src, float* dst, int64_t n) {
  int64_t j = 0;
  if constexpr (V::kWidth > 0) {
    for (; j + V::kWidth <= n; j += V::kWidth) {
      V::store(dst + j, V::load_bf16(src + j));
    }
  }
  for (; j < n; ++j) {
    dst[j] = float_from_bf16(src[j]);
  }
}

/// Note [Kahan-compensated bf16 masters]: adds the updates u[0, n) to the bf16 master `p` with
/// compensation `c` (both n elements, bf16 bits).
template <typename V>
void kahan_add(const float* u, uint16_t* p, uint16_t* c, int64_t n) {
  int64_t j = 0;
  if constexpr (V::kWidth > 0) {
    for (; j + V::kWidth <= n; j += V::kWidth) {
      const typename V::reg old = V::load_bf16(p + j);
      const typename V::reg y = V::add(V::load(u + j), V::load_bf16(c + j));
      V::store_bf16(p + j, V::add(old, y));
      V::store_bf16(c + j, V::sub(y, V::sub(V::load_bf16(p + j), old)));
    }
  }
  for (; j < n; ++j) {
    const float old = float_from_bf16(p[j]);
    const float y = u[j] + float_from_bf16(c[j]);
    p[j] = bf16_from_float(old + y);
    c[j] = bf16_from_float(y - (float_from_bf16(p[j]) - old));
  }
}

/// Plain bf16 masters (Note [Kahan-compensated bf16 masters], last paragraph): rounds the updated
/// widened weights p32[0, n) into the bf16 master `p`.
template <typename V>
void narrow_bf16(const float* p32, uint16_t* p, int64_t n) {
  int64_t j = 0;
  if constexpr (V::kWidth > 0) {
    for (; j + V::kWidth <= n; j += V::kWidth) {
      V::store_bf16(p + j, V::load(p32 + j));
    }
  }
  for (; j < n; ++j) {
    p[j] = bf16_from_float(p32[j]);
  }
}

/// Finishes a bf16 master's block after adam_update_fp32 ran on element_block's `widened`: Kahan
/// addition of the updates, or the rounding of the new weights without compensation.
template <typename V>
void finish_bf16_block(const AdamTensor& t, const float* widened, int64_t lo, int64_t n) {
  if (t.compensation != nullptr) {
    kahan_add<V>(widened, t.param_bf16 + lo, t.compensation + lo, n);
  } else {
    narrow_bf16<V>(widened, t.param_bf16 + lo, n);
  }
}

/// Elements [lo, lo + n) of `t` as a tensor of their own for adam_update_fp32 (moments and
/// gradient offset; the caller may point the moments elsewhere). A bf16 master is widened into
/// `widened` (n floats), which that pass overwrites with the updates u (Note [Kahan-compensated
/// bf16 masters]), or without compensation with the new float32 weights; a float32 master is
/// updated in place.
template <typename V>
AdamTensor element_block(const AdamTensor& t, int64_t lo, int64_t n, float* widened) {
  const auto at = [lo](float* x) { return x == nullptr ? nullptr : x + lo; };
  AdamTensor block = t;
  block.grad = static_cast<const char*>(t.grad) + lo * grad_bytes(t.grad_dtype);
  block.exp_avg = at(t.exp_avg);
  block.exp_avg_sq = at(t.exp_avg_sq);
  block.max_exp_avg_sq = at(t.max_exp_avg_sq);
  block.copy = t.copy == nullptr ? nullptr : static_cast<char*>(t.copy) + lo * copy_bytes(t.copy_dtype);
  block.numel = n;
  block.streaming_stores = false;
  block.quantized = QuantizedMoments{};
  if (t.param_bf16 != nullptr) {
    widen_bf16<V>(t.param_bf16 + lo, widened, n);
    block.param = widened;
    block.param_bf16 = nullptr;
    block.compensation = nullptr;
    block.write_update = t.compensation != nullptr;
  } else {
    block.param = at(t.param);
  }
  return block;
}

/// Note [8-bit Adam states]: updates the blocks of `t` that start in [begin, end).
template <typename V>
void adam_update_quantized(const AdamTensor& t, int64_t begin, int64_t end) {
  const QuantizedMoments& q = t.quantized;
  alignas(64) float m[kQuantBlock];
  alignas(64) float v[kQuantBlock];
  alignas(64) float u[kQuantBlock];
  const int64_t first = (begin + kQuantBlock - 1) / kQuantBlock;
  const int64_t last = (end + kQuantBlock - 1) / kQuantBlock;
  for (int64_t b = first; b < last; ++b) {
    const int64_t lo = b * kQuantBlock;
    const int64_t n = std::min<int64_t>(kQuantBlock, t.numel - lo);
    V::dequantize_block(q.exp_avg_codes + lo, q.exp_avg_absmax[b], *q.exp_avg_map, m, n);
    V::dequantize_block(q.exp_avg_sq_codes + lo, q.exp_avg_sq_absmax[b], *q.exp_avg_sq_map, v, n);
    AdamTensor block = element_block<V>(t, lo, n, u);
    block.exp_avg = m;
    block.exp_avg_sq = v;
    block.max_exp_avg_sq = nullptr;
    adam_update_fp32<V>(block, 0, n);
    if (t.param_bf16 != nullptr) {
      finish_bf16_block<V>(t, u, lo, n);
    }
    V::quantize_pair(m, v, n, *q.exp_avg_map, *q.exp_avg_sq_map, q.exp_avg_codes + lo, q.exp_avg_sq_codes + lo,
                     q.exp_avg_absmax + b, q.exp_avg_sq_absmax + b);
  }
}

/// Note [Kahan-compensated bf16 masters] (with or without compensation) with float32 moments:
/// elements [begin, end), in blocks of kQuantBlock from `begin` (results are per element, so they
/// do not depend on where ranges split).
template <typename V>
void adam_update_bf16(const AdamTensor& t, int64_t begin, int64_t end) {
  alignas(64) float u[kQuantBlock];
  for (int64_t lo = begin; lo < end; lo += kQuantBlock) {
    const int64_t n = std::min<int64_t>(kQuantBlock, end - lo);
    adam_update_fp32<V>(element_block<V>(t, lo, n, u), 0, n);
    finish_bf16_block<V>(t, u, lo, n);
  }
}

template <typename V>
void adam_update(const AdamTensor& t, int64_t begin, int64_t end) {
  if (t.quantized.exp_avg_codes != nullptr) {
    adam_update_quantized<V>(t, begin, end);
  } else if (t.param_bf16 != nullptr) {
    adam_update_bf16<V>(t, begin, end);
  } else {
    adam_update_fp32<V>(t, begin, end);
  }
}

}  // namespace roundpipe::optim::detail::ROUNDPIPE_ADAM_ISA
