// The process-wide traffic table (traffic.h).
#include "dpcore/traffic.h"

#include <algorithm>
#include <mutex>

namespace dpcore {
namespace {

struct Table {
  std::mutex mutex;
  std::array<std::vector<SlotTraffic>, kTrafficKinds> kinds;
};

Table& table() {
  static Table instance;
  return instance;
}

} // namespace

const char* traffic_kind_name(TrafficKind kind) {
  switch (kind) {
    case TrafficKind::Broadcast:
      return "broadcast";
    case TrafficKind::ReduceAdd:
      return "reduce_add";
    case TrafficKind::Scatter:
      return "scatter";
    case TrafficKind::Gather:
      return "gather";
    case TrafficKind::ReduceScatter:
      return "reduce_scatter";
    case TrafficKind::AllGather:
      return "all_gather";
  }
  return "unknown";
}

void TrafficRecord::copy(size_t from, size_t to, int64_t bytes) {
  if (from == to || bytes == 0) {
    return;
  }
  const size_t needed = std::max(from, to) + 1;
  if (slots_.size() < needed) {
    slots_.resize(needed);
  }
  slots_[from].sent += bytes;
  slots_[to].received += bytes;
}

TrafficRecord::~TrafficRecord() {
  if (slots_.empty()) {
    return;
  }
  Table& t = table();
  std::lock_guard<std::mutex> lock(t.mutex);
  std::vector<SlotTraffic>& kind = t.kinds[static_cast<size_t>(kind_)];
  if (kind.size() < slots_.size()) {
    kind.resize(slots_.size());
  }
  for (size_t i = 0; i < slots_.size(); ++i) {
    kind[i].sent += slots_[i].sent;
    kind[i].received += slots_[i].received;
  }
}

std::array<std::vector<SlotTraffic>, kTrafficKinds> traffic_table() {
  Table& t = table();
  std::lock_guard<std::mutex> lock(t.mutex);
  return t.kinds;
}

void reset_traffic() {
  Table& t = table();
  std::lock_guard<std::mutex> lock(t.mutex);
  for (auto& kind : t.kinds) {
    kind.clear();
  }
}

} // namespace dpcore
