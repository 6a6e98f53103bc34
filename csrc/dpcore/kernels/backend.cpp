// detail::backend_for: the one place where a kernel's entry point picks the
// implementation for a device (kernels.h).
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS

#include "dpcore/kernels.h"

namespace dpcore {
namespace detail {

const Backend& backend_for(const c10::Device& device) {
  static const Backend kCpu{&cpu::pack, &cpu::pack_multi, &cpu::unpack, &cpu::reduce_add_n};
  static const Backend kGeneric{&generic::pack, &generic::pack_multi, &generic::unpack, &reduce_add_n_aten};
#ifdef DPCORE_WITH_CUDA
  static const Backend kCuda{&cuda::pack, &cuda::pack_multi, &cuda::unpack, &cuda::reduce_add_n};
  if (device.is_cuda()) {
    return kCuda;
  }
#endif
  return device.is_cpu() ? kCpu : kGeneric;
}

} // namespace detail
} // namespace dpcore
