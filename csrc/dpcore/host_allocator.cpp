#define TORCH_ASSERT_ONLY_METHOD_OPERATORS

#include "dpcore/host_allocator.h"

#include "dpcore/env.h"

#include <ATen/EmptyTensor.h>
#include <ATen/core/Tensor.h>
#include <c10/core/Allocator.h>
#include <c10/util/Exception.h>

#include <sys/mman.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace dpcore {
namespace {

constexpr size_t kAlignment = 2 * 1024 * 1024;

// Set once the cache is destroyed at exit: later frees go to the system.
std::atomic<bool> g_cache_closed{false};

size_t round_up(size_t n) {
  return (n + kAlignment - 1) / kAlignment * kAlignment;
}

int64_t cap_bytes() {
  return env_int("DPCORE_HOST_CACHE_MB", 1024, 0) * 1024 * 1024;
}

class HostCache final : public c10::Allocator {
 public:
  HostCache() : cap_(cap_bytes()) {}
  ~HostCache() override {
    g_cache_closed = true;
    clear();
  }

  c10::DataPtr allocate(size_t n) override {
    const size_t size = round_up(n == 0 ? 1 : n);
    void* data = nullptr;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = free_.find(size);
      if (it != free_.end() && !it->second.empty()) {
        data = it->second.back();
        it->second.pop_back();
        cached_ -= static_cast<int64_t>(size);
        ++hits_;
      } else {
        ++misses_;
      }
    }
    if (data == nullptr) {
      TORCH_CHECK(
          posix_memalign(&data, kAlignment, size) == 0, "dpcore host cache: out of memory allocating ", size,
          " bytes");
      madvise(data, size, MADV_HUGEPAGE); // a hint; failure only costs speed
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      sizes_[data] = size;
    }
    return {data, data, &HostCache::release, c10::Device(c10::kCPU)};
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }

  HostCacheStats stats() {
    std::lock_guard<std::mutex> lock(mutex_);
    return {cached_, hits_, misses_};
  }

  void clear() {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& entry : free_) {
      for (void* p : entry.second) {
        std::free(p);
      }
    }
    free_.clear();
    cached_ = 0;
  }

  static HostCache& instance() {
    static HostCache cache;
    return cache;
  }

 private:
  static void release(void* data) {
    if (g_cache_closed) {
      std::free(data);
      return;
    }
    instance().put(data);
  }

  void put(void* data) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = sizes_.find(data);
    TORCH_INTERNAL_ASSERT(it != sizes_.end(), "dpcore host cache: unknown buffer freed");
    const size_t size = it->second;
    sizes_.erase(it);
    if (cached_ + static_cast<int64_t>(size) > cap_) {
      std::free(data);
      return;
    }
    free_[size].push_back(data);
    cached_ += static_cast<int64_t>(size);
  }

  std::mutex mutex_;
  std::map<size_t, std::vector<void*>> free_;
  std::unordered_map<void*, size_t> sizes_;
  const int64_t cap_;
  int64_t cached_ = 0;
  int64_t hits_ = 0;
  int64_t misses_ = 0;
};

} // namespace

at::Tensor host_cache_empty_strided(c10::IntArrayRef sizes, c10::IntArrayRef strides, c10::ScalarType dtype) {
  return at::detail::empty_strided_generic(
      sizes, strides, &HostCache::instance(), c10::DispatchKeySet(c10::DispatchKey::CPU), dtype);
}

HostCacheStats host_cache_stats() {
  return HostCache::instance().stats();
}

void host_cache_clear() {
  HostCache::instance().clear();
}

} // namespace dpcore
