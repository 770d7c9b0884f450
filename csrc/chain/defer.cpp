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
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/python_cpp_function.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/variable.h>

#include <cstdint>
#include <memory>
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
// The native block of the same microbatch (a `Calls` held through tls_block):
// calls with a native WeightLayer go there instead, so a call makes no
// Python object (no Entry, kept tensor, gradient edge or node wrapper) that
// W later frees, each a hand-over of the GIL on threads of one interpreter.
thread_local PyObject* tls_block = nullptr;
thread_local Calls* tls_calls = nullptr;

// deferred.Entry and torch.autograd.graph.GradientEdge, set once
// (configure_defer) and kept for the life of the process.
PyObject* entry_type = nullptr;
PyTypeObject* edge_type = nullptr;
Py_ssize_t edge_fields = 2;  // (node, output_nr), and None for any later field (ownership_token)

void set_pending(const py::object& entries, const py::object& edges, const py::object& block) {
  PyObject* old_entries = tls_entries;
  PyObject* old_edges = tls_edges;
  PyObject* old_block = tls_block;
  if (entries.is_none()) {
    tls_entries = tls_edges = tls_block = nullptr;
    tls_calls = nullptr;
  } else {
    if (!PyList_CheckExact(entries.ptr()) || !PyList_CheckExact(edges.ptr())) {
      throw py::type_error("set_pending takes two lists, or None and None");
    }
    Calls* calls = block.is_none() ? nullptr : block.cast<Calls*>();
    tls_entries = entries.inc_ref().ptr();
    tls_edges = edges.inc_ref().ptr();
    tls_block = block.is_none() ? nullptr : block.inc_ref().ptr();
    tls_calls = calls;
  }
  Py_XDECREF(old_entries);
  Py_XDECREF(old_edges);
  Py_XDECREF(old_block);
}

// GradientEdge(node, nr) of `edge`: a namedtuple, made as tuple.__new__ makes a subclass's.
py::object python_edge(const torch::autograd::Edge& edge) {
  py::object node = py::reinterpret_steal<py::object>(torch::autograd::functionToPyObject(edge.function));
  py::object nr = py::int_(edge.input_nr);
  py::object grad_edge = py::reinterpret_steal<py::object>(edge_type->tp_alloc(edge_type, edge_fields));
  if (!grad_edge) throw py::error_already_set();
  PyTuple_SET_ITEM(grad_edge.ptr(), 0, node.release().ptr());
  PyTuple_SET_ITEM(grad_edge.ptr(), 1, nr.release().ptr());
  for (Py_ssize_t i = 2; i < edge_fields; ++i) PyTuple_SET_ITEM(grad_edge.ptr(), i, py::none().release().ptr());
  return grad_edge;
}

// A call appended to a block: its layer, what W keeps, and its output's
// gradient edge, where I will capture the call's gradient.
void add_call(Calls& block, std::shared_ptr<Layer> layer, at::Tensor kept, const at::Tensor& out) {
  if (block.edges.size() != block.calls.size()) {
    throw py::value_error("a block's calls have gradients already: no call can join it");
  }
  block.edges.push_back(torch::autograd::impl::gradient_edge(out));
  block.calls.push_back(Call{std::move(layer), std::move(kept), at::Tensor()});
}

