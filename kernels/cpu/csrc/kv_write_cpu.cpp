// Store the new tokens' K and V at their paged-cache slots on the CPU (layouts: kv_write.h).
//
// Why it exists: torch's index_copy_ makes the same copies but has a large fixed cost a call
// for a single decode token (dispatch, checks, iterator set-up; docs/kernels.md), and a
// forward pass calls it twice per layer; here each token is one memcpy per tensor. Every
// slot is checked before anything is written, so a bad slot raises and changes nothing.

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "kv_write.h"

namespace corefleet {
namespace {

void write_kv_cache_(const at::Tensor& key, const at::Tensor& value, at::Tensor k_cache,
                     at::Tensor v_cache, const at::Tensor& slot_mapping) {
  write_kv_slots(key, value, k_cache, v_cache, slot_mapping);
}

}  // namespace
}  // namespace corefleet

TORCH_LIBRARY_FRAGMENT(corefleet_cpu, m) {
  m.def("write_kv_cache_(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor slot_mapping) -> ()",
        &corefleet::write_kv_cache_);
}
