// The cached replicas of one module, over Python module objects (the reason
// it lives in csrc/python/): the replica module objects, one
// dpcore::ReplicaBuffers (persistent per-device buffers) per bucket of the
// master's parameters and buffers, and the per-step refresh that re-syncs
// each replica's attribute dicts from its master's and points its parameter
// and buffer slots at fresh views of the buffers.
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "dpcore/flatten.h"
#include "dpcore/replica_buffers.h"
#include "python/bindings.h"
#include "python/tensor_lists.h"

namespace py = pybind11;

namespace dpcore {
namespace python {
namespace {

// module.__dict__, read directly (no attribute lookup through the type).
py::dict instance_dict(const py::handle& module) {
  PyObject* d = PyObject_GenericGetDict(module.ptr(), nullptr);
  if (d == nullptr) {
    throw py::error_already_set();
  }
  return py::reinterpret_steal<py::dict>(d);
}

// What the cache's structure depends on: for every master module, the
// identity of each parameter, buffer and child (by key), and each tensor's
// dtype, device, shape and requires_grad (`module.double()` keeps the
// Parameter objects but swaps their data); and the identity of its
// `_compiled_call_impl` (set by `module.compile()`), whose replicas are
// compiled per replica by the Python side when the set is built.
std::vector<int64_t> structure_of(const py::list& masters) {
  static const char* const kOwnDicts[] = {"_parameters", "_buffers", "_modules"};
  std::vector<int64_t> out;
  out.reserve(masters.size() * 16);
  for (const py::handle& module : masters) {
    const py::dict d = instance_dict(module);
    out.push_back(
        static_cast<int64_t>(
            reinterpret_cast<intptr_t>(PyDict_GetItemString(d.ptr(), "_compiled_call_impl"))));
    for (const char* name : kOwnDicts) {
      PyObject* sub = PyDict_GetItemString(d.ptr(), name);
      if (sub == nullptr || !PyDict_Check(sub)) {
        out.push_back(-1);
        continue;
      }
      out.push_back(PyDict_Size(sub));
      PyObject* key = nullptr;
      PyObject* value = nullptr;
      Py_ssize_t pos = 0;
      while (PyDict_Next(sub, &pos, &key, &value)) {
        out.push_back(static_cast<int64_t>(PyObject_Hash(key)));
        out.push_back(static_cast<int64_t>(reinterpret_cast<intptr_t>(value)));
        if (THPVariable_Check(value)) {
          const at::Tensor& t = THPVariable_Unpack(value);
          out.push_back(static_cast<int64_t>(t.scalar_type()));
          out.push_back(static_cast<int64_t>(t.device().type()));
          out.push_back(static_cast<int64_t>(t.device().index()));
          out.push_back(t.requires_grad() ? 1 : 0);
          out.push_back(t.dim());
          for (int64_t size : t.sizes()) {
            out.push_back(size);
          }
        }
      }
    }
  }
  return out;
}

// One entry of a master module's _parameters or _buffers dict.
struct Slot {
  size_t module;  // index into the master modules
  bool parameter; // in _parameters, else in _buffers
  py::str name;
  std::optional<size_t> tensor; // index into the unique tensors; none for a None entry
};

// One entry of a master module's _modules dict.
struct Child {
  py::str name;
  std::optional<size_t> module; // index into the master modules; none for a None entry
};

// What the replicas of one master module need besides their tensors.
struct ModulePlan {
  std::vector<py::str> hooks;    // names of the hook dicts in the master's __dict__
  std::vector<py::str> privates; // attributes its replicas keep for themselves
  std::vector<Child> children;
};

// One bucket: its persistent buffers and its master tensors, in bucket order.
struct BucketEntry {
  std::shared_ptr<ReplicaBuffers> replicas;
  std::vector<at::Tensor> tensors;
  py::list objects; // the same tensors as the Python objects (Parameters stay Parameters)
  bool requires_grad = false;
};

// Where the copies of one unique tensor are: bucket, position in it.
struct Place {
  size_t bucket = 0;
  size_t position = 0;
};

// Buckets of `tensors` as dpcore::make_buckets cuts them, with tensors that
// require grad never sharing a bucket with ones that do not (a frozen
// tensor's copies need no gradient reduction), in the order of each bucket's
// first tensor.
std::vector<std::vector<size_t>> buckets_by_grad(
    const std::vector<at::Tensor>& tensors, int64_t bucket_bytes) {
  std::vector<std::vector<size_t>> result;
  for (const bool requires_grad : {true, false}) {
    std::vector<size_t> indices;
    std::vector<at::Tensor> group;
    for (size_t i = 0; i < tensors.size(); ++i) {
      if (tensors[i].requires_grad() == requires_grad) {
        indices.push_back(i);
        group.push_back(tensors[i]);
      }
    }
    for (const Bucket& bucket : make_buckets(group, bucket_bytes)) {
      std::vector<size_t> members;
      members.reserve(bucket.indices.size());
      for (size_t k : bucket.indices) {
        members.push_back(indices[k]);
      }
      result.push_back(std::move(members));
    }
  }
  std::sort(result.begin(), result.end(), [](const auto& a, const auto& b) { return a.front() < b.front(); });
  return result;
}

class ReplicaSet {
 public:
  // The replicas of `module` on `targets` (one row of replica modules per
  // target, one replica per module of module.modules()), and the buffers of
  // its unique parameters and buffers in buckets of about `bucket_bytes`.
  // Each replica module is made by `replicate(master)` where given (not
  // None), else by master._replicate_for_data_parallel().
  ReplicaSet(
      const py::object& module, const std::vector<c10::Device>& targets, int64_t bucket_bytes,
      const py::object& replicate)
      : masters_(module.attr("modules")()) {
    std::unordered_map<PyObject*, size_t> module_index;
    for (size_t i = 0; i < masters_.size(); ++i) {
      module_index.emplace(masters_[i].ptr(), i);
    }
    std::unordered_map<PyObject*, size_t> tensor_index;
    std::vector<at::Tensor> tensors;
    py::list tensor_objects;
    plans_.reserve(masters_.size());
    for (size_t mi = 0; mi < masters_.size(); ++mi) {
      const py::handle master = masters_[mi];
      const py::dict d = instance_dict(master);
      for (const bool parameter : {true, false}) {
        const py::dict entries = d[parameter ? "_parameters" : "_buffers"];
        for (const auto& [key, value] : entries) {
          Slot slot{mi, parameter, py::reinterpret_borrow<py::str>(key), std::nullopt};
          if (!value.is_none()) {
            TORCH_CHECK_TYPE(
                THPVariable_Check(value.ptr()), "ReplicaSet: expected ", parameter ? "parameter" : "buffer",
                " '", std::string(py::str(key)), "' of module ", mi, " to be a tensor or None, but got ",
                std::string(py::str(py::type::handle_of(value).attr("__name__"))));
            auto [it, added] = tensor_index.emplace(value.ptr(), tensors.size());
            if (added) {
              tensors.push_back(THPVariable_Unpack(value.ptr()));
              tensor_objects.append(value);
            }
            slot.tensor = it->second;
          }
          slots_.push_back(std::move(slot));
        }
      }
      ModulePlan plan;
      for (const auto& [key, value] : d) {
        if (PyUnicode_Check(key.ptr()) && PyDict_Check(value.ptr()) &&
            std::string(py::str(key)).find("hook") != std::string::npos) {
          plan.hooks.push_back(py::reinterpret_borrow<py::str>(key));
        }
      }
      for (const py::handle name : py::iter(py::getattr(master, "_replica_private_attrs", py::tuple()))) {
        plan.privates.push_back(py::reinterpret_borrow<py::str>(name));
      }
      const py::dict children = d["_modules"];
      for (const auto& [key, value] : children) {
        Child child{py::reinterpret_borrow<py::str>(key), std::nullopt};
        if (!value.is_none()) {
          child.module = module_index.at(value.ptr());
        }
        plan.children.push_back(std::move(child));
      }
      plans_.push_back(std::move(plan));
    }
    signature_ = structure_of(masters_);
    if (targets.empty()) {
      return;
    }
    // Replica modules first: a module that cannot be replicated (a lazy
    // module not yet initialized) raises its own error before any sizing.
    rows_.reserve(targets.size());
    for (size_t j = 0; j < targets.size(); ++j) {
      py::list row;
      for (const py::handle master : masters_) {
        row.append(replicate.is_none() ? master.attr("_replicate_for_data_parallel")() : replicate(master));
      }
      rows_.push_back(std::move(row));
    }
    places_.resize(tensors.size());
    for (const std::vector<size_t>& members : buckets_by_grad(tensors, bucket_bytes)) {
      BucketEntry entry;
      for (size_t position = 0; position < members.size(); ++position) {
        const size_t i = members[position];
        places_[i] = Place{buckets_.size(), position};
        entry.tensors.push_back(tensors[i]);
        entry.objects.append(tensor_objects[i]);
      }
      entry.requires_grad = entry.tensors.front().requires_grad();
      entry.replicas = std::make_shared<ReplicaBuffers>(entry.tensors, targets);
      buckets_.push_back(std::move(entry));
    }
  }

