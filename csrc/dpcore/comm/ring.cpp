// The ring collectives: reduce_scatter, all_gather, all_gather_out,
// all_reduce, reduce_scatter_coalesced, all_gather_coalesced. Slot i sends
// to slot i + 1 (mod N); each of the N - 1 steps moves one segment per slot.
// A hop is reduce_add_n (the partial sum read in place where the receiver
// can read the sender's memory: the same device, a CPU list, peer access;
// else copied over first) or an ATen copy, on the current streams of the
// devices, which both order with events: one code path for every device
// type.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <map>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "dpcore/comm.h"
#include "dpcore/comm/checks.h"
#include "dpcore/common.h"
#include "dpcore/device.h"
#include "dpcore/flatten.h"
#include "dpcore/kernels.h"
#include "dpcore/traffic.h"

namespace dpcore {
namespace {

size_t ring_index(int64_t i, size_t n) {
  const int64_t m = i % static_cast<int64_t>(n);
  return static_cast<size_t>(m < 0 ? m + static_cast<int64_t>(n) : m);
}

// N consecutive segments of a flat buffer.
struct Segments {
  std::vector<int64_t> offsets;
  std::vector<int64_t> sizes;
  int64_t total = 0;

  explicit Segments(std::vector<int64_t> counts) : sizes(std::move(counts)) {
    offsets.reserve(sizes.size());
    for (const int64_t size : sizes) {
      offsets.push_back(total);
      total += size;
    }
  }
  at::Tensor of(const at::Tensor& flat, size_t i) const {
    return flat.narrow(0, offsets[i], sizes[i]);
  }
};

int64_t item_bytes(const at::Tensor& t) {
  return static_cast<int64_t>(t.element_size());
}

// fn(j) for every slot j of one ring step (no two touch the same memory).
// On a CPU list the slots run at once on the intra-op threads (each slot's
// work then runs on one thread): one join per step rather than one per
// slot. On CUDA the host only queues the work, slot by slot.
template <typename F>
void for_each_slot(c10::ArrayRef<c10::Device> devices, const F& fn) {
  const auto n = static_cast<int64_t>(devices.size());
  if (devices[0].is_cpu()) {
    at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
      for (int64_t j = begin; j < end; ++j) {
        fn(static_cast<size_t>(j));
      }
    });
    return;
  }
  for (int64_t j = 0; j < n; ++j) {
    fn(static_cast<size_t>(j));
  }
}

// The ring reduce-scatter of `flats` (1-D, one numel and dtype, flats[j] on
// devices[j]): result[i], new on devices[i], the sum of segment i. At step
// s slot j receives segment j - s - 2 from slot j - 1 and adds its own, so
// segment i's sum starts at slot i + 1 and ends at slot i. `in_place`
// (all_reduce): each slot sums into its own flat, where the next step reads
// it, so that segment i's sum ends in flats[i]; nothing is allocated or
// returned. A slot never writes the segment its successor reads in the same
// step.
std::vector<at::Tensor> ring_reduce_scatter(
    const std::vector<at::Tensor>& flats, c10::ArrayRef<c10::Device> devices, const Segments& seg,
    TrafficRecord& traffic, bool in_place = false) {
  const size_t n = flats.size();
  if (n == 1) {
    if (in_place) {
      return {};
    }
    c10::DeviceGuard guard(devices[0]);
    at::Tensor out = empty_flat(flats[0], devices[0], seg.total);
    out.copy_(flats[0]);
    return {out};
  }
  const int64_t item = item_bytes(flats[0]);
  const auto from_of = [n](size_t j) { return ring_index(static_cast<int64_t>(j) - 1, n); };
  std::vector<at::Tensor> partial(n); // partial[j]: what slot j summed in the last step
  for (size_t s = 0; s + 1 < n; ++s) {
    const auto segment_of = [n, s](size_t j) {
      return ring_index(static_cast<int64_t>(j) - static_cast<int64_t>(s) - 2, n);
    };
    std::vector<at::Tensor> next(n);
    for (size_t j = 0; j < n; ++j) {
      c10::DeviceGuard guard(devices[j]);
      const size_t c = segment_of(j);
      next[j] = in_place ? seg.of(flats[j], c) : empty_flat(flats[j], devices[j], seg.sizes[c]);
    }
    for_each_slot(devices, [&](size_t j) {
      const size_t c = segment_of(j);
      if (seg.sizes[c] == 0) {
        return;
      }
      c10::DeviceGuard guard(devices[j]);
      const at::Tensor sent = s == 0 || in_place ? seg.of(flats[from_of(j)], c) : partial[from_of(j)];
      // The own segment first: where the sum goes into it, every backend
      // reads it before writing (ATen's path copies sources[0] into out).
      const std::vector<at::Tensor> sources{seg.of(flats[j], c), detail::readable_on(sent, devices[j])};
      reduce_add_n(sources, next[j], /*accumulate=*/false);
    });
    for (size_t j = 0; j < n; ++j) {
      traffic.copy(from_of(j), j, seg.sizes[segment_of(j)] * item);
    }
    partial = std::move(next);
  }
  return in_place ? std::vector<at::Tensor>{} : partial;
}

