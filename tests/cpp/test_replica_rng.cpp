// Per-call random streams (dpcore/replica_rng.h): inside a scope, random
// operators given no generator draw from the call's stream, the same numbers
// for the same seed whatever the order the calls run in; the default
// generator gives one number per parallel call; an explicit generator, and
// code outside any scope, are left alone; DPCORE_REPLICA_RNG=0 turns it off.
// Every stream's seed is stream_seed(the group's number, position), the
// derivation replica_seeds gives the CUDA-graph captures.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <cstdlib>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "dpcore/replica_rng.h"
#include "helpers.h"

namespace {

using dpcore_test::cpus;

// One draw of each kind (a factory, dropout's bernoulli_, normal_) per call
// of a parallel call on `devices`, the calls run in `order`.
std::vector<at::Tensor> draws(const std::vector<size_t>& order) {
  dpcore::ReplicaStreams streams = dpcore::replica_streams(cpus(order.size()));
  EXPECT_EQ(streams.per_call.size(), order.size());
  std::vector<at::Tensor> out(order.size());
  for (size_t i : order) {
    dpcore::ReplicaStreamScope scope(streams.per_call.at(i).get());
    at::Tensor ones = at::ones({64}, at::kDouble);
    out[i] = at::cat({at::rand({8}, at::kDouble), at::dropout(ones, 0.5, true), at::randn_like(ones)});
  }
  return out;
}

TEST(ReplicaRng, CallsThatShareNoGeneratorGetNoStream) {
  EXPECT_TRUE(dpcore::replica_streams(cpus(1)).per_call.empty());
  EXPECT_TRUE(dpcore::replica_streams({}).per_call.empty());
  EXPECT_TRUE(dpcore::replica_streams({c10::Device(c10::kCPU), c10::Device(c10::kMeta)}).per_call.empty());
}

TEST(ReplicaRng, StreamsDependOnTheSeedAndPositionNotTheOrder) {
  at::manual_seed(3);
  const std::vector<at::Tensor> first = draws({0, 1, 2});
  const at::Tensor after = at::rand({4}, at::kDouble);
  at::manual_seed(3);
  const std::vector<at::Tensor> reversed = draws({2, 1, 0});
  EXPECT_TRUE(at::equal(at::rand({4}, at::kDouble), after)); // one number taken, whichever call drew first
  for (size_t i = 0; i < first.size(); ++i) {
    EXPECT_TRUE(at::equal(first[i], reversed[i])) << "call " << i;
  }
  EXPECT_FALSE(at::equal(first[0], first[1]));
  EXPECT_FALSE(at::equal(first[1], first[2]));
  at::manual_seed(4);
  EXPECT_FALSE(at::equal(draws({0, 1, 2})[0], first[0]));
}

TEST(ReplicaRng, ScopesLeaveOtherDrawsAlone) {
  at::manual_seed(5);
  dpcore::ReplicaStreams streams = dpcore::replica_streams(cpus(2));
  ASSERT_EQ(streams.per_call.size(), 2u);
  EXPECT_FALSE(dpcore::current_replica_generator().has_value());
  dpcore::ReplicaStreamScope scope(streams.per_call[0].get());
  at::rand({4}); // takes the parallel call's one number from the default generator
  const at::Tensor state = at::detail::getDefaultCPUGenerator().get_state();
  at::Generator explicit_generator = at::detail::createCPUGenerator(7);
  const at::Tensor given = at::rand({4}, explicit_generator, at::kDouble);
  EXPECT_TRUE(at::equal(given, at::rand({4}, at::detail::createCPUGenerator(7), at::kDouble)));
  at::Tensor elsewhere;
  std::thread other([&] { elsewhere = at::rand({4}, at::kDouble); }); // no scope there
  other.join();
  at::Generator reference = at::detail::createCPUGenerator();
  reference.set_state(state);
  EXPECT_TRUE(at::equal(elsewhere, at::rand({4}, reference, at::kDouble)));
  at::Tensor own_state = dpcore::current_replica_generator()->get_state();
  EXPECT_FALSE(at::equal(own_state, state));
}

TEST(ReplicaRng, StreamSeedIsSplitmix64FromTheNumber) {
  // splitmix64's reference outputs from state 0: stream p is output p + 1
  EXPECT_EQ(dpcore::stream_seed(0, 0), 0xE220A8397B1DCDAFULL);
  EXPECT_EQ(dpcore::stream_seed(0, 1), 0x6E789E6AA1B965F4ULL);
  EXPECT_EQ(dpcore::stream_seed(0, 2), 0x06C45D188009454FULL);
  EXPECT_EQ(dpcore::stream_seed(0, 3), 0xF88BB8A8724C81ECULL);
  for (const uint64_t number : {uint64_t{1}, uint64_t{12345}, ~uint64_t{0}}) {
    std::set<uint64_t> seen;
    for (uint64_t position = 0; position < 256; ++position) {
      const uint64_t seed = dpcore::stream_seed(number, position);
      EXPECT_EQ(seed, dpcore::stream_seed(number, position)); // deterministic
      EXPECT_TRUE(seen.insert(seed).second) << "number " << number << ", position " << position;
      if (position > 0) { // one step of the sequence: the state moves on by the golden gamma
        EXPECT_EQ(seed, dpcore::stream_seed(number + 0x9E3779B97F4A7C15ULL, position - 1));
      }
    }
    EXPECT_NE(dpcore::stream_seed(number, 0), dpcore::stream_seed(number + 1, 0));
  }
}

TEST(ReplicaRng, ReplicaSeedsAreTheStreamsSeeds) {
  at::manual_seed(11);
  at::Generator copy = at::detail::createCPUGenerator();
  copy.set_state(at::detail::getDefaultCPUGenerator().get_state());
  const std::vector<uint64_t> seeds = dpcore::replica_seeds(cpus(3));
  const uint64_t number = dpcore::take_number(copy); // one randint draw
  EXPECT_EQ(
      seeds,
      (std::vector<uint64_t>{
          dpcore::stream_seed(number, 0), dpcore::stream_seed(number, 1), dpcore::stream_seed(number, 2)}));
  EXPECT_TRUE(
      at::equal(at::detail::getDefaultCPUGenerator().get_state(), copy.get_state())); // one number taken
  at::manual_seed(11);
  EXPECT_EQ(dpcore::replica_seeds(cpus(3)), seeds);
  at::manual_seed(11);
  EXPECT_EQ(dpcore::replica_seeds(cpus(1)), std::vector<uint64_t>{seeds[0]}); // a lone call's seed too
  at::manual_seed(12);
  EXPECT_NE(dpcore::replica_seeds(cpus(3)), seeds);
  at::manual_seed(11);
  dpcore::ReplicaStreams streams = dpcore::replica_streams(cpus(3)); // the eager replicas' streams
  for (size_t i = 0; i < seeds.size(); ++i) {
    EXPECT_EQ(streams.per_call.at(i)->generator().current_seed(), seeds[i]) << "call " << i;
  }
  try {
    dpcore::replica_seeds({c10::Device(c10::kCPU), dpcore_test::meta()});
    ADD_FAILURE() << "a meta device was accepted";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(
        std::string(e.what()).find("expected CPU or CUDA devices, but devices[1] is meta"), std::string::npos)
        << e.what();
  }
}

TEST(ReplicaRng, ReplicaSeedsInsideACallTakeFromItsStream) {
  at::manual_seed(2);
  dpcore::ReplicaStreams streams = dpcore::replica_streams(cpus(2));
  dpcore::ReplicaStreamScope scope(streams.per_call.at(0).get());
  at::Generator own = *dpcore::current_replica_generator(); // takes the outer call's number now
  const at::Tensor outside = at::detail::getDefaultCPUGenerator().get_state();
  at::Generator copy = at::detail::createCPUGenerator();
  copy.set_state(own.get_state());
  const std::vector<uint64_t> seeds = dpcore::replica_seeds(cpus(2));
  const uint64_t number = dpcore::take_number(copy);
  EXPECT_EQ(seeds, (std::vector<uint64_t>{dpcore::stream_seed(number, 0), dpcore::stream_seed(number, 1)}));
  EXPECT_TRUE(at::equal(own.get_state(), copy.get_state()));
  EXPECT_TRUE(at::equal(at::detail::getDefaultCPUGenerator().get_state(), outside));
}

TEST(ReplicaRng, TheVariableTurnsItOff) {
  ASSERT_EQ(setenv(dpcore::kReplicaRngVariable, "0", 1), 0);
  EXPECT_TRUE(dpcore::replica_streams(cpus(2)).per_call.empty());
  EXPECT_TRUE(dpcore::replica_streams(cpus(1)).per_call.empty());
  ASSERT_EQ(setenv(dpcore::kReplicaRngVariable, "on", 1), 0);
  EXPECT_THROW(dpcore::replica_streams(cpus(2)), c10::ValueError);
  ASSERT_EQ(setenv(dpcore::kReplicaRngVariable, "1", 1), 0);
  EXPECT_EQ(dpcore::replica_streams(cpus(2)).per_call.size(), 2u);
  ASSERT_EQ(unsetenv(dpcore::kReplicaRngVariable), 0);
}

} // namespace
