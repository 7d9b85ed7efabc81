// Element-wise layer ops fused into one pass each on the CPU: residual add + RMSNorm, rotary
// embedding (in place, or with the cast and cache write of rotary_to_cache), and SiLU-and-mul. As separate torch ops they made ~10 passes over
// every layer's activations per step, a visible share of a prefill-heavy run (docs/kernels.md).
//
// Numerics follow kernels/reference.py, computed in float32 with one rounding to the tensor's
// dtype where the reference rounds:
//   rms_norm:     r = x + residual (rounded, it is the new residual); normed =
//                 round(r * rsqrt(mean(r^2) + eps)); out = round(weight * normed)
//   rotary:       GPT-NeoX "rotate half": x1 * cos - x2 * sin, x2 * cos + x1 * sin
//   silu_and_mul: silu(gate) * up, rounded once
// float32 results differ from the reference only in summation order (the norm's mean).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Optional.h>
#include <torch/library.h>

#include "kv_write.h"
#include "parallel.h"
#include "scalar.h"
#include "vec_avx512.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>

namespace corefleet {
namespace {

// Rows per task so a task moves ~64 KB: small batches (decode) stay on one thread, where
// waking the pool would cost more than the work.
inline int64_t row_grain(int64_t row_elems) { return std::max<int64_t>(1, 16384 / row_elems); }

template <typename T>
void rms_norm_kernel(
    const at::Tensor& x, const c10::optional<at::Tensor>& residual, const at::Tensor& weight,
    double eps, at::Tensor& out, at::Tensor& residual_out) {
  const int64_t rows = x.size(0);
  const int64_t hidden = x.size(1);
  const T* xs = x.data_ptr<T>();
  const T* res = residual.has_value() ? residual->data_ptr<T>() : nullptr;
  const T* w = weight.data_ptr<T>();
  T* o = out.data_ptr<T>();
  T* ro = residual_out.data_ptr<T>();
  const float feps = static_cast<float>(eps);
  parallel_for(0, rows, row_grain(hidden), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = xs + r * hidden;
      T* ror = ro + r * hidden;
      T* orow = o + r * hidden;
      int64_t i = 0;
      float sum_sq = 0.f;
#if defined(__AVX512F__)
      __m512 acc = _mm512_setzero_ps();
      for (; i + 16 <= hidden; i += 16) {
        __m512 v = load16(xr + i);
        if (res != nullptr) {
          store16(ror + i, _mm512_add_ps(v, load16(res + r * hidden + i)));
          v = load16(ror + i);  // the rounded residual, as the scalar path uses
        } else {
          store16(ror + i, v);
        }
        acc = _mm512_fmadd_ps(v, v, acc);
      }
      sum_sq = _mm512_reduce_add_ps(acc);
#endif
      for (; i < hidden; ++i) {
        // The new residual is x + residual rounded to the dtype, as torch's add would.
        const T v = res != nullptr ? narrow<T>(widen(xr[i]) + widen(res[r * hidden + i])) : xr[i];
        ror[i] = v;
        const float f = widen(v);
        sum_sq += f * f;
      }
      const float inv_rms = 1.f / std::sqrt(sum_sq / static_cast<float>(hidden) + feps);
      i = 0;
#if defined(__AVX512F__)
      const __m512 scale = _mm512_set1_ps(inv_rms);
      for (; i + 16 <= hidden; i += 16) {
        T normed[16];
        store16(normed, _mm512_mul_ps(load16(ror + i), scale));  // rounded to T, as the reference
        store16(orow + i, _mm512_mul_ps(load16(w + i), load16(normed)));
      }
#endif
      for (; i < hidden; ++i) {
        const float normed = widen(narrow<T>(widen(ror[i]) * inv_rms));
        orow[i] = narrow<T>(widen(w[i]) * normed);
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> rms_norm(
    const at::Tensor& x, const c10::optional<at::Tensor>& residual, const at::Tensor& weight,
    double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "rms_norm: x must be a contiguous [T, H] tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "rms_norm supports float32 and bfloat16, got ", x.scalar_type());
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type(),
              "rms_norm: weight must be a contiguous [H] tensor of x's dtype");
  if (residual.has_value()) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->is_contiguous() &&
                    residual->scalar_type() == x.scalar_type(),
                "rms_norm: residual must be a contiguous tensor shaped and typed like x");
  }
  at::Tensor out = at::empty_like(x);           // [T, H]
  at::Tensor residual_out = at::empty_like(x);  // [T, H] x + residual (a copy of x without one)
  if (x.numel() == 0) {
    return {out, residual_out};
  }
  if (x.scalar_type() == at::kFloat) {
    rms_norm_kernel<float>(x, residual, weight, eps, out, residual_out);
  } else {
    rms_norm_kernel<c10::BFloat16>(x, residual, weight, eps, out, residual_out);
  }
  return {out, residual_out};
}

// Rotates heads [0, num_heads) of each token in place; x rows are `row_stride` apart.
template <typename T>
inline void rotate_heads(T* x, int64_t num_heads, int64_t head_dim, const T* cos, const T* sin) {
  const int64_t half = head_dim / 2;
  for (int64_t h = 0; h < num_heads; ++h) {
    T* xh = x + h * head_dim;
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = widen(xh[i]);
      const float x2 = widen(xh[i + half]);
      xh[i] = narrow<T>(x1 * widen(cos[i]) - x2 * widen(sin[i]));
      xh[i + half] = narrow<T>(x2 * widen(cos[i + half]) + x1 * widen(sin[i + half]));
    }
  }
}

template <typename T>
void rotary_kernel(at::Tensor& query, at::Tensor& key, const at::Tensor& cos,
                   const at::Tensor& sin) {
  const int64_t tokens = query.size(0);
  const int64_t head_dim = query.size(2);
  T* q = query.data_ptr<T>();
  T* k = key.data_ptr<T>();
  const T* c = cos.data_ptr<T>();
  const T* s = sin.data_ptr<T>();
  const int64_t row_elems = (query.size(1) + key.size(1)) * head_dim;
  parallel_for(0, tokens, row_grain(row_elems), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      rotate_heads(q + t * query.stride(0), query.size(1), head_dim, c + t * head_dim,
                   s + t * head_dim);
      rotate_heads(k + t * key.stride(0), key.size(1), head_dim, c + t * head_dim,
                   s + t * head_dim);
    }
  });
}

