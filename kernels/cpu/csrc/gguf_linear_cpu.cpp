// Linear layer on GGUF-quantized weights for a decode-sized batch on the CPU:
// out = x @ W^T (+ bias), W read in its GGUF blocks and dequantized in registers.
//
// Layouts (row-major):
//   x       [M, K]                      float32 or bfloat16, contiguous
//   qweight [N, K / elems * bytes]      uint8, contiguous: row n is W[n]'s GGUF blocks in file
//                                       order (gguf_blocks.h: Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K)
//   bias    [N]                         x's dtype, optional
//   returns [M, N]                      x's dtype
//
// Why it exists: a decode step streams every weight from DRAM for a few rows of arithmetic, so
// its time is the bytes read. A 4-bit weight is 0.56-0.69 bytes a value against 2 (bfloat16)
// or 4 (float32): read as blocks and dequantized in registers, the layer costs a fraction of
// the float one. Dequantizing to a float copy first would write and read that copy instead.
//
// How: each thread takes a band of weight rows and walks it in tiles of eight rows, as
// small_linear does (sub-bands side by side for up to 24 x rows, so the thread reads eight long
// sequential streams; adjacent rows, prefetched, above). With up to kDirectMaxRows x rows, each
// block of each tile row is decoded into vectors (gguf_blocks_avx512.h) and every vector is
// multiplied at once by all x rows: the dequantized weights never leave the registers. With
// more x rows, decoding once per x row would cost more than the multiplies, so the tile's rows
// are decoded once into an L1/L2 scratch and the float products run over it, three x rows per
// pass (small_linear's tile_dots).
//
// Numerics: the activations stay float (bfloat16 x is widened exactly): no int8 quantization
// of x, so the result is the float product with the dequantized weights up to summation order.
// The weights are the dequantized values (a fused multiply-add may round Q4_1/Q4_K/Q5_K's
// offset once where gguf_dequantize rounds twice). Each output is a float32 sum over K in
// memory order, 16 partial sums reduced in a fixed order (reduce_each): the same whichever path,
// tile shape or thread computes it, so results depend neither on the thread count nor on which
// other rows are in the batch.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Optional.h>
#include <torch/library.h>

#include "gguf_blocks.h"
#include "gguf_blocks_avx512.h"
#include "parallel.h"
#include "scalar.h"
#include "vec_avx512.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace corefleet {
namespace {

using gguf::Fused;

constexpr int64_t kRowsPerTile = 8;         // weight rows streamed together
constexpr int64_t kDirectMaxRows = 4;       // x rows up to which weights stay in registers
constexpr int64_t kMaxRowsSideBySide = 24;  // x rows up to which a tile takes rows from sub-bands
constexpr int64_t kLanes = 16;              // floats per partial-sum vector

#if defined(__AVX512F__)
// dots[j * R + r] = <W row r, x row j> for R quantized rows row_step bytes apart and MM float32
// x rows of K values: every decoded vector meets all MM x rows while it is in a register.
// R and MM are template parameters so the R * MM accumulators stay in registers.
template <typename F, int R, int MM>
inline void direct_dots(const uint8_t* w, int64_t row_step, int64_t blocks, const float* x,
                        int64_t k, float* dots) {
  __m512 acc[R * MM];  // [j * R + r], the order of dots
  for (int i = 0; i < R * MM; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const float* xb = x + b * F::kElems;
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      gguf::decode16<Fused>(F{}, w + r * row_step + b * F::kBytes, [&](int v, __m512 wv) {
#pragma GCC unroll 4
        for (int j = 0; j < MM; ++j) {
          acc[j * R + r] =
              _mm512_fmadd_ps(wv, _mm512_loadu_ps(xb + j * k + kLanes * v), acc[j * R + r]);
        }
      });
    }
  }
  reduce_each(acc, dots);
}

// R quantized rows, row_step bytes apart, decoded into scratch [R, K] float32.
template <typename F, int R>
inline void decode_rows(const uint8_t* w, int64_t row_step, int64_t blocks, float* scratch) {
  const int64_t k = blocks * F::kElems;
  for (int r = 0; r < R; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      float* dst = scratch + r * k + b * F::kElems;
      gguf::decode16<Fused>(F{}, w + r * row_step + b * F::kBytes,
                            [&](int v, __m512 wv) { _mm512_storeu_ps(dst + kLanes * v, wv); });
    }
  }
}

