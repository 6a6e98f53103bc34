#define TORCH_ASSERT_ONLY_METHOD_OPERATORS

#include "dpcore/grad_ready.h"

#include <c10/util/Exception.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <utility>

namespace dpcore {

// The counters and callbacks, shared with the hooks (which hold it weakly,
// so a hook that runs while the object is destroyed does nothing).
struct GradReadiness::State {
  std::vector<int64_t> bucket_of;
  std::vector<int64_t> order;
  std::vector<int64_t> sizes;     // parameters per bucket
  std::vector<int64_t> remaining; // parameters per bucket not yet accumulated in this backward
  int64_t prefix = 0;             // buckets order[0..prefix) are complete
  int64_t task = -1;
  bool armed = false;
  bool deferred = false;
  Begin on_begin;
  Ready on_ready;
  mutable std::mutex mutex;

  // One parameter's gradient was accumulated: counts it; the callbacks run
  // after the lock is released (they may call back into task()).
  void on_grad(size_t index) {
    bool begin = false;
    int64_t ready = -1;
    {
      std::lock_guard<std::mutex> lock(mutex);
      if (!armed) {
        return;
      }
      const int64_t current = torch::autograd::get_current_graph_task_id();
      if (task == -1) {
        task = current;
        remaining = sizes;
        prefix = 0;
        begin = true;
      } else {
        TORCH_CHECK(
            current == task,
            "DataParallel(process_group=...): a backward pass reached the parameters while another one that "
            "synchronizes them has not finished (a reentrant backward, such as "
            "torch.utils.checkpoint(..., use_reentrant=True), is not supported: use use_reentrant=False)");
      }
      remaining[static_cast<size_t>(bucket_of[index])] -= 1;
      if (!deferred) {
        const int64_t before = prefix;
        while (prefix < static_cast<int64_t>(order.size()) &&
               remaining[static_cast<size_t>(order[static_cast<size_t>(prefix)])] == 0) {
          ++prefix;
        }
        if (prefix > before) {
          ready = prefix;
        }
      }
    }
    if (begin) {
      on_begin();
    }
    if (ready >= 0) {
      on_ready(ready);
    }
  }
};

GradReadiness::GradReadiness(
    const std::vector<at::Tensor>& params, std::vector<int64_t> bucket_of, std::vector<int64_t> order,
    Begin on_begin, Ready on_ready)
    : state_(std::make_shared<State>()) {
  TORCH_CHECK(
      bucket_of.size() == params.size(), "GradReadiness: expected one bucket index per parameter (",
      params.size(), "), but got ", bucket_of.size());
  const int64_t buckets = static_cast<int64_t>(order.size());
  std::vector<int64_t> sizes(order.size(), 0);
  for (const int64_t b : bucket_of) {
    TORCH_CHECK(
        b >= 0 && b < buckets, "GradReadiness: expected bucket indices in [0, ", buckets, "), but got ", b);
    sizes[static_cast<size_t>(b)] += 1;
  }
  std::vector<int64_t> sorted = order;
  std::sort(sorted.begin(), sorted.end());
  for (int64_t b = 0; b < buckets; ++b) {
    TORCH_CHECK(
        sorted[static_cast<size_t>(b)] == b,
        "GradReadiness: expected the launch order to hold every bucket of [0, ", buckets, ") once");
  }
  state_->bucket_of = std::move(bucket_of);
  state_->order = std::move(order);
  state_->sizes = sizes;
  state_->remaining = std::move(sizes);
  state_->on_begin = std::move(on_begin);
  state_->on_ready = std::move(on_ready);
  removers_.reserve(params.size());
  const std::weak_ptr<State> weak = state_;
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& p = params[i];
    TORCH_CHECK(
        p.requires_grad() && p.is_leaf(),
        "GradReadiness: expected parameters that are leaves requiring grad, but parameter ", i, " is not");
    // A shared_ptr in torch 2.11, an intrusive_ptr in 2.13: kept as its own type.
    auto accumulator = torch::autograd::impl::grad_accumulator(p);
    TORCH_CHECK(accumulator, "GradReadiness: parameter ", i, " has no gradient accumulator");
    const uintptr_t key = accumulator->add_post_hook(
        std::make_unique<torch::autograd::utils::LambdaPostHook>(
            [weak, i](
                const torch::autograd::variable_list& outputs,
                const torch::autograd::variable_list& /*inputs*/) {
              if (const std::shared_ptr<State> state = weak.lock()) {
                state->on_grad(i);
              }
              return outputs;
            }));
    removers_.emplace_back([accumulator = std::move(accumulator), key] { accumulator->del_post_hook(key); });
  }
}

GradReadiness::~GradReadiness() {
  remove();
}

void GradReadiness::arm(bool armed, bool deferred) {
  std::lock_guard<std::mutex> lock(state_->mutex);
  state_->armed = armed;
  state_->deferred = deferred;
}

void GradReadiness::reset() {
  std::lock_guard<std::mutex> lock(state_->mutex);
  state_->task = -1;
}

int64_t GradReadiness::task() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->task;
}

void GradReadiness::remove() {
  for (const std::function<void()>& remove_hook : removers_) {
    remove_hook();
  }
  removers_.clear();
  std::lock_guard<std::mutex> lock(state_->mutex);
  state_->armed = false;
}

} // namespace dpcore