// The ring all-gather in place: flats[j] (1-D, on devices[j]) holds segment
// j; afterwards every flat holds every segment. At step s slot j receives
// segment j - 1 - s from slot j - 1.
void ring_all_gather(
    const std::vector<at::Tensor>& flats, c10::ArrayRef<c10::Device> devices, const Segments& seg,
    TrafficRecord& traffic) {
  const size_t n = flats.size();
  if (n == 1) {
    return;
  }
  const int64_t item = item_bytes(flats[0]);
  for (size_t s = 0; s + 1 < n; ++s) {
    const auto from_of = [n](size_t j) { return ring_index(static_cast<int64_t>(j) - 1, n); };
    const auto segment_of = [n, s](size_t j) {
      return ring_index(static_cast<int64_t>(j) - 1 - static_cast<int64_t>(s), n);
    };
    for_each_slot(devices, [&](size_t j) {
      const size_t c = segment_of(j);
      if (seg.sizes[c] == 0) {
        return;
      }
      c10::DeviceGuard guard(devices[j]);
      seg.of(flats[j], c).copy_(seg.of(flats[from_of(j)], c), may_copy_async(devices[j]));
    });
    for (size_t j = 0; j < n; ++j) {
      traffic.copy(from_of(j), j, seg.sizes[segment_of(j)] * item);
    }
  }
}

void check_dense_tensor(const at::Tensor& t, const char* op, const std::string& what) {
  TORCH_CHECK(t.defined(), op, ": ", what, " is undefined");
  TORCH_CHECK(
      t.layout() == c10::kStrided, op, ": expected dense (strided) tensors, but ", what, " has layout ",
      t.layout());
}

// The checks of one tensor per slot (named what[j]): dense, on devices[j],
// of tensors[0]'s dtype and, where `same_numel`, its numel.
void check_per_slot(
    at::TensorList tensors, c10::ArrayRef<c10::Device> devices, const char* op, const char* what,
    bool same_numel) {
  TORCH_CHECK(
      tensors.size() == devices.size(), op, ": expected one tensor in '", what,
      "' per device (len(devices) = ", devices.size(), "), but got ", tensors.size());
  for (size_t j = 0; j < tensors.size(); ++j) {
    const at::Tensor& t = tensors[j];
    check_dense_tensor(t, op, c10::str(what, "[", j, "]"));
    TORCH_CHECK(
        normalize_device(t.device()) == devices[j], op, ": expected ", what, "[", j, "] on ", devices[j],
        " (devices[", j, "]), but it is on ", t.device());
    TORCH_CHECK(
        t.scalar_type() == tensors[0].scalar_type(), op, ": expected ", what, "[", j, "] of dtype ",
        tensors[0].scalar_type(), ", as ", what, "[0] is, but it is ", t.scalar_type());
    TORCH_CHECK(
        !same_numel || t.numel() == tensors[0].numel(), op, ": expected ", what, "[", j, "] to have ",
        tensors[0].numel(), " elements, as ", what, "[0] has, but it has ", t.numel());
  }
}

Segments checked_segments(const std::optional<std::vector<int64_t>>& sizes, int64_t numel, size_t n) {
  if (!sizes) {
    return Segments(balanced_chunk_sizes(numel, static_cast<int64_t>(n)));
  }
  TORCH_CHECK(
      sizes->size() == n, "reduce_scatter: expected one entry of 'sizes' per device (len(devices) = ", n,
      "), but got ", sizes->size());
  for (size_t i = 0; i < n; ++i) {
    TORCH_CHECK(
        (*sizes)[i] >= 0, "reduce_scatter: expected non-negative sizes, but sizes[", i, "] is ", (*sizes)[i]);
  }
  const int64_t sum = std::accumulate(sizes->begin(), sizes->end(), int64_t{0});
  TORCH_CHECK(
      sum == numel, "reduce_scatter: expected 'sizes' to sum to ", numel,
      " (the elements of each input), but they sum to ", sum);
  return Segments(*sizes);
}

// Each input as a contiguous 1-D tensor of its elements in order: a view
// where it is contiguous, else a copy on its device.
std::vector<at::Tensor> flat_inputs(at::TensorList inputs) {
  std::vector<at::Tensor> flats;
  flats.reserve(inputs.size());
  for (const at::Tensor& t : inputs) {
    c10::DeviceGuard guard(t.device());
    flats.push_back(t.contiguous().view({-1}));
  }
  return flats;
}

// ---- buckets of the coalesced forms ----