// dots[j * R + r] = <wf row r, x row j> for R decoded rows [R, K] and MM x rows; the products
// in the same order as direct_dots, so the two paths give the same bits.
template <int R, int MM>
inline void scratch_dots(const float* wf, int64_t k, const float* x, float* dots) {
  __m512 acc[R * MM];
  for (int i = 0; i < R * MM; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; i += kLanes) {
    __m512 xv[MM];
#pragma GCC unroll 4
    for (int j = 0; j < MM; ++j) xv[j] = _mm512_loadu_ps(x + j * k + i);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 wv = _mm512_loadu_ps(wf + r * k + i);
#pragma GCC unroll 4
      for (int j = 0; j < MM; ++j) acc[j * R + r] = _mm512_fmadd_ps(wv, xv[j], acc[j * R + r]);
    }
  }
  reduce_each(acc, dots);
}
#endif

// What a band needs: the weight, x widened to float32, the output and its sizes.
template <typename T>
struct Problem {
  const uint8_t* w;  // [N, row_bytes]
  const T* bias;     // [N] or nullptr
  const float* x;    // [M, K]
  T* out;            // [M, N]
  int64_t m, k, n, row_bytes;
};

// out[m0 + j, row0 + r * step] = dots[j * R + r] + bias for the tile's R rows and MM x rows.
template <typename T, int R, int MM>
inline void store_tile(const Problem<T>& p, const float* dots, int64_t row0, int64_t step,
                       int64_t m0) {
  for (int j = 0; j < MM; ++j) {
    for (int r = 0; r < R; ++r) {
      const int64_t row = row0 + r * step;
      const float b = p.bias != nullptr ? widen(p.bias[row]) : 0.f;
      store(dots[j * R + r] + b, p.out + (m0 + j) * p.n + row);
    }
  }
}

#if defined(__AVX512F__)
// One tile of R weight rows (row0, row0 + step, ...) against every x row. `next` (or nullptr):
// the next tile's bytes, prefetched a share per pass over x on the scratch path.
template <typename F, typename T, int R>
void tile(const Problem<T>& p, int64_t row0, int64_t step, float* scratch, const uint8_t* next) {
  const int64_t blocks = p.k / F::kElems;
  const uint8_t* w = p.w + row0 * p.row_bytes;
  float dots[R * 3];
  if (p.m <= kDirectMaxRows) {
    switch (p.m) {
      case 1: direct_dots<F, R, 1>(w, step * p.row_bytes, blocks, p.x, p.k, dots); break;
      case 2: direct_dots<F, R, 2>(w, step * p.row_bytes, blocks, p.x, p.k, dots); break;
      case 3: direct_dots<F, R, 3>(w, step * p.row_bytes, blocks, p.x, p.k, dots); break;
      default: break;
    }
    if (p.m == 4) {  // two x rows at a time: four would spill the accumulators at R = 8
      direct_dots<F, R, 2>(w, step * p.row_bytes, blocks, p.x, p.k, dots);
      store_tile<T, R, 2>(p, dots, row0, step, 0);
      direct_dots<F, R, 2>(w, step * p.row_bytes, blocks, p.x + 2 * p.k, p.k, dots);
      store_tile<T, R, 2>(p, dots, row0, step, 2);
      return;
    }
    switch (p.m) {
      case 1: store_tile<T, R, 1>(p, dots, row0, step, 0); break;
      case 2: store_tile<T, R, 2>(p, dots, row0, step, 0); break;
      default: store_tile<T, R, 3>(p, dots, row0, step, 0); break;
    }
    return;
  }
  decode_rows<F, R>(w, step * p.row_bytes, blocks, scratch);
  const int64_t passes = (p.m + 2) / 3;
  const int64_t prefetch_per_pass = next == nullptr ? 0 : (R * p.row_bytes / passes + 63) / 64;
  for (int64_t m0 = 0; m0 < p.m;) {
    for (int64_t line = 0; line < prefetch_per_pass; ++line) {
      __builtin_prefetch(next + 64 * line, 0, 3);
    }
    next += 64 * prefetch_per_pass;
    const float* xs = p.x + m0 * p.k;
    if (p.m - m0 >= 3) {
      scratch_dots<R, 3>(scratch, p.k, xs, dots);
      store_tile<T, R, 3>(p, dots, row0, step, m0);
      m0 += 3;
    } else if (p.m - m0 == 2) {
      scratch_dots<R, 2>(scratch, p.k, xs, dots);
      store_tile<T, R, 2>(p, dots, row0, step, m0);
      m0 += 2;
    } else {
      scratch_dots<R, 1>(scratch, p.k, xs, dots);
      store_tile<T, R, 1>(p, dots, row0, step, m0);
      m0 += 1;
    }
  }
}

