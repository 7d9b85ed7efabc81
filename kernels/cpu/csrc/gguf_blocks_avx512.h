// GGUF blocks decoded sixteen values at a time with AVX-512 (the byte layouts are in
// gguf_blocks.h). Only compiled where the target has AVX-512F.
//
// decode16<Mode>(Format{}, block, emit) calls emit(v, w) for each vector v of the block in order
// (v = 0 .. elems/16 - 1; w = the float32 values 16v .. 16v + 15), so a caller sums a block's
// products in the order the values lie in memory, whether it consumes them at once (gguf_linear
// multiplies each w by several x rows while it is in a register) or stores them (a dequantized
// tile, gguf_dequantize). Everything is inlined into the caller's loop.
//
// How a vector is built: 16 bytes zero- or sign-extended to 16 int32 lanes (vpmovzxbd), a nibble
// taken with an and (low) or a shift (high), high bits merged with one vpternlogd, converted to
// float (exact: at most 8 bits), and scaled with one multiply-add by the block's (or sub-block's)
// scale broadcast to all lanes. Q4_0 and Q4_1 look their nibbles up in a 16-entry table of the
// block's values instead (vpermps). Rounding is as in gguf_blocks.h: the same values, bit for
// bit.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

#include "gguf_blocks.h"

#include <cstdint>
#include <type_traits>
#include <utility>

namespace corefleet {
namespace gguf {

#define CF_INLINE inline __attribute__((always_inline))

// f(std::integral_constant<int, I>{}) for I = 0 .. N-1: the sub-block and bit positions become
// compile-time constants (immediate shifts, constant offsets).
template <typename F, int... I>
CF_INLINE void static_for(F&& f, std::integer_sequence<int, I...>) {
  (f(std::integral_constant<int, I>{}), ...);
}
template <int N, typename F>
CF_INLINE void static_for(F&& f) {
  static_for(f, std::make_integer_sequence<int, N>{});
}

CF_INLINE float f16v(const uint8_t* p) {
#if defined(__F16C__)
  uint16_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return _cvtsh_ss(bits);  // exact, subnormals included
#else
  return f16(p);
#endif
}

CF_INLINE __m512i bytes_u32(const uint8_t* p) {  // 16 bytes -> 16 uint32 lanes
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
// v shifted left by S (right for S < 0), as one immediate shift.
template <int S>
CF_INLINE __m512i shift(__m512i v) {
  if constexpr (S > 0) return _mm512_slli_epi32(v, S);
  else if constexpr (S < 0) return _mm512_srli_epi32(v, -S);
  else return v;
}
// low | (high & mask) in one vpternlogd (truth table A | (B & C) = 0xF0 | (0xCC & 0xAA)).
CF_INLINE __m512i merge_bits(__m512i low, __m512i high, int mask) {
  return _mm512_ternarylogic_epi32(low, high, _mm512_set1_epi32(mask), 0xF8);
}

template <typename Mode>
CF_INLINE __m512 affine16(__m512 q, __m512 scale, __m512 offset) {
  if constexpr (std::is_same_v<Mode, Exact>) {
    __m512 product = _mm512_mul_ps(q, scale);
    __asm__("" : "+v"(product));  // rounded on its own, as numpy does (see no_contract)
    return _mm512_add_ps(product, offset);
  } else {
    return _mm512_fmadd_ps(q, scale, offset);
  }
}

// Vec<F>: format F's vector decoder. A block's vectors come in kGroups groups that share some
// loads; prepare() puts what the whole block shares (its scales) in a State, group<G>() emits
// group G's vectors. (Walking a group across a tile's rows before the next group, so that its
// x vectors stay in registers, measured slower at one x row than a block per row at a time.)
template <typename F>
struct Vec;

// The block's float16 at p (and p + 2) as float32 lanes: one load-and-convert, no scalar trip.
CF_INLINE __m128 f16x4(const uint8_t* p) {
  return _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

template <>
struct Vec<Q8_0> {
  static constexpr int kGroups = 1;
  struct State {};
  template <typename Mode>
  static CF_INLINE void prepare(const uint8_t*, State&) {}
  template <typename Mode, int G, typename Emit>
  static CF_INLINE void group(const uint8_t* b, const State&, Emit&& emit) {
    const __m512 d = _mm512_broadcastss_ps(f16x4(b));
    for (int v = 0; v < 2; ++v) {
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2 + 16 * v));
      emit(v, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), d));
    }
  }
};