  // Whether the masters' structure is still the one the set was built for.
  bool valid() const {
    return structure_of(masters_) == signature_;
  }

  // Refreshes rows 0..rows-1 and returns their root replica modules.
  // outputs[b] holds bucket b's copies, device-major (copy of position p for
  // target j at j * size + p), as BroadcastBucket returns them; None has the
  // bucket refreshed here, without autograd history. Each replica's __dict__
  // becomes a copy of its master's, except: its own _parameters, _buffers
  // and _modules dicts (children pointing at its row's replicas) and private
  // attributes; hook dicts copied (a replica's hooks never reach the master
  // or another replica; an empty one is reused while the replica's is still
  // empty); _is_replica set. Then every parameter and buffer slot is set to
  // its copy.
  py::list sync(size_t rows, const py::sequence& outputs) {
    TORCH_CHECK_VALUE(
        rows <= rows_.size(), "ReplicaSet.sync: expected at most ", rows_.size(), " rows, but got ", rows);
    TORCH_CHECK_VALUE(
        outputs.size() == buckets_.size(), "ReplicaSet.sync: expected one entry of outputs per bucket (",
        buckets_.size(), "), but got ", outputs.size());
    std::vector<py::tuple> copies;
    copies.reserve(buckets_.size());
    for (size_t b = 0; b < buckets_.size(); ++b) {
      copies.push_back(bucket_copies(b, outputs[b], rows));
    }
    py::list roots;
    for (size_t j = 0; j < rows; ++j) {
      sync_row(j, copies);
      roots.append(rows_[j][0]);
    }
    return roots;
  }

