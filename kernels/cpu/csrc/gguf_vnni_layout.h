// The packed layout of GGUF weights for the integer (AVX512-VNNI) linear, and the conversions
// from and to the file's layout (gguf_blocks.h). Plain C++: every build packs and unpacks alike.
//
// A weight [N, K] of Q4_0, Q4_1 or Q8_0 (32-value blocks) is cut into tiles of 16 output rows
// (the last tile padded with zero rows); a tile's blocks are stored one after another, and block
// b of a tile holds block b of its 16 rows interleaved for vpdpbusd, whose 32-bit lane r sums
// four byte products: lane r of every 64-byte vector below is row r.
//
//   Q8_0  d[16] (float16, row r at 2r), then 8 vectors: vector g, lane r = row r's q[4g..4g+3]
//         each XOR 0x80 (q + 128 as an unsigned byte)                       32 + 512 = 544 bytes
//   Q4_0  d[16], then 4 vectors: vector c, lane r = row r's nibble bytes 4c..4c+3 as the file
//         has them: low nibbles are values 4c..4c+3, high nibbles values 16+4c..16+4c+3
//                                                                           32 + 256 = 288 bytes
//   Q4_1  d[16], m[16] (float16), then the nibbles as Q4_0                  64 + 256 = 320 bytes
//
// 16 rows' blocks take exactly 16 file blocks' bytes: a packed weight is the same size as the
// file's when N is a multiple of 16 (at most 15 padding rows otherwise), so it replaces the
// file's copy in memory. It is kept as a uint8 tensor [N_pad, K / 32 * block_bytes].
//
// The unsigned bytes are what vpdpbusd multiplies (unsigned weight x signed activation); the
// offset they carry (8 for Q4_0, 128 for Q8_0) is taken back per block as offset * sum(x_q).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include "gguf_blocks.h"

#include <cstdint>
#include <cstring>

