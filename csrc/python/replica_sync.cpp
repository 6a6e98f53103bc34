// The per-step refresh of cached replica modules, over Python module objects
// (the reason it lives in csrc/python/): re-sync each replica's attribute
// dict from its master's and set its parameter and buffer slots, and check
// cheaply whether the master's structure still matches the cache.
#include <torch/extension.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "python/bindings.h"

namespace py = pybind11;

namespace dpcore {
namespace python {
namespace {

const char* const kOwnDicts[] = {"_parameters", "_buffers", "_modules"};

py::dict instance_dict(const py::handle& module) {
  return py::reinterpret_borrow<py::dict>(py::getattr(module, "__dict__"));
}

// What the cache's structure depends on: for every master module, the
// identity of each parameter, buffer and child (by key), and each tensor's
// dtype, device, shape and requires_grad (`module.double()` keeps the
// Parameter objects but swaps their data).
std::vector<int64_t> structure_of(const py::list& masters) {
  std::vector<int64_t> out;
  out.reserve(masters.size() * 16);
  for (const py::handle& module : masters) {
    const py::dict d = instance_dict(module);
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

class StructureSignature {
 public:
  explicit StructureSignature(const py::list& masters) : value_(structure_of(masters)) {}
  bool matches(const py::list& masters) const { return structure_of(masters) == value_; }

 private:
  std::vector<int64_t> value_;
};

// How one row of replicas (one per master module, on one device) is
// refreshed; built once per cache.
class ReplicaSyncPlan {
 public:
  // hooks[i]: names of module i's hook dicts; privates[i]: attributes module
  // i's replicas keep for themselves; children[i]: (name, index of the child
  // in the module list, or -1 for None); slots: (module index, 0 for a
  // parameter or 1 for a buffer, name, index into the row's copies or -1).
  ReplicaSyncPlan(
      py::list masters,
      std::vector<std::vector<py::str>> hooks,
      std::vector<std::vector<py::str>> privates,
      std::vector<std::vector<std::pair<py::str, int64_t>>> children,
      std::vector<std::tuple<int64_t, int64_t, py::str, int64_t>> slots)
      : masters_(std::move(masters)),
        hooks_(std::move(hooks)),
        privates_(std::move(privates)),
        children_(std::move(children)),
        slots_(std::move(slots)) {
    TORCH_CHECK_VALUE(
        hooks_.size() == masters_.size() && privates_.size() == masters_.size() &&
            children_.size() == masters_.size(),
        "ReplicaSyncPlan: expected one entry of hooks, privates and children per master module (",
        masters_.size(), ")");
  }

  // Each replica's __dict__ becomes a copy of its master's, except: its own
  // _parameters/_buffers/_modules dicts (children pointing at this row's
  // replicas) and private attributes; hook dicts copied (a replica's hooks
  // never reach the master or another replica; an empty one is reused when
  // the replica's is still empty); _is_replica set. Then every parameter and
  // buffer slot is set from `copies`.
  void sync(const py::list& row, const py::list& copies) const {
    TORCH_CHECK_VALUE(
        row.size() == masters_.size(), "ReplicaSyncPlan.sync: expected ", masters_.size(),
        " replica modules, but got ", row.size());
    const py::str& kIsReplica = is_replica_key_;
    const auto& kOwn = own_keys_;
    std::vector<py::dict> own_params(row.size());
    std::vector<py::dict> own_buffers(row.size());
    for (size_t i = 0; i < row.size(); ++i) {
      const py::dict master = instance_dict(masters_[i]);
      const py::dict current = instance_dict(row[i]);
      py::dict d = py::reinterpret_steal<py::dict>(PyDict_Copy(master.ptr()));
      for (const py::str& key : kOwn) {
        d[key] = current[key];
      }
      for (const py::str& key : privates_[i]) {
        PyObject* value = PyDict_GetItem(current.ptr(), key.ptr());
        d[key] = value ? py::reinterpret_borrow<py::object>(value) : py::none();
      }
      for (const py::str& key : hooks_[i]) {
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
      d[kIsReplica] = py::bool_(true);
      py::setattr(row[i], "__dict__", d);
      py::dict modules = py::reinterpret_borrow<py::dict>(d[kOwn[2]]);
      for (const auto& [name, index] : children_[i]) {
        modules[name] = index >= 0 ? py::reinterpret_borrow<py::object>(row[index]) : py::none();
      }
      own_params[i] = py::reinterpret_borrow<py::dict>(d[kOwn[0]]);
      own_buffers[i] = py::reinterpret_borrow<py::dict>(d[kOwn[1]]);
    }
    for (const auto& [module, kind, name, index] : slots_) {
      py::dict& target = kind == 0 ? own_params[module] : own_buffers[module];
      target[name] = index >= 0 ? py::reinterpret_borrow<py::object>(copies[index]) : py::none();
    }
  }

 private:
  py::list masters_;
  std::vector<std::vector<py::str>> hooks_;
  std::vector<std::vector<py::str>> privates_;
  std::vector<std::vector<std::pair<py::str, int64_t>>> children_;
  std::vector<std::tuple<int64_t, int64_t, py::str, int64_t>> slots_;
  py::str is_replica_key_{"_is_replica"};
  py::str own_keys_[3] = {py::str("_parameters"), py::str("_buffers"), py::str("_modules")};
};

} // namespace

void bind_replica_sync(py::module_& m) {
  py::class_<StructureSignature>(m, "StructureSignature")
      .def(py::init<const py::list&>(), py::arg("masters"))
      .def("matches", &StructureSignature::matches, py::arg("masters"));
  py::class_<ReplicaSyncPlan>(m, "ReplicaSyncPlan")
      .def(
          py::init<
              py::list, std::vector<std::vector<py::str>>, std::vector<std::vector<py::str>>,
              std::vector<std::vector<std::pair<py::str, int64_t>>>,
              std::vector<std::tuple<int64_t, int64_t, py::str, int64_t>>>(),
          py::arg("masters"), py::arg("hooks"), py::arg("privates"), py::arg("children"), py::arg("slots"))
      .def("sync", &ReplicaSyncPlan::sync, py::arg("row"), py::arg("copies"));
}

} // namespace python
} // namespace dpcore