  py::list buckets() const {
    py::list result;
    for (const BucketEntry& entry : buckets_) {
      result.append(py::make_tuple(entry.replicas, entry.objects, entry.requires_grad));
    }
    return result;
  }

  py::list replica_modules() const {
    py::list result;
    for (const py::list& row : rows_) {
      result.append(py::list(row));
    }
    return result;
  }

  // Garbage-collector support: every Python object the set holds.
  int traverse(visitproc visit, void* arg) const {
    Py_VISIT(masters_.ptr());
    for (const py::list& row : rows_) {
      Py_VISIT(row.ptr());
    }
    for (const BucketEntry& entry : buckets_) {
      Py_VISIT(entry.objects.ptr());
    }
    return 0;
  }

  void clear() {
    masters_ = py::list();
    rows_.clear();
    buckets_.clear();
    slots_.clear();
    plans_.clear();
  }

 private:
  // Bucket b's copies for the first `rows` targets, device-major.
  py::tuple bucket_copies(size_t b, const py::handle& given, size_t rows) {
    const BucketEntry& entry = buckets_[b];
    const size_t size = entry.tensors.size();
    if (given.is_none()) {
      TensorList2D fresh;
      {
        py::gil_scoped_release no_gil;
        fresh = entry.replicas->refresh(entry.tensors);
      }
      py::tuple result(rows * size);
      GcPause pause; // thousands of new objects at once (tensor_lists.h)
      for (size_t j = 0; j < rows; ++j) {
        for (size_t p = 0; p < size; ++p) {
          result[j * size + p] = py::cast(std::move(fresh[j][p]));
        }
      }
      return result;
    }
    py::tuple result = py::tuple(py::reinterpret_borrow<py::object>(given));
    TORCH_CHECK_VALUE(
        result.size() == size * rows_.size(), "ReplicaSet.sync: expected outputs[", b, "] to hold ",
        size * rows_.size(), " copies (", size, " tensors on ", rows_.size(), " targets), but got ",
        result.size());
    return result;
  }

