// gguf_linear's inner loops (AVX-512): a tile of R quantized weight rows against MM x rows.
// gguf_linear_cpu.cpp says how they are combined and why.
//
// X, the x rows' element type, picks the multiply:
//   float          x rows float32; the weights' float32 vectors multiplied by FMA.
//   c10::BFloat16  x rows bfloat16 as given (AVX512-BF16 only); each two weight vectors rounded
//                  to one vector of 32 bfloat16 (vcvtne2ps2bf16, to nearest even: the
//                  values the reference's .to(torch.bfloat16) gives) and multiplied in pairs
//                  by vdpbf16ps, exact products summed in float32: half the instructions of
//                  widening x.
// Every function makes an output's products in K order into one 16-lane accumulator, so the
// in-register and decoded-tile paths give the same bits.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

#include <c10/util/BFloat16.h>

#include "gguf_blocks.h"
#include "gguf_blocks_avx512.h"
#include "vec_avx512.h"

#include <cstdint>
#include <type_traits>

namespace corefleet {
namespace gguf_tiles {

constexpr int64_t kLanes = 16;            // floats per partial-sum vector
constexpr int64_t kPrefetchBytes = 2048;  // how far ahead of each row's stream to prefetch
// K values a decoded tile holds: 8 rows of 2 KiB (512 floats, 1024 bfloat16), 16 KiB of L1.
// Longer chunks amortise the accumulators' trip through memory between chunks.
template <typename X>
constexpr int64_t kChunk = 2048 / static_cast<int64_t>(sizeof(X));
// Row stride (elements) of the decoded tile and of x on that path: 64 bytes more than the row,
// so that rows a power of two apart do not all map to the same L1 sets.
template <typename X>
constexpr int64_t kStride = kChunk<X> + 64 / static_cast<int64_t>(sizeof(X));

// Block b of a row: prefetch the line(s) `distance` bytes further on, once per line. The
// hardware prefetcher alone leaves the eight streams short of data (1.2-1.6x slower at one x
// row).
template <typename F>
inline void prefetch_ahead(const uint8_t* row, int64_t b, int64_t distance) {
  const uint8_t* ahead = row + b * F::kBytes + distance;
  if constexpr (F::kBytes >= 64) {
    for (int64_t off = 0; off < F::kBytes; off += 64) __builtin_prefetch(ahead + off, 0, 3);
  } else if ((b * F::kBytes) / 64 != ((b + 1) * F::kBytes) / 64) {  // the block ends a line
    __builtin_prefetch(ahead, 0, 3);
  }
}

// Calls use(v0, w) for each weight vector (X float: w __m512, v0 = its first value's index in
// the block) or each pair of them (X bfloat16: w __m512bh, 32 values from v0) of one block.
template <typename X, typename F, typename Use>
inline void decoded(const uint8_t* block, Use&& use) {
  if constexpr (std::is_same_v<X, float>) {
    gguf::decode16<gguf::Fused>(F{}, block, [&](int v, __m512 w) { use(kLanes * v, w); });
  } else {
#if defined(__AVX512BF16__)
    __m512 even = _mm512_setzero_ps();
    gguf::decode16<gguf::Fused>(F{}, block, [&](int v, __m512 w) {
      if (v % 2 == 0) {  // v is a constant once inlined: no branch
        even = w;
      } else {
        use(kLanes * (v - 1), _mm512_cvtne2ps_pbh(w, even));  // [even, odd] in memory order
      }
    });
#endif
  }
}

// One vector of x or of decoded weights, and acc += w * x: 16 products (float32) or 16 sums of
// two (bfloat16 pairs).
inline __m512 load_vec(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 multiply_add(__m512 w, __m512 x, __m512 acc) { return _mm512_fmadd_ps(w, x, acc); }
#if defined(__AVX512BF16__)
inline __m512bh load_vec(const c10::BFloat16* p) { return (__m512bh)_mm512_loadu_si512(p); }
inline __m512 multiply_add(__m512bh w, __m512bh x, __m512 acc) {
  return _mm512_dpbf16_ps(acc, w, x);
}
#endif

// dots[j * R + r] = <W row r, x row j> for R quantized rows row_step bytes apart and MM x rows
// (x_stride apart): every decoded vector meets all MM x rows while it is in a register. R and
// MM are template parameters so the R * MM accumulators stay in registers.
template <typename F, typename X, int R, int MM>
inline void direct_dots(const uint8_t* w, int64_t row_step, int64_t blocks, const X* x,
                        int64_t x_stride, float* dots) {
  __m512 acc[R * MM];  // [j * R + r], the order of dots
  for (int i = 0; i < R * MM; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const X* xb = x + b * F::kElems;
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      prefetch_ahead<F>(w + r * row_step, b, kPrefetchBytes);
      decoded<X, F>(w + r * row_step + b * F::kBytes, [&](int64_t v0, auto wv) {
#pragma GCC unroll 4
        for (int j = 0; j < MM; ++j) {
          acc[j * R + r] = multiply_add(wv, load_vec(xb + j * x_stride + v0), acc[j * R + r]);
        }
      });
    }
  }
  reduce_each(acc, dots);
}

// R quantized rows, row_step bytes apart: `blocks` blocks each into scratch [R, kStride<X>]
// (float32 or the bfloat16 pairs), prefetching `ahead` bytes further on (the next tile's).
template <typename F, typename X, int R>
inline void decode_rows(const uint8_t* w, int64_t row_step, int64_t blocks, X* scratch,
                        int64_t ahead) {
  for (int r = 0; r < R; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      prefetch_ahead<F>(w + r * row_step, b, ahead);
      X* dst = scratch + r * kStride<X> + b * F::kElems;
      decoded<X, F>(w + r * row_step + b * F::kBytes, [&](int64_t v0, auto wv) {
        _mm512_storeu_si512(dst + v0, (__m512i)wv);
      });
    }
  }
}

// acc_mem[j * R + r] += the products of decoded rows wd [R, kc] (kStride<X> apart) and MM x
// rows (x_stride apart) over one chunk of kc values, in direct_dots' order. The accumulators
// live in acc_mem between chunks (a store and a load are exact).
template <typename X, int R, int MM>
inline void chunk_dots(const X* wd, int64_t kc, const X* x, int64_t x_stride, float* acc_mem) {
  constexpr int64_t kStep = 64 / sizeof(X);  // values per vector: 16 floats, 32 bfloat16
  __m512 acc[R * MM];
#pragma GCC unroll 24
  for (int i = 0; i < R * MM; ++i) acc[i] = _mm512_load_ps(acc_mem + kLanes * i);
  for (int64_t i = 0; i < kc; i += kStep) {
    decltype(load_vec(x)) xv[MM];
#pragma GCC unroll 4
    for (int j = 0; j < MM; ++j) xv[j] = load_vec(x + j * x_stride + i);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      auto wv = load_vec(wd + r * kStride<X> + i);
      // Loaded once for the MM multiplies: GCC would fold the load into each of them instead,
      // and the loads then outnumber the multiplies (measured 7 % slower).
      __asm__("" : "+v"(wv));
#pragma GCC unroll 4
      for (int j = 0; j < MM; ++j) acc[j * R + r] = multiply_add(wv, xv[j], acc[j * R + r]);
    }
  }
#pragma GCC unroll 24
  for (int i = 0; i < R * MM; ++i) _mm512_store_ps(acc_mem + kLanes * i, acc[i]);
}

template <int N>
inline void reduce_mem(const float* acc_mem, float* dots) {
  __m512 acc[N];
#pragma GCC unroll 24
  for (int i = 0; i < N; ++i) acc[i] = _mm512_load_ps(acc_mem + kLanes * i);
  reduce_each(acc, dots);
}

}  // namespace gguf_tiles
}  // namespace corefleet

#endif  // __AVX512F__
