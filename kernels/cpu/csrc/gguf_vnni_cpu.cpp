// Linear layer on GGUF weights with integer dot products (AVX512-VNNI): out = x @ W^T (+ bias)
// with W packed once at load (gguf_vnni_layout.h) and x quantized per block of 32 to int8 on
// each call (gguf_vnni_quantize.h), for Q4_0, Q4_1 and Q8_0.
//
// Layouts (row-major):
//   x        [M, K]                 float32 or bfloat16, contiguous, M >= 1, K % 32 == 0
//   packed   [N_pad, K / 32 * bytes] uint8: gguf_pack_vnni's output (N_pad: N up to 16)
//   bias     [N]                    x's dtype, optional
//   returns  [M, N]                 x's dtype
//
// Why: gguf_linear (gguf_linear_cpu.cpp) decodes every weight to float and multiplies it by
// float activations: at a few rows that is the bytes' speed, but with many rows the decode and
// the float multiplies are the cost, and the weights' file layout makes each of a thread's
// eight row streams a separate prefetch. Here the weight bytes go straight into vpdpbusd (64
// byte products an instruction, against 16 or 32 float ones), the x side is quantized once per
// call, and a tile's 16 rows are one contiguous stream.
//
// How: tiles of 16 rows are split between the threads (parallel.h). A thread walks its tiles in
// groups of kTileGroup and the x rows in chunks of kRowChunk: each tile of the group meets every
// x row of the chunk, kMaxRows at a time (gguf_vnni_dots.h), 16 KiB of its blocks at a time, so
// a tile is read from memory once and its blocks from L1 by the chunk's passes (a whole tile,
// 18-74 KiB at K = 2048-8192 for Q4_0, 35 KiB for Q8_0 at 2048, would not stay in L1); the x
// chunk stays in L2.
//
// Numerics: the product with x rounded to its int8 blocks (the activations' quantization error:
// ~0.4 % of a block's largest value at worst), exactly: integer block dots, then float32 sums of
// one product per block in K order. kernels/gguf_vnni_reference.py computes the same in torch.
// The result does not depend on the thread count or on the other rows of the batch.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Optional.h>
#include <torch/library.h>

#include "gguf_vnni_dots.h"
#include "gguf_vnni_layout.h"
#include "gguf_vnni_quantize.h"
#include "parallel.h"
#include "scalar.h"

#include <algorithm>
#include <cstdint>

#if defined(__AVX512F__)
#include "vec_avx512.h"
#endif