  void sync_row(size_t j, const std::vector<py::tuple>& copies) const {
    const py::list& row = rows_[j];
    std::vector<py::dict> own_params(row.size());
    std::vector<py::dict> own_buffers(row.size());
    for (size_t i = 0; i < row.size(); ++i) {
      const ModulePlan& plan = plans_[i];
      const py::dict master = instance_dict(masters_[i]);
      const py::dict current = instance_dict(row[i]);
      py::dict d = py::reinterpret_steal<py::dict>(PyDict_Copy(master.ptr()));
      for (const py::str& key : own_keys_) {
        d[key] = current[key];
      }
      for (const py::str& key : plan.privates) {
        PyObject* value = PyDict_GetItem(current.ptr(), key.ptr());
        d[key] = value ? py::reinterpret_borrow<py::object>(value) : py::none();
      }
      for (const py::str& key : plan.hooks) {
        PyObject* hooks = PyDict_GetItem(d.ptr(), key.ptr());
        if (hooks == nullptr || !PyDict_Check(hooks)) {
          continue;
        }
        if (PyDict_Size(hooks) == 0) {
          PyObject* mine = PyDict_GetItem(current.ptr(), key.ptr());
          if (mine != nullptr && mine != hooks && Py_TYPE(mine) == Py_TYPE(hooks) && PyDict_Size(mine) == 0) {
            d[key] = py::reinterpret_borrow<py::object>(mine);
          } else {
            d[key] = py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(Py_TYPE(hooks)))();
          }
        } else {
          d[key] = py::reinterpret_borrow<py::object>(hooks).attr("copy")();
        }
      }
      d[is_replica_key_] = py::bool_(true);
      // object.__setattr__, not the module's: nn.Module.__setattr__ is
      // Python code that only passes "__dict__" on, and costs several times
      // the rest of this loop.
      if (PyObject_GenericSetAttr(row[i].ptr(), dict_key_.ptr(), d.ptr()) != 0) {
        throw py::error_already_set();
      }
      py::dict modules = py::reinterpret_borrow<py::dict>(d[own_keys_[2]]);
      for (const Child& child : plan.children) {
        modules[child.name] =
            child.module ? py::reinterpret_borrow<py::object>(row[*child.module]) : py::none();
      }
      own_params[i] = py::reinterpret_borrow<py::dict>(d[own_keys_[0]]);
      own_buffers[i] = py::reinterpret_borrow<py::dict>(d[own_keys_[1]]);
    }
    for (const Slot& slot : slots_) {
      py::dict& target = slot.parameter ? own_params[slot.module] : own_buffers[slot.module];
      if (!slot.tensor) {
        target[slot.name] = py::none();
        continue;
      }
      const Place& place = places_[*slot.tensor];
      const size_t size = buckets_[place.bucket].tensors.size();
      target[slot.name] = copies[place.bucket][j * size + place.position];
    }
  }

