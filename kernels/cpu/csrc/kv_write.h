// Storing new tokens' K and V at their paged-cache slots: one memcpy per token and tensor.
// Shared by write_kv_cache_ (kv_write_cpu.cpp) and rotary_to_cache (layer_ops_cpu.cpp).
//
// Layouts:
//   key, value        [T, Hkv, D]                         heads and head_dim contiguous (views
//                                                         into the fused qkv projection are fine)
//   k_cache, v_cache  [num_blocks, block_size, Hkv, D]    contiguous, key's dtype
//   slot_mapping      [T] int64                           block * block_size + offset per token
//
// Every slot is checked before anything is written, so a bad slot raises and changes nothing.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <cstring>

namespace corefleet {

inline void check_kv_tokens(const at::Tensor& t, const at::Tensor& cache, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && cache.device().is_cpu(), "write_kv_cache_: CPU tensors only");
  TORCH_CHECK(t.dim() == 3 && t.size(1) == cache.size(2) && t.size(2) == cache.size(3), name,
              " must be [T, Hkv, D] matching the cache, got ", t.sizes(), " for a cache of ",
              cache.sizes());
  TORCH_CHECK(t.stride(2) == 1 && t.stride(1) == t.size(2), name,
              "'s heads and head_dim must be contiguous");
  TORCH_CHECK(t.scalar_type() == cache.scalar_type(), name, " and its cache must share a dtype");
}

inline void check_kv_caches(const at::Tensor& k_cache, const at::Tensor& v_cache) {
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.scalar_type() == v_cache.scalar_type(),
              "write_kv_cache_: caches must be contiguous [num_blocks, block_size, Hkv, D] "
              "tensors of one shape and dtype");
}

inline void write_kv_slots(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache,
                           at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  check_kv_caches(k_cache, v_cache);
  check_kv_tokens(key, k_cache, "key");
  check_kv_tokens(value, v_cache, "value");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 &&
                  slot_mapping.is_contiguous() && slot_mapping.size(0) == key.size(0) &&
                  value.size(0) == key.size(0),
              "write_kv_cache_: slot_mapping must be a contiguous [T] int64 tensor");
  const int64_t num_tokens = key.size(0);
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t) {
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "write_kv_cache_: slot_mapping[", t,
                "] = ", slots[t], " is outside [0, ", num_slots, ")");
  }

  const int64_t elem = static_cast<int64_t>(key.element_size());
  const int64_t run = key.size(1) * key.size(2) * elem;  // bytes of one token's [Hkv, D]
  const char* k_src = static_cast<const char*>(key.data_ptr());
  const char* v_src = static_cast<const char*>(value.data_ptr());
  char* k_dst = static_cast<char*>(k_cache.data_ptr());
  char* v_dst = static_cast<char*>(v_cache.data_ptr());
  for (int64_t t = 0; t < num_tokens; ++t) {
    std::memcpy(k_dst + slots[t] * run, k_src + t * key.stride(0) * elem, run);
    std::memcpy(v_dst + slots[t] * run, v_src + t * value.stride(0) * elem, run);
  }
}

}  // namespace corefleet