// 4-bit values through a table: the block's sixteen possible values, computed once, and one
// vpermps a vector (it reads only the low four bits of each index, so the low nibble needs no
// mask). Measured 1.25x the convert-and-scale decode (fewer instructions per vector).
CF_INLINE __m512 iota16(float first) {
  return _mm512_setr_ps(first, first + 1, first + 2, first + 3, first + 4, first + 5, first + 6,
                        first + 7, first + 8, first + 9, first + 10, first + 11, first + 12,
                        first + 13, first + 14, first + 15);
}

// Q4_0's table d * (i - 8): one rounding each, as numpy's.
template <>
struct Vec<Q4_0> {
  static constexpr int kGroups = 1;
  struct State {};
  template <typename Mode>
  static CF_INLINE void prepare(const uint8_t*, State&) {}
  template <typename Mode, int G, typename Emit>
  static CF_INLINE void group(const uint8_t* b, const State&, Emit&& emit) {
    const __m512 d = _mm512_broadcastss_ps(f16x4(b));
    const __m512 table = _mm512_mul_ps(d, iota16(-8.f));
    const __m512i q = bytes_u32(b + 2);  // byte j: value j (low), value j + 16 (high)
    emit(0, _mm512_permutexvar_ps(q, table));
    emit(1, _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table));
  }
};

// Q4_1's table d * i + m.
template <>
struct Vec<Q4_1> {
  static constexpr int kGroups = 1;
  struct State {};
  template <typename Mode>
  static CF_INLINE void prepare(const uint8_t*, State&) {}
  template <typename Mode, int G, typename Emit>
  static CF_INLINE void group(const uint8_t* b, const State&, Emit&& emit) {
    const __m128 dm = f16x4(b);  // d, m
    const __m512 table = affine16<Mode>(iota16(0.f), _mm512_broadcastss_ps(dm),
                                        _mm512_broadcastss_ps(_mm_movehdup_ps(dm)));
    const __m512i q = bytes_u32(b + 4);
    emit(0, _mm512_permutexvar_ps(q, table));
    emit(1, _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table));
  }
};

// Q4_K/Q5_K: group g is the 32 bytes of nibbles holding sub-blocks 2g (low nibbles) and 2g + 1
// (high), four vectors; Q5_K's fifth bit of value j of sub-block s is bit s of qh[j], moved to
// bit 4. (A table per sub-block measured slower here: its two broadcasts cost more than the
// converts they save.)
struct KState {
  alignas(32) float scale[8];   // d * sc[s]
  alignas(32) float offset[8];  // -(dmin * mn[s])
  __m512i qh[2];                // Q5_K: qh[0..15], qh[16..31] as 32-bit lanes
};

// The eight sub-block scales and offsets, eight lanes at a time (each product rounded once).
CF_INLINE void k_affine16(const uint8_t* b, KState& st) {
  uint64_t sc, mn;
  k_scales_mins(b + 4, &sc, &mn);
  const __m256 scf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(sc)));
  const __m256 mnf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(mn)));
  _mm256_store_ps(st.scale, _mm256_mul_ps(scf, _mm256_set1_ps(f16v(b))));
  _mm256_store_ps(st.offset, _mm256_mul_ps(mnf, _mm256_set1_ps(-f16v(b + 2))));
}

