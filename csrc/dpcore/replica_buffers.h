// Persistent per-device copies of a bucket of master tensors: what cached
// replicas read their parameters and buffers from.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <utility>
#include <vector>

#include "dpcore/flatten.h"

namespace dpcore {

class ReplicaBuffers {
 public:
  // `like`: the master tensors of the bucket (dense, one dtype, all on one
  // device); `targets`: the devices to hold copies on (may repeat the
  // master's device: each entry gets its own buffer).
  ReplicaBuffers(at::TensorList like, std::vector<c10::Device> targets);

  // Brings every target's buffer up to date with `tensors` (shapes and dtype
  // as at construction) and returns result[d][i], tensors[i] on targets[d]:
  // fresh tensors (no autograd history) viewing the persistent buffers. All
  // copies of entry (d, i) ever returned share one version counter (and only
  // they: entries are independent, so an in-place update of one buffer never
  // invalidates another). The copy is skipped when no master tensor changed
  // (same storage, same version) and no returned copy was changed in place
  // since. When a copy changes the bytes of an entry, that entry's version is
  // bumped, so that autograd refuses every graph that saved one of its copies
  // before (of any earlier call) rather than silently reading new values.
  //
  // Safe to call from several threads at once: calls are serialized, and one
  // call's result is never mixed with another's. Runs outside inference mode
  // whatever the caller's mode (the copies must have version counters).
  TensorList2D refresh(at::TensorList tensors);

  // Makes the next refresh copy every entry, as if every master tensor had
  // changed: for writes that no version counter saw (a replayed CUDA graph
  // updating buffers in place, on the master or on a copy).
  void invalidate();

  // Whether the last refresh copied (false: it found nothing changed).
  bool last_refresh_copied() const {
    return copied_.load();
  }

  // Bytes the last refresh copied into each target's buffer (0 where it
  // found nothing to copy there).
  std::vector<int64_t> last_copied_bytes() const;

  // Writes `value` (entry `entry`'s shape and dtype, on targets[target]) into
  // that target's copy of the entry, where `master` (the entry's master
  // tensor, as refresh takes it) now holds the same bytes: a shard of the
  // sharded optimizer stepped there. Bumps the entry's version there (as a
  // refresh that changes bytes does), and the next refresh leaves that copy
  // as it is unless `master` changes again (storage or version): the
  // updated bytes do not go back to the target they came from.
  void write(int64_t target, int64_t entry, const at::Tensor& value, const at::Tensor& master);

  // One tensor per entry viewing targets[target]'s buffer, sharing the
  // version counter of refresh's copies of that entry: for a collective
  // that writes the copies in place (the all-gather of sharded gradients),
  // followed by mark_current. Copies nothing.
  std::vector<at::Tensor> views(int64_t target);

  // Marks each entries[k] on targets[target] as holding the bytes of
  // masters[k] (its master tensor, as refresh takes it) as it is now, as
  // write() does once it has copied: bumps the entry's version there, and
  // the next refresh leaves that copy as it is unless the master changes
  // again (storage or version).
  void mark_current(int64_t target, c10::ArrayRef<int64_t> entries, at::TensorList masters);

  // Finds writes that no version counter saw. Where the next refresh would
  // skip the copy (no master tensor and no copy changed since the last
  // one), compares every target's buffer with `tensors` (as refresh takes
  // them) byte for byte, on the target's device. Returns the indices of the
  // entries whose bytes differ on some target, in order; the next refresh
  // copies the bucket and marks those entries changed (as refresh marks an
  // entry whose master changed: see the version note of refresh). Empty
  // when every byte is equal, and when the next refresh copies anyway (then
  // nothing is compared). Serialized with refresh.
  std::vector<int64_t> verify(at::TensorList tensors);

 private:
  // Raises unless `tensors` are the bucket's (count, shapes, dtype, device);
  // `fn` names the caller in the message.
  void check_tensors(at::TensorList tensors, const char* fn) const;
  // Whether the next refresh copies: a master tensor changed (new storage or
  // version, every entry before the first refresh) or a copy was changed in
  // place. master_changed[i]: whether entry i's master changed.
  bool changed(at::TensorList tensors, std::vector<char>& master_changed) const;
  // Copies the master's bytes into each of `targets`' buffers, but the
  // entries kept there (kept[d][i]), in runs; records the bytes copied.
  void copy_entries(
      at::TensorList tensors, const std::vector<std::vector<char>>& kept, const std::vector<size_t>& targets);
  // Raises unless `target` and `entry` are in range and `master` is entry's
  // master (shape, dtype, device); `fn` names the caller.
  void check_entry(int64_t target, int64_t entry, const at::Tensor& master, const char* fn) const;

  FlatLayout layout_;
  c10::Device source_;
  std::vector<c10::Device> targets_;
  std::vector<at::Tensor> flats_;
  // anchors_[d][i]: the tensor whose version counter every returned copy of
  // entry (d, i) shares; anchor_versions_: its version after the last refresh.
  TensorList2D anchors_;
  std::vector<std::vector<int64_t>> anchor_versions_;
  std::vector<const void*> master_ptrs_;
  std::vector<int64_t> master_versions_;
  // written_[d][i]: the master's (data_ptr, version) when write() left entry
  // (d, i) equal to it ({nullptr, -1}: none since the last refresh).
  std::vector<std::vector<std::pair<const void*, int64_t>>> written_;
  std::vector<int64_t> copied_bytes_;
  std::atomic<bool> copied_{false};
  mutable std::mutex mutex_; // held by refresh
};

} // namespace dpcore