// One ring's tensors, by index, ordered by owner: owner o's are
// indices[bounds[o] .. bounds[o + 1]).
struct RingBucket {
  std::vector<size_t> indices;
  std::vector<size_t> bounds;
};

// Cuts `like` (dense) into buckets of one dtype (dtypes in order of first
// appearance), each taking from every owner's tensors, in order, until it
// holds about bucket_bytes / n of them (at least one while any is left).
std::vector<RingBucket> ring_buckets(
    at::TensorList like, c10::ArrayRef<int64_t> owners, size_t n, int64_t bucket_bytes) {
  std::vector<c10::ScalarType> dtypes;
  std::map<c10::ScalarType, std::vector<std::vector<size_t>>> queues; // dtype -> owner -> indices
  for (size_t k = 0; k < like.size(); ++k) {
    auto [it, fresh] = queues.try_emplace(like[k].scalar_type(), n);
    if (fresh) {
      dtypes.push_back(like[k].scalar_type());
    }
    it->second[static_cast<size_t>(owners[k])].push_back(k);
  }
  const int64_t share = std::max<int64_t>(1, bucket_bytes / static_cast<int64_t>(n));
  std::vector<RingBucket> buckets;
  for (const c10::ScalarType dtype : dtypes) {
    const std::vector<std::vector<size_t>>& by_owner = queues[dtype];
    std::vector<size_t> next(n, 0);
    bool left = true;
    while (left) {
      RingBucket bucket;
      bucket.bounds.push_back(0);
      left = false;
      for (size_t o = 0; o < n; ++o) {
        int64_t taken = 0;
        while (next[o] < by_owner[o].size() && taken < share) {
          const at::Tensor& t = like[by_owner[o][next[o]]];
          taken += static_cast<int64_t>(t.numel()) * item_bytes(t);
          bucket.indices.push_back(by_owner[o][next[o]++]);
        }
        bucket.bounds.push_back(bucket.indices.size());
        left = left || next[o] < by_owner[o].size();
      }
      buckets.push_back(std::move(bucket));
    }
  }
  return buckets;
}

// The entries [first, last) of `layout` as a layout of their own (offsets
// from entry `first`'s).
FlatLayout sub_layout(const FlatLayout& layout, size_t first, size_t last) {
  FlatLayout sub;
  sub.dtype = layout.dtype;
  const int64_t start = first < layout.size() ? layout.offsets[first] : layout.numel;
  for (size_t e = first; e < last; ++e) {
    sub.offsets.push_back(layout.offsets[e] - start);
    sub.sizes.push_back(layout.sizes[e]);
    sub.strides.push_back(layout.strides[e]);
  }
  sub.numel = (last < layout.size() ? layout.offsets[last] : layout.numel) - start;
  return sub;
}

// The bucket's segment sizes: owner o's elements.
Segments bucket_segments(const FlatLayout& layout, const RingBucket& bucket) {
  std::vector<int64_t> sizes;
  const size_t n = bucket.bounds.size() - 1;
  for (size_t o = 0; o < n; ++o) {
    sizes.push_back(sub_layout(layout, bucket.bounds[o], bucket.bounds[o + 1]).numel);
  }
  return Segments(std::move(sizes));
}

std::vector<at::Tensor> pick(
    at::TensorList list, const std::vector<size_t>& indices, size_t first, size_t last) {
  std::vector<at::Tensor> result;
  result.reserve(last - first);
  for (size_t e = first; e < last; ++e) {
    result.push_back(list[indices[e]]);
  }
  return result;
}

void check_owners(c10::ArrayRef<int64_t> owners, size_t count, size_t n, const char* op, const char* what) {
  TORCH_CHECK(
      owners.size() == count, op, ": expected one entry of 'owners' per tensor (", count, " in ", what,
      "), but got ", owners.size());
  for (size_t k = 0; k < owners.size(); ++k) {
    TORCH_CHECK(
        owners[k] >= 0 && owners[k] < static_cast<int64_t>(n), op, ": expected owners[", k, "] in [0, ", n,
        ") (an index into devices), but it is ", owners[k]);
  }
}

// ---- the coalesced forms on a CPU list ----
//
// On a CPU list every slot's memory is the one host memory, so the ring's
// N - 1 hops per bucket would only move segments through fresh buffers
// (and flatten every list first). There the coalesced forms compute the
// ring's result in place of running it: each owner's sums read every list
// where it is, in the ring's order, and an all-gather copies each tensor
// straight into its targets; the traffic counted is still what each slot of
// the ring sends and receives (the same figures, hop by hop summed).

// Half types round at each hop of the ring; every other dtype sums in its
// own type, so one pass over the sources in ring order equals the ring.
bool rounds_per_hop(c10::ScalarType dtype) {
  return at::isReducedFloatingType(dtype) || dtype == c10::ScalarType::ComplexHalf;
}

