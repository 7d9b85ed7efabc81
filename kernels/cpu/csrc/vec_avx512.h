// AVX-512 helpers shared by the C++ CPU ops: 16-lane float32 loads and stores from float32 or
// bfloat16 memory (the vector forms of scalar.h's widen and store), a vectorised exp, and
// batched horizontal sums. Only compiled where the target has AVX-512F.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

#include <c10/util/BFloat16.h>

namespace corefleet {

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

// 16 bfloat16 bit patterns as float32: exact, each shifted into the high half of its lane.
inline __m512 widen16(__m256i bits) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

inline __m512 load16(const c10::BFloat16* p) {
  return widen16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }

// 16 floats rounded to bfloat16 bit patterns as c10::BFloat16's constructor does: to nearest
// even, and NaN to its quiet NaN (rounding a NaN's bits could carry into the sign).
inline __m256i round_to_bf16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded =
      _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  const __m512i upper =
      _mm512_mask_mov_epi32(_mm512_srli_epi32(rounded, 16), nan, _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(upper);
}

inline void store16(c10::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), round_to_bf16(v));
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

// Lane i of the result is the sum of the 16 lanes of x[i]: sixteen horizontal sums for the
// price of about four. Pairs of inputs are interleaved and added level by level, so the vector
// count halves while each vector holds partial sums of twice as many inputs.
inline __m512 transpose_sum16(const __m512 (&x)[16]) {
  __m512 pairs[8];  // per 128-bit lane: [a02, b02, a13, b13] for inputs a = 2i, b = 2i + 1
  for (int i = 0; i < 8; ++i) {
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(x[2 * i], x[2 * i + 1]),
                             _mm512_unpackhi_ps(x[2 * i], x[2 * i + 1]));
  }
  __m512 quads[4];  // per 128-bit lane j: lane j's sums of inputs 4m .. 4m + 3
  for (int m = 0; m < 4; ++m) {
    const __m512d a = _mm512_castps_pd(pairs[2 * m]);
    const __m512d b = _mm512_castps_pd(pairs[2 * m + 1]);
    quads[m] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // Across the four 128-bit lanes: [L0 + L1, L2 + L3] of two vectors, then the two halves.
  const __m512 q01 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x88),
                                   _mm512_shuffle_f32x4(quads[0], quads[1], 0xDD));
  const __m512 q23 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x88),
                                   _mm512_shuffle_f32x4(quads[2], quads[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(q01, q23, 0x88),
                       _mm512_shuffle_f32x4(q01, q23, 0xDD));
}

// dots[i] = the sum of the 16 lanes of acc[i], for N accumulators, sixteen at a time through
// transpose_sum16. Every accumulator's lanes are added in the same order whatever N and its
// place among them, so a result does not depend on how outputs are grouped into tiles.
template <int N>
inline void reduce_each(const __m512 (&acc)[N], float* dots) {
  for (int base = 0; base < N; base += 16) {
    __m512 group[16];
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) {
      group[i] = base + i < N ? acc[base + i] : _mm512_setzero_ps();
    }
    const int count = N - base < 16 ? N - base : 16;
    _mm512_mask_storeu_ps(dots + base, static_cast<__mmask16>((1u << count) - 1u),
                          transpose_sum16(group));
  }
}

}  // namespace corefleet

#endif  // __AVX512F__
