// The data-moving kernels under the collectives. Each has a CPU implementation
// (the reference, always built; kernels/), in a CUDA build a CUDA one
// (cuda/), and an ATen-generic one for any other device. The entry points
// below check their arguments and run the backend of the device, chosen in
// one place: detail::backend_for (kernels/backend.cpp). The same kernels are
// PyTorch operators (torch.ops.dpcore.pack, .pack_multi, .unpack,
// .reduce_add_n): the schema and the Meta implementations are in ops.cpp,
// and each backend registers its implementation at the bottom of its own
// file (TORCH_LIBRARY_IMPL(dpcore, CPU/CUDA, m)).
//
// Why the entry points do not call through the dispatcher: they take the
// caller's FlatLayout, which the collectives and ReplicaBuffers compute once
// and reuse on every call (the operators' schema cannot carry it, so an
// operator call recomputes it from the tensors), and they run inside C++
// collectives that already hold their device and stream guards, where a
// boxed dispatcher call per bucket would only add cost. The operators exist
// for Python, torch.compile and the tests.
//
// Adding a kernel: its entry point and Backend member here, the CPU
// implementation in kernels/, the CUDA one in cuda/, the generic one, the
// table entries in kernels/backend.cpp, and the operator (schema and Meta in
// ops.cpp, registration beside each implementation).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "dpcore/common.h"
#include "dpcore/flatten.h"

