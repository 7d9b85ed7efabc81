// Row-wise argmax of the logits on the CPU, for greedy sampling (and the exponential-race draw
// of random sampling, which ends in an argmax too).
//
// Layout: logits [B, V] float32 or bfloat16, rows contiguous -> [B] int64.
//
// Why it exists: torch's argmax over the last dimension is an order of magnitude slower than
// its amax, its index-tracking reduction not vectorised, and a decode step pays it once over
// the whole vocabulary (docs/kernels.md has the measurements).
//
// Semantics are torch.argmax's: the first index of the maximum; a row holding NaN gives the
// index of its first NaN (NaN compares greater than everything there).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "parallel.h"
#include "scalar.h"
#include "vec_avx512.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace corefleet {
namespace {

// The plain loop: the reference semantics, and the whole row where AVX-512 is missing.
template <typename scalar_t>
int64_t argmax_scalar(const scalar_t* row, int64_t n) {
  int64_t best = 0;
  float best_value = widen(row[0]);
  for (int64_t i = 0; i < n; ++i) {
    const float v = widen(row[i]);
    if (std::isnan(v)) {
      return i;
    }
    if (v > best_value) {
      best = i;
      best_value = v;
    }
  }
  return best;
}

#if defined(__AVX512F__)
// Two passes over the row (it is in cache after the first): the maximum, sixteen lanes at a
// time, noting any NaN; then the first position equal to it.
template <typename scalar_t>
int64_t argmax_row(const scalar_t* row, int64_t n) {
  constexpr int64_t kVec = 16;
  const int64_t full = n / kVec * kVec;
  __m512 best = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __mmask16 nan = 0;
  for (int64_t i = 0; i < full; i += kVec) {
    const __m512 v = load16(row + i);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    best = _mm512_max_ps(best, v);
  }
  if (nan != 0) {
    return argmax_scalar(row, n);  // a broken row: the plain loop finds its first NaN
  }
  float max_value = _mm512_reduce_max_ps(best);
  for (int64_t i = full; i < n; ++i) {  // the tail, scalar
    const float v = widen(row[i]);
    if (std::isnan(v)) {
      return i;  // the first NaN: the full chunks hold none
    }
    max_value = std::max(max_value, v);
  }
  const __m512 target = _mm512_set1_ps(max_value);
  for (int64_t i = 0; i < full; i += kVec) {
    const __mmask16 hit = _mm512_cmp_ps_mask(load16(row + i), target, _CMP_EQ_OQ);
    if (hit != 0) {
      return i + __builtin_ctz(hit);
    }
  }
  for (int64_t i = full; i < n; ++i) {  // the maximum lies in the tail only
    if (widen(row[i]) == max_value) {
      return i;
    }
  }
  return 0;  // unreachable: max_value is one of the row's values
}
#else
template <typename scalar_t>
int64_t argmax_row(const scalar_t* row, int64_t n) {
  return argmax_scalar(row, n);
}
#endif

at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.device().is_cpu(), "argmax_rows: CPU tensors only");
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0, "argmax_rows: logits must be [B, V] "
              "with V > 0, got ", logits.sizes());
  TORCH_CHECK(logits.stride(1) == 1, "argmax_rows: rows must be contiguous");
  TORCH_CHECK(logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16,
              "argmax_rows supports float32 and bfloat16, got ", logits.scalar_type());
  const int64_t rows = logits.size(0);
  const int64_t n = logits.size(1);
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  int64_t* ids = out.data_ptr<int64_t>();
  const int64_t stride = logits.stride(0);
  parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      if (logits.scalar_type() == at::kFloat) {
        ids[r] = argmax_row(logits.data_ptr<float>() + r * stride, n);
      } else {
        ids[r] = argmax_row(logits.data_ptr<c10::BFloat16>() + r * stride, n);
      }
    }
  });
  return out;
}

}  // namespace
}  // namespace corefleet

TORCH_LIBRARY_FRAGMENT(corefleet_cpu, m) {
  m.def("argmax_rows(Tensor logits) -> Tensor", &corefleet::argmax_rows);
}
