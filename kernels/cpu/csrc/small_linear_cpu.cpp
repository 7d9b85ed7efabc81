// Linear layer for a decode-sized batch on the CPU: out = x @ weight^T (+ bias), for M <= 64.
//
// Layouts (all row-major):
//   x       [M, K]   float32 or bfloat16, contiguous
//   weight  [N, K]   x's dtype, contiguous (the nn.Linear layout)
//   bias    [N]      x's dtype, optional
//   returns [M, N]   x's dtype
//
// Why it exists: in a decode step a linear layer streams its whole weight matrix from DRAM
// (the model's weights do not fit the caches) for a few rows of arithmetic, and MKL's GEMV and
// its GEMM on so few rows read the weights well below a plain read's bandwidth
// (docs/kernels.md has this file's measurements). Here each thread takes a contiguous band of
// weight rows. With up to 24 x rows it cuts the band into eight sub-bands and walks them side
// by side: a tile is one row from each sub-band, so the thread reads eight long sequential
// streams that the hardware prefetcher follows from start to end. (Tiles of eight adjacent
// rows make every stream one row long, a few cache lines, which the prefetcher has barely
// picked up before it ends; side by side, one x row reads at the speed of a plain read.) With
// more x rows a tile is eight adjacent rows, and each tile prefetches the next while it
// computes. Each tile's dot products with every x row are computed while its rows sit in L1,
// three x rows per pass, and a tile of adjacent rows stores each x row's outputs as one masked
// vector run.
//
// Numerics: float32 accumulation in both dtypes; bfloat16 products are exact in float32
// (weights widened, or multiplied in pairs by vdpbf16ps where the CPU has AVX512-BF16). Each
// output's partial sums are combined in a fixed order, so results do not depend on the thread
// count.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Optional.h>
#include <torch/library.h>

#include "parallel.h"
#include "scalar.h"
#include "vec_avx512.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace corefleet {
namespace {

constexpr int64_t kMaxRows = 64;    // x rows this op accepts; larger batches are GEMMs
constexpr int64_t kRowsPerTile = 8;  // weight rows streamed together
constexpr int64_t kMaxRowsSideBySide = 24;  // x rows up to which a tile takes rows from sub-bands
constexpr int64_t kLanes = 16;       // floats per partial-sum vector

#if defined(__AVX512F__)
// dots[j * R + r] = <w[r * row_step], x[j]> for R weight rows row_step elements apart and MM
// float32 x rows; k % 16 == 0. Ordered by x row, so that one x row's R outputs are adjacent
// (and, for a tile of adjacent weight rows, adjacent in the output row too).
// R and MM are template parameters so the R * MM accumulators live in registers (with a
// runtime count GCC keeps them in memory and every FMA waits on a store); each weight vector
// is loaded and widened once and used for all MM x rows.
template <typename T, int R, int MM>
inline void tile_dots(const T* w, int64_t row_step, int64_t k, const float* x, float* dots) {
  __m512 acc[R * MM];  // [j * R + r], the order of dots
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int j = 0; j < MM; ++j) {
      acc[j * R + r] = _mm512_setzero_ps();
    }
  }
  for (int64_t i = 0; i < k; i += kLanes) {
    __m512 xv[MM];
#pragma GCC unroll 4
    for (int j = 0; j < MM; ++j) {
      xv[j] = _mm512_loadu_ps(x + j * k + i);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 wv = load16(w + r * row_step + i);
#pragma GCC unroll 4
      for (int j = 0; j < MM; ++j) {
        acc[j * R + r] = _mm512_fmadd_ps(wv, xv[j], acc[j * R + r]);
      }
    }
  }
  reduce_each(acc, dots);
}