// A block's calls given their gradients (None: no gradient reached the
// call's output, and it goes), in the order of its edges.
void fill_block(Calls& block, const std::vector<std::optional<at::Tensor>>& grads) {
  if (grads.size() != block.edges.size() || grads.size() != block.calls.size()) {
    throw py::value_error("fill_block: one gradient per waiting call");
  }
  std::vector<Call> kept;
  kept.reserve(block.calls.size());
  for (std::size_t i = 0; i < grads.size(); ++i) {
    if (!grads[i].has_value() || !grads[i]->defined()) continue;
    block.calls[i].g = *grads[i];
    kept.push_back(std::move(block.calls[i]));
  }
  block.calls = std::move(kept);
  block.edges.clear();
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
  std::vector<std::optional<at::Tensor>> aliases;  // the op's parameters where its input wants no gradient
  std::vector<std::int64_t> ints;    // norms: normalized shape; Embedding: padding row, frequency flag
  std::optional<double> eps;
  py::object rule, targets, meta, layer, native;  // the Entry's fields but the call's own
  std::shared_ptr<Layer> native_layer;            // `native` as W reads it; null: W in Python

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

// A planned layer's op: its output, and what its W keeps (the input, cast
// as autocast casts a linear's (an addmm's) input, so W keeps that copy).
// Called without the GIL.
std::pair<at::Tensor, at::Tensor> deferred_op(std::int64_t kind, const at::Tensor& x,
                                              const std::optional<at::Tensor>& weight,
                                              const std::optional<at::Tensor>& bias,
                                              const std::vector<std::int64_t>& ints,
                                              const std::optional<double>& eps) {
  auto autocast_input = [](const at::Tensor& in) {
    const auto dev = in.device().type();
    if (at::autocast::is_autocast_available(dev) && at::autocast::is_autocast_enabled(dev)) {
      const auto low = at::autocast::get_autocast_dtype(dev);
      if (in.scalar_type() != low && in.is_floating_point()) return in.to(low);
    }
    return in;
  };
  switch (kind) {
    case kLinear: {
      at::Tensor in = autocast_input(x);
      return {at::linear(in, *weight, bias), in.detach()};
    }
    case kConv1D: {  // weight_rules.Conv1DRule.forward
      at::Tensor in = autocast_input(x.view({-1, x.size(-1)}));
      std::vector<std::int64_t> size = x.sizes().vec();
      size.back() = ints[0];
      return {at::addmm(*bias, in, *weight).view(size), in.detach()};
    }
    case kLayerNorm:
      return {at::layer_norm(x, ints, weight, bias, eps.value_or(1e-5),
                             at::globalContext().userEnabledCuDNN()),
              x.detach()};
    case kEmbedding:
      return {at::embedding(*weight, x, ints[0], ints[1] != 0, false), x.detach()};
    default:  // kRMSNorm
      return {at::rms_norm(x, ints, weight, eps), x.detach()};
  }
}

class DeferringForward {
 public:
  explicit DeferringForward(py::object slow) : slow_(std::move(slow)) {}

  const py::object& slow() const { return slow_; }

  void set_plan(std::int64_t kind, py::dict params_dict, std::vector<py::str> names,
                std::vector<py::object> params, const py::list& detached, const py::list& aliases,
                std::vector<std::int64_t> ints, std::optional<double> eps, py::object rule,
                py::object targets, py::object meta, py::object layer, py::object native) {
    if (kind < kLinear || kind > kConv1D) throw py::value_error("unknown deferring-forward kind");
    if (names.size() != params.size() || names.size() != detached.size() || names.size() != aliases.size() ||
        names.empty()) {
      throw py::value_error("a plan needs one name, parameter, detached tensor and alias per parameter");
    }
    Plan p{kind, std::move(params_dict), std::move(names), std::move(params), {}, {}, std::move(ints),
           eps, std::move(rule), std::move(targets), std::move(meta), std::move(layer), std::move(native)};
    for (const auto& d : detached) p.detached.push_back(tensor_or_none(d));
    for (const auto& a : aliases) p.aliases.push_back(tensor_or_none(a));
    if (!p.native.is_none()) p.native_layer = p.native.cast<std::shared_ptr<Layer>>();
    if (kind == kEmbedding && (p.ints.size() != 2 || !p.detached[0])) {
      throw py::value_error("an Embedding plan needs its weight, padding row and frequency flag");
    }
    if (kind == kConv1D && (p.ints.size() != 1 || p.detached.size() != 2 || !p.detached[0] || !p.detached[1])) {
      throw py::value_error("a Conv1D plan needs its weight, its bias and its output width");
    }
    plan_ = std::make_shared<const Plan>(std::move(p));
  }

  void clear_plan() { plan_.reset(); }

  bool planned() const { return plan_ != nullptr; }

  py::object call(const py::args& args, const py::kwargs& kwargs) {
    if (!plan_ || tls_entries == nullptr || entry_type == nullptr || args.size() != 1 || PyDict_GET_SIZE(kwargs.ptr()) != 0 ||
        !c10::GradMode::is_enabled() || at::impl::torch_function_mode_enabled() ||
        !THPVariable_CheckExact(args[0].ptr()) || !plan_->current()) {
      return slow_(*args, **kwargs);
    }
    // The op runs without the GIL, as torch's own Python bindings run it: ranks
    // that are threads of one interpreter (local mode) run their Python beside
    // another rank's kernels. The call holds its plan meanwhile (set_plan may
    // replace it), and drops it with the GIL held again. It also holds a C++
    // reference to its input, taken with the GIL: torch takes the GIL to keep a
    // tensor's Python object alive when a second C++ reference to it appears
    // (and to let it go when that one goes), which the op's views and saved
    // tensors would otherwise make it do without the GIL, once or more a call.
    // The plan's detached parameters are such references already.
    const std::shared_ptr<const Plan> plan = plan_;
    const Plan& p = *plan;
    const at::Tensor x = THPVariable_Unpack(args[0].ptr());
    const std::optional<at::Tensor> none;
    at::Tensor out;
    at::Tensor kept;
    // An input that wants no gradient: the aliases that want one (the
    // Python _Forward says why).
    const auto& params = x.requires_grad() ? p.detached : p.aliases;
    {
      py::gil_scoped_release nogil;
      std::tie(out, kept) = deferred_op(p.kind, x, params[0], params.size() > 1 ? params[1] : none, p.ints, p.eps);
    }
    if (!out.requires_grad()) out.requires_grad_(true);  // no trained parameter: a leaf of its own
    if (tls_calls != nullptr && p.native_layer) {
      add_call(*tls_calls, p.native_layer, std::move(kept), out);
      return py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(out)));
    }
    py::object grad_edge = python_edge(torch::autograd::impl::gradient_edge(out));
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
  std::shared_ptr<const Plan> plan_;  // shared: a call keeps its plan while the GIL is released
};

