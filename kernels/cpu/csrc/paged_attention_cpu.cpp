// Paged attention on the CPU, one query token per row: K and V read in place from the paged
// cache through the row's block table (no gathered copy). A decode request is one row; a
// prefill chunk is one row per token, each with its own length (its position + 1), which makes
// the attention causal without a mask (the model runner builds those rows; cpu/backend.py
// passes them on).
//
// Layouts (all row-major):
//   query        [B, Hq, D]                          float32 or bfloat16 (last dim contiguous)
//   k_cache      [num_blocks, block_size, Hkv, D]    same dtype as query, contiguous
//   v_cache      [num_blocks, block_size, Hkv, D]    same dtype as query, contiguous
//   block_table  [B, max_blocks] int64               block id of each of a row's blocks
//   context_lens [B] int64                           tokens a row attends to (>= 1)
//   returns      [B, Hq, D]                          query's dtype, contiguous
//
// Grouped-query attention: Hq = G * Hkv and query heads [h * G, (h + 1) * G) share KV head h,
// so one task handles one (row, KV head) pair and reads each K/V row once for its G queries.
//
// Numerics: everything is accumulated in float32 with an exact two-pass softmax (scores for
// the whole context are kept in a per-thread scratch buffer, then max, exp, sum). bfloat16 on
// a CPU with AVX512-BF16 multiplies bf16 pairs instead (paged_attention_bf16.h), with the
// probabilities rounded to bfloat16 for the V sum. Only positions < context_lens[b] are ever
// read, so stale or uninitialised cache memory past a row's length (or in blocks outside its
// table) cannot reach the output.
//
// Only light headers are included: the full <torch/extension.h> (pybind11 + all of ATen)
// roughly triples the build time, and the op is reached through torch.ops instead.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "paged_attention_blocks.h"
#include "paged_attention_bf16.h"
#include "parallel.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace corefleet {
namespace {

using namespace attention;  // the inner loops (paged_attention_blocks.h, _bf16.h)

// Task boundaries for `parts` contiguous ranges of about equal work, one per thread. A task
// (row b, one of `splits` head ranges) costs its row's length plus a fixed overhead. Equal
// counts would not do: rows differ in length, and when a prefill chunk's tokens come as rows
// their lengths grow one by one (a triangle), so the last half holds ~3/4 of the work.
constexpr int64_t kPartsPerThread = 8;

std::vector<int64_t> balanced_bounds(
    const int64_t* lens, int64_t batch, int64_t splits, int64_t parts) {
  constexpr int64_t kTaskOverhead = 16;  // in positions: queries, softmax, output
  const int64_t tasks = batch * splits;
  int64_t total = 0;
  for (int64_t b = 0; b < batch; ++b) {
    total += (lens[b] + kTaskOverhead) * splits;
  }
  std::vector<int64_t> bounds(parts + 1, tasks);
  bounds[0] = 0;
  int64_t done = 0;
  int64_t part = 1;
  for (int64_t task = 0; task < tasks && part < parts; ++task) {
    done += lens[task / splits] + kTaskOverhead;
    while (part < parts && done * parts >= total * part) {
      bounds[part++] = task + 1;
    }
  }
  return bounds;
}

// kPairs: bfloat16 multiplied in bf16 pairs in both passes (paged_attention_bf16.h, 32 bf16
// make one vdpbf16ps operand), instantiated only where the CPU has AVX512-BF16; false: every
// K and V element widened to float32. The host wrapper chooses once per call. On the pairs
// path the queries and probabilities are kept as scalar_t (bfloat16), which also keeps the
// pairs functions' calls dependent on scalar_t: a build without AVX512-BF16, where they do
// not exist, never looks them up.
template <typename scalar_t, bool kPairs>
void paged_attention_kernel(
    const at::Tensor& query,         // [B, Hq, D]
    const at::Tensor& k_cache,       // [num_blocks, bs, Hkv, D]
    const at::Tensor& v_cache,       // [num_blocks, bs, Hkv, D]
    const at::Tensor& block_table,   // [B, max_blocks] int64
    const at::Tensor& context_lens,  // [B] int64
    double scale,
    at::Tensor& out) {               // [B, Hq, D]
  static_assert(!kPairs || std::is_same_v<scalar_t, c10::BFloat16>, "pairs are bfloat16");
  const int64_t batch = query.size(0);
  const int64_t num_q_heads = query.size(1);
  const int64_t head_dim = query.size(2);
  const int64_t num_blocks = k_cache.size(0);
  const int64_t block_size = k_cache.size(1);
  const int64_t num_kv_heads = k_cache.size(2);
  const int64_t group = num_q_heads / num_kv_heads;
  const int64_t max_blocks = block_table.size(1);

  const int64_t q_row_stride = query.stride(0);
  const int64_t q_head_stride = query.stride(1);
  const int64_t token_stride = num_kv_heads * head_dim;  // between positions in a block
  const int64_t block_stride = block_size * token_stride;

  const scalar_t* q_data = query.data_ptr<scalar_t>();
  const scalar_t* k_data = k_cache.data_ptr<scalar_t>();
  const scalar_t* v_data = v_cache.data_ptr<scalar_t>();
  const int64_t* table = block_table.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  scalar_t* out_data = out.data_ptr<scalar_t>();

  int64_t max_len = 0;
  for (int64_t b = 0; b < batch; ++b) {
    max_len = std::max(max_len, lens[b]);
  }
  const float fscale = static_cast<float>(scale);

  // A task is one row and a range of its KV heads. Whole rows when there are enough rows to
  // keep every thread busy: a position's K (and V) for all heads is one contiguous
  // Hkv * D run in the cache, read front to back, where one head per task read a D-wide
  // slice every Hkv * D elements (a strided pattern the prefetcher follows poorly). A few
  // rows (single-stream decode) split their heads across threads.
  const int64_t threads = parallel_threads();
  const int64_t head_splits = batch >= 2 * threads ? 1 : num_kv_heads;
  const int64_t heads_per_task = num_kv_heads / head_splits;

  // Several parts of equal work per thread, claimed one by one (parallel.h): a thread that is
  // descheduled for a while leaves its parts to the others.
  const int64_t parts = std::min(batch * head_splits, threads * kPartsPerThread);
  const std::vector<int64_t> bounds = balanced_bounds(lens, batch, head_splits, parts);
  parallel_for(0, parts, 1, [&](int64_t part_begin, int64_t part_end) {
    const int64_t begin = bounds[part_begin];
    const int64_t end = bounds[part_end];
    // Scratch, reused by every task in the range.
    std::vector<float> q(kPairs ? 0 : num_q_heads * head_dim);  // [Hq, D] scaled queries
    std::vector<float> acc(num_q_heads * head_dim);    // [Hq, D] weighted sum of V rows
    std::vector<float> scores(num_q_heads * max_len);  // [Hq, L] logits, then probabilities
    std::vector<float> inv_sum(num_q_heads);           // [Hq] 1 / softmax normaliser
    // Pairs path: the queries unscaled and the probabilities rounded, both as bfloat16.
    std::vector<scalar_t> q_pairs(kPairs ? num_q_heads * head_dim : 0);  // [Hq, D]
    std::vector<scalar_t> probs(kPairs ? num_q_heads * (max_len + 1) : 0);  // [Hq, L + 1]

    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / head_splits;
      const int64_t h0 = (task % head_splits) * heads_per_task;
      const int64_t h1 = h0 + heads_per_task;
      const int64_t qh0 = h0 * group;  // first query head of the task
      const int64_t qh1 = h1 * group;
      const int64_t len = lens[b];
      const int64_t* row_blocks = table + b * max_blocks;

      for (int64_t qh = qh0; qh < qh1; ++qh) {
        const scalar_t* src = q_data + b * q_row_stride + qh * q_head_stride;
        if constexpr (kPairs) {  // unscaled: the scale is applied to the float32 scores
          std::memcpy(&q_pairs[qh * head_dim], src, head_dim * sizeof(scalar_t));
        } else {  // scaled once here instead of once per score
          for (int64_t d = 0; d < head_dim; ++d) {
            q[qh * head_dim + d] = widen(src[d]) * fscale;
          }
        }
      }

      // Pass 1: logits of every position, block by block, reading only positions < len.
      // Runs of up to 16 positions: their 16 dot products are summed horizontally together.
      const int64_t last_block = (len - 1) / block_size;
      for (int64_t start = 0; start < len; start += block_size) {
        const int64_t block = row_blocks[start / block_size];
        TORCH_CHECK(block >= 0 && block < num_blocks, "block id ", block, " out of range");
        const int64_t count = std::min(block_size, len - start);
        // The next block's K, a head's run at a time, spread over this block's work; in the
        // last block, pass 2's first block of V instead.
        const int64_t ahead = start / block_size + 2;  // the block two ahead in the row
        const scalar_t* k_next = ahead < last_block + 1
            ? k_data + row_blocks[ahead] * block_stride
            : v_data + row_blocks[std::min(ahead - last_block - 1, last_block)] * block_stride;
        const scalar_t* k_block = k_data + block * block_stride;
        for (int64_t h = h0; h < h1; ++h) {
          for (int64_t t = 0; t < count; t += 16) {
            const scalar_t* k_run = k_block + t * token_stride + h * head_dim;
            const int64_t run = std::min<int64_t>(16, count - t);
            prefetch_block(k_next + t * token_stride, run, token_stride, h * head_dim,
                           head_dim);
            float* run_scores = &scores[h * group * len + start + t];
            if constexpr (kPairs) {
              score_positions_pairs(k_run, token_stride, run, &q_pairs[h * group * head_dim],
                                    group, head_dim, fscale, run_scores, len);
            } else {
              score_positions(k_run, token_stride, run, &q[h * group * head_dim], group,
                              head_dim, run_scores, len);
            }
          }
        }
      }

      // Softmax per query head; the normaliser is applied to the output at the end.
      for (int64_t qh = qh0; qh < qh1; ++qh) {
        float* s = &scores[qh * len];
        float max_score = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < len; ++t) {
          max_score = std::max(max_score, s[t]);
        }
        inv_sum[qh] = 1.f / exp_shift_sum(s, len, max_score);
      }

      // Pass 2: probability-weighted sum of V rows, one KV head at a time.
      std::fill(acc.begin() + qh0 * head_dim, acc.begin() + qh1 * head_dim, 0.f);
      const RowCache<scalar_t> v_row{v_data, row_blocks, len, block_size, block_stride,
                                     token_stride};
      for (int64_t h = h0; h < h1; ++h) {
        if constexpr (kPairs) {
          for (int64_t qh = h * group; qh < (h + 1) * group; ++qh) {
            round_probabilities(&scores[qh * len], len, &probs[qh * (len + 1)]);
          }
          accumulate_head_pairs(v_row, h, &probs[h * group * (len + 1)], len + 1, group,
                                head_dim, &acc[h * group * head_dim]);
        } else {
          accumulate_head(v_row, h, &scores[h * group * len], len, group, head_dim,
                          &acc[h * group * head_dim]);
        }
      }

      for (int64_t qh = qh0; qh < qh1; ++qh) {
        scalar_t* dst = out_data + (b * num_q_heads + qh) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) {
          store(acc[qh * head_dim + d] * inv_sum[qh], &dst[d]);
        }
      }
    }
  });
}