// The ring reduce-scatter's counts for segments `seg`: slot j receives
// every segment but j - 1's from slot j - 1.
void count_ring_reduce_scatter(const Segments& seg, int64_t item, size_t n, TrafficRecord& traffic) {
  if (n < 2) {
    return;
  }
  for (size_t j = 0; j < n; ++j) {
    const size_t from = ring_index(static_cast<int64_t>(j) - 1, n);
    traffic.copy(from, j, (seg.total - seg.sizes[from]) * item);
  }
}

// The ring all-gather's counts: slot j receives every segment but its own
// from slot j - 1.
void count_ring_all_gather(const Segments& seg, int64_t item, size_t n, TrafficRecord& traffic) {
  if (n < 2) {
    return;
  }
  for (size_t j = 0; j < n; ++j) {
    traffic.copy(ring_index(static_cast<int64_t>(j) - 1, n), j, (seg.total - seg.sizes[j]) * item);
  }
}

// One entry of sum_entries: each of outs (+)= the sum of sources, left to
// right (all of one shape and dtype); with one source, copies of it.
struct SumEntry {
  std::vector<at::Tensor> sources;
  std::vector<at::Tensor> outs;
};

// The fewest elements of a piece that a contiguous entry is cut into.
constexpr int64_t kPieceElements = 64 * 1024;

// Every entry of `entries`, in one parallel region: the entries, contiguous
// ones larger than a piece cut into pieces, are dealt to the intra-op
// threads by bytes (largest first, each to the least loaded), and each
// piece's outs are written one after the other by reduce_add_n on its
// thread, so that a source piece copied to several outs is read from cache.
// One region per call rather than one per large tensor: on a loaded machine
// each region's join can wait a time slice. Views are made here, on the
// calling thread (under its no-grad guard); work under kPieceElements in all
// runs on this thread.
void sum_entries(const std::vector<SumEntry>& entries, bool accumulate) {
  const auto threads = static_cast<size_t>(std::max(1, at::get_num_threads()));
  int64_t total = 0;
  for (const SumEntry& entry : entries) {
    total += entry.outs[0].numel() * static_cast<int64_t>(entry.outs.size());
  }
  const int64_t piece = std::max(kPieceElements, total / static_cast<int64_t>(4 * threads) + 1);
  std::vector<SumEntry> pieces;
  std::vector<int64_t> bytes;
  const auto contiguous = [](const std::vector<at::Tensor>& list) {
    return std::all_of(list.begin(), list.end(), [](const at::Tensor& t) { return t.is_contiguous(); });
  };
  const auto cut = [](const std::vector<at::Tensor>& list, int64_t start, int64_t len) {
    std::vector<at::Tensor> parts;
    parts.reserve(list.size());
    for (const at::Tensor& t : list) {
      parts.push_back(t.view({-1}).narrow(0, start, len));
    }
    return parts;
  };
  for (const SumEntry& entry : entries) {
    const int64_t numel = entry.outs[0].numel();
    const int64_t weight = static_cast<int64_t>(entry.outs.size() * (entry.sources.size() + 1));
    if (numel == 0) {
      continue;
    }
    if (threads == 1 || numel <= piece || !contiguous(entry.sources) || !contiguous(entry.outs)) {
      pieces.push_back(entry);
      bytes.push_back(numel * weight);
      continue;
    }
    for (int64_t start = 0; start < numel; start += piece) {
      const int64_t len = std::min(piece, numel - start);
      pieces.push_back({cut(entry.sources, start, len), cut(entry.outs, start, len)});
      bytes.push_back(len * weight);
    }
  }
  const auto run = [&](const SumEntry& p) {
    for (const at::Tensor& out : p.outs) {
      reduce_add_n(p.sources, out, accumulate);
    }
  };
  if (threads == 1 || pieces.size() < 2 || total <= kPieceElements) {
    std::for_each(pieces.begin(), pieces.end(), run);
    return;
  }
  std::vector<size_t> order(pieces.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return bytes[a] > bytes[b]; });
  const size_t bins_count = std::min(threads, pieces.size());
  std::vector<std::vector<size_t>> bins(bins_count);
  std::vector<int64_t> loads(bins_count, 0);
  for (const size_t i : order) {
    const auto b = static_cast<size_t>(std::min_element(loads.begin(), loads.end()) - loads.begin());
    bins[b].push_back(i);
    loads[b] += bytes[i];
  }
  at::parallel_for(0, static_cast<int64_t>(bins_count), 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      for (const size_t i : bins[static_cast<size_t>(b)]) {
        run(pieces[i]);
      }
    }
  });
}

