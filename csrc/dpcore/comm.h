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
//  * Traffic (traffic.h): every collective counts the bytes it moves between
//    the slots of its list (positions, so ["cpu"] * 4 has 4 slots). The
//    ring collectives count each hop. Of the others, a collective whose
//    source or destination is one tensor or device outside the list (the
//    source of broadcast, broadcast_out, scatter, scatter_out; the
//    destination of reduce_add, reduce_add_coalesced, gather, gather_out)
//    puts that endpoint on the slot of the first entry on its device (on a
//    CPU list: slot 0), or on slot N (one past the list) where no entry is;
//    broadcast_coalesced's and broadcast_flat_into's source is slot 0, and
//    broadcast_flat_into's flats[d] slot d + 1 (the replica refresh's flats
//    are those of devices 1..N-1). A copy to the endpoint's own slot and a
//    view (scatter's chunks on the source's device) count nothing. So
//    DataParallel's gradient reduction, whose inputs are replicas 1..N-1
//    (replica 0 accumulates into .grad itself), counts (N-2) * G into slot
//    0 on a CPU list, and (N-1) * G into slot N-1 (outside) on distinct GPUs.
//  * Ring collectives (reduce_scatter, all_gather, all_reduce and their
//    coalesced forms): slot i sends to slot i + 1 (mod N) in N - 1 steps, so
//    each slot moves about (N-1)/N of the bytes each way; with segments seg:
//    a reduce-scatter's slot i sends total - seg[i] and receives total -
//    seg[i-1], an all-gather's sends total - seg[i+1] and receives total -
//    seg[i]. Partial sums travel in the tensors' dtype (half types round at
//    each hop). Hops between CUDA devices are ATen copies and reduce_add_n
//    reads on the current streams, ordered by events (a peer's memory is
//    read in place where peer access is on). torch.cuda.nccl would serve
//    distinct GPUs one day; it cannot run on a repeated GPU.
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
// own version counter. `slots` (one per list, for the traffic counts):
// each list's position in the caller's device list, whose position 0 is the
// destination (DataParallel's replicas 1..N-1 summed into device 0); by
// default list k is slot k and the destination as said above.
std::vector<at::Tensor> reduce_add_coalesced(
    const TensorList2D& inputs, std::optional<c10::Device> destination,
    int64_t bucket_bytes = kDefaultBucketBytes,
    const std::optional<std::vector<int64_t>>& slots = std::nullopt);

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

// ---- ring collectives (comm/ring.cpp) ----
//
// reduce_scatter: inputs[j] (dense, on devices[j], one numel and dtype for
// all) are summed elementwise and split into N consecutive segments of the
// flattened sum, of `sizes` elements (N non-negative counts summing to the
// numel; default balanced_chunk_sizes): result[i], a new 1-D tensor on
// devices[i], holds segment i. The sum is in ring order, left to right:
// segment i = ((inputs[i+1] + inputs[i+2]) + ...) + inputs[i] (indices mod
// N), the same on every device type. N = 1: a copy of inputs[0] flattened.
std::vector<at::Tensor> reduce_scatter(
    at::TensorList inputs, c10::ArrayRef<c10::Device> devices,
    const std::optional<std::vector<int64_t>>& sizes = std::nullopt);

// all_gather: shards[i] (1-D, on devices[i], one dtype) concatenated in
// order: result[j], a new 1-D tensor on devices[j]. N = 1: a copy.
std::vector<at::Tensor> all_gather(at::TensorList shards, c10::ArrayRef<c10::Device> devices);

// all_gather into `outs` (1-D, contiguous, of the shards' total numel and
// dtype; outs[j] on shards[j]'s device; the outs' devices are the list).
// A shard that already sits at its place in its own out (a view of outs[j]
// at shards[j]'s offset: ZeRO's flat buffers) is not copied. The outs must
// not share memory with each other, nor with another shard (checked
// before anything is written).
void all_gather_out(at::TensorList shards, at::TensorList outs);

// all_reduce: every inputs[j] (as reduce_scatter's, not sharing memory
// with each other) becomes the elementwise sum, in place: reduce_scatter
// with balanced segments, then all_gather back into the inputs (segment i
// summed in reduce_scatter's order, every input bit-identical). N = 1:
// nothing changes.
void all_reduce(at::TensorList inputs, c10::ArrayRef<c10::Device> devices);

// reduce_scatter of lists: tensors[j] lists device j's tensors (on
// devices[j], dense; shapes and dtypes equal across j, several dtypes
// allowed); result[k] = the sum over j of tensors[j][k], a new tensor on
// devices[owners[k]] (owners[k] in [0, N)), summed in the ring order of
// reduce_scatter with k's owner as the segment's. The tensors are packed
// per dtype into buckets of about `bucket_bytes`, each taking about
// bucket_bytes / N of every owner's tensors in order, laid out by owner so
// that an owner's tensors are one segment; one ring per bucket. Results of
// one bucket and owner are views of one buffer, each with its own version
// counter.
std::vector<at::Tensor> reduce_scatter_coalesced(
    const TensorList2D& tensors, c10::ArrayRef<c10::Device> devices, c10::ArrayRef<int64_t> owners,
    int64_t bucket_bytes = kDefaultBucketBytes);

// all_gather of lists: tensors[k] (dense) sits on devices[owners[k]];
// result[d][k] holds it on devices[d], bucketed as reduce_scatter_coalesced.
// Without `outs`, result[owners[k]][k] is tensors[k] itself and the others
// are views of one buffer per bucket and device (own version counters).
// With `outs` (outs[d][k]: tensors[k]'s shape and dtype, on devices[d], e.g.
// the replicas' parameters), the values are written into them and `outs`
// is returned; an out that is tensors[k] itself is left as it is.
TensorList2D all_gather_coalesced(
    at::TensorList tensors, c10::ArrayRef<int64_t> owners, c10::ArrayRef<c10::Device> devices,
    const std::optional<TensorList2D>& outs = std::nullopt, int64_t bucket_bytes = kDefaultBucketBytes);

namespace detail {
// Helpers the files of comm/ share.

// A fresh copy of `tensor` on `device`, with tensor's strides where it is
// dense (so channels_last stays channels_last). broadcast.cpp.
at::Tensor copy_to(const at::Tensor& tensor, c10::Device device);

// `tensor` where reduce_add_n on `device` can read it: itself when on
// `device` or on a device whose memory `device` reads directly (peer access;
// reduce_add_n orders the streams), else a copy on `device`. reduce_add.cpp.
at::Tensor readable_on(const at::Tensor& tensor, c10::Device device);

// The bytes a copy of `tensor` moves: its elements, or a sparse tensor's
// indices and values. broadcast.cpp.
int64_t wire_bytes(const at::Tensor& tensor);

// The slot of an endpoint on `device` (the traffic rule above): the first i
// with devices[i] == device, else devices.size(). broadcast.cpp.
size_t slot_of(c10::Device device, c10::ArrayRef<c10::Device> devices);
} // namespace detail

} // namespace dpcore
