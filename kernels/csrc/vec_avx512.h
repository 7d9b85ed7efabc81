// AVX-512 helpers shared by the C++ CPU ops: 16-lane float32 loads and stores from float32 or
// bfloat16 memory, and a vectorised exp. Only compiled where the target has AVX-512F.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

#include <c10/util/BFloat16.h>

namespace corefleet {

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

inline __m512 load16(const c10::BFloat16* p) {
  // bf16 -> fp32 is exact: widen the 16-bit patterns and shift them into the high half.
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }

inline void store16(c10::BFloat16* p, __m512 v) {
  // Round to nearest even, as c10::BFloat16's constructor does for finite values.
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded =
      _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
}

// exp(x) per lane: x = n ln2 + r with |r| <= ln2 / 2, exp(r) by its degree-6 Taylor
// polynomial (relative error < 2e-7 there), times 2^n via scalef. x is clamped to [-87, 88]:
// below, results flush towards 0 (negligible next to a softmax max or in silu); above, float32
// would overflow.
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // r = x - n ln2, with ln2 split in a high part exact in float and a small correction.
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.f / 720.f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

}  // namespace corefleet

#endif  // __AVX512F__