void rotary_(at::Tensor query, at::Tensor key, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3, "rotary_: query [T, Hq, D] and key [T, Hkv, D]");
  TORCH_CHECK(query.size(0) == key.size(0) && query.size(2) == key.size(2),
              "rotary_: query and key disagree on tokens or head_dim");
  TORCH_CHECK(query.size(2) % 2 == 0, "rotary_: head_dim must be even");
  for (const at::Tensor* t : {&query, &key}) {
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == t->size(2),
                "rotary_: heads of a token must be contiguous (rows may be strided)");
  }
  TORCH_CHECK(query.scalar_type() == key.scalar_type() && cos.scalar_type() == query.scalar_type() &&
                  sin.scalar_type() == query.scalar_type(),
              "rotary_: query, key, cos and sin must share a dtype");
  TORCH_CHECK(query.scalar_type() == at::kFloat || query.scalar_type() == at::kBFloat16,
              "rotary_ supports float32 and bfloat16, got ", query.scalar_type());
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() &&
                  cos.numel() == query.size(0) * query.size(2) && sin.numel() == cos.numel(),
              "rotary_: cos and sin must be contiguous [T, (1,) D] tensors");
  if (query.size(0) == 0) {
    return;
  }
  if (query.scalar_type() == at::kFloat) {
    rotary_kernel<float>(query, key, cos, sin);
  } else {
    rotary_kernel<c10::BFloat16>(query, key, cos, sin);
  }
}

// Rows of `n` values from src (rows `src_stride` apart) into contiguous dst, rounded once.
template <typename S, typename D>
void convert_rows(const S* src, int64_t src_stride, D* dst, int64_t rows, int64_t n) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < n; ++i) {
      dst[r * n + i] = narrow<D>(widen(src[r * src_stride + i]));
    }
  }
}

// A [T, H, D] view of the fused projection's columns [first, first + H * D), in `dtype`
// (contiguous; a copy unless the dtype is the projection's own, then the view itself).
at::Tensor heads_as(const at::Tensor& qkv, int64_t first, int64_t heads, int64_t head_dim,
                    at::ScalarType dtype) {
  const int64_t tokens = qkv.size(0);
  at::Tensor view = qkv.narrow(1, first, heads * head_dim).view({tokens, heads, head_dim});
  if (dtype == qkv.scalar_type()) {
    return view;
  }
  at::Tensor out = at::empty({tokens, heads, head_dim}, qkv.options().dtype(dtype));
  const int64_t n = heads * head_dim;
  if (qkv.scalar_type() == at::kFloat) {
    convert_rows(view.data_ptr<float>(), qkv.stride(0), out.data_ptr<c10::BFloat16>(), tokens, n);
  } else {
    convert_rows(view.data_ptr<c10::BFloat16>(), qkv.stride(0), out.data_ptr<float>(), tokens, n);
  }
  return out;
}

