// Readiness of the hybrid mode's gradient buckets (dpcore/_buckets.py), counted
// in C++: a post hook on each master parameter's AccumulateGrad node (as DDP's
// reducer hooks it) runs once per backward, after the parameter's complete
// in-process gradient was accumulated into .grad, and counts it against its
// bucket. The front end is called once when a synchronizing backward first
// reaches a parameter (`on_begin`) and whenever the prefix of complete buckets
// in launch order grows (`on_ready`): no call per parameter. No Python here:
// the binding is csrc/python/grad_ready.cpp.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

namespace dpcore {

class GradReadiness {
 public:
  using Begin = std::function<void()>;
  using Ready = std::function<void(int64_t)>;

  // `params`: leaves that require grad; `bucket_of[i]`: the bucket of
  // params[i], in [0, buckets); `order`: every bucket once, in launch order.
  // Keeps each parameter's AccumulateGrad node alive (so every graph uses the
  // hooked one) and hooks it.
  GradReadiness(
      const std::vector<at::Tensor>& params, std::vector<int64_t> bucket_of, std::vector<int64_t> order,
      Begin on_begin, Ready on_ready);
  ~GradReadiness(); // remove()
  GradReadiness(const GradReadiness&) = delete;
  GradReadiness& operator=(const GradReadiness&) = delete;

  // Whether the backward of the latest forward synchronizes (hooks count
  // only then) and whether launches wait for the final callback (`deferred`:
  // on_ready is never called; the front end launches every bucket there).
  void arm(bool armed, bool deferred);
  // No synchronizing backward in progress: the next hook that counts starts one.
  void reset();
  // The graph task of the synchronizing backward in progress, -1 if none.
  int64_t task() const;
  // Removes every hook (idempotent); the object counts nothing after.
  void remove();

 private:
  struct State;
  std::shared_ptr<State> state_;
  // One per parameter: removes its hook (holding its gradient accumulator).
  std::vector<std::function<void()>> removers_;
};

} // namespace dpcore