// Host wrapper: validate everything the kernel relies on, then dispatch on dtype and path.
at::Tensor paged_attention(
    const at::Tensor& query,         // [B, Hq, D]
    const at::Tensor& k_cache,       // [num_blocks, bs, Hkv, D]
    const at::Tensor& v_cache,       // [num_blocks, bs, Hkv, D]
    const at::Tensor& block_table,   // [B, max_blocks] int64
    const at::Tensor& context_lens,  // [B] int64
    double scale) {
  for (const at::Tensor* t : {&query, &k_cache, &v_cache, &block_table, &context_lens}) {
    TORCH_CHECK(t->device().is_cpu(), "paged_attention: all tensors must be on the CPU");
  }
  TORCH_CHECK(query.dim() == 3, "query must be [B, Hq, D], got ", query.sizes());
  TORCH_CHECK(k_cache.dim() == 4, "k_cache must be [blocks, block_size, Hkv, D]");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "k_cache and v_cache shapes differ");
  TORCH_CHECK(
      query.scalar_type() == k_cache.scalar_type() && query.scalar_type() == v_cache.scalar_type(),
      "query, k_cache and v_cache must share a dtype");
  TORCH_CHECK(
      query.scalar_type() == at::kFloat || query.scalar_type() == at::kBFloat16,
      "paged_attention supports float32 and bfloat16, got ", query.scalar_type());
  TORCH_CHECK(query.size(2) == k_cache.size(3), "query and cache head_dim differ");
  TORCH_CHECK(
      k_cache.size(2) > 0 && query.size(1) % k_cache.size(2) == 0,
      "query heads must be a multiple of KV heads");
