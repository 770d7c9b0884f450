// The deferring forward (fastpipe/runtime/deferred.py's `_Forward`) in C++.
//
// Why native: while a split schedule runs, every Linear / LayerNorm /
// Embedding / RMSNorm call goes through the deferring forward. In Python its
// bookkeeping (read the parameters, detach, make the Entry and the gradient
// edge) cost ~3 µs a call on top of the op, about as much as the bubble the
// split removes on small transformer blocks. Here a call is the op itself
// plus a few object allocations.
//
// Division of labour: the Python `_Forward` decides (hooks, flags, which
// parameters train, the native WeightLayer) and hands its decision over as
// a Plan with `set_plan`; this object runs calls that match the Plan and
// sends every other call to the Python object (`slow`): no pending
// microbatch on this thread, extra arguments, grad mode off, a tensor
// subclass or torch-function mode (Python's functional op would dispatch
// to it), or parameters other than the planned ones (a replica swapped in).
// The ops are those of the built-in rules' `forward`, so both paths give the
// same outputs and entries bit for bit.
#include "defer.h"
#include "wgrad.h"

#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/autocast_mode.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/python_cpp_function.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/variable.h>

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

namespace fastpipe {
namespace {

namespace py = pybind11;

// The lists this thread's deferring layers append to (deferred.collecting
// sets them to the pending microbatch's `entries` and `edges`); null
// outside a collecting region. Strong references, taken and dropped with the
// GIL held.
thread_local PyObject* tls_entries = nullptr;
thread_local PyObject* tls_edges = nullptr;

// deferred.Entry and torch.autograd.graph.GradientEdge, set once
// (configure_defer) and kept for the life of the process.
PyObject* entry_type = nullptr;
PyTypeObject* edge_type = nullptr;

void set_pending(const py::object& entries, const py::object& edges) {
  PyObject* old_entries = tls_entries;
  PyObject* old_edges = tls_edges;
  if (entries.is_none()) {
    tls_entries = tls_edges = nullptr;
  } else {
    if (!PyList_CheckExact(entries.ptr()) || !PyList_CheckExact(edges.ptr())) {
      throw py::type_error("set_pending takes two lists, or None and None");
    }
    tls_entries = entries.inc_ref().ptr();
    tls_edges = edges.inc_ref().ptr();
  }
  Py_XDECREF(old_entries);
  Py_XDECREF(old_edges);
}

std::optional<at::Tensor> tensor_or_none(const py::handle& h) {
  if (h.is_none()) return std::nullopt;
  if (!THPVariable_Check(h.ptr())) throw py::type_error("a plan's detached parameters are tensors or None");
  return THPVariable_Unpack(h.ptr());
}

struct Plan {
  std::int64_t kind;
  py::dict params_dict;              // the module's _parameters
  std::vector<py::str> names;        // the rule's parameters, in its order
  std::vector<py::object> params;    // what params_dict held under them when planned
  std::vector<std::optional<at::Tensor>> detached;
  std::vector<std::int64_t> ints;    // norms: normalized shape; Embedding: padding row, frequency flag
  std::optional<double> eps;
  py::object rule, targets, meta, layer, native;  // the Entry's fields but the call's own

  // The module still holds the planned parameters (one dict lookup each).
  bool current() const {
    for (std::size_t i = 0; i < names.size(); ++i) {
      if (PyDict_GetItemWithError(params_dict.ptr(), names[i].ptr()) != params[i].ptr()) {
        PyErr_Clear();
        return false;
      }
    }
    return true;
  }
};

class DeferringForward {
 public:
  explicit DeferringForward(py::object slow) : slow_(std::move(slow)) {}

  const py::object& slow() const { return slow_; }

  void set_plan(std::int64_t kind, py::dict params_dict, std::vector<py::str> names,
                std::vector<py::object> params, const py::list& detached,
                std::vector<std::int64_t> ints, std::optional<double> eps, py::object rule,
                py::object targets, py::object meta, py::object layer, py::object native) {
    if (kind < kLinear || kind > kRMSNorm) throw py::value_error("unknown deferring-forward kind");
    if (names.size() != params.size() || names.size() != detached.size() || names.empty()) {
      throw py::value_error("a plan needs one name, parameter and detached tensor per parameter");
    }
    Plan p{kind, std::move(params_dict), std::move(names), std::move(params), {}, std::move(ints),
           eps, std::move(rule), std::move(targets), std::move(meta), std::move(layer), std::move(native)};
    for (const auto& d : detached) p.detached.push_back(tensor_or_none(d));
    if (kind == kEmbedding && (p.ints.size() != 2 || !p.detached[0])) {
      throw py::value_error("an Embedding plan needs its weight, padding row and frequency flag");
    }
    plan_ = std::move(p);
  }

  void clear_plan() { plan_.reset(); }

  bool planned() const { return plan_.has_value(); }

