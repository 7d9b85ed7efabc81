// The experts of a mixture-of-experts layer in one call on the CPU (reference.fused_moe):
// out[t] = sum_k w[t, k] * down_e(silu(gate_e(x[t])) * up_e(x[t])), e = ids[t, k].
//
// Layouts (all contiguous, row-major):
//   x            [T, H]      float32 or bfloat16
//   w13          [E, 2I, H]  x's dtype: each expert's gate rows (:I) and up rows (I:)
//   w2           [E, H, I]   x's dtype: each expert's down projection
//   topk_weights [T, K]      float32
//   topk_ids     [T, K]      int32 or int64; an id outside [0, E) is skipped (expert parallel)
//   returns      [T, H]      x's dtype
//
// Why it exists: the reference loops over every expert in Python, finds its tokens with a
// nonzero() each time and runs six torch ops per expert that has any: ~E small ops per layer
// even when a decode step touches only K experts, each matmul on a handful of rows (where
// torch's GEMM reads the weights well below a plain read's bandwidth), and an index_add per
// expert. Here the routing is turned into a grouped order once, then:
//
//   1. route:   count the slots (token, k) of each expert, lay them out grouped by expert
//               (ascending, each group in token order: the reference's nonzero() order), and
//               list each token's slots in that order (for the combine);
//   2. gather:  the slots' x rows, grouped: xs [S, H];
//   3. gate/up: per expert, its rows of xs against its w13 with SwiGLU applied -> act [S, I];
//   4. down:    per expert, act against its w2 -> y [S, H] (rounded to x's dtype, as the
//               reference's F.linear output is);
//   5. combine: per token, the float32 sum of weight * y over its slots in expert order,
//               rounded once into out.
//
// Steps 3 and 4 take one of two paths per expert, by its row count n. Experts with
// n < gemm_min_rows (every expert of a decode step, and a prefill's groups of up to a few hundred
// rows) are all together one parallel region of our own pool (parallel.h) over (expert, band of
// weight rows) tasks, each task streaming its band of weights once through register tiles
// against all of the expert's rows: at a few rows the step is bound by the weights' bytes, read
// here at a plain read's bandwidth, and up to ~256 rows the tiles are at least as fast as
// torch's GEMM (measured, benchmarks/README.md "Fused MoE"). A larger group is one ATen
// matmul per projection over its gathered block (oneDNN/MKL), which ATen parallelises itself:
// those experts run one after another, outside our pool. The backend picks gemm_min_rows per
// dtype (cpu/backend.py).
//
// Why the combine reads a per-slot buffer instead of each down-projection tile adding into the
// output: tiles of different experts write the same tokens, so adding in place needs either
// atomics (float adds in whatever order threads finish: results that change run to run) or an
// ownership split of the output that the GEMM path cannot follow. y costs S x H values, written
// once and read once (a few hundred KB for a decode step; 32 MB each way for a 512-token
// float32 prefill of OLMoE's shape, estimated at under 1 % of its time), and the combine then
// adds each token's experts in ascending order, as the reference does, whatever the thread
// count.
//
// Numerics: float32 accumulation everywhere; rounding to x's dtype where the reference rounds
// (the gate/up projection, silu(gate), its product with up, the down projection), so bfloat16
// differs from the reference only by the matmuls' summation order.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "fused_moe_tiles.h"
#include "parallel.h"
#include "scalar.h"
#include "vec_avx512.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace corefleet {
namespace {

using moe_tiles::kLanes;
constexpr int64_t kMaxStreamRows = 256;  // the most rows of an expert the tiles take
constexpr int64_t kGateUpBand = 32;      // I columns per gate/up task (32 gate + 32 up rows)
constexpr int64_t kDownBand = 64;        // H rows of w2 per down task

// ---- routing ---------------------------------------------------------------------------------

struct Routing {
  std::vector<int64_t> expert_start;  // [E + 1]: expert e's slots are [start[e], start[e + 1])
  std::vector<int64_t> slot_token;    // [S]: the token of each slot, grouped by expert
  std::vector<float> slot_weight;     // [S]: its routing weight
  std::vector<int64_t> token_start;   // [T + 1]: token t's slots are token_slots[start[t]...]
  std::vector<int64_t> token_slots;   // [S]: each token's slots, in ascending expert order
};

template <typename Id>
Routing route(const Id* ids, const float* weights, int64_t tokens, int64_t k, int64_t experts) {
  Routing r;
  r.expert_start.assign(experts + 1, 0);
  for (int64_t i = 0; i < tokens * k; ++i) {
    const int64_t e = static_cast<int64_t>(ids[i]);
    if (e >= 0 && e < experts) {
      ++r.expert_start[e + 1];
    }
  }
  for (int64_t e = 0; e < experts; ++e) {
    r.expert_start[e + 1] += r.expert_start[e];
  }
  const int64_t slots = r.expert_start[experts];
  r.slot_token.resize(slots);
  r.slot_weight.resize(slots);
  std::vector<int64_t> next(r.expert_start.begin(), r.expert_start.end() - 1);  // [E]
  std::vector<int64_t> per_token(tokens + 1, 0);
  for (int64_t i = 0; i < tokens * k; ++i) {  // token-major: each group comes out in token order
    const int64_t e = static_cast<int64_t>(ids[i]);
    if (e >= 0 && e < experts) {
      const int64_t s = next[e]++;
      r.slot_token[s] = i / k;
      r.slot_weight[s] = weights[i];
      ++per_token[i / k + 1];
    }
  }
  for (int64_t t = 0; t < tokens; ++t) {
    per_token[t + 1] += per_token[t];
  }
  r.token_start = per_token;
  r.token_slots.resize(slots);
  for (int64_t s = 0; s < slots; ++s) {  // slots in expert order: each token's list is too
    r.token_slots[per_token[r.slot_token[s]]++] = s;
  }
  return r;
}

using moe_tiles::band_dots;

// ---- SwiGLU --------------------------------------------------------------------------------

// out[i] = round(round(silu(g)) * u) with g and u rounded to T first: the reference's rounding
// (its projection's output in T, F.silu's output in T, the product in T).
template <typename T, typename G>
void swiglu(const G* gate, const G* up, T* out, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 one = _mm512_set1_ps(1.f);
  for (; i + kLanes <= n; i += kLanes) {
    __m512 g = load16(gate + i);
    __m512 u = load16(up + i);
    if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<G, float>) {
      g = widen16(round_to_bf16(g));
      u = widen16(round_to_bf16(u));
    }
    const __m512 exp_neg = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
    __m512 silu = _mm512_div_ps(g, _mm512_add_ps(one, exp_neg));
    if constexpr (std::is_same_v<T, c10::BFloat16>) silu = widen16(round_to_bf16(silu));
    store16(out + i, _mm512_mul_ps(silu, u));
  }
#endif
  for (; i < n; ++i) {
    const float g = widen(narrow<T>(widen(gate[i])));
    const float u = widen(narrow<T>(widen(up[i])));
    out[i] = narrow<T>(widen(narrow<T>(g / (1.f + std::exp(-g)))) * u);
  }
}

