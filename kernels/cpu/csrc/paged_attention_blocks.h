// The inner loops of the CPU paged attention (paged_attention_cpu.cpp): pass 1 scores runs of
// positions against a KV head's queries, pass 2 accumulates probability-weighted V rows, plus
// the softmax's exp-and-sum and the K prefetch through the block table. An AVX-512 version of
// each and a portable one with the same signatures. Private to that file.
#pragma once

#include <c10/util/BFloat16.h>

#include "scalar.h"
#include "vec_avx512.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace corefleet {
namespace attention {

// Lanes of the independent partial sums in dot(). A fixed-width inner loop over independent
// accumulators is what lets GCC vectorise the reduction at -O3 without -ffast-math (which
// would also let it reorder the softmax arithmetic).
constexpr int64_t kLanes = 16;

inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float partial[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int64_t j = 0; j < kLanes; ++j) {
      partial[j] += a[i + j] * b[i + j];
    }
  }
  float sum = 0.f;
  for (int64_t j = 0; j < kLanes; ++j) {
    sum += partial[j];
  }
  for (; i < n; ++i) {  // head dims that are not a multiple of kLanes
    sum += a[i] * b[i];
  }
  return sum;
}

// out[i] += weight * x[i]
inline void axpy(float* __restrict out, float weight, const float* __restrict x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    out[i] += weight * x[i];
  }
}

// Where one row's K or V lives: its block table and the cache geometry.
template <typename scalar_t>
struct RowCache {
  const scalar_t* data;       // the cache, [num_blocks, block_size, Hkv, D]
  const int64_t* blocks;      // the row's block ids
  int64_t len;                // positions the row attends to
  int64_t block_size;
  int64_t block_stride;       // elements between blocks
  int64_t token_stride;       // elements between positions of a block
};

#if defined(__AVX512F__)
// Explicit AVX-512 versions of the two inner loops and of exp. GCC's auto-vectorised loops
// above leave the horizontal sums and the scalar libm exp on the critical path, which made
// the kernel compute-bound, well above the cost of its memory traffic (docs/kernels.md).
constexpr int64_t kVec = 16;  // floats per __m512

// s[t] = exp(s[t] - max_score); returns the sum of the new s.
inline float exp_shift_sum(float* s, int64_t n, float max_score) {
  const __m512 shift = _mm512_set1_ps(max_score);
  __m512 sum = _mm512_setzero_ps();
  int64_t t = 0;
  for (; t + kVec <= n; t += kVec) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + t), shift));
    _mm512_storeu_ps(s + t, e);
    sum = _mm512_add_ps(sum, e);
  }
  if (t < n) {  // tail: masked lanes neither load nor store nor add
    const __mmask16 m = static_cast<__mmask16>((1u << (n - t)) - 1u);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + t), shift));
    _mm512_mask_storeu_ps(s + t, m, e);
    sum = _mm512_mask_add_ps(sum, m, sum, e);
  }
  return _mm512_reduce_add_ps(sum);
}

// scores[g * score_stride + t] = <q[g], k_t> for `count` <= 16 consecutive positions of a
// block (k_t = k + t * token_stride, one KV head's D values) and that head's G queries
// (q: [G, D] floats). A full run of 16 keeps its 16 partial sums in registers and sums them
// horizontally together; a shorter run (the context's last block) sums each one by itself.
template <typename scalar_t>
inline void score_positions(
    const scalar_t* k, int64_t token_stride, int64_t count, const float* q, int64_t group,
    int64_t head_dim, float* scores, int64_t score_stride) {
  for (int64_t g = 0; g < group; ++g) {
    const float* qg = q + g * head_dim;
    float* sg = scores + g * score_stride;
    if (count < 16) {
      for (int64_t t = 0; t < count; ++t) {
        __m512 partial = _mm512_setzero_ps();
        for (int64_t c = 0; c < head_dim; c += kVec) {
          partial = _mm512_fmadd_ps(_mm512_loadu_ps(qg + c), load16(k + t * token_stride + c),
                                    partial);
        }
        sg[t] = _mm512_reduce_add_ps(partial);
      }
      continue;
    }
    __m512 partial[16];
#pragma GCC unroll 16
    for (int t = 0; t < 16; ++t) {
      partial[t] = _mm512_setzero_ps();
    }
    for (int64_t c = 0; c < head_dim; c += kVec) {
      const __m512 qc = _mm512_loadu_ps(qg + c);
#pragma GCC unroll 16
      for (int t = 0; t < 16; ++t) {
        partial[t] = _mm512_fmadd_ps(qc, load16(k + t * token_stride + c), partial[t]);
      }
    }
    _mm512_storeu_ps(sg, transpose_sum16(partial));
  }
}