// One bucket of reduce_scatter_coalesced on a CPU list: owner o's sums, in
// one new buffer per owner (as the ring's), are sum_k tensors[o + 1 + k]
// for k = 0 .. N - 1 (indices mod N), left to right: the ring's order. One
// sum_entries over the bucket, or for half types one per hop, each rounding
// as a hop does.
void direct_reduce_scatter_bucket(
    const TensorList2D& tensors, c10::ArrayRef<c10::Device> devices, const RingBucket& bucket,
    const FlatLayout& layout, const Segments& seg, std::vector<at::Tensor>& results) {
  const size_t n = devices.size();
  const bool per_hop = n > 2 && rounds_per_hop(layout.dtype);
  std::vector<SumEntry> entries;
  entries.reserve(bucket.indices.size());
  const at::Tensor& like = tensors[0][bucket.indices[0]];
  for (size_t o = 0; o < n; ++o) {
    const size_t first = bucket.bounds[o];
    const size_t last = bucket.bounds[o + 1];
    if (first == last) {
      continue;
    }
    std::vector<at::Tensor> views =
        sub_layout(layout, first, last).unflatten(empty_flat(like, devices[o], seg.sizes[o]));
    for (size_t e = first; e < last; ++e) {
      const size_t k = bucket.indices[e];
      SumEntry entry;
      for (size_t h = 0; h < (per_hop ? 2 : n); ++h) {
        entry.sources.push_back(tensors[(o + 1 + h) % n][k]);
      }
      entry.outs.push_back(views[e - first]);
      entries.push_back(std::move(entry));
      results[k] = std::move(views[e - first]);
    }
  }
  sum_entries(entries, /*accumulate=*/false);
  if (!per_hop) {
    return;
  }
  // The entries in the order built above: owner by owner, e in order.
  for (size_t h = 2; h < n; ++h) {
    size_t i = 0;
    for (size_t o = 0; o < n; ++o) {
      for (size_t e = bucket.bounds[o]; e < bucket.bounds[o + 1]; ++e) {
        entries[i++].sources = {tensors[(o + 1 + h) % n][bucket.indices[e]]};
      }
    }
    sum_entries(entries, /*accumulate=*/true);
  }
}

// Whether some tensor all_gather_coalesced would write (an out that is not
// its source itself) shares a storage with any source: then it runs the
// ring, which reads every source into its own buffers before writing.
bool writes_into_sources(at::TensorList tensors, const TensorList2D& outs) {
  std::vector<const c10::StorageImpl*> read;
  read.reserve(tensors.size());
  for (const at::Tensor& t : tensors) {
    if (t.has_storage()) {
      read.push_back(t.storage().unsafeGetStorageImpl());
    }
  }
  std::sort(read.begin(), read.end());
  for (const std::vector<at::Tensor>& row : outs) {
    for (size_t k = 0; k < row.size(); ++k) {
      if (!row[k].is_same(tensors[k]) && row[k].has_storage() &&
          std::binary_search(read.begin(), read.end(), row[k].storage().unsafeGetStorageImpl())) {
        return true;
      }
    }
  }
  return false;
}

// One bucket of all_gather_coalesced on a CPU list: every tensors[k] copied
// straight into result[d][k] for each d (into the given outs, or into one
// new buffer per device, as the ring's), but where result[d][k] is
// tensors[k] itself; one sum_entries of one source per tensor (copies, each
// source piece read once for all its targets).
void direct_all_gather_bucket(
    at::TensorList tensors, c10::ArrayRef<int64_t> owners, c10::ArrayRef<c10::Device> devices,
    const RingBucket& bucket, const FlatLayout& layout, bool into_outs, TensorList2D& result) {
  if (!into_outs) {
    for (size_t d = 0; d < devices.size(); ++d) {
      std::vector<at::Tensor> views =
          layout.unflatten(empty_flat(tensors[bucket.indices[0]], devices[d], layout.numel));
      for (size_t e = 0; e < bucket.indices.size(); ++e) {
        const size_t k = bucket.indices[e];
        result[d][k] = static_cast<size_t>(owners[k]) == d ? tensors[k] : std::move(views[e]);
      }
    }
  }
  std::vector<SumEntry> entries;
  entries.reserve(bucket.indices.size());
  for (const size_t k : bucket.indices) {
    if (tensors[k].numel() == 0) {
      continue;
    }
    SumEntry entry{{tensors[k]}, {}};
    for (size_t d = 0; d < devices.size(); ++d) {
      if (!result[d][k].is_same(tensors[k])) {
        entry.outs.push_back(result[d][k]);
      }
    }
    if (!entry.outs.empty()) {
      entries.push_back(std::move(entry));
    }
  }
  sum_entries(entries, /*accumulate=*/false);
}

} // namespace

std::vector<at::Tensor> reduce_scatter(
    at::TensorList inputs, c10::ArrayRef<c10::Device> devices_in,
    const std::optional<std::vector<int64_t>>& sizes) {
  const auto devices = check_devices(devices_in, "reduce_scatter");
  check_per_slot(inputs, devices, "reduce_scatter", "inputs", /*same_numel=*/true);
  const Segments seg = checked_segments(sizes, inputs[0].numel(), devices.size());
  c10::NoGradGuard no_grad;
  TrafficRecord traffic(TrafficKind::ReduceScatter);
  return ring_reduce_scatter(flat_inputs(inputs), devices, seg, traffic);
}