// ---- the op ----------------------------------------------------------------------------------

// Rows of `src` ([rows, n], T) as float32 into `dst` ([rows, n]).
template <typename T>
void widen_rows(const T* src, float* dst, int64_t rows, int64_t n) {
  for (int64_t i = 0; i < rows * n; ++i) dst[i] = widen(src[i]);
}

template <typename T>
struct Experts {
  const at::Tensor& w13;  // [E, 2I, H]
  const at::Tensor& w2;   // [E, H, I]
  int64_t hidden;         // H
  int64_t inter;          // I
  const Routing& routing;
  int64_t gemm_min_rows;
  int64_t num_experts;    // E
  int64_t most_streamed;  // the most rows of an expert on the streaming path

  Experts(const at::Tensor& w13_, const at::Tensor& w2_, const Routing& routing_,
          int64_t gemm_min_rows_)
      : w13(w13_), w2(w2_), hidden(w2_.size(1)), inter(w2_.size(2)), routing(routing_),
        gemm_min_rows(gemm_min_rows_), num_experts(w13_.size(0)), most_streamed(0) {
    for (int64_t e = 0; e < num_experts; ++e) {
      if (streamed(e)) most_streamed = std::max(most_streamed, rows(e));
    }
  }

  int64_t rows(int64_t e) const { return routing.expert_start[e + 1] - routing.expert_start[e]; }
  bool streamed(int64_t e) const { return rows(e) > 0 && rows(e) < gemm_min_rows; }
};

