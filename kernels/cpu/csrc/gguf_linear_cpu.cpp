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
// How: each thread takes a band of weight rows and walks it in tiles of eight rows, every row's
// stream prefetched 2 KiB ahead. With up to three x rows (two for the K-quants), a tile is one
// row from each of eight sub-bands, so that the thread reads eight long sequential streams (as
// small_linear does for a few x rows); each block of each tile row is decoded into vectors
// (gguf_blocks_avx512.h) and every vector multiplied at once by all x rows: the dequantized
// weights never leave the registers. With more x rows, decoding once per pass over x would cost
// more than the multiplies: a tile is eight adjacent rows, decoded 2 KiB of values a row at a
// time into an L1 scratch, and each chunk is multiplied by every x row, three at a time, the
// accumulators kept between chunks (the multiply loop is small_linear's tile_dots).
//
// Numerics: the activations stay float: no int8 quantization of x, so the result is the float
// product with the dequantized weights up to summation order, accumulated in float32. float32 x
// multiplies the float32 dequantized values (a fused multiply-add may round Q4_1/Q4_K/Q5_K's
// offset once where gguf_dequantize rounds twice). bfloat16 x, on a CPU with AVX512-BF16,
// multiplies the weights rounded to bfloat16, exactly the weights of the reference backend and
// of the prefill path (dequantize to x's dtype, then torch's GEMM), in pairs by vdpbf16ps (exact
// products, twice the multiplies per instruction; gguf_linear_tiles.h); elsewhere it is widened
// and takes the float32 path. Each output is a float32 sum over K in memory order, 16 partial
// sums reduced in a fixed order (reduce_each): the same whichever path, tile shape or thread
// computes it, so results depend neither on the thread count nor on which other rows are in
// the batch.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Optional.h>
#include <torch/library.h>

