// A random stream of its own for each call of a parallel call that shares a
// device's default generator with another call (the rule and the mechanism:
// docs/design.md, "Randomness"). No Python here: the binding and the
// tasks that enter the streams are in csrc/python/parallel_apply.cpp.
#pragma once

#include <ATen/core/Generator.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace dpcore {

namespace detail {
struct StreamGroup;
} // namespace detail

// The stream of one call: a generator on `device`, created on its first use
// and seeded from its group's seed (one number taken from the group's parent
// generator when the first call of the group draws) and its `position` in
// the group.
class ReplicaStream {
 public:
  ReplicaStream(c10::Device device, std::shared_ptr<detail::StreamGroup> group, uint64_t position);
  const c10::Device& device() const {
    return device_;
  }
  // The call's generator; used only on the thread running the call.
  const at::Generator& generator();

 private:
  c10::Device device_;
  std::shared_ptr<detail::StreamGroup> group_;
  uint64_t position_;
  std::optional<at::Generator> generator_;
};

// The environment variable that turns the streams off ("0"; "1" or unset: on).
constexpr const char* kReplicaRngVariable = "DPCORE_REPLICA_RNG";

// The streams of the calls of one parallel call, call i to run on devices[i].
struct ReplicaStreams {
  // One per call, null for a call that keeps its device's generator; empty
  // when every call does (no two calls share a generator, or the streams are
  // off, or unavailable).
  std::vector<std::shared_ptr<ReplicaStream>> per_call;
  // Why calls that share a generator got no stream although the streams are
  // on (the dispatch key is taken by other code); empty otherwise.
  std::string unavailable;
};

// Each group of at least two calls that share a default generator (all CPU
// calls; the calls on one CUDA device) gets a stream per call, whose parent
// is that generator, or this thread's own stream where it has one for the
// device (a parallel call inside a call). Reads DPCORE_REPLICA_RNG (error
// naming it unless "0", "1" or unset) only when some calls share a
// generator; installs the kernels on the first call that needs them.
ReplicaStreams replica_streams(const std::vector<c10::Device>& devices);

// While alive, on this thread, random operators on the stream's device that
// are given no generator draw from the stream's generator (nested scopes
// restore the outer one). A null stream changes nothing.
class ReplicaStreamScope {
 public:
  explicit ReplicaStreamScope(ReplicaStream* stream);
  ~ReplicaStreamScope();
  ReplicaStreamScope(const ReplicaStreamScope&) = delete;
  ReplicaStreamScope& operator=(const ReplicaStreamScope&) = delete;

 private:
  ReplicaStream* previous_;
  bool entered_;
  bool was_included_;
};

// The generator of the stream of the call running on this thread (created
// on first use), or nullopt where the thread has none.
std::optional<at::Generator> current_replica_generator();

} // namespace dpcore
