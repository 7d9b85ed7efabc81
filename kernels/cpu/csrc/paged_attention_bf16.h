// The bfloat16 paged attention's inner loops on CPUs with AVX512-BF16: both passes multiply
// bf16 pairs with vdpbf16ps instead of widening every K and V element to float32 first.
// Private to paged_attention_cpu.cpp, which takes this path for bfloat16 caches whose head_dim
// is a multiple of 32 and keeps paged_attention_blocks.h's loops for everything else.
//
// Why: widened, the kernel is compute-bound. Per position and KV head it spent ~60 vector
// instructions (three per 16 widened elements, then one FMA per query and 16 elements) and
// fell well short of the memory bandwidth (docs/kernels.md). vdpbf16ps takes 32 bf16 pairs
// and does two multiply-adds per lane, with the bf16 products exact in float32.
//
// Numerics: pass 1 is exact products summed in float32, as the widened path, in another order.
// Pass 2 multiplies V by the probabilities rounded to bfloat16 (what transformers' bfloat16
// attention does too: its softmax output is cast to the query's dtype before the PV matmul);
// the normaliser stays the float32 sum.
#pragma once

#if defined(__AVX512BF16__)

#include <c10/util/BFloat16.h>

#include "paged_attention_blocks.h"
#include "vec_avx512.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace corefleet {
namespace attention {

constexpr int64_t kPairChunk = 32;  // bf16 elements per __m512: one vdpbf16ps operand

inline __m512bh load_pairs(const c10::BFloat16* p) {
  return (__m512bh)_mm512_loadu_si512(p);
}

// scores[g * score_stride + t] = scale * <q[g], k_t> for `count` <= 16 consecutive positions
// of a block (k_t = k + t * token_stride) and a KV head's G queries (q: [G, D] bf16, unscaled;
// D a multiple of 32). A full run of 16 keeps 16 partial sums in registers and sums them
// horizontally together; a shorter run sums each one by itself.
inline void score_positions_pairs(
    const c10::BFloat16* k, int64_t token_stride, int64_t count, const c10::BFloat16* q,
    int64_t group, int64_t head_dim, float scale, float* scores, int64_t score_stride) {
  const __m512 scale16 = _mm512_set1_ps(scale);
  for (int64_t g = 0; g < group; ++g) {
    const c10::BFloat16* qg = q + g * head_dim;
    float* sg = scores + g * score_stride;
    if (count < 16) {
      for (int64_t t = 0; t < count; ++t) {
        __m512 partial = _mm512_setzero_ps();
        for (int64_t c = 0; c < head_dim; c += kPairChunk) {
          partial = _mm512_dpbf16_ps(partial, load_pairs(qg + c),
                                     load_pairs(k + t * token_stride + c));
        }
        sg[t] = scale * _mm512_reduce_add_ps(partial);
      }
      continue;
    }
    __m512 partial[16];
#pragma GCC unroll 16
    for (int t = 0; t < 16; ++t) {
      partial[t] = _mm512_setzero_ps();
    }
    for (int64_t c = 0; c < head_dim; c += kPairChunk) {
      const __m512bh qc = load_pairs(qg + c);
#pragma GCC unroll 16
      for (int t = 0; t < 16; ++t) {
        partial[t] = _mm512_dpbf16_ps(partial[t], qc, load_pairs(k + t * token_stride + c));
      }
    }
    _mm512_storeu_ps(sg, _mm512_mul_ps(transpose_sum16(partial), scale16));
  }
}

// probs[t] = bf16(p[t]) for t < n, and probs[n] = 0: pass 2 reads probabilities in pairs
// (t, t + 1), and the pair that starts at the last position must find a finite partner.
inline void round_probabilities(const float* p, int64_t n, c10::BFloat16* probs) {
  int64_t t = 0;
  for (; t + 16 <= n; t += 16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(probs + t),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(p + t)));
  }
  for (; t < n; ++t) {
    probs[t] = c10::BFloat16(p[t]);
  }
  probs[n] = c10::BFloat16(0.f);
}