// _Forward._holds's look at a kept plan's parameters, made here (a stage's
// every layer, at every step's install): `params_dict` (the module's
// _parameters) still holds `params` under `names`; each parameter trains as
// `targets` says (None: frozen) and, training, has no tensor or
// post-accumulate hook; each `detached` alias still views its parameter's
// memory with its dtype, sizes and strides (`p.data = ...` swaps it).
bool plan_holds(const py::dict& params_dict, const std::vector<py::str>& names, const py::tuple& params,
                const py::tuple& targets, const py::tuple& detached) {
  static PyObject* hooks_name = PyUnicode_InternFromString("_backward_hooks");
  static PyObject* post_name = PyUnicode_InternFromString("_post_accumulate_grad_hooks");
  const std::size_t n = names.size();
  if (params.size() != n || targets.size() != n || detached.size() != n) return false;
  for (std::size_t i = 0; i < n; ++i) {
    PyObject* obj = PyTuple_GET_ITEM(params.ptr(), i);
    PyObject* now = PyDict_GetItemWithError(params_dict.ptr(), names[i].ptr());
    if (now == nullptr && PyErr_Occurred()) throw py::error_already_set();
    if (now != obj) return false;
    if (obj == Py_None) continue;
    PyObject* d = PyTuple_GET_ITEM(detached.ptr(), i);
    if (!THPVariable_Check(obj) || !THPVariable_Check(d)) return false;
    const at::Tensor& t = THPVariable_Unpack(obj);
    const bool trained = PyTuple_GET_ITEM(targets.ptr(), i) != Py_None;
    if (t.requires_grad() != trained) return false;
    if (trained) {
      for (PyObject* name : {hooks_name, post_name}) {
        py::object hooks = py::reinterpret_steal<py::object>(PyObject_GetAttr(obj, name));
        if (!hooks) throw py::error_already_set();
        const int set = name == post_name ? hooks.ptr() != Py_None : PyObject_IsTrue(hooks.ptr());
        if (set < 0) throw py::error_already_set();
        if (set) return false;
      }
    }
    const at::Tensor& alias = THPVariable_Unpack(d);
    if (alias.data_ptr() != t.data_ptr() || alias.scalar_type() != t.scalar_type() ||
        alias.sizes() != t.sizes() || alias.strides() != t.strides()) {
      return false;
    }
  }
  return true;
}

