// GGUF block formats for the C++ CPU ops (gguf_linear_cpu.cpp, gguf_dequantize_cpu.cpp): the
// format table, the argument checks both ops share, and each block decoded one value at a time
// (the portable path; gguf_blocks_avx512.h decodes sixteen values per instruction).
//
// A quantized weight [N, K] is a uint8 tensor [N, K / elems * bytes]: each row is its blocks one
// after another, as the GGUF file stores them (kernels/gguf_quant.py documents every byte). Per
// block (d, dmin, m float16; q the stored integers; s the sub-block):
//   Q8_0  32 values, 34 bytes:  d, int8 q[32]                          value = q * d
//   Q4_0  32 values, 18 bytes:  d, nibbles[16] (byte j: values j, j+16)  value = d * (q - 8)
//   Q4_1  32 values, 20 bytes:  d, m, nibbles as Q4_0                   value = d * q + m
//   Q4_K  256 values, 144 bytes: d, dmin, scales[12] (eight 6-bit scales and mins),
//         nibbles[128] (32-byte group g: sub-block 2g low, 2g+1 high)
//         value = (d * sc[s]) * q - dmin * mn[s]
//   Q5_K  256 values, 176 bytes: as Q4_K with qh[32] before the nibbles (bit s of qh[j]: the
//         fifth bit of value j of sub-block s)
//   Q6_K  256 values, 210 bytes: ql[128], qh[64], int8 scales[16] (one per 16 values), d
//         value = (d * sc[v / 16]) * (q - 32)
//
// Rounding: the values equal the `gguf` package's dequantization bit for bit (the tests' oracle):
// each product and sum is rounded to float32 where numpy rounds it. Where the oracle rounds a
// product before adding an offset (Q4_1, Q4_K, Q5_K), the exact mode keeps the two roundings;
// the fused mode (gguf_linear's dot products, where a last-bit difference in a weight is noise)
// may fuse them. Q4_0 and Q6_K's offsets are the scale times a power of two, so one fused
// multiply-add is exact there, and Q8_0 has none.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace corefleet {
namespace gguf {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "GGUF blocks are little-endian");

struct Exact {};  // round where the gguf package rounds: gguf_dequantize
struct Fused {};  // a fused multiply-add may round once instead of twice: gguf_linear