// acc[g * head_dim + j * 16 ...] += sum over positions t of p[g * p_stride + t] * v_t[j * 16 ...]
// for NG queries and NV 16-float slices of one head's V (v_offset: the slice's offset in a
// position's [Hkv, D] run). The NG * NV accumulators stay in registers over the whole context;
// the next block's slice is prefetched while a block is read.
template <typename scalar_t, int NG, int NV>
void accumulate_context(
    const RowCache<scalar_t>& v, int64_t v_offset, const float* p, int64_t p_stride,
    float* acc, int64_t head_dim) {
  __m512 a[NG][NV];
  for (int g = 0; g < NG; ++g) {
    for (int j = 0; j < NV; ++j) {
      a[g][j] = _mm512_loadu_ps(acc + g * head_dim + j * kVec);
    }
  }
  for (int64_t start = 0; start < v.len; start += v.block_size) {
    const int64_t index = start / v.block_size;
    const scalar_t* block = v.data + v.blocks[index] * v.block_stride + v_offset;
    const int64_t count = std::min(v.block_size, v.len - start);
    const bool more = start + v.block_size < v.len;
    const scalar_t* next = more ? v.data + v.blocks[index + 1] * v.block_stride + v_offset
                                : nullptr;
    for (int64_t t = 0; t < count; ++t) {
      if (next != nullptr) {
        const char* line = reinterpret_cast<const char*>(next + t * v.token_stride);
        for (size_t byte = 0; byte < NV * kVec * sizeof(scalar_t); byte += 64) {
          __builtin_prefetch(line + byte, 0, 2);  // into L2: see prefetch_block
        }
      }
      const scalar_t* row = block + t * v.token_stride;
      __m512 vv[NV];
      for (int j = 0; j < NV; ++j) {
        vv[j] = load16(row + j * kVec);
      }
      for (int g = 0; g < NG; ++g) {
        const __m512 pg = _mm512_set1_ps(p[g * p_stride + start + t]);
        for (int j = 0; j < NV; ++j) {
          a[g][j] = _mm512_fmadd_ps(pg, vv[j], a[g][j]);
        }
      }
    }
  }
  for (int g = 0; g < NG; ++g) {
    for (int j = 0; j < NV; ++j) {
      _mm512_storeu_ps(acc + g * head_dim + j * kVec, a[g][j]);
    }
  }
}

template <typename scalar_t, int NG>
void accumulate_context_nv(
    int64_t nv, const RowCache<scalar_t>& v, int64_t v_offset, const float* p,
    int64_t p_stride, float* acc, int64_t head_dim) {
  switch (nv) {
    case 4: accumulate_context<scalar_t, NG, 4>(v, v_offset, p, p_stride, acc, head_dim); break;
    case 3: accumulate_context<scalar_t, NG, 3>(v, v_offset, p, p_stride, acc, head_dim); break;
    case 2: accumulate_context<scalar_t, NG, 2>(v, v_offset, p, p_stride, acc, head_dim); break;
    default: accumulate_context<scalar_t, NG, 1>(v, v_offset, p, p_stride, acc, head_dim); break;
  }
}