// --- I: the input gradients, and each deferred layer's output gradient ------
//
// deferred.backward_input's engine call, made here: what the Python call
// costs beside the engine (its argument parsing, a Python object for each of
// the stage's parameters, the loop that hands each entry its gradient) is
// felt on small transformer stages (docs/benchmarks.md), and on ranks that
// share one interpreter the thread holds the GIL for all of it, next to
// another rank's forward. Same engine entry as torch.autograd's (Engine::execute
// with output edges, accumulate_grad false), the same edges, and the same
// context stashed for compiled backwards on device threads.

using torch::autograd::Edge;
using torch::autograd::Node;

// An edge whose node is a Python autograd.Function's: the Python call
// handles that backward (THPFunction's layout differs across torch versions).
struct PythonNode {};

// A root: a tensor (its grad_fn, or its accumulator for a leaf) or a
// GradientEdge (node, output_nr, ...) of a C++ node.
Edge root_edge(PyObject* obj) {
  if (THPVariable_Check(obj)) {
    Edge e = torch::autograd::impl::gradient_edge(THPVariable_Unpack(obj));
    if (!e.is_valid()) throw py::value_error("backward_input: a root needs no gradient and has no grad_fn");
    return e;
  }
  if (!PyTuple_Check(obj) || PyTuple_GET_SIZE(obj) < 2) {
    throw py::type_error("backward_input: a root or an edge is a tensor or a GradientEdge");
  }
  PyObject* node = PyTuple_GET_ITEM(obj, 0);
  if (!torch::autograd::THPCppFunction_Check(node)) throw PythonNode{};
  const auto nr = PyLong_AsUnsignedLong(PyTuple_GET_ITEM(obj, 1));
  if (PyErr_Occurred()) throw py::error_already_set();
  Edge e;
  e.function = reinterpret_cast<torch::autograd::THPCppFunction*>(node)->cdata;
  e.input_nr = static_cast<std::uint32_t>(nr);
  return e;
}

// Where a tensor's gradient is captured, as torch.autograd.grad finds it:
// its grad_fn, or the accumulator a leaf already has; an invalid edge where
// it has neither (nothing can reach it: its gradient is None).
Edge output_edge(const at::Tensor& t) {
  if (!t.requires_grad()) throw py::value_error("backward_input: an input or parameter does not require grad");
  if (const auto& fn = t.grad_fn()) return Edge(fn, t.output_nr());
  auto acc = torch::autograd::impl::try_get_grad_accumulator(t);
  return acc ? Edge(std::move(acc), 0) : Edge();
}

py::object wrap_or_none(at::Tensor t) {
  if (!t.defined()) return py::none();
  return py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(t)));
}

// torch.autograd's own call stashes the caller's contextvars for compiled
// backwards that run on the engine's device threads; done alike here.
struct StashedContext {
  StashedContext() {
    // Kept for the life of the process (null where this torch has no such call).
    static PyObject* stash = lookup("_stash_obj_in_tls");
    static PyObject* remove = lookup("_remove_obj_from_tls");
    if (stash == nullptr || remove == nullptr) return;
    py::object ctx = py::reinterpret_steal<py::object>(PyContext_CopyCurrent());
    if (!ctx) throw py::error_already_set();
    py::reinterpret_borrow<py::object>(stash)("context", ctx);
    remove_ = remove;
  }
  ~StashedContext() {
    if (remove_ == nullptr) return;
    PyObject* r = PyObject_CallFunction(remove_, "s", "context");
    if (r == nullptr) PyErr_Clear();  // nothing to report from a destructor
    Py_XDECREF(r);
  }
  static PyObject* lookup(const char* name) {
    py::module_ torch_c = py::module_::import("torch._C");
    return py::hasattr(torch_c, name) ? py::object(torch_c.attr(name)).release().ptr() : nullptr;
  }
  PyObject* remove_ = nullptr;
};

using Blocks = std::vector<std::shared_ptr<Calls>>;

py::object backward_input_native(const py::tuple& roots, const py::tuple& grads, const py::list& inputs,
                                 const py::list& params, const py::list& entries, const py::list& edges,
                                 const Blocks& blocks, bool keep_graph);

