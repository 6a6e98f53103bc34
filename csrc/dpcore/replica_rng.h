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

// The one seed derivation (docs/randomness.md): the seed of the stream of
// the call at `position` among the calls of a parallel call that share a
// default generator, from the one `number` taken from that generator for
// them: splitmix64's output number `position` + 1 from state `number`,
// z = number + 0x9E3779B97F4A7C15 * (position + 1),
// z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9, z = (z ^ (z >> 27)) * 0x94D049BB133111EB,
// seed = z ^ (z >> 31) (mod 2^64). Distinct positions give unrelated seeds.
uint64_t stream_seed(uint64_t number, uint64_t position);

// One 64-bit number taken from `generator`, advancing it: on the CPU a
// randint(0, 2^63 - 1) draw; on CUDA, with no kernel launch or
// synchronization, stream_seed(seed, offset) of the Philox generator, whose
// offset then moves on by one draw's worth (4), as a kernel drawing would.
uint64_t take_number(at::Generator& generator);

// The stream of one call: a generator on `device`, created on its first use
// and seeded with stream_seed(the group's number, `position`), the number
// taken from the group's parent generator when the first call of the group
// draws.
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

// The seed of the stream of each call of a parallel call on `devices` (CPU
// or CUDA; an error naming the entry otherwise), derived as
// replica_streams' are, but now and for every call: per group of calls that
// share a default generator (a lone call forms a group of one), one number
// taken from the group's parent, then stream_seed(number, position in the
// group). What the CUDA-graph captures seed their random states with.
std::vector<uint64_t> replica_seeds(const std::vector<c10::Device>& devices);

// The generator of the stream of the call running on this thread (created
// on first use), or nullopt where the thread has none.
std::optional<at::Generator> current_replica_generator();

} // namespace dpcore
