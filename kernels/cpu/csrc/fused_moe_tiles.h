// fused_moe's register tiles: dot products of a few weight rows (float32 or bfloat16) with a
// few float32 or bfloat16 activation rows, the weights streamed once. fused_moe_cpu.cpp says
// how the op uses them and why.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <c10/util/BFloat16.h>

#include "scalar.h"
#include "vec_avx512.h"

#include <cstdint>
#include <type_traits>

namespace corefleet {
namespace moe_tiles {

constexpr int64_t kLanes = 16;  // floats per vector
constexpr int kTileRows = 8;    // weight rows streamed together

#if defined(__AVX512F__)
inline __mmask16 first_lanes(int64_t n) { return static_cast<__mmask16>((1u << n) - 1u); }

inline __m512 load16_first(const float* p, int64_t n) {
  return _mm512_maskz_loadu_ps(first_lanes(n), p);
}

inline __m512 load16_first(const c10::BFloat16* p, int64_t n) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  return widen16(_mm256_maskz_loadu_epi16(first_lanes(n), p));
#else
  float tmp[kLanes] = {};
  for (int64_t i = 0; i < n; ++i) tmp[i] = widen(p[i]);
  return _mm512_loadu_ps(tmp);
#endif
}

// dots[j * R + r] = <w[r * k ...], x[j * k ...]> for R adjacent weight rows and MM float32
// activation rows, both k long (any k: the last partial vector is loaded masked). R and MM are
// template parameters so the R * MM accumulators stay in registers; each weight vector is
// loaded once for all MM rows.
template <typename W, int R, int MM>
inline void tile_dots(const W* w, int64_t k, const float* x, float* dots) {
  __m512 acc[R * MM];
#pragma GCC unroll 32
  for (int q = 0; q < R * MM; ++q) acc[q] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + kLanes <= k; i += kLanes) {
    __m512 xv[MM];
#pragma GCC unroll 4
    for (int j = 0; j < MM; ++j) xv[j] = _mm512_loadu_ps(x + j * k + i);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 wv = load16(w + r * k + i);
#pragma GCC unroll 4
      for (int j = 0; j < MM; ++j) acc[j * R + r] = _mm512_fmadd_ps(wv, xv[j], acc[j * R + r]);
    }
  }
  if (i < k) {
    const int64_t rest = k - i;
    for (int r = 0; r < R; ++r) {
      const __m512 wv = load16_first(w + r * k + i, rest);
      for (int j = 0; j < MM; ++j) {
        acc[j * R + r] = _mm512_fmadd_ps(wv, load16_first(x + j * k + i, rest), acc[j * R + r]);
      }
    }
  }
  reduce_each(acc, dots);
}

#if defined(__AVX512BF16__)
// bfloat16 weights against bfloat16 rows without widening either: vdpbf16ps multiplies 16
// pairs exactly in float32 and adds both products to a lane, half the instructions of
// widen-and-FMA. Denormal inputs count as zero, as the instruction defines; k % 32 == 0.
template <int R, int MM>
inline void tile_dots_pairs(const c10::BFloat16* w, int64_t k, const c10::BFloat16* x,
                            float* dots) {
  __m512 acc[R * MM];
#pragma GCC unroll 32
  for (int q = 0; q < R * MM; ++q) acc[q] = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; i += 2 * kLanes) {
    __m512bh xv[MM];
#pragma GCC unroll 4
    for (int j = 0; j < MM; ++j) xv[j] = (__m512bh)_mm512_loadu_si512(x + j * k + i);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + r * k + i);
#pragma GCC unroll 4
      for (int j = 0; j < MM; ++j) acc[j * R + r] = _mm512_dpbf16_ps(acc[j * R + r], wv, xv[j]);
    }
  }
  reduce_each(acc, dots);
}
#endif
#else
// Portable version: fixed-width independent partial sums, which GCC vectorises at -O3.
template <typename W, int R, int MM>
inline void tile_dots(const W* w, int64_t k, const float* x, float* dots) {
  for (int q = 0; q < R * MM; ++q) {  // q = j * R + r
    const W* row = w + (q % R) * k;
    const float* xr = x + (q / R) * k;
    float partial[kLanes] = {};
    int64_t i = 0;
    for (; i + kLanes <= k; i += kLanes) {
      for (int64_t l = 0; l < kLanes; ++l) partial[l] += widen(row[i + l]) * xr[i + l];
    }
    float sum = 0.f;
    for (int64_t l = 0; l < kLanes; ++l) sum += partial[l];
    for (; i < k; ++i) sum += widen(row[i]) * xr[i];
    dots[q] = sum;
  }
}
#endif

// out[j * ldo + r] = <w row r, x row j> for R adjacent weight rows and all n rows of x, three x
// rows per pass (R * 3 accumulators, the x and weight vectors fit the 32 AVX-512 registers).
// X is float (rows widened) or, on the bfloat16-pairs path, bfloat16.
template <typename W, typename X, int R>
void tile_all_rows(const W* w, int64_t k, const X* x, int64_t n, float* out, int64_t ldo) {
  float dots[R * 3];
  auto tile = [&](auto mm, int64_t j0) {
    constexpr int MM = decltype(mm)::value;
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<X, c10::BFloat16>) {
      tile_dots_pairs<R, MM>(w, k, x + j0 * k, dots);
    } else {
      tile_dots<W, R, MM>(w, k, x + j0 * k, dots);
    }
#else
    tile_dots<W, R, MM>(w, k, x + j0 * k, dots);
#endif
    for (int j = 0; j < MM; ++j) {
      for (int r = 0; r < R; ++r) out[(j0 + j) * ldo + r] = dots[j * R + r];
    }
  };
  int64_t j = 0;
  for (; j + 3 <= n; j += 3) tile(std::integral_constant<int, 3>{}, j);
  if (n - j == 2) tile(std::integral_constant<int, 2>{}, j);
  if (n - j == 1) tile(std::integral_constant<int, 1>{}, j);
}

// out[j * ldo + (r - r0)] = <w row r, x row j> for weight rows [r0, r1), in tiles of kTileRows
// adjacent rows (and one smaller tile for the rest).
template <typename W, typename X>
void band_dots(const W* w, int64_t r0, int64_t r1, int64_t k, const X* x, int64_t n, float* out,
               int64_t ldo) {
  int64_t r = r0;
  for (; r + kTileRows <= r1; r += kTileRows) {
    tile_all_rows<W, X, kTileRows>(w + r * k, k, x, n, out + (r - r0), ldo);
  }
  const W* wr = w + r * k;
  float* o = out + (r - r0);
  switch (r1 - r) {
    case 7: tile_all_rows<W, X, 7>(wr, k, x, n, o, ldo); break;
    case 6: tile_all_rows<W, X, 6>(wr, k, x, n, o, ldo); break;
    case 5: tile_all_rows<W, X, 5>(wr, k, x, n, o, ldo); break;
    case 4: tile_all_rows<W, X, 4>(wr, k, x, n, o, ldo); break;
    case 3: tile_all_rows<W, X, 3>(wr, k, x, n, o, ldo); break;
    case 2: tile_all_rows<W, X, 2>(wr, k, x, n, o, ldo); break;
    case 1: tile_all_rows<W, X, 1>(wr, k, x, n, o, ldo); break;
    default: break;
  }
}

}  // namespace moe_tiles
}  // namespace corefleet