namespace dpcore {

// Copies every tensors[i] (any strides, on flat's device) into its place in
// `flat` given by `layout`. `flat` is 1-D, contiguous, of layout.dtype and
// layout.numel elements.
void pack(at::TensorList tensors, const FlatLayout& layout, const at::Tensor& flat);

// pack into every buffer of `flats` at once (all on `tensors`' device, each
// as `flat` above): each tensor is read once and written K = flats.size()
// times, so that K copies of a bucket on one device cost one read of it (on
// CUDA one launch per 16 buffers, plus one for members that are not one
// block of bytes). The result equals K separate packs, bit for bit.
void pack_multi(at::TensorList tensors, const FlatLayout& layout, at::TensorList flats);

// The reverse of pack: copies each entry of `flat` into tensors[i].
void unpack(const at::Tensor& flat, const FlatLayout& layout, at::TensorList tensors);

// A fresh flat buffer holding `tensors` (all on one device) laid out as
// `layout`, on `tensors`' device: pack into a new buffer.
at::Tensor flatten(at::TensorList tensors, const FlatLayout& layout);

// out = sum(sources), or out += sum(sources) when `accumulate`, in one pass
// over memory. Every source has out's shape and dtype and lives on out's
// device or, for CUDA, on a device whose memory out's device reads directly
// (peer access): such sources are read in place, after the work queued on
// their device's current stream, and kept alive until out's stream is done
// with them. Half types accumulate in float. K >= 1 sources.
void reduce_add_n(at::TensorList sources, const at::Tensor& out, bool accumulate);

// outs[i] = sum over k of sources[k][i] (or += when `accumulate`) for every
// i: reduce_add_n over lists of tensors, spread over the tensors where they
// are small (3000 tensors of 3500 floats run as one parallel loop).
void reduce_add_lists(const TensorList2D& sources, at::TensorList outs, bool accumulate);

namespace detail {
// A tensor at least this large is processed by itself, its elements spread
// over the intra-op threads; smaller ones are spread as a group.
constexpr int64_t kLargeTensorBytes = 256 * 1024;
// Smallest group of small tensors handed to one intra-op thread.
constexpr int64_t kTensorsPerTask = 16;
// The argument checks of pack / unpack (`op` names which in the messages)
// and of reduce_add_n, shared by the entry points above and by every
// backend's operator implementation.
void check_pack_args(
    at::TensorList tensors, const FlatLayout& layout, const at::Tensor& flat, const char* op);
// The checks of one flat buffer for `count` tensors laid out as `layout`
// (defined, contiguous 1-D, layout.numel elements of layout.dtype), named
// 'flat', or flats[index] when index >= 0.
void check_flat(
    const at::Tensor& flat, const FlatLayout& layout, size_t count, const char* op, int64_t index);
// pack_multi's: at least one flat, each as check_pack_args wants it, all on
// one device.
void check_pack_multi_args(at::TensorList tensors, const FlatLayout& layout, at::TensorList flats);
void check_reduce_add_n_args(at::TensorList sources, const at::Tensor& out);
// Whether every source covers one dense block of memory with out's strides,
// so that element j of each sits at the same offset from its data pointer.
bool same_dense_layout(at::TensorList sources, const at::Tensor& out);
// reduce_add_n with ATen ops, for any layout and device; half types are
// accumulated in float.
void reduce_add_n_aten(at::TensorList sources, const at::Tensor& out, bool accumulate);

// One member of a pack_multi as bytes: `nbytes` from `src` to byte
// `offset` of the flat buffers.
struct PackBlock {
  const char* src;
  int64_t offset;
  int64_t nbytes;
};

// pack_multi's members as blocks of bytes, what every backend copies.
// `direct`: the members laid out as the layout says, read in place. The
// others are written by ATen into `first_flat` first (in stream order on a
// device), and `staged` holds their bytes there: the source for the other
// flats. Empty members are left out.
struct PackMultiPlan {
  std::vector<PackBlock> direct;
  std::vector<PackBlock> staged;
};
PackMultiPlan plan_pack_multi(at::TensorList tensors, const FlatLayout& layout, const at::Tensor& first_flat);

using PackFn = void (*)(at::TensorList, const FlatLayout&, const at::Tensor&);
using PackMultiFn = void (*)(at::TensorList, const FlatLayout&, at::TensorList);
using UnpackFn = void (*)(const at::Tensor&, const FlatLayout&, at::TensorList);
using ReduceAddNFn = void (*)(at::TensorList, const at::Tensor&, bool);

// One backend's implementations of the kernels (arguments already checked).
struct Backend {
  PackFn pack;
  PackMultiFn pack_multi;
  UnpackFn unpack;
  ReduceAddNFn reduce_add_n;
};

// The backend for tensors on `device`: CPU, CUDA (in a CUDA build), else the
// ATen-generic one. The one device switch of the entry points above.
const Backend& backend_for(const c10::Device& device);

// The operators over one backend's implementation: the layout of `tensors`
// and the checks of the entry points, then the backend. Each backend
// registers them for its dispatch key, e.g.
//   m.impl("pack", &detail::pack_op<&cpu::pack>);
template <PackFn kImpl>
void pack_op(at::TensorList tensors, const at::Tensor& flat) {
  const FlatLayout layout = FlatLayout::of(tensors);
  check_pack_args(tensors, layout, flat, "pack");
  kImpl(tensors, layout, flat);
}

template <PackMultiFn kImpl>
void pack_multi_op(at::TensorList tensors, at::TensorList flats) {
  const FlatLayout layout = FlatLayout::of(tensors);
  check_pack_multi_args(tensors, layout, flats);
  kImpl(tensors, layout, flats);
}

template <UnpackFn kImpl>
void unpack_op(const at::Tensor& flat, at::TensorList tensors) {
  const FlatLayout layout = FlatLayout::of(tensors);
  check_pack_args(tensors, layout, flat, "unpack");
  kImpl(flat, layout, tensors);
}

template <ReduceAddNFn kImpl>
void reduce_add_n_op(at::TensorList sources, const at::Tensor& out, bool accumulate) {
  check_reduce_add_n_args(sources, out);
  kImpl(sources, out, accumulate);
}
} // namespace detail

// The backends' implementations: arguments already checked.
namespace cpu {
void pack(at::TensorList tensors, const FlatLayout& layout, const at::Tensor& flat);
void pack_multi(at::TensorList tensors, const FlatLayout& layout, at::TensorList flats);
void unpack(const at::Tensor& flat, const FlatLayout& layout, at::TensorList tensors);
void reduce_add_n(at::TensorList sources, const at::Tensor& out, bool accumulate);
void reduce_add_lists(const TensorList2D& sources, at::TensorList outs, bool accumulate);
} // namespace cpu

// Any other device: one ATen copy per tensor, ATen adds (reduce_add_n is
// detail::reduce_add_n_aten).
namespace generic {
void pack(at::TensorList tensors, const FlatLayout& layout, const at::Tensor& flat);
void pack_multi(at::TensorList tensors, const FlatLayout& layout, at::TensorList flats);
void unpack(const at::Tensor& flat, const FlatLayout& layout, at::TensorList tensors);
} // namespace generic

#ifdef DPCORE_WITH_CUDA
namespace cuda {
void pack(at::TensorList tensors, const FlatLayout& layout, const at::Tensor& flat);
void pack_multi(at::TensorList tensors, const FlatLayout& layout, at::TensorList flats);
void unpack(const at::Tensor& flat, const FlatLayout& layout, at::TensorList tensors);
void reduce_add_n(at::TensorList sources, const at::Tensor& out, bool accumulate);
} // namespace cuda
#endif

} // namespace dpcore