std::vector<at::Tensor> all_gather(at::TensorList shards, c10::ArrayRef<c10::Device> devices_in) {
  const auto devices = check_devices(devices_in, "all_gather");
  check_per_slot(shards, devices, "all_gather", "shards", /*same_numel=*/false);
  std::vector<at::Tensor> outs;
  int64_t total = 0;
  for (const at::Tensor& shard : shards) {
    total += shard.numel();
  }
  outs.reserve(devices.size());
  for (const c10::Device& device : devices) {
    c10::DeviceGuard guard(device);
    outs.push_back(empty_flat(shards[0], device, total));
  }
  all_gather_out(shards, outs);
  return outs;
}

void all_gather_out(at::TensorList shards, at::TensorList outs) {
  TORCH_CHECK(!outs.empty(), "all_gather: expected at least one tensor in 'out', but it is empty");
  std::vector<c10::Device> listed;
  listed.reserve(outs.size());
  for (size_t j = 0; j < outs.size(); ++j) {
    TORCH_CHECK(outs[j].defined(), "all_gather: out[", j, "] is undefined");
    listed.push_back(outs[j].device());
  }
  const auto devices = check_devices(listed, "all_gather", "the devices of out");
  check_per_slot(shards, devices, "all_gather", "shards", /*same_numel=*/false);
  std::vector<int64_t> sizes;
  sizes.reserve(shards.size());
  for (size_t j = 0; j < shards.size(); ++j) {
    TORCH_CHECK(
        shards[j].dim() == 1, "all_gather: expected shards[", j, "] to be 1-D, but it has shape ",
        shards[j].sizes());
    sizes.push_back(shards[j].numel());
  }
  const Segments seg(std::move(sizes));
  for (size_t j = 0; j < outs.size(); ++j) {
    const at::Tensor& out = outs[j];
    TORCH_CHECK(
        out.layout() == c10::kStrided && out.dim() == 1 && out.is_contiguous(), "all_gather: expected out[",
        j, "] to be a contiguous 1-D tensor, but it has shape ", out.sizes(), " and strides ", out.strides());
    TORCH_CHECK(
        out.numel() == seg.total, "all_gather: expected out[", j, "] to have ", seg.total,
        " elements (the shards' total), but it has ", out.numel());
    TORCH_CHECK(
        out.scalar_type() == shards[0].scalar_type(), "all_gather: expected out[", j, "] of dtype ",
        shards[0].scalar_type(), " (the shards'), but it is ", out.scalar_type());
    for (size_t i = 0; i < j; ++i) {
      check_no_overlap(out, c10::str("out[", j, "]"), outs[i], c10::str("out[", i, "]"), "all_gather");
    }
  }
  c10::NoGradGuard no_grad;
  // A shard already at its place in its own out is not copied; any other is
  // copied in first, before the ring writes anything (from a copy where it
  // may share memory with an out).
  std::vector<at::Tensor> sources(outs.size());
  for (size_t j = 0; j < outs.size(); ++j) {
    const at::Tensor place = seg.of(outs[j], j);
    const bool in_place = shards[j].numel() == 0 ||
                          (shards[j].is_alias_of(outs[j]) &&
                           shards[j].storage_offset() == place.storage_offset() && shards[j].stride(0) == 1);
    if (in_place) {
      continue;
    }
    bool may_share = false;
    for (size_t i = 0; i < outs.size(); ++i) {
      may_share =
          check_no_overlap(
              outs[i], c10::str("out[", i, "]"), shards[j], c10::str("shards[", j, "]"), "all_gather") ||
          may_share;
    }
    sources[j] = may_share ? shards[j].clone() : shards[j];
  }
  for (size_t j = 0; j < outs.size(); ++j) {
    if (sources[j].defined()) {
      c10::DeviceGuard guard(devices[j]);
      seg.of(outs[j], j).copy_(sources[j], may_copy_async(devices[j]));
    }
  }
  TrafficRecord traffic(TrafficKind::AllGather);
  ring_all_gather(outs.vec(), devices, seg, traffic);
}