inline float f16(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// The value of `v` as rounded to float32, which the compiler may not fuse into a following add
// (GCC contracts a * b + c into an FMA under -std=c++20, even in intrinsics). Costs nothing: the
// empty asm only pins the value to a register.
inline float no_contract(float v) {
#if defined(__x86_64__)
  __asm__("" : "+x"(v));
#elif defined(__aarch64__)
  __asm__("" : "+w"(v));
#else
  volatile float pinned = v;
  v = pinned;
#endif
  return v;
}

// Q4_K/Q5_K's 12 scale bytes -> eight 6-bit scales and eight mins, one per byte of a uint64
// (byte s for sub-block s), computed four bytes at a time. Bytes 0-3 hold scales 0-3 in their
// low six bits, bytes 4-7 mins 0-3; scales and mins 4-7 take their low four bits from bytes
// 8-11 (low nibble, high nibble) and their top two bits from the top bits of bytes 0-3 / 4-7.
// (x >> 2) & 0x30 moves each byte's bits 6-7 to bits 4-5 of the same byte.
inline void k_scales_mins(const uint8_t* p, uint64_t* scales, uint64_t* mins) {
  uint32_t lo_s, lo_m, hi;
  std::memcpy(&lo_s, p, 4);
  std::memcpy(&lo_m, p + 4, 4);
  std::memcpy(&hi, p + 8, 4);
  const uint32_t s47 = (hi & 0x0F0F0F0Fu) | ((lo_s >> 2) & 0x30303030u);
  const uint32_t m47 = ((hi >> 4) & 0x0F0F0F0Fu) | ((lo_m >> 2) & 0x30303030u);
  *scales = (lo_s & 0x3F3F3F3Fu) | static_cast<uint64_t>(s47) << 32;
  *mins = (lo_m & 0x3F3F3F3Fu) | static_cast<uint64_t>(m47) << 32;
}

// scale * q + offset, rounded as Mode says (for the offsets not a multiple of the scale).
template <typename Mode>
inline float affine(float q, float scale, float offset) {
  if constexpr (std::is_same_v<Mode, Exact>) {
    return no_contract(scale * q) + offset;
  } else {
    return scale * q + offset;
  }
}

// One format per struct: its size, and `decode<Mode>(block, out)` writing its `kElems` values.
struct Q8_0 {
  static constexpr const char* kName = "Q8_0";
  static constexpr int64_t kType = 8, kElems = 32, kBytes = 34;
  template <typename Mode>
  static void decode(const uint8_t* b, float* out) {
    const float d = f16(b);
    for (int i = 0; i < 32; ++i) out[i] = static_cast<float>(static_cast<int8_t>(b[2 + i])) * d;
  }
};

struct Q4_0 {
  static constexpr const char* kName = "Q4_0";
  static constexpr int64_t kType = 2, kElems = 32, kBytes = 18;
  template <typename Mode>
  static void decode(const uint8_t* b, float* out) {
    const float d = f16(b);
    for (int j = 0; j < 16; ++j) {
      out[j] = d * static_cast<float>((b[2 + j] & 0x0F) - 8);
      out[j + 16] = d * static_cast<float>((b[2 + j] >> 4) - 8);
    }
  }
};

struct Q4_1 {
  static constexpr const char* kName = "Q4_1";
  static constexpr int64_t kType = 3, kElems = 32, kBytes = 20;
  template <typename Mode>
  static void decode(const uint8_t* b, float* out) {
    const float d = f16(b), m = f16(b + 2);
    for (int j = 0; j < 16; ++j) {
      out[j] = affine<Mode>(static_cast<float>(b[4 + j] & 0x0F), d, m);
      out[j + 16] = affine<Mode>(static_cast<float>(b[4 + j] >> 4), d, m);
    }
  }
};

// Q4_K and Q5_K: sub-block s's scale d * sc[s] and offset -(dmin * mn[s]), each rounded once.
inline void k_affine(const uint8_t* b, float* scale, float* offset) {
  const float d = f16(b), dmin = f16(b + 2);
  uint64_t sc, mn;
  k_scales_mins(b + 4, &sc, &mn);
  for (int s = 0; s < 8; ++s) {
    scale[s] = d * static_cast<float>((sc >> (8 * s)) & 0x3F);
    offset[s] = -(dmin * static_cast<float>((mn >> (8 * s)) & 0x3F));
  }
}

struct Q4_K {
  static constexpr const char* kName = "Q4_K";
  static constexpr int64_t kType = 12, kElems = 256, kBytes = 144;
  template <typename Mode>
  static void decode(const uint8_t* b, float* out) {
    float scale[8], offset[8];
    k_affine(b, scale, offset);
    for (int s = 0; s < 8; ++s) {
      const uint8_t* q = b + 16 + 32 * (s / 2);
      const int shift = 4 * (s % 2);
      for (int j = 0; j < 32; ++j) {
        out[32 * s + j] = affine<Mode>(static_cast<float>((q[j] >> shift) & 0x0F), scale[s],
                                       offset[s]);
      }
    }
  }
};

struct Q5_K {
  static constexpr const char* kName = "Q5_K";
  static constexpr int64_t kType = 13, kElems = 256, kBytes = 176;
  template <typename Mode>
  static void decode(const uint8_t* b, float* out) {
    float scale[8], offset[8];
    k_affine(b, scale, offset);
    const uint8_t* qh = b + 16;
    for (int s = 0; s < 8; ++s) {
      const uint8_t* q = b + 48 + 32 * (s / 2);
      const int shift = 4 * (s % 2);
      for (int j = 0; j < 32; ++j) {
        const int v = ((q[j] >> shift) & 0x0F) | (((qh[j] >> s) & 1) << 4);
        out[32 * s + j] = affine<Mode>(static_cast<float>(v), scale[s], offset[s]);
      }
    }
  }
};

struct Q6_K {
  static constexpr const char* kName = "Q6_K";
  static constexpr int64_t kType = 14, kElems = 256, kBytes = 210;
  template <typename Mode>
  static void decode(const uint8_t* b, float* out) {
    const float d = f16(b + 208);
    // Half h of 128 values, group i of 32 in it: low nibbles (i < 2) or high nibbles of
    // ql[64h + 32 (i % 2) + j], two high bits from bits 2i of qh[32h + j].
    for (int h = 0; h < 2; ++h) {
      for (int i = 0; i < 4; ++i) {
        const uint8_t* ql = b + 64 * h + 32 * (i % 2);
        const uint8_t* qh = b + 128 + 32 * h;
        for (int j = 0; j < 32; ++j) {
          const int v = 128 * h + 32 * i + j;
          const int q = ((ql[j] >> (4 * (i / 2))) & 0x0F) | (((qh[j] >> (2 * i)) & 3) << 4);
          const float scale = d * static_cast<float>(static_cast<int8_t>(b[192 + v / 16]));
          out[v] = scale * static_cast<float>(q - 32);
        }
      }
    }
  }
};

// Calls fn(Format{}) for the format with ggml type id `type`; raises for any other id.
template <typename Fn>
decltype(auto) visit(int64_t type, const char* op, Fn&& fn) {
  switch (type) {
    case Q8_0::kType: return fn(Q8_0{});
    case Q4_0::kType: return fn(Q4_0{});
    case Q4_1::kType: return fn(Q4_1{});
    case Q4_K::kType: return fn(Q4_K{});
    case Q5_K::kType: return fn(Q5_K{});
    case Q6_K::kType: return fn(Q6_K{});
    default:
      TORCH_CHECK(false, op, ": unsupported ggml_type ", type,
                  " (supported: Q4_0=2, Q4_1=3, Q8_0=8, Q4_K=12, Q5_K=13, Q6_K=14)");
  }
}

// The checks both ops make on a quantized weight of K values a row, before any work.
template <typename F>
void check_qweight(const char* op, const at::Tensor& qweight, int64_t k) {
  TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.dim() == 2, op,
              ": qweight must be a 2-D uint8 tensor [N, row_bytes], got ", qweight.scalar_type(),
              " with ", qweight.dim(), " dimensions");
  TORCH_CHECK(qweight.is_contiguous(), op, ": qweight must be contiguous");
  TORCH_CHECK(k > 0 && k % F::kElems == 0, op, ": K must be a positive multiple of ", F::kName,
              "'s block of ", F::kElems, " values, got ", k);
  TORCH_CHECK(qweight.size(1) == k / F::kElems * F::kBytes, op, ": a ", F::kName, " row of K=", k,
              " values has ", k / F::kElems * F::kBytes, " bytes, qweight rows have ",
              qweight.size(1));
}

}  // namespace gguf
}  // namespace corefleet