#include "gguf_blocks.h"
#include "gguf_linear_tiles.h"
#include "parallel.h"
#include "scalar.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace corefleet {
namespace {

constexpr int64_t kRowsPerTile = 8;  // weight rows streamed together
constexpr int64_t kLanes = 16;       // floats per partial-sum vector

// x rows up to which a tile is decoded in registers (one pass over x); above, into the L1
// scratch. Measured: the table-decoded 32-value formats gain from registers up to 3 rows, the
// K-quants (a costlier decode) are even at 2 and lose at 3.
template <typename F>
constexpr int64_t kDirectRows = F::kElems == 32 ? 3 : 2;

// What a band needs: the weight, the x rows as the kernels read them (X: float32, or bfloat16
// for the pairs path), the output and its sizes.
template <typename T, typename X>
struct Problem {
  const uint8_t* w;  // [N, row_bytes]
  const T* bias;     // [N] or nullptr
  const X* x;        // [M, x_stride], K values a row
  T* out;            // [M, N]
  int64_t m, k, n, row_bytes, x_stride;
};

// out[m0 + j, row0 + r * step] = dots[j * R + r] + bias for the tile's R rows and MM x rows.
template <typename T, typename X, int R, int MM>
inline void store_tile(const Problem<T, X>& p, const float* dots, int64_t row0, int64_t step,
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
using gguf_tiles::chunk_dots;
using gguf_tiles::decode_rows;
using gguf_tiles::direct_dots;
using gguf_tiles::kChunk;
using gguf_tiles::kStride;
using gguf_tiles::reduce_mem;

// One tile of R weight rows (row0, row0 + step, ...) against every x row. Up to kDirectRows x
// rows: decoded in registers, one pass. More: the tile decoded kChunk values at a time into
// `scratch` [R, kStride<X>] (64-byte aligned) and each chunk multiplied by every x row, three
// at a time, the M * R accumulator vectors kept in `acc_mem` [M, R, 16] between chunks.
template <typename F, typename T, typename X, int R>
void tile(const Problem<T, X>& p, int64_t row0, int64_t step, X* scratch, float* acc_mem) {
  const int64_t row_step = step * p.row_bytes;
  const int64_t blocks = p.k / F::kElems;
  const uint8_t* w = p.w + row0 * p.row_bytes;
  float dots[R * 3];
  switch (p.m) {
    case 1:
      direct_dots<F, X, R, 1>(w, row_step, blocks, p.x, p.x_stride, dots);
      store_tile<T, X, R, 1>(p, dots, row0, step, 0);
      return;
    case 2:
      direct_dots<F, X, R, 2>(w, row_step, blocks, p.x, p.x_stride, dots);
      store_tile<T, X, R, 2>(p, dots, row0, step, 0);
      return;
    case 3:
      if (kDirectRows<F> < 3) break;
      direct_dots<F, X, R, 3>(w, row_step, blocks, p.x, p.x_stride, dots);
      store_tile<T, X, R, 3>(p, dots, row0, step, 0);
      return;
    default: break;
  }
  const int64_t stride = p.x_stride;
  const auto acc = [&](int64_t m0) { return acc_mem + m0 * R * kLanes; };  // x row m0's R
  std::fill(acc_mem, acc(p.m), 0.f);
  for (int64_t c0 = 0; c0 < p.k; c0 += kChunk<X>) {
    const int64_t kc = std::min(kChunk<X>, p.k - c0);  // whole blocks: kChunk is 512 or 1024
    // Prefetched: the same chunk of the next tile (kRowsPerTile rows on), which the tile after
    // this one decodes (2 KiB ahead lands in this tile's own next row).
    decode_rows<F, X, R>(w + c0 / F::kElems * F::kBytes, row_step, kc / F::kElems, scratch,
                         kRowsPerTile * p.row_bytes);
    const X* xs = p.x + c0;
    int64_t m0 = 0;
    for (; m0 + 3 <= p.m; m0 += 3) {
      chunk_dots<X, R, 3>(scratch, kc, xs + m0 * stride, stride, acc(m0));
    }
    if (p.m - m0 == 2) chunk_dots<X, R, 2>(scratch, kc, xs + m0 * stride, stride, acc(m0));
    if (p.m - m0 == 1) chunk_dots<X, R, 1>(scratch, kc, xs + m0 * stride, stride, acc(m0));
  }
  int64_t m0 = 0;
  for (; m0 + 3 <= p.m; m0 += 3) {
    reduce_mem<R * 3>(acc(m0), dots);
    store_tile<T, X, R, 3>(p, dots, row0, step, m0);
  }
  if (p.m - m0 == 2) {
    reduce_mem<R * 2>(acc(m0), dots);
    store_tile<T, X, R, 2>(p, dots, row0, step, m0);
  } else if (p.m - m0 == 1) {
    reduce_mem<R>(acc(m0), dots);
    store_tile<T, X, R, 1>(p, dots, row0, step, m0);
  }
}

// `floats` floats of a thread's reusable buffer, 64-byte aligned (the buffer is kept between
// calls: no allocation, and no page faults, per call).
inline float* aligned_floats(std::vector<float>& storage, int64_t floats) {
  storage.resize(static_cast<size_t>(floats + kLanes));
  const auto address = reinterpret_cast<uintptr_t>(storage.data());
  return reinterpret_cast<float*>((address + 63) & ~uintptr_t{63});
}

// One thread's band of weight rows [r0, r1), in tiles of kRowsPerTile rows and then the rows
// left over one by one. In registers (few x rows, reading at memory speed): a tile is one row
// from each of kRowsPerTile sub-bands, so that the thread reads eight long sequential streams
// (small_linear's order for few rows). Decoded tiles (more x rows, compute-bound): a tile is
// kRowsPerTile adjacent rows, so that its outputs are runs of each output row; from sub-bands
// they land kRowsPerTile cache lines apart, and an output larger than L2 (the 49152-row LM
// head at 64 x rows) measured 1.4x slower for the misses.
template <typename F, typename T, typename X>
void band(const Problem<T, X>& p, int64_t r0, int64_t r1) {
  thread_local std::vector<float> scratch_storage, acc_storage;
  X* scratch = nullptr;      // [kRowsPerTile, kStride<X>] X values
  float* acc_mem = nullptr;  // [M, kRowsPerTile, kLanes]
  const bool decoded = p.m > kDirectRows<F>;
  if (decoded) {
    scratch = reinterpret_cast<X*>(aligned_floats(scratch_storage, kRowsPerTile * kStride<float>));
    acc_mem = aligned_floats(acc_storage, kRowsPerTile * p.m * kLanes);
  }
  const int64_t tiles = (r1 - r0) / kRowsPerTile;
  for (int64_t t = 0; t < tiles; ++t) {
    if (decoded) {
      tile<F, T, X, kRowsPerTile>(p, r0 + t * kRowsPerTile, 1, scratch, acc_mem);
    } else {
      tile<F, T, X, kRowsPerTile>(p, r0 + t, tiles, scratch, acc_mem);
    }
  }
  for (int64_t row = r0 + tiles * kRowsPerTile; row < r1; ++row) {
    tile<F, T, X, 1>(p, row, 1, scratch, acc_mem);
  }
}
#else
// Portable version: each row decoded into a float32 scratch row, then its dot product with
// every x row as fixed-width independent partial sums (which GCC vectorises at -O3).
template <typename F, typename T, typename X>
void band(const Problem<T, X>& p, int64_t r0, int64_t r1) {
  std::vector<float> row(static_cast<size_t>(p.k));
  const int64_t blocks = p.k / F::kElems;
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      F::template decode<gguf::Fused>(p.w + r * p.row_bytes + b * F::kBytes,
                                row.data() + b * F::kElems);
    }
    for (int64_t j = 0; j < p.m; ++j) {
      const float* x = p.x + j * p.x_stride;
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


// The x rows the kernels read, [M, x_stride] of X: x itself where it already is X; otherwise a
// copy (bfloat16 widened to float32 once, a few KB that every thread reads from cache), also
// made to pad rows 4 KiB apart by 64 bytes (see kStride). torch's allocator aligns either to
// 64 bytes: a vector load that splits across two cache lines costs two.
template <typename F, typename T, typename X>
void run(const at::Tensor& x, const at::Tensor& qweight, const c10::optional<at::Tensor>& bias,
         at::Tensor& out) {
  Problem<T, X> p{qweight.data_ptr<uint8_t>(),
                  bias.has_value() ? bias->data_ptr<T>() : nullptr,
                  nullptr,
                  out.data_ptr<T>(),
                  x.size(0),
                  x.size(1),
                  qweight.size(0),
                  qweight.size(1),
                  x.size(1)};
  at::Tensor copy;
  // Rows 4 KiB apart (K = 1024, 2048, ... floats) map to the same L1 sets: padded on the
  // decoded-tile path, which reads three of them at a time next to the scratch rows.
  const bool pad = p.m > kDirectRows<F> && p.k * static_cast<int64_t>(sizeof(X)) % 4096 == 0;
  if (std::is_same_v<T, X> && !pad) {
    p.x = reinterpret_cast<const X*>(x.data_ptr<T>());
  } else {
    p.x_stride = pad ? p.k + 64 / static_cast<int64_t>(sizeof(X)) : p.k;
    const auto dtype = std::is_same_v<X, float> ? at::kFloat : at::kBFloat16;
    copy = at::empty({p.m, p.x_stride}, x.options().dtype(dtype));
    X* dst = reinterpret_cast<X*>(copy.data_ptr());
    const T* xs = x.data_ptr<T>();
    for (int64_t j = 0; j < p.m; ++j) {
      for (int64_t i = 0; i < p.k; ++i) {
        dst[j * p.x_stride + i] = static_cast<X>(xs[j * p.k + i]);
      }
    }
    p.x = dst;
  }
  // Bands of at least 64 rows, as small_linear: small per-band overhead next to the rows'
  // bytes, and work for both cores on the smallest projections.
  parallel_for(0, p.n, 64, [&](int64_t r0, int64_t r1) { band<F, T, X>(p, r0, r1); });
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
      run<F, float, float>(x, qweight, bias, out);
    } else {
#if defined(__AVX512BF16__)
      run<F, c10::BFloat16, c10::BFloat16>(x, qweight, bias, out);  // bfloat16 pairs
#else
      run<F, c10::BFloat16, float>(x, qweight, bias, out);  // x widened
#endif
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