#if defined(__AVX512F__)
  TORCH_CHECK(query.size(2) % 16 == 0, "head_dim must be a multiple of 16 (AVX-512 path)");
#endif
  TORCH_CHECK(query.stride(2) == 1, "query's head_dim must be contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(
      block_table.scalar_type() == at::kLong && block_table.dim() == 2 &&
          block_table.is_contiguous() && block_table.size(0) == query.size(0),
      "block_table must be a contiguous [B, max_blocks] int64 tensor");
  TORCH_CHECK(
      context_lens.scalar_type() == at::kLong && context_lens.dim() == 1 &&
          context_lens.is_contiguous() && context_lens.size(0) == query.size(0),
      "context_lens must be a contiguous [B] int64 tensor");

  // Lengths are checked here, once, so the kernel never reads past a row's block table.
  const int64_t capacity = block_table.size(1) * k_cache.size(1);
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < query.size(0); ++b) {
    TORCH_CHECK(
        lens[b] >= 1 && lens[b] <= capacity, "context_lens[", b, "] = ", lens[b],
        " is outside [1, ", capacity, "]");
  }

  at::Tensor out = at::empty(query.sizes(), query.options());  // [B, Hq, D] contiguous
  if (query.numel() == 0) {
    return out;
  }
  if (query.scalar_type() == at::kFloat) {
    paged_attention_kernel<float, false>(
        query, k_cache, v_cache, block_table, context_lens, scale, out);
    return out;
  }
#if defined(__AVX512BF16__)
  if (query.size(2) % kPairChunk == 0) {  // whole vdpbf16ps operands along head_dim
    paged_attention_kernel<c10::BFloat16, true>(
        query, k_cache, v_cache, block_table, context_lens, scale, out);
    return out;
  }
#endif
  paged_attention_kernel<c10::BFloat16, false>(
      query, k_cache, v_cache, block_table, context_lens, scale, out);
  return out;
}

}  // namespace
}  // namespace corefleet

TORCH_LIBRARY_FRAGMENT(corefleet_cpu, m) {
  m.def(
      "paged_attention(Tensor query, Tensor k_cache, Tensor v_cache, "
      "Tensor block_table, Tensor context_lens, float scale) -> Tensor",
      &corefleet::paged_attention);
}
