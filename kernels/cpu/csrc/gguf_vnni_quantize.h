// Activations quantized for the integer GGUF linear: each row of x [M, K] in blocks of 32
// values, each block to int8 with one float32 scale (llama.cpp's Q8_0 activation scheme, with a
// float32 scale where Q8_0 stores float16):
//
//   d = max|x| / 127     q = round_half_even(x * (1 / d))  in [-127, 127]    (d = 0: q = 0)
//
// and, per block, what the weight's format needs to take its offset back (gguf_vnni_layout.h):
// corr = offset * sum(q) (int32; Q4_0: 8, Q8_0: 128) and dsum = d * sum(q) (float32; Q4_1's
// m * sum(x)). Done once per call, before the threads share it. The torch reference
// (kernels/gguf_vnni_reference.py) computes the same values bit for bit: the same float32
// division, reciprocal, product and rounding.
#pragma once

#include <c10/util/BFloat16.h>

#include "scalar.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>

#include "vec_avx512.h"
#endif

namespace corefleet {
namespace vnni {

// One call's quantized activations: M rows of K values, nb = K / 32 blocks a row.
struct QuantizedX {
  const int8_t* q;     // [M, K]
  const float* d;      // [M, nb]
  const int32_t* corr; // [M, nb] offset * sum(q)
  const float* dsum;   // [M, nb] d * sum(q)
  int64_t m, k, nb;
};

// The scale of a block whose largest magnitude is `amax`, and the multiplier that quantizes it.
inline void block_scale(float amax, float* d, float* inv) {
  *d = amax / 127.f;
  *inv = *d != 0.f ? 1.f / *d : 0.f;
}

// Row `x` (K values) into q, d, corr, dsum (its row of each).
template <typename T>
void quantize_row(const T* x, int64_t k, int32_t offset, int8_t* q, float* d, int32_t* corr,
                  float* dsum) {
  for (int64_t b = 0; b < k / 32; ++b) {
    const T* xb = x + 32 * b;
    int8_t* qb = q + 32 * b;
    int32_t sum = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    const __m512 lo = load16(xb), hi = load16(xb + 16);
    const float amax = _mm512_reduce_max_ps(
        _mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    float inv;
    block_scale(amax, d + b, &inv);
    const __m512 scale = _mm512_set1_ps(inv);
    // Rounded to nearest even (the MXCSR default), as torch.round.
    const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, scale));
    const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, scale));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qb), _mm512_cvtsepi32_epi8(qlo));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + 16), _mm512_cvtsepi32_epi8(qhi));
    sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
#else
    float amax = 0.f;
    for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(widen(xb[i])));
    float inv;
    block_scale(amax, d + b, &inv);
    for (int i = 0; i < 32; ++i) {
      const auto v = static_cast<int32_t>(std::nearbyint(widen(xb[i]) * inv));
      qb[i] = static_cast<int8_t>(std::clamp(v, -127, 127));
      sum += qb[i];
    }
#endif
    corr[b] = offset * sum;
    dsum[b] = d[b] * static_cast<float>(sum);
  }
}

}  // namespace vnni
}  // namespace corefleet
