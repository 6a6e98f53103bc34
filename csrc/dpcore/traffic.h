// Bytes moved between the slots of the collectives, counted per kind of
// collective and per slot: always on, read and reset by dpcore.comm.traffic()
// and reset_traffic(). It includes no other dpcore header.
//
// A slot is a position in a collective's device list, so that a list of CPU
// "devices" (["cpu"] * 4), where every device is the same, still has N
// slots. A copy of B bytes from slot a to slot b (a != b) adds B to sent[a]
// and to received[b]; a slot's copy to itself, and a view, count nothing.
// Which slot each collective's endpoints take is documented in comm.h.
//
// Cost: a collective adds its copies to a TrafficRecord of its own (no lock)
// and merges it into the process-wide table once, under one mutex, when the
// record goes out of scope.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace dpcore {

enum class TrafficKind : uint8_t {
  Broadcast,     // broadcast, broadcast_out, broadcast_coalesced, broadcast_flat_into (the replica refresh)
  ReduceAdd,     // reduce_add, reduce_add_coalesced
  Scatter,       // scatter, scatter_out
  Gather,        // gather, gather_out
  ReduceScatter, // reduce_scatter, reduce_scatter_coalesced, all_reduce's first half
  AllGather,     // all_gather, all_gather_out, all_gather_coalesced, all_reduce's second half
};
constexpr size_t kTrafficKinds = 6;

// "broadcast", "reduce_add", "scatter", "gather", "reduce_scatter", "all_gather".
const char* traffic_kind_name(TrafficKind kind);

struct SlotTraffic {
  int64_t sent = 0;
  int64_t received = 0;
};

// One collective call's copies, merged into the process-wide table when the
// record is destroyed (also when the call raises after some copies ran).
class TrafficRecord {
 public:
  explicit TrafficRecord(TrafficKind kind) : kind_(kind) {}
  TrafficRecord(const TrafficRecord&) = delete;
  TrafficRecord& operator=(const TrafficRecord&) = delete;
  ~TrafficRecord();

  // A copy of `bytes` bytes from slot `from` to slot `to`: nothing when
  // from == to or bytes == 0.
  void copy(size_t from, size_t to, int64_t bytes);

 private:
  TrafficKind kind_;
  std::vector<SlotTraffic> slots_;
};

// The counts since the last reset: table[kind][slot], each kind's list as
// long as the highest slot it counted plus one (empty when none).
std::array<std::vector<SlotTraffic>, kTrafficKinds> traffic_table();

// Sets every count to zero.
void reset_traffic();

} // namespace dpcore
