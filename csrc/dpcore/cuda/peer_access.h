// Peer access between CUDA devices (CUDA builds only). Callers outside
// csrc/dpcore/cuda use dpcore::can_access_directly (device.h).
#pragma once

#include <c10/core/Device.h>

namespace dpcore {
namespace cuda {

// Whether kernels on device `reader` may read memory on device `owner`
// directly; on the first ask for a pair, checks cudaDeviceCanAccessPeer and
// enables access. `reader` != `owner`, both visible.
bool peer_access(c10::DeviceIndex reader, c10::DeviceIndex owner);

} // namespace cuda
} // namespace dpcore
