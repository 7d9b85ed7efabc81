// GGUF-quantized weights to float32 or bfloat16 rows on the CPU.
//
// Layouts (row-major):
//   qweight [N, K / elems * bytes]  uint8, contiguous: each row its GGUF blocks in file order
//                                   (gguf_blocks.h has the formats)
//   returns [N, K]                  float32 or bfloat16
//
// What it is for: prefill, whose many rows make a linear layer a GEMM (dequantize the weight,
// then torch's GEMM), and embedding lookups (the caller selects the rows of qweight first). The
// values equal the `gguf` package's dequantization bit for bit (gguf_blocks.h says how);
// bfloat16 is that float32 value rounded to nearest even, as torch's .to(torch.bfloat16).
// Rows are split across the ops' pool; each is decoded sixteen values at a time with AVX-512,
// or one at a time in the other builds.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "gguf_blocks.h"
#include "gguf_blocks_avx512.h"
#include "parallel.h"
#include "scalar.h"
#include "vec_avx512.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace corefleet {
namespace {

// Rows [r0, r1) of the weight, `blocks` blocks each, into out [., K] of dtype T.
template <typename F, typename T>
void dequantize_rows(const uint8_t* q, int64_t r0, int64_t r1, int64_t blocks, T* out) {
  const int64_t k = blocks * F::kElems;
  const int64_t row_bytes = blocks * F::kBytes;
#if defined(__AVX512F__)
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = q + r * row_bytes;
    T* dst = out + r * k;
    for (int64_t b = 0; b < blocks; ++b) {
      gguf::decode16<gguf::Exact>(F{}, row + b * F::kBytes, [&](int v, __m512 w) {
        store16(dst + b * F::kElems + 16 * v, w);
      });
    }
  }
#else
  float values[F::kElems];
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      F::template decode<gguf::Exact>(q + r * row_bytes + b * F::kBytes, values);
      T* dst = out + r * k + b * F::kElems;
      for (int64_t i = 0; i < F::kElems; ++i) store(values[i], dst + i);
    }
  }
#endif
}

at::Tensor gguf_dequantize(const at::Tensor& qweight, int64_t ggml_type, int64_t k,
                           at::ScalarType dtype) {
  constexpr const char* op = "gguf_dequantize";
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, op,
              ": dtype must be float32 or bfloat16, got ", dtype);
  return gguf::visit(ggml_type, op, [&](auto format) {
    using F = decltype(format);
    gguf::check_qweight<F>(op, qweight, k);
    const int64_t n = qweight.size(0);
    at::Tensor out = at::empty({n, k}, qweight.options().dtype(dtype));  // [N, K]
    const uint8_t* q = qweight.data_ptr<uint8_t>();
    const int64_t blocks = k / F::kElems;
    // Chunks of about 64 K values: enough work to be worth handing to another thread; a few
    // embedding rows stay on the calling thread.
    const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / k);
    if (dtype == at::kFloat) {
      float* o = out.data_ptr<float>();
      parallel_for(0, n, grain, [&](int64_t r0, int64_t r1) {
        dequantize_rows<F>(q, r0, r1, blocks, o);
      });
    } else {
      c10::BFloat16* o = out.data_ptr<c10::BFloat16>();
      parallel_for(0, n, grain, [&](int64_t r0, int64_t r1) {
        dequantize_rows<F>(q, r0, r1, blocks, o);
      });
    }
    return out;
  });
}

}  // namespace
}  // namespace corefleet

TORCH_LIBRARY_FRAGMENT(corefleet_cpu, m) {
  m.def("gguf_dequantize(Tensor qweight, int ggml_type, int k, ScalarType dtype) -> Tensor",
        &corefleet::gguf_dequantize);
}