#if defined(__AVX512BF16__)
// bfloat16 weights against bfloat16 x rows without widening either: vdpbf16ps multiplies 16
// pairs of bfloat16 values exactly in float32 and adds both products to a float32 lane, so one
// instruction does the work of two widen-and-FMA steps, which speeds up the compute-bound rows
// of a decode batch. Denormal inputs count as zero, as the instruction defines; k % 32 == 0.
template <int R, int MM>
inline void tile_dots_bf16_pairs(const c10::BFloat16* w, int64_t row_step, int64_t k,
                                 const c10::BFloat16* x, float* dots) {
  __m512 acc[R * MM];  // [j * R + r], the order of dots
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int j = 0; j < MM; ++j) {
      acc[j * R + r] = _mm512_setzero_ps();
    }
  }
  for (int64_t i = 0; i < k; i += 2 * kLanes) {
    __m512bh xv[MM];
#pragma GCC unroll 4
    for (int j = 0; j < MM; ++j) {
      xv[j] = (__m512bh)_mm512_loadu_si512(x + j * k + i);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + r * row_step + i);
#pragma GCC unroll 4
      for (int j = 0; j < MM; ++j) {
        acc[j * R + r] = _mm512_dpbf16_ps(acc[j * R + r], wv, xv[j]);
      }
    }
  }
  reduce_each(acc, dots);
}
#endif
#else
// Portable version: fixed-width independent partial sums, which GCC vectorises at -O3.
template <typename T, int R, int MM>
inline void tile_dots(const T* w, int64_t row_step, int64_t k, const float* x_rows, float* dots) {
  for (int64_t q = 0; q < R * MM; ++q) {  // q = j * R + r
    const T* row = w + (q % R) * row_step;
    const float* x = x_rows + (q / R) * k;
    float partial[kLanes] = {};
    int64_t i = 0;
    for (; i + kLanes <= k; i += kLanes) {
      for (int64_t j = 0; j < kLanes; ++j) {
        partial[j] += widen(row[i + j]) * x[i + j];
      }
    }
    float sum = 0.f;
    for (int64_t j = 0; j < kLanes; ++j) {
      sum += partial[j];
    }
    for (; i < k; ++i) {
      sum += widen(row[i]) * x[i];
    }
    dots[q] = sum;
  }
}
#endif

// out[i] = v[i] + bias[i] for the R <= 16 outputs of one x row against adjacent weight rows.
// With masked vector loads and stores (AVX512-BW/VL): one output at a time, the bfloat16
// rounding and the stores cost as much as a K = 576 tile's dot products' last third.
template <typename T, int R>
inline void store_run(const float* v, const T* bias, T* out) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  static_assert(R <= 16, "one vector of outputs");
  const __mmask16 mask = static_cast<__mmask16>((1u << R) - 1u);
  __m512 sum = _mm512_maskz_loadu_ps(mask, v);
  if constexpr (std::is_same_v<T, float>) {
    if (bias != nullptr) {
      sum = _mm512_add_ps(sum, _mm512_maskz_loadu_ps(mask, bias));
    }
    _mm512_mask_storeu_ps(out, mask, sum);
  } else {
    if (bias != nullptr) {
      sum = _mm512_add_ps(sum, widen16(_mm256_maskz_loadu_epi16(mask, bias)));
    }
    _mm256_mask_storeu_epi16(out, mask, round_to_bf16(sum));
  }
#else
  for (int r = 0; r < R; ++r) {
    store(v[r] + (bias != nullptr ? widen(bias[r]) : 0.f), out + r);
  }
#endif
}

// One tile: R weight rows row0, row0 + step, ... against x rows [m0, m0 + MM), written to out.
// X is float (x widened once) or, on the bf16-pairs path, bfloat16 (x as given).
template <typename T, typename X, int R, int MM>
inline void tile(const T* w, const T* bias, const X* xs, int64_t row0, int64_t step,
                 int64_t m0, int64_t k, int64_t n, T* out) {
  float dots[R * MM];
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<X, c10::BFloat16>) {
    tile_dots_bf16_pairs<R, MM>(w + row0 * k, step * k, k, xs + m0 * k, dots);
  } else {
    tile_dots<T, R, MM>(w + row0 * k, step * k, k, xs + m0 * k, dots);
  }
#else
  tile_dots<T, R, MM>(w + row0 * k, step * k, k, xs + m0 * k, dots);