namespace corefleet {
namespace vnni {

constexpr int64_t kTileRows = 16;  // output rows per tile: one float32 vector of outputs
constexpr int64_t kBlock = 32;     // values per block, in every packed format

// What the packed form of format F looks like and how its blocks map to the file's.
template <typename F>
struct Packed;

template <>
struct Packed<gguf::Q8_0> {
  static constexpr bool kMins = false;
  static constexpr int32_t kOffset = 128;  // stored byte = q + 128
  static constexpr int64_t kScaleBytes = 32, kQuantBytes = 512;
};
template <>
struct Packed<gguf::Q4_0> {
  static constexpr bool kMins = false;
  static constexpr int32_t kOffset = 8;  // value = d * (q - 8)
  static constexpr int64_t kScaleBytes = 32, kQuantBytes = 256;
};
template <>
struct Packed<gguf::Q4_1> {
  static constexpr bool kMins = true;
  static constexpr int32_t kOffset = 0;  // value = d * q + m: m * sum(x) instead
  static constexpr int64_t kScaleBytes = 64, kQuantBytes = 256;
};

template <typename F>
constexpr int64_t kTileBlockBytes = Packed<F>::kScaleBytes + Packed<F>::kQuantBytes;
static_assert(kTileBlockBytes<gguf::Q8_0> == kTileRows * gguf::Q8_0::kBytes);
static_assert(kTileBlockBytes<gguf::Q4_0> == kTileRows * gguf::Q4_0::kBytes);
static_assert(kTileBlockBytes<gguf::Q4_1> == kTileRows * gguf::Q4_1::kBytes);

inline int64_t padded_rows(int64_t n) { return (n + kTileRows - 1) / kTileRows * kTileRows; }

// Calls fn(Format{}) for the formats with a packed form; raises for any other ggml type.
template <typename Fn>
decltype(auto) visit(int64_t type, const char* op, Fn&& fn) {
  switch (type) {
    case gguf::Q8_0::kType: return fn(gguf::Q8_0{});
    case gguf::Q4_0::kType: return fn(gguf::Q4_0{});
    case gguf::Q4_1::kType: return fn(gguf::Q4_1{});
    default:
      TORCH_CHECK(false, op, ": ggml_type ", type,
                  " has no packed form (packed formats: Q4_0=2, Q4_1=3, Q8_0=8)");
  }
}

// File block `src` (row r of a tile) into the tile block `dst`, or back (Unpack).
template <typename F>
inline void pack_block(const uint8_t* src, int64_t r, uint8_t* dst) {
  using P = Packed<F>;
  std::memcpy(dst + 2 * r, src, 2);  // d
  if constexpr (P::kMins) std::memcpy(dst + 32 + 2 * r, src + 2, 2);  // m
  const uint8_t* q = src + (F::kBytes - P::kQuantBytes / kTileRows);  // the quant bytes
  uint8_t* out = dst + P::kScaleBytes + 4 * r;
  for (int64_t v = 0; v < P::kQuantBytes / 64; ++v) {
    for (int j = 0; j < 4; ++j) {
      const uint8_t byte = q[4 * v + j];
      out[64 * v + j] = P::kOffset == 128 ? static_cast<uint8_t>(byte ^ 0x80) : byte;
    }
  }
}

template <typename F>
inline void unpack_block(const uint8_t* tile_block, int64_t r, uint8_t* dst) {
  using P = Packed<F>;
  std::memcpy(dst, tile_block + 2 * r, 2);
  if constexpr (P::kMins) std::memcpy(dst + 2, tile_block + 32 + 2 * r, 2);
  uint8_t* q = dst + (F::kBytes - P::kQuantBytes / kTileRows);
  const uint8_t* in = tile_block + P::kScaleBytes + 4 * r;
  for (int64_t v = 0; v < P::kQuantBytes / 64; ++v) {
    for (int j = 0; j < 4; ++j) {
      const uint8_t byte = in[64 * v + j];
      q[4 * v + j] = P::kOffset == 128 ? static_cast<uint8_t>(byte ^ 0x80) : byte;
    }
  }
}

// Tiles [t0, t1) of the packed weight from the file's rows `file` [N, row_bytes] (padding rows
// zero: their scales are 0, so they add nothing and their outputs are never stored).
template <typename F>
void pack_tiles(const uint8_t* file, int64_t n, int64_t blocks, int64_t t0, int64_t t1,
                uint8_t* packed) {
  const int64_t row_bytes = blocks * F::kBytes;
  for (int64_t t = t0; t < t1; ++t) {
    uint8_t* tile = packed + t * kTileRows * row_bytes;
    std::memset(tile, 0, static_cast<size_t>(kTileRows * row_bytes));
    for (int64_t r = 0; r < kTileRows && t * kTileRows + r < n; ++r) {
      const uint8_t* row = file + (t * kTileRows + r) * row_bytes;
      for (int64_t b = 0; b < blocks; ++b) {
        pack_block<F>(row + b * F::kBytes, r, tile + b * kTileBlockBytes<F>);
      }
    }
  }
}

// Row `n` of the packed weight back in the file's layout (row_bytes bytes into `dst`).
template <typename F>
void unpack_row(const uint8_t* packed, int64_t blocks, int64_t n, uint8_t* dst) {
  const int64_t row_bytes = blocks * F::kBytes;
  const uint8_t* tile = packed + n / kTileRows * kTileRows * row_bytes;
  for (int64_t b = 0; b < blocks; ++b) {
    unpack_block<F>(tile + b * kTileBlockBytes<F>, n % kTileRows, dst + b * F::kBytes);
  }
}

// The checks on a packed weight of N rows of K values, before any work.
template <typename F>
void check_packed(const char* op, const at::Tensor& packed, int64_t n, int64_t k) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 2 && packed.is_contiguous(),
              op, ": the packed weight must be a contiguous 2-D uint8 tensor");
  TORCH_CHECK(n > 0, op, ": N must be positive, got ", n);
  TORCH_CHECK(k > 0 && k % kBlock == 0, op, ": K must be a positive multiple of 32, got ", k);
  TORCH_CHECK(packed.size(0) == padded_rows(n) && packed.size(1) == k / kBlock * F::kBytes, op,
              ": a packed ", F::kName, " weight of N=", n, ", K=", k, " is [", padded_rows(n),
              ", ", k / kBlock * F::kBytes, "], got [", packed.size(0), ", ", packed.size(1),
              "]");
}

}  // namespace vnni
}  // namespace corefleet