void all_reduce(at::TensorList inputs, c10::ArrayRef<c10::Device> devices_in) {
  const auto devices = check_devices(devices_in, "all_reduce");
  check_per_slot(inputs, devices, "all_reduce", "inputs", /*same_numel=*/true);
  for (size_t j = 0; j < inputs.size(); ++j) {
    for (size_t i = 0; i < j; ++i) {
      check_no_overlap(
          inputs[j], c10::str("inputs[", j, "]"), inputs[i], c10::str("inputs[", i, "]"), "all_reduce");
    }
  }
  const size_t n = devices.size();
  if (n == 1) {
    return;
  }
  c10::NoGradGuard no_grad;
  const Segments seg(balanced_chunk_sizes(inputs[0].numel(), static_cast<int64_t>(n)));
  // A contiguous input is summed into in place; any other through a
  // contiguous copy, written back at the end.
  std::vector<at::Tensor> flats = flat_inputs(inputs);
  {
    TrafficRecord traffic(TrafficKind::ReduceScatter);
    ring_reduce_scatter(flats, devices, seg, traffic, /*in_place=*/true);
  }
  {
    TrafficRecord traffic(TrafficKind::AllGather);
    ring_all_gather(flats, devices, seg, traffic);
  }
  for (size_t j = 0; j < n; ++j) {
    if (!flats[j].is_alias_of(inputs[j])) {
      c10::DeviceGuard guard(devices[j]);
      inputs[j].copy_(flats[j].view(inputs[j].sizes()), may_copy_async(devices[j]));
    }
  }
}

std::vector<at::Tensor> reduce_scatter_coalesced(
    const TensorList2D& tensors, c10::ArrayRef<c10::Device> devices_in, c10::ArrayRef<int64_t> owners,
    int64_t bucket_bytes) {
  const char* op = "reduce_scatter_coalesced";
  const auto devices = check_devices(devices_in, op);
  const size_t n = devices.size();
  TORCH_CHECK(
      tensors.size() == n, op, ": expected one list in 'tensors' per device (len(devices) = ", n,
      "), but got ", tensors.size());
  TORCH_CHECK(bucket_bytes > 0, op, ": expected bucket_bytes to be positive, but got ", bucket_bytes);
  const size_t count = tensors[0].size();
  check_owners(owners, count, n, op, "tensors[0]");
  for (size_t j = 0; j < n; ++j) {
    TORCH_CHECK(
        tensors[j].size() == count, op, ": expected tensors[", j, "] to hold ", count,
        " tensors, as tensors[0] does, but it holds ", tensors[j].size());
    for (size_t k = 0; k < count; ++k) {
      const at::Tensor& t = tensors[j][k];
      const at::Tensor& first = tensors[0][k];
      check_dense_tensor(t, op, c10::str("tensors[", j, "][", k, "]"));
      TORCH_CHECK(
          normalize_device(t.device()) == devices[j], op, ": expected tensors[", j, "][", k, "] on ",
          devices[j], " (devices[", j, "]), but it is on ", t.device());
      TORCH_CHECK(
          t.sizes().equals(first.sizes()), op, ": expected tensors[", j, "][", k, "] of shape ",
          first.sizes(), ", as tensors[0][", k, "] is, but it has shape ", t.sizes());
      TORCH_CHECK(
          t.scalar_type() == first.scalar_type(), op, ": expected tensors[", j, "][", k, "] of dtype ",
          first.scalar_type(), ", as tensors[0][", k, "] is, but it is ", t.scalar_type());
    }
  }
  c10::NoGradGuard no_grad;
  TrafficRecord traffic(TrafficKind::ReduceScatter);
  std::vector<at::Tensor> results(count);
  for (const RingBucket& bucket : ring_buckets(tensors[0], owners, n, bucket_bytes)) {
    const std::vector<at::Tensor> like = pick(tensors[0], bucket.indices, 0, bucket.indices.size());
    const FlatLayout layout = FlatLayout::of(like);
    const Segments seg = bucket_segments(layout, bucket);
    if (devices[0].is_cpu()) {
      count_ring_reduce_scatter(seg, item_bytes(like[0]), n, traffic);
      direct_reduce_scatter_bucket(tensors, devices, bucket, layout, seg, results);
      continue;
    }
    // Every list packed under list 0's layout (pack reads any strides).
    std::vector<at::Tensor> flats;
    flats.reserve(n);
    for (size_t j = 0; j < n; ++j) {
      const std::vector<at::Tensor> members = pick(tensors[j], bucket.indices, 0, bucket.indices.size());
      c10::DeviceGuard guard(devices[j]);
      at::Tensor flat = flat_alias(members[0], layout);
      flats.push_back(flat.defined() ? flat : flatten(members, layout));
    }
    const std::vector<at::Tensor> sums = ring_reduce_scatter(flats, devices, seg, traffic);
    for (size_t o = 0; o < n; ++o) {
      std::vector<at::Tensor> views =
          sub_layout(layout, bucket.bounds[o], bucket.bounds[o + 1]).unflatten(sums[o]);
      for (size_t e = 0; e < views.size(); ++e) {
        results[bucket.indices[bucket.bounds[o] + e]] = std::move(views[e]);
      }
    }
  }
  return results;
}