template <bool kFifthBit>
struct VecK {
  static constexpr int kGroups = 4;
  using State = KState;
  static constexpr int kNibbles = kFifthBit ? 48 : 16;  // offset of the nibbles in the block
  template <typename Mode>
  static CF_INLINE void prepare(const uint8_t* b, State& st) {
    k_affine16(b, st);
    if constexpr (kFifthBit) st.qh[0] = bytes_u32(b + 16), st.qh[1] = bytes_u32(b + 32);
  }
  template <typename Mode, int G, typename Emit>
  static CF_INLINE void group(const uint8_t* b, const State& st, Emit&& emit) {
    const uint8_t* nibbles = b + kNibbles + 32 * G;
    const __m512i q[2] = {bytes_u32(nibbles), bytes_u32(nibbles + 16)};
    static_for<2>([&](auto high_) {
      constexpr int s = 2 * G + decltype(high_)::value;
      static_for<2>([&](auto half_) {
        constexpr int half = decltype(half_)::value;
        __m512i v;
        if constexpr (s % 2 == 0) v = _mm512_and_si512(q[half], _mm512_set1_epi32(0x0F));
        else v = _mm512_srli_epi32(q[half], 4);
        if constexpr (kFifthBit) v = merge_bits(v, shift<4 - s>(st.qh[half]), 0x10);
        emit(2 * s + half, affine16<Mode>(_mm512_cvtepi32_ps(v), _mm512_set1_ps(st.scale[s]),
                                          _mm512_set1_ps(st.offset[s])));
      });
    });
  }
};
template <>
struct Vec<Q4_K> : VecK<false> {};
template <>
struct Vec<Q5_K> : VecK<true> {};

// Q6_K: value 128h + 32i + j takes nibble i / 2 of ql[64h + 32 (i % 2) + j] and bits 2i, 2i + 1
// of qh[32h + j] as bits 4-5; (d * sc) * (q - 32) as fma(q, d * sc, -32 (d * sc)), exact as
// Q4_0's. Group h is half h (eight vectors, sharing its six loads); vector v = 8h + 2i + half
// uses scale v.
template <>
struct Vec<Q6_K> {
  static constexpr int kGroups = 2;
  struct State {
    alignas(64) float scale[16];
    alignas(64) float offset[16];
  };
  template <typename Mode>
  static CF_INLINE void prepare(const uint8_t* b, State& st) {
    const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192));
    const __m512 sc = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc8)),
                                    _mm512_set1_ps(f16v(b + 208)));
    _mm512_store_ps(st.scale, sc);
    _mm512_store_ps(st.offset, _mm512_mul_ps(sc, _mm512_set1_ps(-32.f)));
  }
  template <typename Mode, int h, typename Emit>
  static CF_INLINE void group(const uint8_t* b, const State& st, Emit&& emit) {
    const __m512i ql[2][2] = {{bytes_u32(b + 64 * h), bytes_u32(b + 64 * h + 16)},
                              {bytes_u32(b + 64 * h + 32), bytes_u32(b + 64 * h + 48)}};
    const __m512i qh[2] = {bytes_u32(b + 128 + 32 * h), bytes_u32(b + 128 + 32 * h + 16)};
    static_for<4>([&](auto i_) {
      constexpr int i = decltype(i_)::value;
      static_for<2>([&](auto half_) {
        constexpr int half = decltype(half_)::value;
        __m512i nib;
        if constexpr (i < 2) nib = _mm512_and_si512(ql[i % 2][half], _mm512_set1_epi32(0x0F));
        else nib = _mm512_srli_epi32(ql[i % 2][half], 4);
        const __m512i q = merge_bits(nib, shift<4 - 2 * i>(qh[half]), 0x30);
        constexpr int v = 8 * h + 2 * i + half;
        emit(v, _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), _mm512_set1_ps(st.scale[v]),
                                _mm512_set1_ps(st.offset[v])));
      });
    });
  }
};

// The whole block: emit(v, w) for v = 0 .. elems/16 - 1 in order.
template <typename Mode, typename F, typename Emit>
CF_INLINE void decode16(F, const uint8_t* b, Emit&& emit) {
  typename Vec<F>::State st;
  Vec<F>::template prepare<Mode>(b, st);
  static_for<Vec<F>::kGroups>([&](auto g) {
    Vec<F>::template group<Mode, decltype(g)::value>(b, st, emit);
  });
}

}  // namespace gguf
}  // namespace corefleet

#endif  // __AVX512F__