  py::object call(const py::args& args, const py::kwargs& kwargs) {
    if (!plan_ || tls_entries == nullptr || entry_type == nullptr || args.size() != 1 || PyDict_GET_SIZE(kwargs.ptr()) != 0 ||
        !c10::GradMode::is_enabled() || at::impl::torch_function_mode_enabled() ||
        !THPVariable_CheckExact(args[0].ptr()) || !plan_->current()) {
      return slow_(*args, **kwargs);
    }
    const Plan& p = *plan_;
    const at::Tensor& x = THPVariable_Unpack(args[0].ptr());
    at::Tensor out;
    at::Tensor kept;
    switch (p.kind) {
      case kLinear: {
        // Cast as autocast casts a linear's input, so W keeps that copy.
        at::Tensor in = x;
        const auto dev = x.device().type();
        if (at::autocast::is_autocast_available(dev) && at::autocast::is_autocast_enabled(dev)) {
          const auto low = at::autocast::get_autocast_dtype(dev);
          if (x.scalar_type() != low && x.is_floating_point()) in = x.to(low);
        }
        out = at::linear(in, *p.detached[0], p.detached[1]);
        kept = in.detach();
        break;
      }
      case kLayerNorm:
        out = at::layer_norm(x, p.ints, p.detached[0], p.detached[1], p.eps.value_or(1e-5),
                             at::globalContext().userEnabledCuDNN());
        kept = x.detach();
        break;
      case kEmbedding:
        out = at::embedding(*p.detached[0], x, p.ints[0], p.ints[1] != 0, false);
        kept = x.detach();
        break;
      default:  // kRMSNorm
        out = at::rms_norm(x, p.ints, p.detached[0], p.eps);
        kept = x.detach();
        break;
    }
    if (!out.requires_grad()) out.requires_grad_(true);  // nothing before it trains: a leaf of its own
    const auto edge = torch::autograd::impl::gradient_edge(out);
    py::object node = py::reinterpret_steal<py::object>(torch::autograd::functionToPyObject(edge.function));
    py::object nr = py::int_(edge.input_nr);
    // GradientEdge(node, nr): a namedtuple, made as tuple.__new__ makes a subclass's.
    py::object grad_edge = py::reinterpret_steal<py::object>(edge_type->tp_alloc(edge_type, 2));
    if (!grad_edge) throw py::error_already_set();
    PyTuple_SET_ITEM(grad_edge.ptr(), 0, node.release().ptr());
    PyTuple_SET_ITEM(grad_edge.ptr(), 1, nr.release().ptr());
    py::object kept_py = py::reinterpret_steal<py::object>(THPVariable_Wrap(kept));
    py::tuple saved = py::make_tuple(kept_py);
    PyObject* argv[] = {p.rule.ptr(), p.targets.ptr(), saved.ptr(), p.meta.ptr(), Py_None,
                        p.layer.ptr(), p.native.ptr()};
    py::object entry = py::reinterpret_steal<py::object>(PyObject_Vectorcall(entry_type, argv, 7, nullptr));
    if (!entry) throw py::error_already_set();
    if (PyList_Append(tls_entries, entry.ptr()) < 0 || PyList_Append(tls_edges, grad_edge.ptr()) < 0) {
      throw py::error_already_set();
    }
    return py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(out)));
  }

 private:
  py::object slow_;  // the Python _Forward: decides plans, runs every other call
  std::optional<Plan> plan_;
};

}  // namespace

void register_defer(py::module_& m) {
  m.def(
      "configure_defer",
      [](py::object entry, py::object edge) {
        if (!PyType_Check(edge.ptr()) || !PyType_IsSubtype(reinterpret_cast<PyTypeObject*>(edge.ptr()), &PyTuple_Type)) {
          throw py::type_error("configure_defer: the edge type must be a tuple subclass (GradientEdge)");
        }
        Py_XDECREF(entry_type);
        Py_XDECREF(reinterpret_cast<PyObject*>(edge_type));
        entry_type = entry.inc_ref().ptr();
        edge_type = reinterpret_cast<PyTypeObject*>(edge.inc_ref().ptr());
      },
      py::arg("entry"), py::arg("edge"),
      "The Entry class and GradientEdge type the deferring forwards build (once per process).");
  m.def("set_pending", &set_pending, py::arg("entries"), py::arg("edges"),
        "This thread's deferring forwards append to these lists (None, None: they run the Python path).");
  py::class_<DeferringForward>(m, "DeferringForward")
      .def(py::init<py::object>(), py::arg("slow"))
      .def_property_readonly("slow", &DeferringForward::slow)
      .def_property_readonly("planned", &DeferringForward::planned)
      .def("set_plan", &DeferringForward::set_plan, py::arg("kind"), py::arg("params_dict"), py::arg("names"),
           py::arg("params"), py::arg("detached"), py::arg("ints"), py::arg("eps"), py::arg("rule"),
           py::arg("targets"), py::arg("meta"), py::arg("layer"), py::arg("native"))
      .def("clear_plan", &DeferringForward::clear_plan)
      .def("__call__", &DeferringForward::call);
}

}  // namespace fastpipe