#endif
  for (int j = 0; j < MM; ++j) {
    T* orow = out + (m0 + j) * n + row0;
    if (step == 1) {  // adjacent weight rows: the R outputs are one run of the output row
      store_run<T, R>(dots + j * R, bias != nullptr ? bias + row0 : nullptr, orow);
      continue;
    }
    for (int r = 0; r < R; ++r) {
      const float bias_r = bias != nullptr ? widen(bias[row0 + r * step]) : 0.f;
      store(dots[j * R + r] + bias_r, orow + r * step);
    }
  }
}

// All x rows against R weight rows, three x rows at a time: R * 3 accumulators plus the x and
// weight vectors fit in the 32 AVX-512 registers at R = 8 (four x rows would spill). Three
// rather than two loads fewer x vectors per FMA, which pays at 32-64 rows.
// `next` (or nullptr) is the tile to read after this one, [next_elems] contiguous weights:
// each pass over x prefetches its share, so the next tile is in cache when it starts instead
// of stalling its first pass on DRAM (adjacent tiles are short streams the hardware
// prefetcher picks up late).
template <typename T, typename X, int R>
inline void tile_all_rows(const T* w, const T* bias, const X* xs, int64_t row0, int64_t step,
                          int64_t m, int64_t k, int64_t n, T* out, const T* next = nullptr,
                          int64_t next_elems = 0) {
  if (next == nullptr) {  // side by side: the plain loop (one merged loop measured slower)
    int64_t m0 = 0;
    for (; m0 + 3 <= m; m0 += 3) tile<T, X, R, 3>(w, bias, xs, row0, step, m0, k, n, out);
    for (; m0 + 2 <= m; m0 += 2) tile<T, X, R, 2>(w, bias, xs, row0, step, m0, k, n, out);
    if (m0 < m) tile<T, X, R, 1>(w, bias, xs, row0, step, m0, k, n, out);
    return;
  }
  const int64_t passes = (m + 2) / 3;
  const int64_t next_bytes = next_elems * static_cast<int64_t>(sizeof(T));
  const int64_t bytes_per_pass = (next_bytes / passes + 63) / 64 * 64;
  const char* prefetch = reinterpret_cast<const char*>(next);
  const char* prefetch_end = prefetch + next_bytes;
  int64_t m0 = 0;
  while (m0 < m) {
    for (int64_t byte = 0; byte < bytes_per_pass && prefetch < prefetch_end; byte += 64) {
      __builtin_prefetch(prefetch, 0, 3);
      prefetch += 64;
    }
    if (m - m0 >= 3) {
      tile<T, X, R, 3>(w, bias, xs, row0, step, m0, k, n, out);
      m0 += 3;
    } else if (m - m0 == 2) {
      tile<T, X, R, 2>(w, bias, xs, row0, step, m0, k, n, out);
      m0 += 2;
    } else {
      tile<T, X, R, 1>(w, bias, xs, row0, step, m0, k, n, out);
      m0 += 1;
    }
  }
}