// One thread's band of weight rows [r0, r1), as small_linear's band: kRowsPerTile sub-bands
// side by side for up to kMaxRowsSideBySide x rows, adjacent tiles above; the fewer than
// kRowsPerTile rows left over one by one.
template <typename F, typename T>
void band(const Problem<T>& p, int64_t r0, int64_t r1) {
  thread_local std::vector<float> scratch;  // [kRowsPerTile, K]; kept: no page faults per call
  if (p.m > kDirectMaxRows) scratch.resize(static_cast<size_t>(kRowsPerTile * p.k));
  const int64_t tiles = (r1 - r0) / kRowsPerTile;
  const bool side_by_side = p.m <= kMaxRowsSideBySide;
  const int64_t step = side_by_side ? tiles : 1;
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t row0 = side_by_side ? r0 + t : r0 + t * kRowsPerTile;
    const bool prefetch = !side_by_side && t + 1 < tiles;
    const uint8_t* next = prefetch ? p.w + (row0 + kRowsPerTile) * p.row_bytes : nullptr;
    tile<F, T, kRowsPerTile>(p, row0, step, scratch.data(), next);
  }
  for (int64_t row = r0 + tiles * kRowsPerTile; row < r1; ++row) {
    tile<F, T, 1>(p, row, 1, scratch.data(), nullptr);
  }
}
#else
// Portable version: each row decoded into a float32 scratch row, then its dot product with
// every x row as fixed-width independent partial sums (which GCC vectorises at -O3).
template <typename F, typename T>
void band(const Problem<T>& p, int64_t r0, int64_t r1) {
  std::vector<float> row(static_cast<size_t>(p.k));
  const int64_t blocks = p.k / F::kElems;
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      F::template decode<Fused>(p.w + r * p.row_bytes + b * F::kBytes,
                                row.data() + b * F::kElems);
    }
    for (int64_t j = 0; j < p.m; ++j) {
      const float* x = p.x + j * p.k;
      float partial[kLanes] = {};
      for (int64_t i = 0; i < p.k; i += kLanes) {  // K is a multiple of 32
        for (int64_t l = 0; l < kLanes; ++l) partial[l] += row[i + l] * x[i + l];
      }
      float sum = 0.f;
      for (int64_t l = 0; l < kLanes; ++l) sum += partial[l];
      store(sum + (p.bias != nullptr ? widen(p.bias[r]) : 0.f), p.out + j * p.n + r);
    }
  }
}
#endif

template <typename F, typename T>
void gguf_linear_kernel(const at::Tensor& x, const at::Tensor& qweight,
                        const c10::optional<at::Tensor>& bias, at::Tensor& out) {
  Problem<T> p{qweight.data_ptr<uint8_t>(),
               bias.has_value() ? bias->data_ptr<T>() : nullptr,
               nullptr,
               out.data_ptr<T>(),
               x.size(0),
               x.size(1),
               qweight.size(0),
               qweight.size(1)};
  // x widened to float32 once: [M, K], a few KB that every thread reads from cache.
  std::vector<float> xf;
  if constexpr (std::is_same_v<T, float>) {
    p.x = x.data_ptr<float>();
  } else {
    xf.resize(static_cast<size_t>(p.m * p.k));
    const T* xs = x.data_ptr<T>();
    for (int64_t i = 0; i < p.m * p.k; ++i) xf[i] = widen(xs[i]);
    p.x = xf.data();
  }
  // Bands of at least 64 rows, as small_linear: small per-band overhead next to the rows'
  // bytes, and work for both cores on the smallest projections.
  parallel_for(0, p.n, 64, [&](int64_t r0, int64_t r1) { band<F, T>(p, r0, r1); });
}

at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& qweight, int64_t ggml_type,
                       const c10::optional<at::Tensor>& bias) {
  constexpr const char* op = "gguf_linear";
  TORCH_CHECK(x.dim() == 2, op, ": x must be [M, K], got ", x.dim(), " dimensions");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
              ": x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(x.is_contiguous(), op, ": x must be contiguous");
  return gguf::visit(ggml_type, op, [&](auto format) {
    using F = decltype(format);
    gguf::check_qweight<F>(op, qweight, x.size(1));
    if (bias.has_value()) {
      TORCH_CHECK(bias->dim() == 1 && bias->size(0) == qweight.size(0) &&
                      bias->is_contiguous() && bias->scalar_type() == x.scalar_type(),
                  op, ": bias must be a contiguous [N] tensor of x's dtype");
    }
    at::Tensor out = at::empty({x.size(0), qweight.size(0)}, x.options());  // [M, N]
    if (out.numel() == 0) return out;
    if (x.scalar_type() == at::kFloat) {
      gguf_linear_kernel<F, float>(x, qweight, bias, out);
    } else {
      gguf_linear_kernel<F, c10::BFloat16>(x, qweight, bias, out);
    }
    return out;
  });
}

}  // namespace
}  // namespace corefleet

TORCH_LIBRARY_FRAGMENT(corefleet_cpu, m) {
  m.def("gguf_linear(Tensor x, Tensor qweight, int ggml_type, Tensor? bias) -> Tensor",
        &corefleet::gguf_linear);
}
