// A plain streaming read of a buffer, for the benchmarks' memory-bandwidth figure
// (benchmarks/gguf_linear_cpu.py, cpu_matmul_libraries.py): what the GGUF kernels' reading of
// their weights is measured against. Every 64-bit word is XOR-ed into the result (so that no
// load can be skipped), in 64 KiB chunks on the ops' thread pool (parallel.h), as the kernels
// read; the XOR is far cheaper than a load from memory.

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "parallel.h"

#include <atomic>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace corefleet {
namespace {

constexpr int64_t kChunkBytes = 64 << 10;

uint64_t xor_range(const uint8_t* p, int64_t bytes) {
  uint64_t result = 0;
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512i a = _mm512_setzero_si512(), b = a, c = a, d = a;
  for (; i + 256 <= bytes; i += 256) {
    a = _mm512_xor_si512(a, _mm512_loadu_si512(p + i));
    b = _mm512_xor_si512(b, _mm512_loadu_si512(p + i + 64));
    c = _mm512_xor_si512(c, _mm512_loadu_si512(p + i + 128));
    d = _mm512_xor_si512(d, _mm512_loadu_si512(p + i + 192));
  }
  const __m512i all = _mm512_xor_si512(_mm512_xor_si512(a, b), _mm512_xor_si512(c, d));
  alignas(64) uint64_t lanes[8];
  _mm512_store_si512(lanes, all);
  for (uint64_t lane : lanes) result ^= lane;
#endif
  for (; i + 8 <= bytes; i += 8) {
    uint64_t word;
    std::memcpy(&word, p + i, 8);
    result ^= word;
  }
  for (; i < bytes; ++i) result ^= p[i];
  return result;
}

// The XOR of every 64-bit word of `buffer` (any contiguous tensor), read once.
int64_t stream_read(const at::Tensor& buffer) {
  TORCH_CHECK(buffer.is_contiguous(), "stream_read: the buffer must be contiguous");
  const auto* p = static_cast<const uint8_t*>(buffer.data_ptr());
  const int64_t bytes = buffer.numel() * static_cast<int64_t>(buffer.element_size());
  std::atomic<uint64_t> result{0};
  parallel_for(0, (bytes + kChunkBytes - 1) / kChunkBytes, 16, [&](int64_t c0, int64_t c1) {
    const int64_t begin = c0 * kChunkBytes;
    const int64_t end = c1 * kChunkBytes < bytes ? c1 * kChunkBytes : bytes;
    result.fetch_xor(xor_range(p + begin, end - begin), std::memory_order_relaxed);
  });
  return static_cast<int64_t>(result.load());
}

}  // namespace
}  // namespace corefleet

TORCH_LIBRARY_FRAGMENT(corefleet_cpu, m) {
  m.def("stream_read(Tensor buffer) -> int", &corefleet::stream_read);
}
