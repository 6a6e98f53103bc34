// Per-call random streams (dpcore/replica_rng.h): inside a scope, random
// operators given no generator draw from the call's stream, the same numbers
// for the same seed whatever the order the calls run in; the default
// generator gives one number per parallel call; an explicit generator, and
// code outside any scope, are left alone; DPCORE_REPLICA_RNG=0 turns it off.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <cstdlib>
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
