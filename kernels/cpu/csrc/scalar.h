// Scalar float32 <-> bfloat16 helpers shared by the C++ CPU ops, which read either dtype,
// compute in float32 and round once on the way out (where kernels/reference.py rounds). The
// AVX-512 counterparts, 16 lanes at a time, are in vec_avx512.h.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>

namespace corefleet {

// bf16 -> fp32 is exact: a bfloat16 is the high half of a float32 bit pattern.
inline float widen(float v) { return v; }
inline float widen(c10::BFloat16 v) { return static_cast<float>(v); }

// fp32 -> T; to bfloat16 as c10::BFloat16's constructor rounds (to nearest even, NaN kept).
template <typename T>
inline T narrow(float v) {
  return static_cast<T>(v);
}

template <typename T>
inline void store(float value, T* out) {
  *out = narrow<T>(value);
}

// `n` values of a row as float32: float32 rows are used in place, bfloat16 rows are widened
// into `scratch` (n floats), which is returned.
inline const float* widen_row(const float* row, float* /*scratch*/, int64_t /*n*/) {
  return row;
}

inline const float* widen_row(const c10::BFloat16* row, float* __restrict scratch, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    scratch[i] = widen(row[i]);
  }
  return scratch;
}

}  // namespace corefleet
