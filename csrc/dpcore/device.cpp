#define TORCH_ASSERT_ONLY_METHOD_OPERATORS

#include "dpcore/device.h"

#include <c10/core/Event.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

namespace dpcore {

c10::Device normalize_device(c10::Device device) {
  if (device.is_cpu()) {
    return c10::Device(c10::kCPU);
  }
  return device;
}

std::vector<c10::Device> check_devices(c10::ArrayRef<c10::Device> devices, const char* op, const char* arg) {
  TORCH_CHECK(!devices.empty(), op, ": expected at least one device in '", arg, "', but the list is empty");
  std::vector<c10::Device> result;
  result.reserve(devices.size());
  const c10::DeviceType type = devices[0].type();
  for (size_t i = 0; i < devices.size(); ++i) {
    const c10::Device device = normalize_device(devices[i]);
    TORCH_CHECK(
        device.type() == type, op, ": expected all of '", arg, "' to be of one device type, but ", arg,
        "[0] is ", devices[0], " and ", arg, "[", i, "] is ", device);
    if (!device.is_cpu()) {
      TORCH_CHECK(
          c10::impl::hasDeviceGuardImpl(type), op, ": ", arg, "[", i, "] is ", device,
          ", but PyTorch has no support for that device type loaded");
      // DeviceIndex is int8_t: widen it, or the message prints it as a char.
      const int count = static_cast<int>(c10::impl::getDeviceGuardImpl(type)->deviceCount());
      TORCH_CHECK(
          device.has_index() && device.index() >= 0 && device.index() < count, op, ": ", arg, "[", i, "] is ",
          device, ", but only ", count, " ", c10::DeviceTypeName(type, /*lower_case=*/true),
          " device(s) are visible");
    }
    result.push_back(device);
  }
  return result;
}

c10::Device current_device(c10::DeviceType type) {
  if (type == c10::kCPU) {
    return c10::Device(c10::kCPU);
  }
  TORCH_CHECK(
      c10::impl::hasDeviceGuardImpl(type), "no support for device type ", c10::DeviceTypeName(type),
      " is loaded");
  return c10::impl::getDeviceGuardImpl(type)->getDevice();
}

c10::Stream current_stream(c10::Device device) {
  device = normalize_device(device);
  if (device.is_cpu()) {
    return c10::Stream(c10::Stream::DEFAULT, device);
  }
  return c10::impl::getDeviceGuardImpl(device.type())->getStream(device);
}

bool can_access_directly(c10::Device reader, c10::Device owner) {
  reader = normalize_device(reader);
  owner = normalize_device(owner);
  if (reader == owner) {
    return true;
  }
#ifdef DPCORE_WITH_CUDA
  if (reader.is_cuda() && owner.is_cuda()) {
    return cuda::peer_access(reader.index(), owner.index());
  }
#endif
  return false;
}

void wait_stream(c10::Stream consumer, c10::Stream producer) {
  if (consumer == producer || consumer.device_type() != producer.device_type() ||
      !supports_events(producer.device_type())) {
    return;
  }
  c10::Event event(producer.device_type());
  event.record(producer);
  event.block(consumer);
}

void order_after(c10::Device consumer, c10::Device producer) {
  if (consumer.type() != producer.type()) {
    return;
  }
  wait_stream(current_stream(consumer), current_stream(producer));
}

bool supports_events(c10::DeviceType type) {
  return type != c10::kCPU && type != c10::kMeta;
}

} // namespace dpcore