namespace corefleet {
namespace {

using vnni::kTileRows;

constexpr int64_t kMaxRows = 8;    // x rows per pass over a tile: 2 x 8 accumulators
constexpr int64_t kTileGroup = 8;  // tiles that share one x row chunk
constexpr int64_t kRowChunk = 64;  // x rows a tile group meets before the next chunk
constexpr int64_t kChunkBytes = 16 << 10;  // a tile's blocks met by all the chunk's rows: L1

template <typename T>
struct Problem {
  const uint8_t* packed;  // [N_pad, row_bytes]
  const T* bias;          // [N] or nullptr
  T* out;                 // [M, N]
  int64_t n, row_bytes;
  vnni::QuantizedX x;
};

// out[m0 + m, 16t + r] = acc[m][r] + bias for the tile's rows below N.
template <typename T>
void store_rows(const Problem<T>& p, const float* acc, int64_t t, int64_t m0, int64_t mb) {
  const int64_t n0 = t * kTileRows;
  const int64_t rows = std::min(kTileRows, p.n - n0);
  for (int64_t m = 0; m < mb; ++m) {
    T* out = p.out + (m0 + m) * p.n + n0;
#if defined(__AVX512F__)
    if (rows == kTileRows) {  // a whole tile: one vector
      __m512 v = _mm512_load_ps(acc + m * kTileRows);
      if (p.bias != nullptr) v = _mm512_add_ps(v, load16(p.bias + n0));
      store16(out, v);
      continue;
    }
#endif
    for (int64_t r = 0; r < rows; ++r) {
      const float b = p.bias != nullptr ? widen(p.bias[n0 + r]) : 0.f;
      store(acc[m * kTileRows + r] + b, out + r);
    }
  }
}

// acc_mem [mb, 16] += tile t's rows against x rows [m0, m0 + mb) (mb <= kMaxRows) over blocks
// [b0, b1): the accumulators pass through memory between block chunks (exactly).
template <typename F, typename T>
void tile_chunk(const Problem<T>& p, int64_t t, int64_t m0, int64_t mb, int64_t b0, int64_t b1,
                float* acc_mem) {
  const uint8_t* tile = p.packed + t * kTileRows * p.row_bytes;
#if defined(COREFLEET_GGUF_VNNI)
  __m512 acc[kMaxRows];
  for (int64_t m = 0; m < mb; ++m) acc[m] = _mm512_load_ps(acc_mem + m * kTileRows);
  switch (mb) {
    case 1: vnni::tile_dots<F, 1>(tile, p.x, m0, b0, b1, acc); break;
    case 2: vnni::tile_dots<F, 2>(tile, p.x, m0, b0, b1, acc); break;
    case 3: vnni::tile_dots<F, 3>(tile, p.x, m0, b0, b1, acc); break;
    case 4: vnni::tile_dots<F, 4>(tile, p.x, m0, b0, b1, acc); break;
    case 5: vnni::tile_dots<F, 5>(tile, p.x, m0, b0, b1, acc); break;
    case 6: vnni::tile_dots<F, 6>(tile, p.x, m0, b0, b1, acc); break;
    case 7: vnni::tile_dots<F, 7>(tile, p.x, m0, b0, b1, acc); break;
    default: vnni::tile_dots<F, 8>(tile, p.x, m0, b0, b1, acc); break;
  }
  for (int64_t m = 0; m < mb; ++m) _mm512_store_ps(acc_mem + m * kTileRows, acc[m]);
#else
  vnni::tile_dots_scalar<F>(tile, p.x, m0, mb, b0, b1, acc_mem);
#endif
}

// One thread's tiles [t0, t1): groups of kTileGroup tiles, each against the x rows in chunks
// of kRowChunk; a tile meets a chunk's rows kMaxRows at a time over kChunkBytes of its blocks
// (which stay in L1 for the chunk's passes), then the next blocks.
template <typename F, typename T>
void band(const Problem<T>& p, int64_t t0, int64_t t1) {
  const int64_t m = p.x.m, nb = p.x.nb;
  const int64_t chunk_blocks = std::max<int64_t>(1, kChunkBytes / vnni::kTileBlockBytes<F>);
  alignas(64) float acc_mem[kRowChunk * kTileRows];  // [rows of the chunk, 16]
  for (int64_t g0 = t0; g0 < t1; g0 += kTileGroup) {
    const int64_t g1 = std::min(g0 + kTileGroup, t1);
    for (int64_t c0 = 0; c0 < m; c0 += kRowChunk) {
      const int64_t c1 = std::min(c0 + kRowChunk, m);
      for (int64_t t = g0; t < g1; ++t) {
        std::fill(acc_mem, acc_mem + (c1 - c0) * kTileRows, 0.f);
        for (int64_t b0 = 0; b0 < nb; b0 += chunk_blocks) {
          const int64_t b1 = std::min(b0 + chunk_blocks, nb);
          for (int64_t m0 = c0; m0 < c1; m0 += kMaxRows) {
            tile_chunk<F, T>(p, t, m0, std::min(kMaxRows, c1 - m0), b0, b1,
                             acc_mem + (m0 - c0) * kTileRows);
          }
        }
        store_rows(p, acc_mem, t, c0, c1 - c0);
      }
    }
  }
}

template <typename F, typename T>
void run(const at::Tensor& x, const at::Tensor& packed, int64_t n,
         const c10::optional<at::Tensor>& bias, at::Tensor& out) {
  const int64_t m = x.size(0), k = x.size(1), nb = k / vnni::kBlock;
  at::Tensor q = at::empty({m, k}, x.options().dtype(at::kChar));
  at::Tensor d = at::empty({m, nb}, x.options().dtype(at::kFloat));
  at::Tensor corr = at::empty({m, nb}, x.options().dtype(at::kInt));
  at::Tensor dsum = at::empty({m, nb}, x.options().dtype(at::kFloat));
  const T* xs = x.data_ptr<T>();
  int8_t* qs = q.data_ptr<int8_t>();
  float *ds = d.data_ptr<float>(), *sums = dsum.data_ptr<float>();
  int32_t* corrs = corr.data_ptr<int32_t>();
  parallel_for(0, m, std::max<int64_t>(1, 16384 / k), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      vnni::quantize_row(xs + r * k, k, vnni::Packed<F>::kOffset, qs + r * k, ds + r * nb,
                         corrs + r * nb, sums + r * nb);
    }
  });
  Problem<T> p{packed.data_ptr<uint8_t>(),
               bias.has_value() ? bias->data_ptr<T>() : nullptr,
               out.data_ptr<T>(),
               n,
               packed.size(1),
               {qs, ds, corrs, sums, m, k, nb}};
  // Few x rows: bands of 4 tiles (64 rows, as gguf_linear), for both cores on the smallest
  // projections; many: single tiles, each already a long piece of work.
  const int64_t grain = m <= kMaxRows ? 4 : 1;
  parallel_for(0, packed.size(0) / kTileRows, grain,
               [&](int64_t t0, int64_t t1) { band<F, T>(p, t0, t1); });
}