// The part of attention before attention proper, in one call instead of about ten torch ops a
// layer (split, views, rotary, three casts, the cache write): rotate the query and key columns
// of the fused projection in place (rotary_'s own code, so the values are the unfused path's),
// bring query, key and value to the cache's dtype, store key and value at their slots.
std::tuple<at::Tensor, at::Tensor, at::Tensor> rotary_to_cache(
    at::Tensor qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache,
    at::Tensor v_cache, const at::Tensor& slot_mapping, int64_t num_heads, int64_t num_kv_heads) {
  check_kv_caches(k_cache, v_cache);
  const int64_t head_dim = k_cache.size(3);
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 &&
                  qkv.size(1) == (num_heads + 2 * num_kv_heads) * head_dim &&
                  num_kv_heads == k_cache.size(2) && num_heads > 0,
              "rotary_to_cache: qkv must be [T, (Hq + 2 Hkv) * D] with rows of contiguous "
              "columns, got ", qkv.sizes(), " for ", num_heads, " + 2 x ", num_kv_heads,
              " heads and a cache of ", k_cache.sizes());
  const at::ScalarType cache_dtype = k_cache.scalar_type();
  TORCH_CHECK(cache_dtype == at::kFloat || cache_dtype == at::kBFloat16,
              "rotary_to_cache: caches of float32 or bfloat16, got ", cache_dtype);
  at::Tensor query = qkv.narrow(1, 0, num_heads * head_dim).view({qkv.size(0), num_heads, head_dim});
  at::Tensor key = qkv.narrow(1, num_heads * head_dim, num_kv_heads * head_dim)
                       .view({qkv.size(0), num_kv_heads, head_dim});
  rotary_(query, key, cos, sin);
  at::Tensor q = heads_as(qkv, 0, num_heads, head_dim, cache_dtype);
  at::Tensor k = heads_as(qkv, num_heads * head_dim, num_kv_heads, head_dim, cache_dtype);
  at::Tensor v = heads_as(qkv, (num_heads + num_kv_heads) * head_dim, num_kv_heads, head_dim,
                          cache_dtype);
  write_kv_slots(k, v, k_cache, v_cache, slot_mapping);
  return {q, k, v};
}

template <typename T>
void silu_and_mul_kernel(const at::Tensor& x, at::Tensor& out) {
  const int64_t rows = x.size(0);
  const int64_t inner = out.size(1);
  const T* xs = x.data_ptr<T>();
  T* o = out.data_ptr<T>();
  parallel_for(0, rows, row_grain(2 * inner), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* gate = xs + r * 2 * inner;
      const T* up = gate + inner;
      T* orow = o + r * inner;
      int64_t i = 0;
#if defined(__AVX512F__)
      const __m512 one = _mm512_set1_ps(1.f);
      for (; i + 16 <= inner; i += 16) {
        const __m512 g = load16(gate + i);
        const __m512 exp_neg = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
        const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(one, exp_neg));
        store16(orow + i, _mm512_mul_ps(silu, load16(up + i)));
      }
#endif
      for (; i < inner; ++i) {
        const float g = widen(gate[i]);
        orow[i] = narrow<T>(g / (1.f + std::exp(-g)) * widen(up[i]));
      }
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % 2 == 0,
              "silu_and_mul: x must be a contiguous [T, 2I] tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "silu_and_mul supports float32 and bfloat16, got ", x.scalar_type());
  at::Tensor out = at::empty({x.size(0), x.size(1) / 2}, x.options());  // [T, I]
  if (out.numel() == 0) {
    return out;
  }
  if (x.scalar_type() == at::kFloat) {
    silu_and_mul_kernel<float>(x, out);
  } else {
    silu_and_mul_kernel<c10::BFloat16>(x, out);
  }
  return out;
}

}  // namespace
}  // namespace corefleet

TORCH_LIBRARY_FRAGMENT(corefleet_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor? residual, Tensor weight, float eps) -> (Tensor, Tensor)",
        &corefleet::rms_norm);
  m.def("rotary_(Tensor(a!) query, Tensor(b!) key, Tensor cos, Tensor sin) -> ()",
        &corefleet::rotary_);
  m.def("silu_and_mul(Tensor x) -> Tensor", &corefleet::silu_and_mul);
  m.def("rotary_to_cache(Tensor(a!) qkv, Tensor cos, Tensor sin, Tensor(b!) k_cache, "
        "Tensor(c!) v_cache, Tensor slot_mapping, int num_heads, int num_kv_heads) "
        "-> (Tensor, Tensor, Tensor)",
        &corefleet::rotary_to_cache);
}