// The activation rows of a projection as the streaming tiles read them: float32 rows as they
// are, bfloat16 rows as they are where vdpbf16ps multiplies pairs (k % 32 == 0), else the
// streamed experts' bfloat16 rows widened to float32 once (not once per task).
template <typename T>
struct Operand {
  const T* as_is = nullptr;
  std::vector<float> widened;  // [S, k]: only the streamed experts' rows are filled

  static constexpr bool kPairsBuild =
#if defined(__AVX512BF16__)
      std::is_same_v<T, c10::BFloat16>;
#else
      false;
#endif

  Operand(const T* data, int64_t slots, int64_t k, const Experts<T>& ex) : as_is(data) {
    if (std::is_same_v<T, float> || (kPairsBuild && k % (2 * kLanes) == 0)) {
      return;
    }
    widened.resize(slots * k);
    parallel_for(0, ex.num_experts, 1, [&](int64_t e0, int64_t e1) {
      for (int64_t e = e0; e < e1; ++e) {
        if (ex.streamed(e)) {
          const int64_t s0 = ex.routing.expert_start[e];
          widen_rows(data + s0 * k, widened.data() + s0 * k, ex.rows(e), k);
        }
      }
    });
  }

  // Calls f(rows) with the rows from slot s0 on, as a pointer of the type the tiles read.
  template <typename F>
  void with_rows(int64_t s0, int64_t k, const F& f) const {
    if (!widened.empty()) {
      f(widened.data() + s0 * k);
    } else if constexpr (std::is_same_v<T, float> || kPairsBuild) {
      f(as_is + s0 * k);
    }
  }
};

// (expert, first row) of every band of `band` rows (of `length`) of each streamed expert.
template <typename T>
std::vector<std::pair<int64_t, int64_t>> stream_tasks(const Experts<T>& ex, int64_t length,
                                                      int64_t band) {
  std::vector<std::pair<int64_t, int64_t>> tasks;
  for (int64_t e = 0; e < ex.num_experts; ++e) {
    if (ex.streamed(e)) {
      for (int64_t first = 0; first < length; first += band) tasks.emplace_back(e, first);
    }
  }
  return tasks;
}

template <typename T>
void gate_up(const Experts<T>& ex, const at::Tensor& xs, at::Tensor& act) {
  const int64_t h = ex.hidden, inter = ex.inter;
  T* a = act.data_ptr<T>();
  // The GEMM experts one after another: ATen parallelises each matmul itself.
  for (int64_t e = 0; e < ex.num_experts; ++e) {
    const int64_t n = ex.rows(e), s0 = ex.routing.expert_start[e];
    if (n < ex.gemm_min_rows) continue;
    const at::Tensor proj = at::mm(xs.narrow(0, s0, n), ex.w13[e].t());  // [n, 2I]
    const T* p = proj.data_ptr<T>();
    parallel_for(0, n, std::max<int64_t>(1, 8192 / inter), [&](int64_t j0, int64_t j1) {
      for (int64_t j = j0; j < j1; ++j) {
        swiglu(p + j * 2 * inter, p + j * 2 * inter + inter, a + (s0 + j) * inter, inter);
      }
    });
  }
  const auto tasks = stream_tasks(ex, inter, kGateUpBand);
  if (tasks.empty()) return;
  const Operand<T> rows(xs.data_ptr<T>(), xs.size(0), h, ex);
  const T* w13 = ex.w13.template data_ptr<T>();
  parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> scratch(2 * ex.most_streamed * kGateUpBand);
    float* gate = scratch.data();  // [n, band]
    float* up = gate + ex.most_streamed * kGateUpBand;     // [n, band]
    for (int64_t t = t0; t < t1; ++t) {
      const auto [e, c0] = tasks[t];
      const int64_t c1 = std::min(c0 + kGateUpBand, inter);
      const int64_t n = ex.rows(e), s0 = ex.routing.expert_start[e];
      const T* w = w13 + e * 2 * inter * h;
      rows.with_rows(s0, h, [&](const auto* x) {
        band_dots(w, c0, c1, h, x, n, gate, kGateUpBand);
        band_dots(w, inter + c0, inter + c1, h, x, n, up, kGateUpBand);
      });
      for (int64_t j = 0; j < n; ++j) {
        T* arow = a + (s0 + j) * inter;
        swiglu(gate + j * kGateUpBand, up + j * kGateUpBand, arow + c0, c1 - c0);
      }
    }
  });
}

