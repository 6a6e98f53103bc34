// Peer access between CUDA devices (CUDA builds only): cuda::peer_access,
// declared in device.h, behind dpcore::can_access_directly.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS

#include "dpcore/device.h"

#include <ATen/cuda/PeerToPeerAccess.h>

namespace dpcore {
namespace cuda {

bool peer_access(c10::DeviceIndex reader, c10::DeviceIndex owner) {
  // torch's cache: cudaDeviceCanAccessPeer, then cudaDeviceEnablePeerAccess
  // once per ordered pair. Sharing it means torch's cross-device copies and
  // our kernels never try to enable the same pair twice.
  return at::cuda::get_p2p_access(reader, owner);
}

} // namespace cuda
} // namespace dpcore
