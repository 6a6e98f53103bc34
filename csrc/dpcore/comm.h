// dpcore's collectives: broadcast, reduce-add, scatter and gather between the
// devices of a list, with coalesced (bucketed) forms. Device-generic: a list
// holds CUDA devices or CPU devices, repeats allowed (["cpu"] * 4, [0, 0]).
//
// Common guarantees:
//  * Data movers, not differentiable: outputs carry no autograd history (the
//    autograd Functions in dpcore/_functions.py wrap these for autograd).
//  * broadcast: the output for the first entry equal to the source's device
//    is the source; every other output owns its storage, also when its
//    device repeats the source's. scatter: every chunk bound for the source's
//    own device is a view of it (chunks are disjoint; with `separate`, a
//    tensor of its own on the source's storage); others are copies.
//  * Coalesced outputs each have their own version counter.
//  * Copies between CUDA devices are ordered on the current streams of both
//    devices (or the given streams), without a device-wide synchronize.
//  * Misuse raises c10::Error naming the argument, the index, and what was
//    expected versus found.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/Stream.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "dpcore/common.h"
#include "dpcore/flatten.h"

namespace dpcore {

constexpr int64_t kDefaultBucketBytes = 10 * 1024 * 1024;

// result[i] holds `tensor` on devices[i]. The first entry equal to tensor's
// device is `tensor` itself.
std::vector<at::Tensor> broadcast(const at::Tensor& tensor, c10::ArrayRef<c10::Device> devices);

// Copies `tensor` into every one of `outs` (same shape, one device type).
void broadcast_out(const at::Tensor& tensor, at::TensorList outs);

// result[d][i] holds tensors[i] on devices[d]. All tensors must sit on
// devices[0]; result[0] is `tensors` itself. Dense tensors travel in buckets
// of one dtype of about `bucket_bytes`; sparse ones one by one.
TensorList2D broadcast_coalesced(
    at::TensorList tensors, c10::ArrayRef<c10::Device> devices, int64_t bucket_bytes = kDefaultBucketBytes);

// The elementwise sum of `tensors` (same shape, dtype and layout; dense or
// sparse COO), on `destination` (default: the current device of their type).
// Always a new tensor.
at::Tensor reduce_add(at::TensorList tensors, std::optional<c10::Device> destination);

// Copies the bucket `members` (dense, one dtype, all on one device) laid out
// as `layout` into every buffer of `flats` (1-D, layout.numel elements, each
// on its own device; all checked, by index, before any is written): the
// buffers on the members' device by one pack_multi (the members read once),
// the others by a copy of one flat buffer on that device (the member itself
// when it is the whole bucket, else one of those packed, else one made).
void broadcast_flat_into(at::TensorList members, const FlatLayout& layout, at::TensorList flats);

// result[i] = reduce_add({inputs[0][i], inputs[1][i], ...}) for every i, in
// buckets as broadcast_coalesced. inputs[k] lists device k's tensors, all on
// one device. Dense results are views of one buffer per bucket, each with its
// own version counter.
std::vector<at::Tensor> reduce_add_coalesced(
    const TensorList2D& inputs, std::optional<c10::Device> destination,
    int64_t bucket_bytes = kDefaultBucketBytes);

// Sizes that split `total` into `parts` chunks differing by at most one, the
// larger first (10 into 4: 3, 3, 2, 2).
std::vector<int64_t> balanced_chunk_sizes(int64_t total, int64_t parts);

// scatter and gather take dense (strided) tensors only; sparse ones raise.
//
// Splits `tensor` along `dim` into one chunk per device (sizes `chunk_sizes`,
// default balanced_chunk_sizes) and moves chunk i to devices[i], on
// streams[i] where given. A chunk bound for tensor's own device is a view
// (torch.cuda.comm's rule); with `separate`, it shares tensor's storage but
// is no view, and every such chunk but the first has a version counter of
// its own (the first keeps tensor's): DataParallel's per-replica chunks,
// each its own tensor as a copy on another device is. Memory format
// (channels_last) is preserved.
std::vector<at::Tensor> scatter(
    const at::Tensor& tensor, c10::ArrayRef<c10::Device> devices,
    const std::optional<std::vector<int64_t>>& chunk_sizes = std::nullopt, int64_t dim = 0,
    const std::optional<StreamList>& streams = std::nullopt, bool separate = false);

// Copies consecutive chunks of `tensor` along `dim` into `outs`; the chunk
// sizes are the outs' sizes along dim. An out sharing memory with `tensor`
// or with another out is an error (checked before anything is written).
void scatter_out(
    const at::Tensor& tensor, at::TensorList outs, int64_t dim = 0,
    const std::optional<StreamList>& streams = std::nullopt);

// Concatenates `tensors` along `dim` into a new tensor on `destination`
// (default: the current device of their type). channels_last is kept when
// every input has it.
at::Tensor gather(
    at::TensorList tensors, int64_t dim = 0, std::optional<c10::Device> destination = std::nullopt);

// Concatenates `tensors` along `dim` into `out`, which must not share
// memory with any of them (checked before anything is written).
void gather_out(at::TensorList tensors, const at::Tensor& out, int64_t dim = 0);

} // namespace dpcore
