// Device-list helpers shared by every collective: validation, normalisation and
// the "current device" of a device type. Device-generic: CPU and CUDA take the
// same path through c10's virtual guard interface.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/Stream.h>
#include <c10/util/ArrayRef.h>

#include <optional>
#include <vector>

namespace dpcore {

// A CPU device has no index: "cpu" and "cpu:0" name the same memory.
c10::Device normalize_device(c10::Device device);

// Checks a device list for use by the collective `op`, argument `arg`:
// non-empty, one device type, CUDA indices visible. Returns it normalised.
// Repeats are allowed (["cpu"] * 4, [0, 0]).
std::vector<c10::Device> check_devices(
    c10::ArrayRef<c10::Device> devices, const char* op, const char* arg = "devices");

// The current device of `type` (for CUDA: torch.cuda.current_device()).
c10::Device current_device(c10::DeviceType type);

// The current stream of `device` (CPU has one, the default).
c10::Stream current_stream(c10::Device device);

// Whether kernels running on `reader` may read memory of `owner` directly:
// the same device, or two CUDA devices with peer access (enabled on the
// first ask, once per ordered pair, through torch's own peer-access cache so
// that torch's copies and ours agree). Always false between distinct devices
// in a CPU build.
bool can_access_directly(c10::Device reader, c10::Device owner);

// Makes `consumer` wait for the work queued so far on `producer` (streams of
// one device type), without blocking the host. A no-op for one stream and for
// device types without events (CPU work is synchronous).
void wait_stream(c10::Stream consumer, c10::Stream producer);

// Makes the current stream of `consumer` wait for the work queued so far on
// the current stream of `producer`, without blocking the host. A no-op for
// device types without events (CPU work is synchronous) and for one stream.
void order_after(c10::Device consumer, c10::Device producer);

// Whether a copy into memory on `destination` may return before the data has
// landed: yes for an accelerator, whose streams order the work that follows;
// never for the host, which reads the data next (a non_blocking copy from a
// GPU into pinned host memory would otherwise race the reader).
inline bool may_copy_async(c10::Device destination) {
  return !destination.is_cpu();
}

// Whether `type` supports c10::Event (CPU does not; its copies are synchronous).
bool supports_events(c10::DeviceType type);

#ifdef DPCORE_WITH_CUDA
namespace cuda {
// Implemented by the CUDA backend (cuda/peer_access.cpp); callers use
// can_access_directly. Whether kernels on device `reader` may read memory on
// device `owner` directly; on the first ask for a pair, checks
// cudaDeviceCanAccessPeer and enables access. `reader` != `owner`, both
// visible.
bool peer_access(c10::DeviceIndex reader, c10::DeviceIndex owner);
} // namespace cuda
#endif

} // namespace dpcore
