// Per-call random streams: the thread-local stream, the dispatch key's
// kernels and their one-time registration (docs/design.md, "Randomness").
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include "dpcore/replica_rng.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/randint.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <limits>
#include <map>
#include <mutex>
#include <string_view>
#include <utility>

#include "dpcore/env.h"

namespace dpcore {

namespace {

// The mode key the kernels sit on (docs/design.md says why this one).
constexpr c10::DispatchKey kKey = c10::DispatchKey::TESTING_ONLY_GenericMode;

// ATen operators with no generator argument whose CUDA kernels take the
// device's default generator themselves (fused dropout and attention).
constexpr std::array<std::string_view, 7> kDeviceGeneratorOperators = {
    "aten::native_dropout",
    "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_cudnn_attention",
    "aten::_scaled_dot_product_fused_attention_overrideable",
    "aten::_flash_attention_forward",
    "aten::_efficient_attention_forward",
};

// The stream of the call running on this thread, if it has one.
thread_local ReplicaStream* tls_stream = nullptr;

// Whether tensors on `tensor` draw from the generator of `stream`'s device.
bool same_generator(const c10::Device& tensor, const c10::Device& stream) {
  return tensor.type() == stream.type() && (tensor.is_cpu() || tensor.index() == stream.index());
}

c10::Device with_index(c10::Device device) {
  if (device.is_cuda() && !device.has_index()) {
    return c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getDevice();
  }
  return device.is_cpu() ? c10::Device(c10::DeviceType::CPU) : device;
}

// The first defined tensor among `count` arguments (self, or out).
const at::Tensor* first_tensor(const c10::IValue* arguments, size_t count) {
  for (size_t i = 0; i < count; ++i) {
    if (arguments[i].isTensor() && arguments[i].toTensor().defined()) {
      return &arguments[i].toTensor();
    }
  }
  return nullptr;
}

// The kernel of an operator whose argument `index` (of `count`) is its
// `Generator? generator`: on a thread with a stream, a call given no
// generator whose first tensor is on the stream's device gets the stream's
// generator. Factories without a tensor (rand, randn, randperm) pass: they
// fill a tensor with a random operator that this key catches in turn.
class GeneratorArgumentKernel final : public c10::OperatorKernel {
 public:
  GeneratorArgumentKernel(size_t index, size_t count) : index_(index), count_(count) {}

  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) const {
    if (ReplicaStream* stream = tls_stream) {
      c10::IValue* arguments = stack->data() + (stack->size() - count_);
      if (arguments[index_].isNone()) {
        const at::Tensor* tensor = first_tensor(arguments, count_);
        if (tensor != nullptr && same_generator(tensor->device(), stream->device())) {
          arguments[index_] = stream->generator();
        }
      }
    }
    op.redispatchBoxed(keys.remove(kKey), stack);
  }

 private:
  size_t index_;
  size_t count_;
};

std::mutex& device_lock(c10::DeviceIndex index) {
  static std::mutex guard;
  static std::map<c10::DeviceIndex, std::mutex> locks; // nodes never move
  std::lock_guard<std::mutex> lock(guard);
  return locks[index];
}

at::Tensor state_of(at::Generator& generator) {
  std::lock_guard<std::mutex> lock(generator.mutex());
  return generator.get_state();
}

void set_state(at::Generator& generator, const at::Tensor& state) {
  std::lock_guard<std::mutex> lock(generator.mutex());
  generator.set_state(state);
}

// The kernel of an operator that takes a CUDA device's default generator
// inside its kernel: on a thread with a stream for that device, the default
// generator holds the stream's state while the operator runs (the calls of
// one device take turns, for the launch only) and the stream takes the
// advanced state back. On the CPU these operators draw through operators
// with a generator argument, caught above.
void device_generator_kernel(
    const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  keys = keys.remove(kKey);
  ReplicaStream* stream = tls_stream;
  if (stream == nullptr || !stream->device().is_cuda()) {
    op.redispatchBoxed(keys, stack);
    return;
  }
  const size_t count = op.schema().arguments().size();
  const at::Tensor* tensor = first_tensor(stack->data() + (stack->size() - count), count);
  if (tensor == nullptr || !same_generator(tensor->device(), stream->device())) {
    op.redispatchBoxed(keys, stack);
    return;
  }
  at::Generator own = stream->generator();
  at::Generator shared = at::globalContext().defaultGenerator(stream->device());
  std::lock_guard<std::mutex> turn(device_lock(stream->device().index()));
  const at::Tensor saved = state_of(shared);
  set_state(shared, state_of(own));
  auto give_back = [&] {
    set_state(own, state_of(shared));
    set_state(shared, saved);
  };
  try {
    op.redispatchBoxed(keys, stack);
  } catch (...) {
    give_back();
    throw;
  }
  give_back();
}

// The calls of `devices` that share a default generator: (the device, with
// its index, and the calls on it), in order of first appearance. Calls on
// devices other than CPU and CUDA are left out.
std::vector<std::pair<c10::Device, std::vector<size_t>>> generator_groups(
    const std::vector<c10::Device>& devices) {
  std::vector<std::pair<c10::Device, std::vector<size_t>>> groups;
  for (size_t i = 0; i < devices.size(); ++i) {
    if (!devices[i].is_cpu() && !devices[i].is_cuda()) {
      continue;
    }
    const c10::Device device = with_index(devices[i]);
    auto group = std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return g.first == device; });
    if (group == groups.end()) {
      groups.emplace_back(device, std::vector<size_t>{i});
    } else {
      group->second.push_back(i);
    }
  }
  return groups;
}