template <typename T>
void down(const Experts<T>& ex, const at::Tensor& act, at::Tensor& y) {
  const int64_t h = ex.hidden, inter = ex.inter;
  for (int64_t e = 0; e < ex.num_experts; ++e) {
    const int64_t n = ex.rows(e), s0 = ex.routing.expert_start[e];
    if (n < ex.gemm_min_rows) continue;
    at::Tensor block = y.narrow(0, s0, n);  // [n, H], contiguous rows of y
    at::mm_out(block, act.narrow(0, s0, n), ex.w2[e].t());
  }
  const auto tasks = stream_tasks(ex, h, kDownBand);
  if (tasks.empty()) return;
  const Operand<T> rows(act.data_ptr<T>(), act.size(0), inter, ex);
  const T* w2 = ex.w2.template data_ptr<T>();
  T* yp = y.data_ptr<T>();
  parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> scratch(ex.most_streamed * kDownBand);
    float* dots = scratch.data();  // [n, band]
    for (int64_t t = t0; t < t1; ++t) {
      const auto [e, r0] = tasks[t];
      const int64_t r1 = std::min(r0 + kDownBand, h);
      const int64_t n = ex.rows(e), s0 = ex.routing.expert_start[e];
      rows.with_rows(s0, inter, [&](const auto* x) {
        band_dots(w2 + e * h * inter, r0, r1, inter, x, n, dots, kDownBand);
      });
      for (int64_t j = 0; j < n; ++j) {
        T* yrow = yp + (s0 + j) * h;
        for (int64_t r = r0; r < r1; ++r) yrow[r] = narrow<T>(dots[j * kDownBand + r - r0]);
      }
    }
  });
}

// out[t] = sum over t's slots, in ascending expert order, of weight * y[slot] (float32), rounded.
template <typename T>
void combine(const Routing& r, const T* y, int64_t tokens, int64_t h, T* out) {
  parallel_for(0, tokens, std::max<int64_t>(1, 16384 / h), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t first = r.token_start[t], last = r.token_start[t + 1];
      T* o = out + t * h;
      int64_t i = 0;
#if defined(__AVX512F__)
      for (; i + kLanes <= h; i += kLanes) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t q = first; q < last; ++q) {
          const int64_t s = r.token_slots[q];
          acc = _mm512_add_ps(acc, _mm512_mul_ps(load16(y + s * h + i),
                                                 _mm512_set1_ps(r.slot_weight[s])));
        }
        store16(o + i, acc);
      }
#endif
      for (; i < h; ++i) {
        float acc = 0.f;
        for (int64_t q = first; q < last; ++q) {
          const int64_t s = r.token_slots[q];
          acc += widen(y[s * h + i]) * r.slot_weight[s];
        }
        o[i] = narrow<T>(acc);
      }
    }
  });
}

