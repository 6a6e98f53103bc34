// Transfers between pageable host memory and CUDA devices through a ring of
// pinned staging buffers (CUDA builds only; scatter.cpp and gather.cpp call
// these for CPU <-> CUDA traffic).
//
// Why: a copy between pageable memory and a device is staged by the driver
// through its own small pinned buffers, synchronously, one device after the
// other. Here the host copies block b into a pinned slot while the DMA engine
// moves block b-1, so a large transfer runs at close to the pinned copy rate.
//
// Guarantees:
//  * Host-to-device copies run on a side stream per device (or on the given
//    stream); the current stream of every destination device waits for them
//    with an event, so work queued there afterwards sees the data, and the
//    host never waits for the device beyond reusing a slot.
//  * Device-to-host copies start after the work queued so far on each source
//    device's current stream and have finished when the call returns (the
//    host reads the result next).
//  * Pinned or small (< kMinStagedBytes) host tensors, and tensors with a lazy
//    conjugate or negative bit, are copied by ATen directly.
//  * One transfer at a time uses the ring; concurrent callers queue.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "dpcore/common.h"

namespace dpcore {
namespace cuda {

// Host tensors smaller than this are copied by ATen directly (the driver
// stages small pageable copies without blocking for long).
constexpr int64_t kMinStagedBytes = 1 << 20;
// The ring: DPCORE_STAGING_SLOTS pinned buffers (default 4) of
// DPCORE_STAGING_SLOT_MB MiB each (default 8), read when the ring is first
// used: more or larger slots let the DMA run further ahead of the host.
constexpr int64_t kDefaultStagingSlotMB = 8;
constexpr int64_t kDefaultStagingSlots = 4;

// Copies each host chunks[i] to devices[i] (CUDA): into outs[i] when `outs`
// is non-empty, else into a new tensor with chunks[i]'s strides where dense.
// On streams[i] where given (the caller then orders its own streams, as with
// any scatter on explicit streams), else as the header says. Returns the
// device tensors.
std::vector<at::Tensor> host_to_devices(
    at::TensorList chunks, c10::ArrayRef<c10::Device> devices, at::TensorList outs,
    const std::optional<StreamList>& streams);

// Copies each sources[i] (on a CUDA device) into dests[i] (a CPU tensor of the
// same shape and dtype, any strides); returns once the host holds the data.
void devices_to_host(at::TensorList sources, at::TensorList dests);

} // namespace cuda
} // namespace dpcore
