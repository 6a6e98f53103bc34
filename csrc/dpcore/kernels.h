// The data-moving kernels under the collectives. Each has a CPU implementation
// (the reference, always built) and, in a CUDA build, a CUDA one; the entry
// points below check their arguments and dispatch on the device.
#pragma once

#include <ATen/core/Tensor.h>

#include "dpcore/flatten.h"

namespace dpcore {

// Copies every tensors[i] (any strides, on flat's device) into its place in
// `flat` given by `layout`. `flat` is 1-D, contiguous, of layout.dtype and
// layout.numel elements.
void pack(at::TensorList tensors, const FlatLayout& layout, const at::Tensor& flat);

// The reverse of pack: copies each entry of `flat` into tensors[i].
void unpack(const at::Tensor& flat, const FlatLayout& layout, at::TensorList tensors);

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
// Whether every source covers one dense block of memory with out's strides,
// so that element j of each sits at the same offset from its data pointer.
bool same_dense_layout(at::TensorList sources, const at::Tensor& out);
// reduce_add_n with ATen ops, for any layout and device; half types are
// accumulated in float.
void reduce_add_n_aten(at::TensorList sources, const at::Tensor& out, bool accumulate);
} // namespace detail

namespace cpu {
void pack(at::TensorList tensors, const FlatLayout& layout, const at::Tensor& flat);
void unpack(const at::Tensor& flat, const FlatLayout& layout, at::TensorList tensors);
void reduce_add_n(at::TensorList sources, const at::Tensor& out, bool accumulate);
void reduce_add_lists(const TensorList2D& sources, at::TensorList outs, bool accumulate);
} // namespace cpu

#ifdef DPCORE_WITH_CUDA
namespace cuda {
void pack(at::TensorList tensors, const FlatLayout& layout, const at::Tensor& flat);
void unpack(const at::Tensor& flat, const FlatLayout& layout, at::TensorList tensors);
void reduce_add_n(at::TensorList sources, const at::Tensor& out, bool accumulate);
} // namespace cuda
#endif

} // namespace dpcore