// None where an edge's node is a Python autograd.Function's (the caller then
// makes torch's own call); else (input gradients, reached parameters, entries).
py::object backward_input(const py::tuple& roots, const py::tuple& grads, const py::list& inputs,
                          const py::list& params, const py::list& entries, const py::list& edges,
                          const Blocks& blocks, bool keep_graph) {
  if (roots.size() != grads.size()) throw py::value_error("backward_input: one gradient per root");
  if (entries.size() != edges.size()) throw py::value_error("backward_input: one edge per entry");
  for (const auto& block : blocks) {
    if (!block) throw py::type_error("backward_input: a block is None");
    if (!block->edges.empty() && block->edges.size() != block->calls.size()) {
      throw py::value_error("backward_input: a block's calls have gradients already");
    }
  }
  try {
    return backward_input_native(roots, grads, inputs, params, entries, edges, blocks, keep_graph);
  } catch (PythonNode&) {
    return py::none();  // a Python node among the edges: the Python call
  }
}

py::object backward_input_native(const py::tuple& roots, const py::tuple& grads, const py::list& inputs,
                                 const py::list& params, const py::list& entries, const py::list& edges,
                                 const Blocks& blocks, bool keep_graph) {
  torch::autograd::edge_list root_edges;
  torch::autograd::variable_list root_grads;
  for (std::size_t i = 0; i < roots.size(); ++i) {
    root_edges.push_back(root_edge(roots[i].ptr()));
    if (!THPVariable_Check(grads[i].ptr())) throw py::type_error("backward_input: a root's gradient is a tensor");
    root_grads.push_back(THPVariable_Unpack(grads[i].ptr()));
  }
  // Captured in this order: inputs, parameters, entries; unreachable ones
  // (an invalid edge) are left out of the engine's list.
  const std::size_t n_in = inputs.size(), n_par = params.size(), n = n_in + n_par + edges.size();
  std::vector<std::int64_t> slot(n, -1);
  torch::autograd::edge_list outputs;
  outputs.reserve(n);
  for (std::size_t i = 0; i < n; ++i) {
    PyObject* obj = i < n_in ? inputs[i].ptr() : i < n_in + n_par ? params[i - n_in].ptr()
                                                                    : edges[i - n_in - n_par].ptr();
    Edge e;
    if (i < n_in + n_par) {
      if (!THPVariable_Check(obj)) throw py::type_error("backward_input: inputs and parameters are tensors");
      const at::Tensor& t = THPVariable_Unpack(obj);
      if (i >= n_in && !t.requires_grad()) continue;  // a frozen parameter: nothing to capture
      e = output_edge(t);
    } else {
      e = root_edge(obj);
    }
    if (!e.is_valid()) continue;
    slot[i] = static_cast<std::int64_t>(outputs.size());
    outputs.push_back(std::move(e));
  }
  // Then the blocks' calls, each block's edges in order (all valid: made by the forward).
  std::vector<std::size_t> block_first;
  for (const auto& block : blocks) {
    block_first.push_back(outputs.size());
    outputs.insert(outputs.end(), block->edges.begin(), block->edges.end());
  }
  torch::autograd::variable_list got;
  {
    StashedContext stashed;
    try {
      py::gil_scoped_release nogil;
      got = torch::autograd::Engine::get_default_engine().execute(root_edges, root_grads, keep_graph,
                                                                  /*create_graph=*/false,
                                                                  /*accumulate_grad=*/false, outputs);
    } catch (python_error& e) {
      e.restore();  // a Python hook's exception, as itself
      throw py::error_already_set();
    }
  }
  auto take = [&](std::size_t i) -> at::Tensor { return slot[i] < 0 ? at::Tensor() : got[slot[i]]; };
  py::list input_grads(n_in);
  for (std::size_t i = 0; i < n_in; ++i) input_grads[i] = wrap_or_none(take(i));
  py::list param_grads;  // (index, gradient) where one reached the parameter through autograd
  for (std::size_t i = 0; i < n_par; ++i) {
    at::Tensor g = take(n_in + i);
    if (g.defined()) param_grads.append(py::make_tuple(i, wrap_or_none(std::move(g))));
  }
  static PyObject* g_name = PyUnicode_InternFromString("g");
  py::list reached;  // the entries whose output a gradient reached, each given it
  for (std::size_t i = 0; i < edges.size(); ++i) {
    at::Tensor g = take(n_in + n_par + i);
    if (!g.defined()) continue;
    py::object entry = entries[i];
    if (PyObject_SetAttr(entry.ptr(), g_name, wrap_or_none(std::move(g)).ptr()) < 0) throw py::error_already_set();
    reached.append(entry);
  }
  // Each block's calls get their gradients; calls no gradient reached go, as
  // unreached entries do.
  for (std::size_t b = 0; b < blocks.size(); ++b) {
    Calls& block = *blocks[b];
    if (block.edges.empty()) continue;
    std::vector<std::optional<at::Tensor>> block_grads(got.begin() + block_first[b],
                                                       got.begin() + block_first[b] + block.edges.size());
    fill_block(block, block_grads);
  }
  return py::make_tuple(input_grads, param_grads, reached);
}

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
        const auto fields = py::len(edge.attr("_fields"));
        if (fields < 2) throw py::type_error("configure_defer: GradientEdge has (node, output_nr) first");
        entry_type = entry.inc_ref().ptr();
        edge_type = reinterpret_cast<PyTypeObject*>(edge.inc_ref().ptr());
        edge_fields = static_cast<Py_ssize_t>(fields);
      },
      py::arg("entry"), py::arg("edge"),
      "The Entry class and GradientEdge type the deferring forwards build (once per process).");
  m.def("set_pending", &set_pending, py::arg("entries"), py::arg("edges"), py::arg("block") = py::none(),
        "This thread's deferring forwards append to these lists, and calls with a native WeightLayer "
        "to `block` (a Calls) where given (None, None: they run the Python path).");
  m.def(
      "defer_call",
      [](Calls& block, std::shared_ptr<Layer> layer, const at::Tensor& kept, const at::Tensor& out) {
        if (!layer) throw py::type_error("defer_call: the layer is None");
        if (!out.requires_grad()) throw py::value_error("defer_call: the output needs a gradient edge");
        add_call(block, std::move(layer), kept, out);
      },
      py::arg("block"), py::arg("layer"), py::arg("kept"), py::arg("out"),
      "Adds a call to a block, as the native deferring forward adds one (the Python forward's "
      "calls of a layer with a native WeightLayer, so a block keeps a step's calls in order).");
  m.def(
      "block_edges",
      [](const Calls& block) {
        py::list out;
        for (const auto& edge : block.edges) out.append(python_edge(edge));
        return out;
      },
      py::arg("block"), "The gradient edges of a block's waiting calls (GradientEdges), in order.");
  m.def("fill_block", &fill_block, py::arg("block"), py::arg("grads"),
        "Gives a block's waiting calls their gradients (None: the call goes), in the order of block_edges.");
  py::class_<DeferringForward>(m, "DeferringForward")
      .def(py::init<py::object>(), py::arg("slow"))
      .def_property_readonly("slow", &DeferringForward::slow)
      .def_property_readonly("planned", &DeferringForward::planned)
      .def("set_plan", &DeferringForward::set_plan, py::arg("kind"), py::arg("params_dict"), py::arg("names"),
           py::arg("params"), py::arg("detached"), py::arg("aliases"), py::arg("ints"), py::arg("eps"), py::arg("rule"),
           py::arg("targets"), py::arg("meta"), py::arg("layer"), py::arg("native"))
      .def("clear_plan", &DeferringForward::clear_plan)
      .def("__call__", &DeferringForward::call);
  m.def("plan_holds", &plan_holds, py::arg("params_dict"), py::arg("names"), py::arg("params"),
        py::arg("targets"), py::arg("detached"),
        "Whether a kept deferring plan still fits its layer's parameters (deferred._Forward._holds).");
  m.def("backward_input", &backward_input, py::arg("roots"), py::arg("grads"), py::arg("inputs"),
        py::arg("params"), py::arg("entries"), py::arg("edges"), py::arg("blocks"), py::arg("keep_graph"),
        "I of a deferring stage: one engine call from roots (tensors or GradientEdges) with their "
        "gradients; returns (gradients of inputs, [(index, gradient) of parameters autograd "
        "reached; those that want no gradient are skipped], the entries whose output a gradient reached, each given it as .g; the blocks' calls "
        "get theirs, or go), with the GIL released while the engine runs; None where an edge's node is "
        "a Python Function's.");
}

}  // namespace fastpipe