// acc[g * head_dim + c0 + d] += sum over positions t of probs[g * p_stride + t] * v_t[c0 + d]
// for NG queries and NC 32-element chunks of one head's V starting at v_offset. Positions go
// two at a time: the two V rows are interleaved into bf16 pairs (unpacklo/hi per 128-bit lane),
// so each vdpbf16ps adds both positions' products. The interleave permutes the output lanes:
// `lo` lane 4L + i holds element 8L + i of the chunk and `hi` lane 4L + i element 8L + 4 + i,
// which the final store undoes. The accumulators stay in registers over the whole context.
template <int NG, int NC>
void accumulate_pairs(
    const RowCache<c10::BFloat16>& v, int64_t v_offset, const c10::BFloat16* probs,
    int64_t p_stride, float* acc, int64_t head_dim) {
  __m512 lo[NG][NC];
  __m512 hi[NG][NC];
  for (int g = 0; g < NG; ++g) {
    for (int c = 0; c < NC; ++c) {
      lo[g][c] = _mm512_setzero_ps();
      hi[g][c] = _mm512_setzero_ps();
    }
  }
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t start = 0; start < v.len; start += v.block_size) {
    const int64_t index = start / v.block_size;
    const c10::BFloat16* block = v.data + v.blocks[index] * v.block_stride + v_offset;
    const int64_t count = std::min(v.block_size, v.len - start);
    const bool more = start + 2 * v.block_size < v.len;
    const c10::BFloat16* next =
        more ? v.data + v.blocks[index + 2] * v.block_stride + v_offset : nullptr;
    for (int64_t t = 0; t < count; t += 2) {
      const c10::BFloat16* row = block + t * v.token_stride;
      if (next != nullptr) {  // the next block's rows t and t + 1, spread over the block
        prefetch_block(next + t * v.token_stride, std::min<int64_t>(2, count - t),
                       v.token_stride, 0, NC * kPairChunk);
      }
      const bool second = t + 1 < count;  // else the pair's second row is zeros
      __m512bh even[NC];
      __m512bh odd[NC];
      for (int c = 0; c < NC; ++c) {
        const __m512i a = _mm512_loadu_si512(row + c * kPairChunk);
        const __m512i b =
            second ? _mm512_loadu_si512(row + v.token_stride + c * kPairChunk) : zero;
        even[c] = (__m512bh)_mm512_unpacklo_epi16(a, b);
        odd[c] = (__m512bh)_mm512_unpackhi_epi16(a, b);
      }
      for (int g = 0; g < NG; ++g) {
        uint32_t pair;  // probs[t] in the low half, probs[t + 1] in the high half
        std::memcpy(&pair, probs + g * p_stride + start + t, sizeof(pair));
        const __m512bh pp = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
        for (int c = 0; c < NC; ++c) {
          lo[g][c] = _mm512_dpbf16_ps(lo[g][c], even[c], pp);
          hi[g][c] = _mm512_dpbf16_ps(hi[g][c], odd[c], pp);
        }
      }
    }
  }
  for (int g = 0; g < NG; ++g) {
    for (int c = 0; c < NC; ++c) {
      float lo_lanes[16];
      float hi_lanes[16];
      _mm512_storeu_ps(lo_lanes, lo[g][c]);
      _mm512_storeu_ps(hi_lanes, hi[g][c]);
      float* out = acc + g * head_dim + c * kPairChunk;
      for (int lane = 0; lane < 4; ++lane) {
        for (int i = 0; i < 4; ++i) {
          out[8 * lane + i] += lo_lanes[4 * lane + i];
          out[8 * lane + 4 + i] += hi_lanes[4 * lane + i];
        }
      }
    }
  }
}

template <int NG>
void accumulate_pairs_nc(
    int64_t nc, const RowCache<c10::BFloat16>& v, int64_t v_offset,
    const c10::BFloat16* probs, int64_t p_stride, float* acc, int64_t head_dim) {
  if (nc == 2) {
    accumulate_pairs<NG, 2>(v, v_offset, probs, p_stride, acc, head_dim);
  } else {
    accumulate_pairs<NG, 1>(v, v_offset, probs, p_stride, acc, head_dim);
  }
}

// Pass 2 for one KV head: acc[g] (G queries, [G, D] floats) += the probability-weighted sum of
// the head's V rows, in register tiles of up to 4 queries x 64 elements (16 accumulators).
inline void accumulate_head_pairs(
    const RowCache<c10::BFloat16>& v, int64_t head, const c10::BFloat16* probs,
    int64_t p_stride, int64_t group, int64_t head_dim, float* acc) {
  for (int64_t g0 = 0; g0 < group; g0 += 4) {
    const int64_t ng = std::min<int64_t>(4, group - g0);
    for (int64_t c0 = 0; c0 < head_dim; c0 += 2 * kPairChunk) {
      const int64_t nc = std::min<int64_t>(2, (head_dim - c0) / kPairChunk);
      const int64_t offset = head * head_dim + c0;
      const c10::BFloat16* pg = probs + g0 * p_stride;
      float* ag = acc + g0 * head_dim + c0;
      switch (ng) {
        case 4: accumulate_pairs_nc<4>(nc, v, offset, pg, p_stride, ag, head_dim); break;
        case 3: accumulate_pairs_nc<3>(nc, v, offset, pg, p_stride, ag, head_dim); break;
        case 2: accumulate_pairs_nc<2>(nc, v, offset, pg, p_stride, ag, head_dim); break;
        default: accumulate_pairs_nc<1>(nc, v, offset, pg, p_stride, ag, head_dim); break;
      }
    }
  }
}

}  // namespace attention
}  // namespace corefleet

#endif  // __AVX512BF16__
