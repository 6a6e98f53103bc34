// A caching allocator for the large CPU buffers the collectives create
// (broadcast copies, gathered outputs, reduced sums, coalesced buckets).
//
// Fresh large allocations cost the kernel a page fault and a zeroing pass
// per page before the collective's own copy, which on a CPU device list
// makes an allocating collective markedly slower than a copy into an
// existing buffer. Freed buffers of at least kMinCachedBytes are kept (up to
// a cap, DPCORE_HOST_CACHE_MB, default 1024) and handed out again; new ones
// are 2 MiB aligned with transparent huge pages requested. Small buffers go
// to the regular CPU allocator.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>

#include <cstdint>

namespace dpcore {

constexpr int64_t kMinCachedBytes = 1 << 20;

struct HostCacheStats {
  int64_t cached_bytes = 0; // held by the cache, not in use
  int64_t hits = 0;         // allocations served from the cache
  int64_t misses = 0;       // allocations that went to the system
};

// An uninitialised CPU tensor of `sizes`, `strides` (dense) and `dtype` whose
// memory comes from the cache. Callers go through the empty_* allocators of
// common.h, which take this path for CPU tensors of at least kMinCachedBytes.
at::Tensor host_cache_empty_strided(c10::IntArrayRef sizes, c10::IntArrayRef strides, c10::ScalarType dtype);

HostCacheStats host_cache_stats();

// Returns every cached buffer to the system.
void host_cache_clear();

} // namespace dpcore