// One thread's band of weight rows [r0, r1). With few x rows, kRowsPerTile sub-bands of
// `step` rows walked side by side; with more, tiles of adjacent rows: a tile's rows are then
// reused by several passes over x from L1, and rows `step` apart often map to the same L1 sets
// (step * K * sizeof(T) a multiple of 4 KiB) and evict each other. Measured, adjacent tiles
// with prefetch win from 32 rows and sub-bands up to 24 (kMaxRowsSideBySide; the figures are
// in docs/kernels.md). The fewer than kRowsPerTile rows left over form one tile of adjacent
// rows.
template <typename T, typename X>
void band(const T* w, const T* bias, const X* xs, int64_t r0, int64_t r1, int64_t m,
          int64_t k, int64_t n, T* out) {
  const int64_t tiles = (r1 - r0) / kRowsPerTile;
  const bool side_by_side = m <= kMaxRowsSideBySide;
  const int64_t step = side_by_side ? tiles : 1;
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t row0 = side_by_side ? r0 + t : r0 + t * kRowsPerTile;
    // Adjacent tiles prefetch the next one; side by side, the hardware prefetcher keeps up.
    const T* next = side_by_side || t + 1 == tiles ? nullptr : w + (row0 + kRowsPerTile) * k;
    tile_all_rows<T, X, kRowsPerTile>(w, bias, xs, row0, step, m, k, n, out, next,
                                      kRowsPerTile * k);
  }
  const int64_t rest = r0 + tiles * kRowsPerTile;
  switch (r1 - rest) {
    case 7: tile_all_rows<T, X, 7>(w, bias, xs, rest, 1, m, k, n, out); break;
    case 6: tile_all_rows<T, X, 6>(w, bias, xs, rest, 1, m, k, n, out); break;
    case 5: tile_all_rows<T, X, 5>(w, bias, xs, rest, 1, m, k, n, out); break;
    case 4: tile_all_rows<T, X, 4>(w, bias, xs, rest, 1, m, k, n, out); break;
    case 3: tile_all_rows<T, X, 3>(w, bias, xs, rest, 1, m, k, n, out); break;
    case 2: tile_all_rows<T, X, 2>(w, bias, xs, rest, 1, m, k, n, out); break;
    case 1: tile_all_rows<T, X, 1>(w, bias, xs, rest, 1, m, k, n, out); break;
    default: break;
  }
}

template <typename T>
void small_linear_kernel(
    const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
    at::Tensor& out) {
  const int64_t m = x.size(0);
  const int64_t k = x.size(1);
  const int64_t n = weight.size(0);
  const T* w = weight.data_ptr<T>();
  const T* b = bias.has_value() ? bias->data_ptr<T>() : nullptr;
  T* o = out.data_ptr<T>();

  // Bands of at least 64 rows, claimed by the threads one by one (parallel.h): a grain of 64
  // rows keeps per-band overhead small next to streaming 64 * K weights, and gives both cores
  // work for the smallest projections.
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (k % (2 * kLanes) == 0) {
      const T* xs = x.data_ptr<T>();
      parallel_for(0, n, 64, [&](int64_t r0, int64_t r1) {
        band<T, T>(w, b, xs, r0, r1, m, k, n, o);
      });
      return;
    }
  }
#endif
  // x widened to float32 once: [M, K], a few KB that every thread reads from cache.
  std::vector<float> xf(static_cast<size_t>(m * k));
  const T* xs = x.data_ptr<T>();
  for (int64_t i = 0; i < m * k; ++i) {
    xf[i] = widen(xs[i]);
  }
  parallel_for(0, n, 64, [&](int64_t r0, int64_t r1) {
    band<T, float>(w, b, xf.data(), r0, r1, m, k, n, o);
  });
}

at::Tensor small_linear(
    const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2, "small_linear expects x [M, K], weight [N, K]");
  TORCH_CHECK(x.size(0) <= kMaxRows, "small_linear takes at most ", kMaxRows, " rows, got ",
              x.size(0));
  TORCH_CHECK(x.size(1) == weight.size(1), "x and weight disagree on K: ", x.size(1), " vs ",
              weight.size(1));
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "x and weight must share a dtype");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "small_linear supports float32 and bfloat16, got ", x.scalar_type());
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "x and weight must be contiguous");
#if defined(__AVX512F__)
  TORCH_CHECK(x.size(1) % kLanes == 0, "K must be a multiple of 16 (AVX-512 path)");
#endif
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == weight.size(0) && bias->is_contiguous() &&
                    bias->scalar_type() == x.scalar_type(),
                "bias must be a contiguous [N] tensor of x's dtype");
  }
  at::Tensor out = at::empty({x.size(0), weight.size(0)}, x.options());  // [M, N]
  if (out.numel() == 0) {
    return out;
  }
  if (x.scalar_type() == at::kFloat) {
    small_linear_kernel<float>(x, weight, bias, out);
  } else {
    small_linear_kernel<c10::BFloat16>(x, weight, bias, out);
  }
  return out;
}

}  // namespace
}  // namespace corefleet

TORCH_LIBRARY_FRAGMENT(corefleet_cpu, m) {
  m.def("small_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor", &corefleet::small_linear);
}
