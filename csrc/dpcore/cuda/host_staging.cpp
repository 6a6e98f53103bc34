#define TORCH_ASSERT_ONLY_METHOD_OPERATORS

#include "dpcore/cuda/host_staging.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/core/Event.h>
#include <c10/core/GradMode.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <memory>
#include <mutex>
#include <optional>
#include <utility>

#include "dpcore/common.h"
#include "dpcore/device.h"
#include "dpcore/env.h"

namespace dpcore {
namespace cuda {
namespace {

using c10::cuda::CUDAStream;

// One piece of a device-to-host transfer, at most one slot long.
struct Block {
  char* host;
  const char* device;
  int64_t nbytes;
  CUDAStream stream;
};

// host[0, nbytes) = source[0, nbytes), spread over the intra-op threads.
void host_copy(char* host, const char* source, int64_t nbytes) {
  const auto bytes = at::TensorOptions().dtype(at::kByte);
  at::from_blob(host, {nbytes}, bytes).copy_(at::from_blob(const_cast<char*>(source), {nbytes}, bytes));
}

// The pinned slots and the per-device side streams. A slot is free once the
// event of the last DMA that used it has completed.
class StagingRing {
 public:
  // Never destroyed: the pinned buffers and events must not be released
  // after the CUDA runtime has shut down at process exit.
  static StagingRing& instance() {
    static StagingRing* ring = std::make_unique<StagingRing>().release();
    return *ring;
  }

  // Every slot is allocated here, so that no allocation can fail halfway
  // through a transfer.
  StagingRing()
      : slot_bytes_(env_int("DPCORE_STAGING_SLOT_MB", kDefaultStagingSlotMB, 1) << 20),
        slots_(static_cast<size_t>(env_int("DPCORE_STAGING_SLOTS", kDefaultStagingSlots, 1))) {
    for (Slot& slot : slots_) {
      slot.buffer = at::empty({slot_bytes_}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
      slot.data = static_cast<char*>(slot.buffer.mutable_data_ptr());
    }
  }

  // Bytes per slot: the most one block of a transfer moves.
  int64_t slot_bytes() const {
    return slot_bytes_;
  }

  std::unique_lock<std::mutex> lock() {
    return std::unique_lock<std::mutex>(mutex_);
  }

  // The stream dpcore's staged copies for device `index` run on.
  CUDAStream side_stream(c10::DeviceIndex index) {
    if (side_streams_.empty()) {
      side_streams_.resize(static_cast<size_t>(c10::cuda::device_count()));
    }
    auto& stream = side_streams_.at(static_cast<size_t>(index));
    if (!stream) {
      stream = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, index);
    }
    return *stream;
  }

  // device[0, nbytes) = host[0, nbytes) on `stream`: block by block, each
  // through the next free slot; returns once the host has filled the last
  // slot (the DMAs may still be running).
  void upload(const char* host, char* device, int64_t nbytes, CUDAStream stream) {
    c10::cuda::CUDAGuard guard(stream.device_index());
    for (int64_t offset = 0; offset < nbytes; offset += slot_bytes_) {
      const int64_t count = std::min(slot_bytes_, nbytes - offset);
      Slot& slot = acquire();
      host_copy(slot.data, host + offset, count);
      C10_CUDA_CHECK(cudaMemcpyAsync(
          device + offset, slot.data, static_cast<size_t>(count), cudaMemcpyHostToDevice, stream.stream()));
      slot.record(stream);
    }
  }

  // Runs every block device-to-host, up to one DMA per slot ahead of the
  // host copies out of the slots; returns once every block has landed.
  void download(const std::vector<Block>& blocks) {
    std::vector<Slot*> used(blocks.size(), nullptr);
    size_t issued = 0;
    auto issue = [&]() {
      const Block& block = blocks[issued];
      Slot& slot = acquire();
      c10::cuda::CUDAGuard guard(block.stream.device_index());
      C10_CUDA_CHECK(cudaMemcpyAsync(
          slot.data, block.device, static_cast<size_t>(block.nbytes), cudaMemcpyDeviceToHost,
          block.stream.stream()));
      slot.record(block.stream);
      used[issued++] = &slot;
    };
    while (issued < blocks.size() && issued < slots_.size()) {
      issue();
    }
    for (size_t b = 0; b < blocks.size(); ++b) {
      Slot& slot = *used[b];
      slot.wait();
      host_copy(blocks[b].host, slot.data, blocks[b].nbytes);
      if (issued < blocks.size()) {
        issue(); // into the slot just emptied: the ring goes round in order
      }
    }
  }