// The generator the calls on `device` take their number from: this
// thread's own stream where it is a call on `device` (a parallel call
// inside a call), else the device's default generator.
at::Generator parent_generator(const c10::Device& device) {
  ReplicaStream* outer = tls_stream;
  return outer != nullptr && outer->device() == device ? outer->generator()
                                                       : at::globalContext().defaultGenerator(device);
}

// The index of an argument `Generator? generator` among `arguments`.
std::optional<size_t> generator_argument(const std::vector<c10::Argument>& arguments) {
  for (size_t i = 0; i < arguments.size(); ++i) {
    if (arguments[i].name() == "generator" &&
        arguments[i].type()->str().find("Generator") != std::string::npos) {
      return i;
    }
  }
  return std::nullopt;
}

// The libraries holding the registrations, kept for the life of the process.
struct Registrations {
  std::optional<torch::Library> fallback;
  std::optional<torch::Library> kernels;
};

// Registers the fallthrough fallback and the kernels of every ATen operator
// with a generator argument (and of kDeviceGeneratorOperators); returns why
// not ("" once registered).
std::string register_kernels() {
  static Registrations held;
  c10::Dispatcher& dispatcher = c10::Dispatcher::singleton();
  const std::string key = c10::toString(kKey);
  const std::vector<c10::OperatorName> taken = dispatcher.getRegistrationsForDispatchKey(kKey);
  if (!taken.empty() || dispatcher.hasBackendFallbackForDispatchKey(kKey)) {
    return "the dispatch key " + key + " is already used by other code (" +
           (taken.empty() ? std::string("a fallback") : c10::toString(taken.front())) + ", ...)";
  }
  try {
    held.fallback.emplace(torch::Library::IMPL, "_", kKey, __FILE__, __LINE__);
    held.fallback->fallback(torch::CppFunction::makeFallthrough());
    held.kernels.emplace(torch::Library::IMPL, "aten", kKey, __FILE__, __LINE__);
    for (const c10::OperatorName& name : dispatcher.getAllOpNames()) {
      if (name.name.rfind("aten::", 0) != 0) {
        continue;
      }
      const std::optional<c10::OperatorHandle> op = dispatcher.findSchema(name);
      if (!op) {
        continue;
      }
      const std::string qualified =
          name.overload_name.empty() ? name.name : name.name + "." + name.overload_name;
      const std::vector<c10::Argument>& arguments = op->schema().arguments();
      if (const std::optional<size_t> index = generator_argument(arguments)) {
        held.kernels->impl(
            qualified.c_str(), torch::CppFunction::makeFromBoxedFunctor(
                                   std::make_unique<GeneratorArgumentKernel>(*index, arguments.size())));
      } else if (
          name.overload_name.empty() &&
          std::find(kDeviceGeneratorOperators.begin(), kDeviceGeneratorOperators.end(), name.name) !=
              kDeviceGeneratorOperators.end()) {
        held.kernels->impl(
            qualified.c_str(), torch::CppFunction::makeFromBoxedFunction<&device_generator_kernel>());
      }
    }
  } catch (const c10::Error& error) {
    held.kernels.reset(); // unregisters what was registered
    held.fallback.reset();
    return error.what_without_backtrace();
  }
  return {};
}

