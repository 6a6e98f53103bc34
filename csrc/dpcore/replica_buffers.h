// Persistent per-device copies of a bucket of master tensors: what cached
// replicas read their parameters and buffers from.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
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
  // fresh tensors (own version counters, no autograd history) viewing the
  // persistent buffers. The copy is skipped when no master tensor changed
  // (same storage, same version) and no previously returned copy was changed
  // in place since. When a copy overwrites the buffers, the tensors returned
  // before are marked modified (version bumped), so that autograd refuses a
  // stale graph that saved them rather than silently reading new values.
  TensorList2D refresh(at::TensorList tensors);

  // Whether the last refresh copied (false: it found nothing changed).
  bool last_refresh_copied() const { return copied_; }

 private:
  bool up_to_date(at::TensorList tensors) const;

  FlatLayout layout_;
  c10::Device source_;
  std::vector<c10::Device> targets_;
  std::vector<at::Tensor> flats_;
  std::vector<const void*> master_ptrs_;
  std::vector<int64_t> master_versions_;
  TensorList2D returned_;
  std::vector<std::vector<int64_t>> returned_versions_;
  bool copied_ = false;
};

} // namespace dpcore