 private:
  struct Slot {
    at::Tensor buffer; // pinned, slot_bytes_
    char* data = nullptr;
    std::optional<c10::Event> busy; // the last DMA through this slot

    void wait() {
      if (busy) {
        busy->synchronize();
        busy.reset();
      }
    }

    void record(CUDAStream stream) {
      busy.emplace(c10::DeviceType::CUDA);
      busy->record(stream);
    }
  };

  // The next slot in ring order, once its last DMA has finished.
  Slot& acquire() {
    Slot& slot = slots_[next_];
    next_ = (next_ + 1) % slots_.size();
    slot.wait();
    return slot;
  }

  std::mutex mutex_;
  const int64_t slot_bytes_;
  std::vector<Slot> slots_;
  size_t next_ = 0;
  std::vector<std::optional<CUDAStream>> side_streams_;
};

// Whether a copy between `host` and `device` (same shape and dtype) takes
// the ring: the host side pageable and large enough to pay for it, and both
// sides' values their bytes (no lazy conjugate or negative bit; ATen's own
// copy resolves those).
bool staged(const at::Tensor& host, const at::Tensor& device) {
  const auto plain = [](const at::Tensor& t) {
    return t.layout() == c10::kStrided && !t.is_conj() && !t.is_neg();
  };
  return host.numel() * static_cast<int64_t>(host.element_size()) >= kMinStagedBytes && plain(host) &&
         plain(device) && !host.is_pinned();
}

// out (on the current stream's device) = chunk (host), on the current stream.
void copy_host_to_device(StagingRing& ring, const at::Tensor& chunk, const at::Tensor& out) {
  if (out.numel() == 0) {
    return;
  }
  if (!staged(chunk, out)) {
    out.copy_(chunk, /*non_blocking=*/true);
    return;
  }
  // The ring moves bytes: both sides must hold the elements in one order.
  at::Tensor target = is_plain_dense(out) ? out : at::empty(out.sizes(), out.options());
  at::Tensor source = chunk;
  if (!is_plain_dense(chunk) || !chunk.strides().equals(target.strides())) {
    source = empty_like_layout(chunk, c10::Device(c10::kCPU), target.sizes(), target.strides());
    source.copy_(chunk);
  }
  ring.upload(
      static_cast<const char*>(source.const_data_ptr()), static_cast<char*>(target.mutable_data_ptr()),
      target.numel() * static_cast<int64_t>(target.element_size()), c10::cuda::getCurrentCUDAStream());
  if (!target.is_same(out)) {
    out.copy_(target, /*non_blocking=*/true);
  }
}

} // namespace

std::vector<at::Tensor> host_to_devices(
    at::TensorList chunks, c10::ArrayRef<c10::Device> devices, at::TensorList outs,
    const std::optional<StreamList>& streams) {
  TORCH_CHECK(
      chunks.size() == devices.size() && (outs.empty() || outs.size() == chunks.size()),
      "host_to_devices: expected one device (and one out, when given) per chunk, but got ", chunks.size(),
      " chunks, ", devices.size(), " devices and ", outs.size(), " outs");
  c10::NoGradGuard no_grad;
  StagingRing& ring = StagingRing::instance();
  const auto lock = ring.lock();
  std::vector<at::Tensor> result;
  result.reserve(chunks.size());
  for (size_t i = 0; i < chunks.size(); ++i) {
    const c10::Device device = devices[i];
    TORCH_CHECK(device.is_cuda(), "host_to_devices: expected CUDA devices, but devices[", i, "] is ", device);
    c10::cuda::CUDAGuard device_guard(device);
    const bool given = streams && (*streams)[i].has_value();
    const CUDAStream current = c10::cuda::getCurrentCUDAStream(device.index());
    const CUDAStream copy = given ? CUDAStream(*(*streams)[i]) : ring.side_stream(device.index());
    c10::cuda::CUDAStreamGuard stream_guard(copy);
    at::Tensor out;
    if (outs.empty()) {
      // Allocated for `copy`: free for it to write without waiting.
      out = empty_preserving(chunks[i], device);
    } else {
      out = outs[i];
      if (!given) {
        wait_stream(copy, current); // the caller's stream may still be using out
      }
    }
    // The caller's stream waits for the copies, and out's memory outlives
    // both streams' use; also when a copy fails after others were queued.
    const auto hand_over = [&] {
      if (!given) {
        wait_stream(current, copy);
        out.record_stream(outs.empty() ? c10::Stream(current) : c10::Stream(copy));
      }
    };
    try {
      copy_host_to_device(ring, chunks[i], out);
    } catch (...) {
      hand_over();
      throw;
    }
    hand_over();
    result.push_back(std::move(out));
  }
  return result;
}

void devices_to_host(at::TensorList sources, at::TensorList dests) {
  TORCH_CHECK(
      sources.size() == dests.size(), "devices_to_host: expected one destination per source, but got ",
      sources.size(), " sources and ", dests.size(), " destinations");
  c10::NoGradGuard no_grad;
  StagingRing& ring = StagingRing::instance();
  const auto lock = ring.lock();
  std::vector<Block> blocks;
  std::vector<at::Tensor> device_sources;                // alive until the DMAs land
  std::vector<std::pair<at::Tensor, at::Tensor>> finish; // (dest, host copy) pairs
  std::vector<c10::DeviceIndex> ordered;                 // side streams already ordered
  for (size_t i = 0; i < sources.size(); ++i) {
    const at::Tensor& source = sources[i];
    const at::Tensor& dest = dests[i];
    TORCH_CHECK(
        source.is_cuda() && dest.is_cpu(), "devices_to_host: expected sources[", i,
        "] on a CUDA device and dests[", i, "] on the CPU, but they are on ", source.device(), " and ",
        dest.device());
    if (dest.numel() == 0) {
      continue;
    }
    if (!staged(dest, source)) {
      dest.copy_(source); // synchronous: after the source's current stream
      continue;
    }
    const c10::DeviceIndex index = source.device().index();
    c10::cuda::CUDAGuard guard(index);
    at::Tensor device_source = is_plain_dense(source) ? source : source.contiguous();
    at::Tensor host = dest;
    if (!is_plain_dense(dest) || !dest.strides().equals(device_source.strides())) {
      host = empty_like_layout(
          device_source, c10::Device(c10::kCPU), device_source.sizes(), device_source.strides());
      finish.emplace_back(dest, host);
    }
    const CUDAStream side = ring.side_stream(index);
    if (std::find(ordered.begin(), ordered.end(), index) == ordered.end()) {
      ordered.push_back(index);
    }
    const int64_t nbytes = device_source.numel() * static_cast<int64_t>(device_source.element_size());
    char* host_data = static_cast<char*>(host.mutable_data_ptr());
    const char* device_data = static_cast<const char*>(device_source.const_data_ptr());
    for (int64_t offset = 0; offset < nbytes; offset += ring.slot_bytes()) {
      blocks.push_back(
          {host_data + offset, device_data + offset, std::min(ring.slot_bytes(), nbytes - offset), side});
    }
    device_sources.push_back(std::move(device_source));
  }
  // Every side stream starts after the work queued so far on its device's
  // current stream (which produced the sources and any contiguous copies).
  for (const c10::DeviceIndex index : ordered) {
    wait_stream(ring.side_stream(index), c10::cuda::getCurrentCUDAStream(index));
  }
  ring.download(blocks);
  for (auto& [dest, host] : finish) {
    dest.copy_(host);
  }
}

} // namespace cuda
} // namespace dpcore