TensorList2D all_gather_coalesced(
    at::TensorList tensors, c10::ArrayRef<int64_t> owners, c10::ArrayRef<c10::Device> devices_in,
    const std::optional<TensorList2D>& outs, int64_t bucket_bytes) {
  const char* op = "all_gather_coalesced";
  const auto devices = check_devices(devices_in, op);
  const size_t n = devices.size();
  const size_t count = tensors.size();
  TORCH_CHECK(bucket_bytes > 0, op, ": expected bucket_bytes to be positive, but got ", bucket_bytes);
  check_owners(owners, count, n, op, "tensors");
  for (size_t k = 0; k < count; ++k) {
    check_dense_tensor(tensors[k], op, c10::str("tensors[", k, "]"));
    const c10::Device& owner = devices[static_cast<size_t>(owners[k])];
    TORCH_CHECK(
        normalize_device(tensors[k].device()) == owner, op, ": expected tensors[", k, "] on ", owner,
        " (devices[owners[", k, "]] = devices[", owners[k], "]), but it is on ", tensors[k].device());
  }
  if (outs) {
    TORCH_CHECK(
        outs->size() == n, op, ": expected one list in 'outs' per device (len(devices) = ", n, "), but got ",
        outs->size());
    for (size_t d = 0; d < n; ++d) {
      TORCH_CHECK(
          (*outs)[d].size() == count, op, ": expected outs[", d, "] to hold ", count,
          " tensors (one per tensor), but it holds ", (*outs)[d].size());
      for (size_t k = 0; k < count; ++k) {
        const at::Tensor& out = (*outs)[d][k];
        check_dense_tensor(out, op, c10::str("outs[", d, "][", k, "]"));
        TORCH_CHECK(
            normalize_device(out.device()) == devices[d], op, ": expected outs[", d, "][", k, "] on ",
            devices[d], " (devices[", d, "]), but it is on ", out.device());
        TORCH_CHECK(
            out.sizes().equals(tensors[k].sizes()), op, ": expected outs[", d, "][", k, "] of shape ",
            tensors[k].sizes(), ", as tensors[", k, "] is, but it has shape ", out.sizes());
        TORCH_CHECK(
            out.scalar_type() == tensors[k].scalar_type(), op, ": expected outs[", d, "][", k, "] of dtype ",
            tensors[k].scalar_type(), ", as tensors[", k, "] is, but it is ", out.scalar_type());
      }
    }
  }
  c10::NoGradGuard no_grad;
  TrafficRecord traffic(TrafficKind::AllGather);
  TensorList2D result = outs ? *outs : TensorList2D(n, std::vector<at::Tensor>(count));
  const bool direct = devices[0].is_cpu() && !(outs && writes_into_sources(tensors, *outs));
  for (const RingBucket& bucket : ring_buckets(tensors, owners, n, bucket_bytes)) {
    const std::vector<at::Tensor> members = pick(tensors, bucket.indices, 0, bucket.indices.size());
    const FlatLayout layout = FlatLayout::of(members);
    const Segments seg = bucket_segments(layout, bucket);
    if (direct) {
      count_ring_all_gather(seg, item_bytes(members[0]), n, traffic);
      direct_all_gather_bucket(tensors, owners, devices, bucket, layout, outs.has_value(), result);
      continue;
    }
    std::vector<at::Tensor> flats;
    flats.reserve(n);
    for (size_t d = 0; d < n; ++d) {
      c10::DeviceGuard guard(devices[d]);
      flats.push_back(empty_flat(members[0], devices[d], layout.numel));
      if (seg.sizes[d] > 0) {
        pack(
            pick(tensors, bucket.indices, bucket.bounds[d], bucket.bounds[d + 1]),
            sub_layout(layout, bucket.bounds[d], bucket.bounds[d + 1]), seg.of(flats[d], d));
      }
    }
    ring_all_gather(flats, devices, seg, traffic);
    for (size_t d = 0; d < n; ++d) {
      c10::DeviceGuard guard(devices[d]);
      if (!outs) {
        std::vector<at::Tensor> views = layout.unflatten(flats[d]);
        for (size_t e = 0; e < views.size(); ++e) {
          const size_t k = bucket.indices[e];
          result[d][k] = static_cast<size_t>(owners[k]) == d ? tensors[k] : std::move(views[e]);
        }
        continue;
      }
      // Unpack every entry but those whose out is the owner's tensor itself.
      FlatLayout written;
      written.dtype = layout.dtype;
      written.numel = layout.numel;
      std::vector<at::Tensor> targets;
      for (size_t e = 0; e < bucket.indices.size(); ++e) {
        const size_t k = bucket.indices[e];
        if (result[d][k].is_same(tensors[k])) {
          continue;
        }
        written.offsets.push_back(layout.offsets[e]);
        written.sizes.push_back(layout.sizes[e]);
        written.strides.push_back(layout.strides[e]);
        targets.push_back(result[d][k]);
      }
      if (!targets.empty()) {
        unpack(flats[d], written, targets);
      }
    }
  }
  return result;
}

} // namespace dpcore