  py::list masters_;
  std::vector<int64_t> signature_;
  std::vector<ModulePlan> plans_;
  std::vector<Slot> slots_;
  std::vector<Place> places_; // per unique tensor
  std::vector<BucketEntry> buckets_;
  std::vector<py::list> rows_; // rows_[j][i]: the replica of master i on target j
  py::str is_replica_key_{"_is_replica"};
  py::str dict_key_{"__dict__"};
  py::str own_keys_[3] = {py::str("_parameters"), py::str("_buffers"), py::str("_modules")};
};

// Lets the garbage collector see (and break) reference cycles that pass
// through a ReplicaSet: a module that refers back to its wrapper.
void enable_gc(PyHeapTypeObject* heap_type) {
  PyTypeObject* type = &heap_type->ht_type;
  type->tp_flags |= Py_TPFLAGS_HAVE_GC;
  type->tp_traverse = [](PyObject* self, visitproc visit, void* arg) {
    Py_VISIT(Py_TYPE(self));
    if (py::detail::is_holder_constructed(self)) {
      return py::cast<const ReplicaSet&>(py::handle(self)).traverse(visit, arg);
    }
    return 0;
  };
  type->tp_clear = [](PyObject* self) {
    if (py::detail::is_holder_constructed(self)) {
      py::cast<ReplicaSet&>(py::handle(self)).clear();
    }
    return 0;
  };
}

} // namespace

void bind_replica_sync(py::module_& m) {
  py::class_<ReplicaBuffers, std::shared_ptr<ReplicaBuffers>>(
      m, "ReplicaBuffers",
      "Persistent per-device copies of one bucket of master tensors (built by ReplicaSet).")
      .def(
          py::init([](const std::vector<at::Tensor>& like, const std::vector<c10::Device>& targets) {
            return std::make_shared<ReplicaBuffers>(like, targets);
          }),
          py::arg("like"), py::arg("targets"))
      .def(
          "refresh",
          [](ReplicaBuffers& self, const std::vector<at::Tensor>& tensors) {
            std::vector<at::Tensor> flat;
            {
              py::gil_scoped_release no_gil;
              for (std::vector<at::Tensor>& row : self.refresh(tensors)) {
                for (at::Tensor& t : row) {
                  flat.push_back(std::move(t));
                }
              }
            }
            return to_python_list(std::move(flat));
          },
          py::arg("tensors"),
          "Brings the buffers up to date with `tensors` and returns fresh views of them, "
          "device-major: tensors[i] on targets[d] at d * len(tensors) + i.")
      .def(
          "update",
          [](ReplicaBuffers& self, const std::vector<at::Tensor>& tensors) { self.refresh(tensors); },
          py::arg("tensors"), py::call_guard<py::gil_scoped_release>(),
          "Brings the buffers up to date with `tensors`, as refresh does, without returning views.")
      .def(
          "invalidate", &ReplicaBuffers::invalidate, py::call_guard<py::gil_scoped_release>(),
          "Makes the next refresh copy every entry: for in-place writes no version counter saw "
          "(replayed CUDA graphs).")
      .def(
          "verify",
          [](ReplicaBuffers& self, const std::vector<at::Tensor>& tensors) { return self.verify(tensors); },
          py::arg("tensors"), py::call_guard<py::gil_scoped_release>(),
          "Compares the buffers with `tensors` byte for byte where the next refresh would not copy; returns "
          "the indices of the entries that differ (the next refresh copies them), [] when none does.")
      .def(
          "write", &ReplicaBuffers::write, py::arg("target"), py::arg("entry"), py::arg("value"),
          py::arg("master"), py::call_guard<py::gil_scoped_release>(),
          "Writes `value` into targets[target]'s copy of entry `entry`, which `master` now equals: the next "
          "refresh leaves that copy as it is unless `master` changes again.")
      .def(
          "views",
          [](ReplicaBuffers& self, int64_t target) {
            std::vector<at::Tensor> views;
            {
              py::gil_scoped_release no_gil;
              views = self.views(target);
            }
            return to_python_list(std::move(views));
          },
          py::arg("target"),
          "Tensors viewing targets[target]'s copy of each entry (refresh's version counters), for a "
          "collective that writes them in place; mark_current afterwards.")
      .def(
          "mark_current",
          [](ReplicaBuffers& self, int64_t target, const std::vector<int64_t>& entries,
             const std::vector<at::Tensor>& masters) { self.mark_current(target, entries, masters); },
          py::arg("target"), py::arg("entries"), py::arg("masters"), py::call_guard<py::gil_scoped_release>(),
          "Marks targets[target]'s copies of `entries` as equal to `masters` now (as write() leaves them): "
          "the "
          "next refresh leaves them as they are unless a master changes again.")
      .def_property_readonly("last_refresh_copied", &ReplicaBuffers::last_refresh_copied)
      .def_property_readonly(
          "last_copied_bytes", &ReplicaBuffers::last_copied_bytes,
          "Bytes the last refresh copied per target.");

  py::class_<ReplicaSet>(m, "ReplicaSet", py::custom_type_setup(enable_gc))
      .def(
          py::init<const py::object&, const std::vector<c10::Device>&, int64_t, const py::object&>(),
          py::arg("module"), py::arg("targets"), py::arg("bucket_bytes"), py::arg("replicate") = py::none())
      .def("valid", &ReplicaSet::valid)
      .def("sync", &ReplicaSet::sync, py::arg("rows"), py::arg("outputs"))
      .def_property_readonly(
          "buckets", &ReplicaSet::buckets,
          "(ReplicaBuffers, master tensors, requires_grad) for every bucket, in order")
      .def_property_readonly(
          "replica_modules", &ReplicaSet::replica_modules,
          "rows[j][i]: the replica of module i on targets[j]");
}

} // namespace python
} // namespace dpcore