// Pass 2 for one KV head: acc[g] (G queries, [G, D] floats) += the probability-weighted sum of
// the head's V rows, in register tiles of up to 4 queries x 64 floats.
template <typename scalar_t>
void accumulate_head(
    const RowCache<scalar_t>& v, int64_t head, const float* p, int64_t p_stride,
    int64_t group, int64_t head_dim, float* acc) {
  for (int64_t g0 = 0; g0 < group; g0 += 4) {
    const int64_t ng = std::min<int64_t>(4, group - g0);
    for (int64_t c0 = 0; c0 < head_dim; c0 += 4 * kVec) {
      const int64_t nv = std::min<int64_t>(4, (head_dim - c0) / kVec);
      const int64_t offset = head * head_dim + c0;
      const float* pg = p + g0 * p_stride;
      float* ag = acc + g0 * head_dim + c0;
      switch (ng) {
        case 4: accumulate_context_nv<scalar_t, 4>(nv, v, offset, pg, p_stride, ag, head_dim); break;
        case 3: accumulate_context_nv<scalar_t, 3>(nv, v, offset, pg, p_stride, ag, head_dim); break;
        case 2: accumulate_context_nv<scalar_t, 2>(nv, v, offset, pg, p_stride, ag, head_dim); break;
        default: accumulate_context_nv<scalar_t, 1>(nv, v, offset, pg, p_stride, ag, head_dim); break;
      }
    }
  }
}
#else
inline float exp_shift_sum(float* s, int64_t n, float max_score) {
  float sum = 0.f;
  for (int64_t t = 0; t < n; ++t) {
    s[t] = std::exp(s[t] - max_score);
    sum += s[t];
  }
  return sum;
}
template <typename scalar_t>
inline void score_row(
    const scalar_t* k_row, const float* q, int64_t group, int64_t head_dim, float* scores,
    int64_t score_stride) {
  thread_local std::vector<float> widened;  // [D] the row as float32
  widened.resize(head_dim);
  const float* k = widen_row(k_row, widened.data(), head_dim);
  for (int64_t g = 0; g < group; ++g) {
    scores[g * score_stride] = dot(q + g * head_dim, k, head_dim);
  }
}

template <typename scalar_t>
inline void accumulate_row(
    const scalar_t* v_row, const float* p, int64_t p_stride, int64_t group, int64_t head_dim,
    float* acc) {
  thread_local std::vector<float> widened;  // [D] the row as float32
  widened.resize(head_dim);
  const float* v = widen_row(v_row, widened.data(), head_dim);
  for (int64_t g = 0; g < group; ++g) {
    axpy(acc + g * head_dim, p[g * p_stride], v, head_dim);
  }
}

// Block-level versions of the two helpers above, with the AVX-512 path's signatures.
template <typename scalar_t>
inline void score_positions(
    const scalar_t* k, int64_t token_stride, int64_t count, const float* q, int64_t group,
    int64_t head_dim, float* scores, int64_t score_stride) {
  for (int64_t t = 0; t < count; ++t) {
    score_row(k + t * token_stride, q, group, head_dim, scores + t, score_stride);
  }
}

template <typename scalar_t>
void accumulate_head(
    const RowCache<scalar_t>& v, int64_t head, const float* p, int64_t p_stride,
    int64_t group, int64_t head_dim, float* acc) {
  for (int64_t start = 0; start < v.len; start += v.block_size) {
    const scalar_t* block = v.data + v.blocks[start / v.block_size] * v.block_stride;
    const int64_t count = std::min(v.block_size, v.len - start);
    for (int64_t t = 0; t < count; ++t) {
      accumulate_row(block + t * v.token_stride + head * head_dim, p + start + t, p_stride,
                     group, head_dim, acc);
    }
  }
}
#endif

// Prefetch `width` elements at `offset` in each of the first `count` positions of a block.
// A row's cache blocks are scattered, so each block would start with a run of misses the
// hardware prefetcher only catches up with part-way; pass 1 asks for the next block's K while
// it reads the current one (without this the kernel was load-latency bound). Locality 2
// (prefetcht1) fills L2, not L1: into L1, the misses in flight are capped by L1's few fill
// buffers, which cost bandwidth (docs/kernels.md has the figures).
template <typename scalar_t>
inline void prefetch_block(
    const scalar_t* block, int64_t count, int64_t token_stride, int64_t offset, int64_t width) {
  const int64_t bytes = width * static_cast<int64_t>(sizeof(scalar_t));
  for (int64_t t = 0; t < count; ++t) {
    const char* p = reinterpret_cast<const char*>(block + t * token_stride + offset);
    for (int64_t byte = 0; byte < bytes; byte += 64) {
      __builtin_prefetch(p + byte, 0, 2);
    }
  }
}

}  // namespace attention
}  // namespace corefleet
