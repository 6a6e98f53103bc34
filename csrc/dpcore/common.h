// Types and tensor helpers that every part of the C++ core may use. It
// includes no other dpcore header, so any file may include it.
//
// The core's headers include only those of the layers below them:
//   common.h  device.h  env.h  host_allocator.h  worker_pool.h  rendezvous.h
//   comm/checks.h  cuda/device_table.h  replica_rng.h  grad_ready.h
//   traffic.h  packed.h
//                                 (no dpcore header; comm/checks.h and
//                                 cuda/device_table.h are used only inside
//                                 their folders)
//   sync_batchnorm.h              synchronized BatchNorm (on rendezvous.h)
//   flatten.h                     layouts and buckets
//   kernels.h  cuda/host_staging.h  pack / unpack / reduce_add_n; the pinned ring
//   comm.h                        the collectives (comm/*.cpp)
//   replica_buffers.h             persistent per-device buffers of cached replicas
// A CUDA backend function the core calls is declared in the core's header
// (device.h, kernels.h) and defined under cuda/, never the reverse.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/Stream.h>
#include <c10/util/ArrayRef.h>

#include <cstddef>
#include <optional>
#include <vector>

namespace dpcore {

// One optional stream per device of a list (scatter's `streams`): where an
// entry is given, the copy to that device runs on it.
using StreamList = std::vector<std::optional<c10::Stream>>;

// lists[k][i]: tensor i of list k, one list per device (what the coalesced
// reductions take).
using TensorList2D = std::vector<std::vector<at::Tensor>>;

// Fills `column` with lists[k][i] for every k (it is resized to lists.size()):
// entry i of every list, as the reductions over lists sum it. `column` is
// reused by loops over i, so that no vector is allocated per entry.
inline void take_column(const TensorList2D& lists, size_t i, std::vector<at::Tensor>& column) {
  column.resize(lists.size());
  for (size_t k = 0; k < lists.size(); ++k) {
    column[k] = lists[k][i];
  }
}

// Whether `t`'s values are exactly the bytes of one dense block of memory
// starting at its data pointer: strided, non-overlapping and dense, and with
// no lazy conjugate or negative bit (which make its values differ from its
// bytes). Byte-level copies and raw-pointer kernels take only such tensors.
bool is_plain_dense(const at::Tensor& t);

// Device-generic allocators. A large CPU tensor (at least kMinCachedBytes,
// host_allocator.h) comes from dpcore's host cache; anything else from ATen
// under a guard for `device`.

// An uninitialised tensor on `device` of `sizes` and `strides` (dense: a
// permutation of contiguous strides) with `like`'s dtype.
at::Tensor empty_like_layout(
    const at::Tensor& like, c10::Device device, c10::IntArrayRef sizes, c10::IntArrayRef strides);

// An uninitialised tensor on `device` shaped like `like`, keeping its strides
// where it is dense (channels_last stays channels_last), contiguous otherwise.
at::Tensor empty_preserving(const at::Tensor& like, c10::Device device);

// A 1-D uninitialised buffer of `numel` elements of `like`'s dtype on `device`.
at::Tensor empty_flat(const at::Tensor& like, c10::Device device, int64_t numel);

} // namespace dpcore