// register_kernels' outcome, from its one run (on the first call that needs it).
const std::string& kernels_unavailable() {
  static const std::string reason = register_kernels();
  return reason;
}

} // namespace

uint64_t stream_seed(uint64_t number, uint64_t position) {
  uint64_t z = number + 0x9E3779B97F4A7C15ULL * (position + 1);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

uint64_t take_number(at::Generator& generator) {
  if (generator.device().is_cpu()) {
    c10::impl::ExcludeDispatchKeyGuard no_streams(kKey);
    return static_cast<uint64_t>(
        at::randint(0, std::numeric_limits<int64_t>::max(), {}, generator, at::kLong).item<int64_t>());
  }
  std::lock_guard<std::mutex> lock(generator.mutex());
  const uint64_t offset = generator.get_offset();
  generator.set_offset(offset + 4);
  return stream_seed(generator.current_seed(), offset);
}

namespace detail {

// The calls of one parallel call that share `parent`: one number is taken
// from it for all of them, when the first of them draws.
struct StreamGroup {
  explicit StreamGroup(at::Generator parent) : parent(std::move(parent)) {}

  uint64_t take_number() {
    std::lock_guard<std::mutex> lock(mutex);
    if (!number) {
      number = dpcore::take_number(parent);
    }
    return *number;
  }

  at::Generator parent;
  std::mutex mutex;
  std::optional<uint64_t> number;
};

} // namespace detail

ReplicaStream::ReplicaStream(
    c10::Device device, std::shared_ptr<detail::StreamGroup> group, uint64_t position)
    : device_(device), group_(std::move(group)), position_(position) {}

const at::Generator& ReplicaStream::generator() {
  if (!generator_) {
    at::Generator generator = device_.is_cpu() ? at::detail::createCPUGenerator()
                                               : at::globalContext()
                                                     .getAcceleratorHooksInterface(device_.type())
                                                     .getNewGenerator(device_.index());
    generator.set_current_seed(stream_seed(group_->take_number(), position_));
    generator_ = std::move(generator);
  }
  return *generator_;
}

ReplicaStreams replica_streams(const std::vector<c10::Device>& devices) {
  ReplicaStreams streams;
  const auto groups = generator_groups(devices);
  const bool shared =
      std::any_of(groups.begin(), groups.end(), [](const auto& g) { return g.second.size() > 1; });
  if (!shared || !env_flag(kReplicaRngVariable, true)) {
    return streams;
  }
  if (!kernels_unavailable().empty()) {
    streams.unavailable = kernels_unavailable();
    return streams;
  }
  streams.per_call.resize(devices.size());
  for (const auto& [device, calls] : groups) {
    if (calls.size() < 2) {
      continue;
    }
    auto group = std::make_shared<detail::StreamGroup>(parent_generator(device));
    for (size_t position = 0; position < calls.size(); ++position) {
      streams.per_call[calls[position]] = std::make_shared<ReplicaStream>(device, group, position);
    }
  }
  return streams;
}

std::vector<uint64_t> replica_seeds(const std::vector<c10::Device>& devices) {
  for (size_t i = 0; i < devices.size(); ++i) {
    TORCH_CHECK_VALUE(
        devices[i].is_cpu() || devices[i].is_cuda(),
        "replica_seeds: expected CPU or CUDA devices, but devices[", i, "] is ", devices[i]);
  }
  std::vector<uint64_t> seeds(devices.size());
  for (const auto& [device, calls] : generator_groups(devices)) {
    at::Generator parent = parent_generator(device);
    const uint64_t number = take_number(parent);
    for (size_t position = 0; position < calls.size(); ++position) {
      seeds[calls[position]] = stream_seed(number, position);
    }
  }
  return seeds;
}

ReplicaStreamScope::ReplicaStreamScope(ReplicaStream* stream)
    : previous_(tls_stream),
      entered_(stream != nullptr),
      was_included_(c10::impl::tls_is_dispatch_key_included(kKey)) {
  if (entered_) {
    tls_stream = stream;
    c10::impl::tls_set_dispatch_key_included(kKey, true);
  }
}

ReplicaStreamScope::~ReplicaStreamScope() {
  if (entered_) {
    c10::impl::tls_set_dispatch_key_included(kKey, was_included_);
    tls_stream = previous_;
  }
}

std::optional<at::Generator> current_replica_generator() {
  ReplicaStream* stream = tls_stream;
  if (stream == nullptr) {
    return std::nullopt;
  }
  return stream->generator();
}

} // namespace dpcore