template <typename T>
void fused_moe_kernel(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2,
                      const Routing& routing, int64_t gemm_min_rows, at::Tensor& out) {
  const int64_t tokens = x.size(0), h = x.size(1), inter = w2.size(2);
  const int64_t slots = static_cast<int64_t>(routing.slot_token.size());
  const Experts<T> ex(w13, w2, routing, gemm_min_rows);
  // The slots' rows of x, grouped by expert: [S, H].
  at::Tensor xs = at::empty({slots, h}, x.options());
  const T* xp = x.data_ptr<T>();
  T* xsp = xs.data_ptr<T>();
  parallel_for(0, slots, std::max<int64_t>(1, 16384 / h), [&](int64_t s0, int64_t s1) {
    for (int64_t s = s0; s < s1; ++s) {
      std::memcpy(xsp + s * h, xp + routing.slot_token[s] * h, h * sizeof(T));
    }
  });
  at::Tensor act = at::empty({slots, inter}, x.options());  // [S, I]
  gate_up(ex, xs, act);
  at::Tensor y = at::empty({slots, h}, x.options());  // [S, H]
  down(ex, act, y);
  combine(routing, y.data_ptr<T>(), tokens, h, out.data_ptr<T>());
}

at::Tensor fused_moe(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2,
                     const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                     int64_t gemm_min_rows) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(),
              "fused_moe: x must be a contiguous [T, H] tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "fused_moe supports float32 and bfloat16, got ", x.scalar_type());
  TORCH_CHECK(w13.dim() == 3 && w2.dim() == 3 && w13.is_contiguous() && w2.is_contiguous(),
              "fused_moe: w13 [E, 2I, H] and w2 [E, H, I] must be contiguous");
  TORCH_CHECK(w13.scalar_type() == x.scalar_type() && w2.scalar_type() == x.scalar_type(),
              "fused_moe: the weights must have x's dtype");
  const int64_t experts = w13.size(0), h = x.size(1), inter = w2.size(2);
  TORCH_CHECK(w13.size(1) == 2 * inter && w13.size(2) == h && w2.size(0) == experts &&
                  w2.size(1) == h,
              "fused_moe: shapes disagree: x ", x.sizes(), ", w13 ", w13.sizes(), ", w2 ",
              w2.sizes());
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == x.size(0) &&
                  topk_weights.sizes() == topk_ids.sizes() && topk_ids.is_contiguous() &&
                  topk_weights.is_contiguous(),
              "fused_moe: topk_weights and topk_ids must be contiguous [T, K] tensors");
  TORCH_CHECK(topk_weights.scalar_type() == at::kFloat,
              "fused_moe: topk_weights must be float32");
  TORCH_CHECK(topk_ids.scalar_type() == at::kInt || topk_ids.scalar_type() == at::kLong,
              "fused_moe: topk_ids must be int32 or int64");
  TORCH_CHECK(gemm_min_rows >= 1 && gemm_min_rows <= kMaxStreamRows + 1,
              "fused_moe: gemm_min_rows must be in [1, ", kMaxStreamRows + 1, "]");
  const int64_t tokens = x.size(0), k = topk_ids.size(1);
  const float* weights = topk_weights.data_ptr<float>();
  const Routing routing =
      topk_ids.scalar_type() == at::kInt
          ? route(topk_ids.data_ptr<int32_t>(), weights, tokens, k, experts)
          : route(topk_ids.data_ptr<int64_t>(), weights, tokens, k, experts);
  if (routing.slot_token.empty() || h == 0 || inter == 0) {
    return at::zeros({tokens, h}, x.options());  // no token chose an expert here
  }
  at::Tensor out = at::empty({tokens, h}, x.options());  // [T, H]
  if (x.scalar_type() == at::kFloat) {
    fused_moe_kernel<float>(x, w13, w2, routing, gemm_min_rows, out);
  } else {
    fused_moe_kernel<c10::BFloat16>(x, w13, w2, routing, gemm_min_rows, out);
  }
  return out;
}

}  // namespace
}  // namespace corefleet

TORCH_LIBRARY_FRAGMENT(corefleet_cpu, m) {
  m.def("fused_moe(Tensor x, Tensor w13, Tensor w2, Tensor topk_weights, Tensor topk_ids, "
        "int gemm_min_rows) -> Tensor",
        &corefleet::fused_moe);
}
