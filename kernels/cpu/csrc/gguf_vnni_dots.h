// The integer GGUF linear's inner loop: one packed tile of 16 weight rows (gguf_vnni_layout.h)
// against MB quantized x rows (gguf_vnni_quantize.h), over all K.
//
// Per block of 32 values and x row m: an int32 dot of each tile row with x row m's int8 values,
// vpdpbusd (unsigned weight byte x signed activation byte, four products per 32-bit lane)
// eight times with x's four bytes broadcast to every lane, from -offset * sum(x_q) (the
// weight's offset taken back in int32, exactly); then, in float32,
//     acc[m] += float(dot) * (d_w * d_x)          (+ m_w * (d_x * sum(x_q)) for Q4_1)
// one fused multiply-add per block, blocks in K order. Every decoded weight vector meets all MB
// x rows while it is in a register, so a GEMM reads each weight tile once per MB rows.
//
// The portable form (builds without AVX512-VNNI) computes the same sums one row at a time; the
// backend does not route work there (it packs weights only where the VNNI build is loaded), the
// tests do.
#pragma once

#include "gguf_blocks.h"
#include "gguf_vnni_layout.h"
#include "gguf_vnni_quantize.h"

#include <cstdint>
#include <cstring>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define COREFLEET_GGUF_VNNI 1
#endif

namespace corefleet {
namespace vnni {

constexpr int64_t kPrefetchBytes = 2048;  // how far ahead of the tile stream to prefetch

#if defined(COREFLEET_GGUF_VNNI)
inline __m512i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// acc[m][0..15] += the float32 dots of tile rows 0..15 with x rows m0..m0+MB-1, over blocks
// [b0, b1) in order.
template <typename F, int MB>
inline void tile_dots(const uint8_t* tile, const QuantizedX& x, int64_t m0, int64_t b0,
                      int64_t b1, __m512* acc) {
  using P = Packed<F>;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const int8_t* xq = x.q + m0 * x.k;
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* blk = tile + b * kTileBlockBytes<F>;
    for (int64_t off = 0; off < kTileBlockBytes<F>; off += 64) {
      __builtin_prefetch(blk + kPrefetchBytes + off, 0, 3);
    }
    // Each int32 dot starts at -offset * sum(x_q): the weight's offset taken back exactly,
    // with no subtraction after the products.
    // With one or two x rows, each row's products go to two int32 chains (even and odd
    // vectors), added at the end: eight dependent vpdpbusd a block would be latency-bound.
    constexpr int kChains = MB <= 2 ? 2 : 1;
    __m512i dot[MB * kChains];
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) {
      dot[m] = P::kOffset != 0 ? _mm512_set1_epi32(-x.corr[(m0 + m) * x.nb + b])
                               : _mm512_setzero_si512();
      if constexpr (kChains == 2) dot[MB + m] = _mm512_setzero_si512();
    }
    const uint8_t* quants = blk + P::kScaleBytes;
    const int8_t* xb = xq + 32 * b;
    if constexpr (P::kQuantBytes == 512) {  // Q8_0: vector g holds values 4g..4g+3
#pragma GCC unroll 8
      for (int g = 0; g < 8; ++g) {
        const __m512i w = _mm512_loadu_si512(quants + 64 * g);
#pragma GCC unroll 8
        for (int m = 0; m < MB; ++m) {
          const int chain = kChains == 2 && g % 2 ? MB + m : m;
          dot[chain] = _mm512_dpbusd_epi32(dot[chain], w, broadcast4(xb + m * x.k + 4 * g));
        }
      }
    } else {  // nibbles: vector c holds values 4c.. (low) and 16+4c.. (high)
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        const __m512i v = _mm512_loadu_si512(quants + 64 * c);
        const __m512i lo = _mm512_and_si512(v, low4);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
#pragma GCC unroll 8
        for (int m = 0; m < MB; ++m) {
          const int odd = kChains == 2 ? MB + m : m;
          dot[m] = _mm512_dpbusd_epi32(dot[m], lo, broadcast4(xb + m * x.k + 4 * c));
          dot[odd] = _mm512_dpbusd_epi32(dot[odd], hi, broadcast4(xb + m * x.k + 16 + 4 * c));
        }
      }
    }
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)));
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) {
      const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(x.d[(m0 + m) * x.nb + b]));
      const __m512i exact = kChains == 2 ? _mm512_add_epi32(dot[m], dot[MB + m]) : dot[m];
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), scale, acc[m]);
    }
    if constexpr (P::kMins) {
      const __m512 mw =
          _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32)));
#pragma GCC unroll 8
      for (int m = 0; m < MB; ++m) {
        acc[m] = _mm512_fmadd_ps(mw, _mm512_set1_ps(x.dsum[(m0 + m) * x.nb + b]), acc[m]);
      }
    }
  }
}
#endif

// The same sums, one tile row and x row at a time: acc[m * 16 + r] (portable builds).
template <typename F>
void tile_dots_scalar(const uint8_t* tile, const QuantizedX& x, int64_t m0, int64_t mb,
                      int64_t b0, int64_t b1, float* acc) {
  using P = Packed<F>;
  uint8_t file_block[F::kBytes];
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* blk = tile + b * kTileBlockBytes<F>;
    for (int64_t r = 0; r < kTileRows; ++r) {
      unpack_block<F>(blk, r, file_block);
      const float dw = gguf::f16(file_block);
      const float mw = P::kMins ? gguf::f16(file_block + 2) : 0.f;
      const uint8_t* q = file_block + (F::kBytes - P::kQuantBytes / kTileRows);
      for (int64_t m = 0; m < mb; ++m) {
        const int8_t* xb = x.q + (m0 + m) * x.k + 32 * b;
        int32_t dot = 0;
        for (int j = 0; j < 32; ++j) {
          int32_t w;
          if constexpr (P::kQuantBytes == 512) {
            w = static_cast<int8_t>(q[j]) + 128;  // the packed unsigned byte
          } else {
            w = j < 16 ? (q[j] & 0x0F) : (q[j - 16] >> 4);
          }
          dot += w * xb[j];
        }
        const int64_t xi = (m0 + m) * x.nb + b;
        if (P::kOffset != 0) dot -= x.corr[xi];
        float& out = acc[m * kTileRows + r];
        out = static_cast<float>(dot) * (dw * x.d[xi]) + out;
        if (P::kMins) out = mw * x.dsum[xi] + out;
      }
    }
  }
}

}  // namespace vnni
}  // namespace corefleet