at::Tensor gguf_linear_vnni(const at::Tensor& x, const at::Tensor& packed, int64_t ggml_type,
                            int64_t n, const c10::optional<at::Tensor>& bias) {
  constexpr const char* op = "gguf_linear_vnni";
  TORCH_CHECK(x.dim() == 2, op, ": x must be [M, K], got ", x.dim(), " dimensions");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
              ": x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(x.is_contiguous(), op, ": x must be contiguous");
  TORCH_CHECK(x.size(0) > 0, op, ": x has no rows (M = 0)");
  return vnni::visit(ggml_type, op, [&](auto format) {
    using F = decltype(format);
    vnni::check_packed<F>(op, packed, n, x.size(1));
    if (bias.has_value()) {
      TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n && bias->is_contiguous() &&
                      bias->scalar_type() == x.scalar_type(),
                  op, ": bias must be a contiguous [N] tensor of x's dtype");
    }
    at::Tensor out = at::empty({x.size(0), n}, x.options());  // [M, N]
    if (x.scalar_type() == at::kFloat) {
      run<F, float>(x, packed, n, bias, out);
    } else {
      run<F, c10::BFloat16>(x, packed, n, bias, out);
    }
    return out;
  });
}

// [N, K / 32 * bytes] file blocks -> [N_pad, same] packed tiles.
at::Tensor gguf_pack_vnni(const at::Tensor& qweight, int64_t ggml_type) {
  constexpr const char* op = "gguf_pack_vnni";
  return vnni::visit(ggml_type, op, [&](auto format) {
    using F = decltype(format);
    TORCH_CHECK(qweight.dim() == 2 && qweight.size(0) > 0, op,
                ": qweight must be [N, row_bytes] with N > 0");
    const int64_t k = qweight.size(1) / F::kBytes * F::kElems;
    gguf::check_qweight<F>(op, qweight, k);
    const int64_t n = qweight.size(0), blocks = k / F::kElems;
    at::Tensor packed = at::empty({vnni::padded_rows(n), qweight.size(1)}, qweight.options());
    const uint8_t* src = qweight.data_ptr<uint8_t>();
    uint8_t* dst = packed.data_ptr<uint8_t>();
    parallel_for(0, packed.size(0) / kTileRows, 16, [&](int64_t t0, int64_t t1) {
      vnni::pack_tiles<F>(src, n, blocks, t0, t1, dst);
    });
    return packed;
  });
}

// Rows of a packed weight of N rows back in the file's layout: all N, or those in `rows` [R]
// (int64, each in [0, N): an embedding lookup on a packed table).
at::Tensor gguf_unpack_vnni(const at::Tensor& packed, int64_t ggml_type, int64_t n,
                            const c10::optional<at::Tensor>& rows) {
  constexpr const char* op = "gguf_unpack_vnni";
  return vnni::visit(ggml_type, op, [&](auto format) {
    using F = decltype(format);
    const int64_t k = packed.dim() == 2 ? packed.size(1) / F::kBytes * F::kElems : 0;
    vnni::check_packed<F>(op, packed, n, k);
    const int64_t* ids = nullptr;
    int64_t count = n;
    if (rows.has_value()) {
      TORCH_CHECK(rows->dim() == 1 && rows->scalar_type() == at::kLong && rows->is_contiguous(),
                  op, ": rows must be a contiguous 1-D int64 tensor");
      ids = rows->data_ptr<int64_t>();
      count = rows->size(0);
      for (int64_t i = 0; i < count; ++i) {
        TORCH_CHECK(ids[i] >= 0 && ids[i] < n, op, ": row ", ids[i], " is outside [0, ", n, ")");
      }
    }
    at::Tensor out = at::empty({count, packed.size(1)}, packed.options());
    const uint8_t* src = packed.data_ptr<uint8_t>();
    uint8_t* dst = out.data_ptr<uint8_t>();
    const int64_t blocks = k / F::kElems, row_bytes = packed.size(1);
    parallel_for(0, count, 64, [&](int64_t r0, int64_t r1) {
      for (int64_t i = r0; i < r1; ++i) {
        vnni::unpack_row<F>(src, blocks, ids != nullptr ? ids[i] : i, dst + i * row_bytes);
      }
    });
    return out;
  });
}

// Whether this build's gguf_linear_vnni runs on VNNI (else on its portable integer loop).
bool gguf_vnni_available() {
#if defined(COREFLEET_GGUF_VNNI)
  return true;
#else
  return false;
#endif
}

}  // namespace
}  // namespace corefleet

TORCH_LIBRARY_FRAGMENT(corefleet_cpu, m) {
  m.def("gguf_linear_vnni(Tensor x, Tensor packed, int ggml_type, int n, Tensor? bias) -> Tensor",
        &corefleet::gguf_linear_vnni);
  m.def("gguf_pack_vnni(Tensor qweight, int ggml_type) -> Tensor", &corefleet::gguf_pack_vnni);
  m.def("gguf_unpack_vnni(Tensor packed, int ggml_type, int n, Tensor? rows) -> Tensor",
        &corefleet::gguf_unpack_vnni);
  m.def("gguf_vnni_available() -> bool", &corefleet::gguf_vnni_available);
}
