// W of deferred weight gradients (fastpipe/runtime/deferred.py), in C++.
//
// Why native: W is a handful of aten ops per layer. Issued from Python, each
// pays the binding's argument parsing and, where ranks are threads of one
// interpreter (local mode), hands the GIL to the other ranks' threads and
// waits to get it back; here the whole W of a microbatch runs with the GIL
// released. The ops are those of deferred.py's rules, so both paths agree
// bit for bit.
//
// A WeightLayer is what a layer's W needs that does not change from call to
// call within a step (kind, target parameters, LayerNorm's weight and bias,
// shapes): deferred.py makes one per layer and step, so a call's work is just
// (layer, kept, g) and W passes three flat lists. Calls of one layer form a
// group (first-seen order); Linear (and Conv1D) and Embedding groups are
// gathered into one GEMM / index_add_ when `fuse` is set.
#include "wgrad.h"

#include <algorithm>
#include <torch/csrc/autograd/python_variable.h>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <optional>
#include <vector>

namespace fastpipe {
namespace {

namespace py = pybind11;


// Two WeightLayers that write the same parameters the same way: their calls
// form one group (a chain stage makes a WeightLayer per call; those of one
// Linear must still be gathered into one GEMM).
bool same_work(const Layer& a, const Layer& b) {
  auto same = [](const std::vector<std::optional<at::Tensor>>& x, const std::vector<std::optional<at::Tensor>>& y,
                 bool by_data) {
    if (x.size() != y.size()) return false;
    for (std::size_t i = 0; i < x.size(); ++i) {
      if (x[i].has_value() != y[i].has_value()) return false;
      if (!x[i]) continue;
      if (by_data ? x[i]->data_ptr() != y[i]->data_ptr() || x[i]->sizes() != y[i]->sizes()
                  : !x[i]->is_same(*y[i])) {
        return false;
      }
    }
    return true;
  };
  // targets: the very parameters; tensors (LayerNorm's detached weight and
  // bias): aliases of the same memory.
  return a.kind == b.kind && a.ints == b.ints && a.eps == b.eps && same(a.targets, b.targets, false) &&
         same(a.tensors, b.tensors, true);
}

struct Item {  // one call
  const Layer* layer;
  at::Tensor kept;  // what the forward kept (the input; Embedding: the ids)
  at::Tensor g;     // the output's gradient
};

// AccumulateGrad's two cases: store a fresh gradient (in the parameter's
// dtype), or add it in place.
void accumulate(const at::Tensor& p, const at::Tensor& fresh) {
  at::Tensor& grad = p.mutable_grad();
  if (!grad.defined()) {
    grad = fresh.scalar_type() == p.scalar_type() ? fresh : fresh.to(p.scalar_type());
  } else {
    grad.add_(fresh);
  }
}

// Already 2-D (a chain stage's tensors, most Linears' inputs): as it is,
// without a reshape through the dispatcher (W of a narrow stage makes
// hundreds of these a step).
at::Tensor rows2d(const at::Tensor& t) { return t.dim() == 2 ? t : t.reshape({-1, t.size(-1)}); }

// g^T x (a Conv1D's weight, stored transposed: x^T g) and sum(g) over the
// rows; fused: straight into an existing .grad of the computation's dtype
// (addmm_), as deferred._linear_grads and Conv1DRule.gather.
void linear(const std::vector<const Item*>& items, bool fuse, bool transposed) {
  const auto& targets = items.front()->layer->targets;
  auto run = [&](const at::Tensor& g, const at::Tensor& x, bool fused) {
    if (targets[0].has_value()) {
      const at::Tensor& w = *targets[0];
      const at::Tensor& grad = w.grad();
      const at::Tensor a = transposed ? x.t() : g.t();
      const at::Tensor& b = transposed ? g : x;
      if (fused && grad.defined() && grad.scalar_type() == g.scalar_type() &&
          x.scalar_type() == g.scalar_type() && grad.is_contiguous()) {
        w.mutable_grad().addmm_(a, b);
      } else {
        accumulate(w, at::mm(a, b));
      }
    }
    if (targets.size() > 1 && targets[1].has_value()) accumulate(*targets[1], g.sum(0));
  };
  if (!fuse) {
    for (const Item* it : items) run(rows2d(it->g), rows2d(it->kept), false);
    return;
  }
  if (items.size() == 1) {
    run(rows2d(items[0]->g), rows2d(items[0]->kept), true);
    return;
  }
  std::vector<at::Tensor> gs, xs;
  for (const Item* it : items) {
    gs.push_back(rows2d(it->g));
    xs.push_back(rows2d(it->kept));
  }
  run(at::cat(gs), at::cat(xs), true);
}

// deferred.LayerNormRule.weight_grads: the statistics again, then ATen's own
// backward for the weight and bias only.
void layer_norm(const Item& it) {
  const Layer& layer = *it.layer;
  at::Tensor x = it.kept;
  const at::Tensor& g = it.g;
  if (g.scalar_type() != x.scalar_type() && g.scalar_type() == at::kFloat) x = x.to(at::kFloat);
  std::optional<at::Tensor> w = layer.tensors[0], b = layer.tensors[1];
  if (w.has_value() && w->scalar_type() != x.scalar_type() && x.scalar_type() == at::kFloat) {
    w = w->to(at::kFloat);
    if (b.has_value()) b = b->to(at::kFloat);
  }
  auto [out, mean, rstd] = at::native_layer_norm(x, layer.ints, w, b, layer.eps);
  bool want_w = layer.targets[0].has_value(), want_b = layer.targets[1].has_value();
  auto grads =
      at::native_layer_norm_backward(g, x, layer.ints, mean, rstd, w, b, {false, want_w, want_b});
  if (want_w) accumulate(*layer.targets[0], std::get<1>(grads));
  if (want_b) accumulate(*layer.targets[1], std::get<2>(grads));
}

// deferred.EmbeddingRule: autograd's dense table per call, or (fused) the
// rows of every call added into an existing .grad with one index_add_.
void embedding(const std::vector<const Item*>& items, bool fuse) {
  const Layer& layer = *items.front()->layer;
  if (!layer.targets[0].has_value()) return;
  const at::Tensor& w = *layer.targets[0];
  const std::int64_t num = layer.ints[0], pad = layer.ints[1];
  const bool freq = layer.ints[2] != 0;
  if (!fuse || freq) {
    for (const Item* it : items)
      accumulate(w, at::embedding_dense_backward(it->g, it->kept, num, pad, freq));
    return;
  }
  std::vector<at::Tensor> ids, gs;
  for (const Item* it : items) {
    ids.push_back(it->kept.reshape({-1}));
    gs.push_back(rows2d(it->g));
  }
  at::Tensor id = ids.size() == 1 ? ids[0] : at::cat(ids);
  at::Tensor g = gs.size() == 1 ? gs[0] : at::cat(gs);
  const at::Tensor& grad = w.grad();
  if (!grad.defined() || grad.scalar_type() != g.scalar_type() || !grad.is_contiguous() ||
      (grad.is_cuda() && at::globalContext().deterministicAlgorithms())) {
    accumulate(w, at::embedding_dense_backward(g, id, num, pad, false));
    return;
  }
  if (pad >= 0) g = g.masked_fill(id.eq(pad).unsqueeze(1), 0);
  w.mutable_grad().index_add_(0, id, g);
}

// W of a microbatch's (or several microbatches') deferred layers: the calls
// of `blocks` (in order), then call i of the flat lists, (layers[i], kept[i],
// gs[i]).
void weight_grads(const std::vector<std::shared_ptr<Layer>>& layers, const std::vector<at::Tensor>& kept,
                  const std::vector<at::Tensor>& gs, bool fuse, const std::vector<std::shared_ptr<Calls>>& blocks) {
  if (kept.size() != layers.size() || gs.size() != layers.size()) {
    throw py::value_error("weight_grads: " + std::to_string(layers.size()) + " layers, " +
                          std::to_string(kept.size()) + " kept tensors and " + std::to_string(gs.size()) +
                          " gradients; they must match");
  }
  for (const auto& block : blocks) {
    if (!block) throw py::type_error("weight_grads: a block is None");
  }
  py::gil_scoped_release nogil;
  at::NoGradGuard no_grad;
  std::vector<Item> items;
  std::size_t n = layers.size();
  for (const auto& block : blocks) n += block->calls.size();
  items.reserve(n);
  for (const auto& block : blocks) {
    for (const Call& c : block->calls) items.push_back({c.layer.get(), c.kept, c.g});
  }
  for (std::size_t i = 0; i < layers.size(); ++i) items.push_back({layers[i].get(), kept[i], gs[i]});
  // Groups in first-seen order: a layer's calls together.
  std::vector<std::vector<const Item*>> groups;
  for (const Item& it : items) {
    auto found = std::find_if(groups.begin(), groups.end(), [&](const auto& group) {
      const Layer* first = group.front()->layer;
      return first == it.layer || same_work(*first, *it.layer);
    });
    if (found == groups.end()) {
      groups.push_back({&it});
    } else {
      found->push_back(&it);
    }
  }
  for (const auto& group : groups) {
    switch (group.front()->layer->kind) {
      case kLinear:
      case kConv1D:
        linear(group, fuse, group.front()->layer->kind == kConv1D);
        break;
      case kLayerNorm:
        for (const Item* it : group) layer_norm(*it);
        break;
      case kEmbedding:
        embedding(group, fuse);
        break;
      default:
        throw std::invalid_argument("weight_grads: unknown rule kind " + std::to_string(group.front()->layer->kind));
    }
  }
  // What W read goes now, still without the GIL: freed later from Python,
  // each of these tensors would be a free with the GIL held, beside another
  // rank's forward in local mode.
  groups.clear();
  items.clear();
  for (const auto& block : blocks) {
    block->calls.clear();
    block->edges.clear();
  }
}

// The rows a call adds to a gathered W, as the built-in rules count them
// (Linear: input rows; Embedding: ids, unless frequency-scaled; 0: not
// row-wise). Clears `gather` where the layer computes in another dtype than
// its parameters' (autocast: deferred.WeightQueue._rows says why).
std::int64_t call_rows(const Layer& layer, const at::Tensor& kept, const at::Tensor& g, bool& gather) {
  std::int64_t r = 0;
  if (layer.kind == kLinear || layer.kind == kConv1D) {
    r = kept.size(-1) > 0 ? kept.numel() / kept.size(-1) : 0;
  } else if (layer.kind == kEmbedding && layer.ints.size() == 3 && layer.ints[2] == 0) {
    r = kept.numel();
  } else {
    return 0;
  }
  for (const auto& p : layer.targets) {
    if (p.has_value() && p->scalar_type() != g.scalar_type()) gather = false;
  }
  return r;
}

// Whether `t` reads memory in one of `ranges` (storage address ranges: live
// storages do not overlap, so its first byte says which).
bool within(const at::Tensor& t, const std::vector<std::pair<std::uintptr_t, std::uintptr_t>>& ranges) {
  const auto p = reinterpret_cast<std::uintptr_t>(t.data_ptr());
  for (const auto& [lo, hi] : ranges) {
    if (lo <= p && p < hi) return true;
  }
  return false;
}

// WeightQueue.add's look at one microbatch's entries (deferred.py), made
// here: rows, dtypes and whether a tensor reads a received buffer,
// read per entry, for dozens of entries a microbatch on a transformer stage.
// Rows are counted by call_rows. None where an entry has no native
// WeightLayer: its rule says in Python.
py::object scan_entries(const py::list& entries, const std::vector<std::pair<std::uintptr_t, std::uintptr_t>>& borrowed) {
  static PyObject* native_name = PyUnicode_InternFromString("native");
  static PyObject* saved_name = PyUnicode_InternFromString("saved");
  static PyObject* g_name = PyUnicode_InternFromString("g");
  auto attr = [](const py::handle& obj, PyObject* name) {
    py::object out = py::reinterpret_steal<py::object>(PyObject_GetAttr(obj.ptr(), name));
    if (!out) throw py::error_already_set();
    return out;
  };
  std::int64_t rows = 0;
  bool gather = true;
  py::list touched;
  for (std::size_t i = 0; i < entries.size(); ++i) {
    const py::handle e = entries[i];
    const py::object native = attr(e, native_name);
    if (native.is_none()) return py::none();
    const Layer& layer = *native.cast<std::shared_ptr<Layer>>();
    const py::object saved = attr(e, saved_name), g_obj = attr(e, g_name);
    if (!PyTuple_Check(saved.ptr()) || PyTuple_GET_SIZE(saved.ptr()) == 0 || !THPVariable_Check(g_obj.ptr())) {
      throw py::type_error("scan_entries: an entry's saved is a tuple of tensors and its g a tensor");
    }
    const at::Tensor& g = THPVariable_Unpack(g_obj.ptr());
    bool reads = within(g, borrowed);
    for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(saved.ptr()); ++j) {
      PyObject* t = PyTuple_GET_ITEM(saved.ptr(), j);
      if (!THPVariable_Check(t)) throw py::type_error("scan_entries: an entry's saved is a tuple of tensors");
      const at::Tensor& kept = THPVariable_Unpack(t);
      reads = reads || within(kept, borrowed);
    }
    if (reads) touched.append(i);
    const at::Tensor& first = THPVariable_Unpack(PyTuple_GET_ITEM(saved.ptr(), 0));
    rows = std::max(rows, call_rows(layer, first, g, gather));
  }
  return py::make_tuple(gather && rows > 0 ? py::object(py::int_(rows)) : py::none(), touched);
}

}  // namespace

void register_wgrad(py::module_& m) {
  py::class_<Layer, std::shared_ptr<Layer>>(m, "WeightLayer")
      .def(py::init([](std::int64_t kind, std::vector<std::optional<at::Tensor>> targets,
                       std::vector<std::optional<at::Tensor>> tensors, std::vector<std::int64_t> ints, double eps) {
             if (kind < kLinear || kind > kConv1D || kind == kRMSNorm) {
               throw py::value_error("WeightLayer: unknown rule kind " + std::to_string(kind) +
                                     " (0 Linear, 1 LayerNorm, 2 Embedding, 4 Conv1D)");
             }
             const bool ok = kind == kLinear || kind == kConv1D ? targets.size() == 1 || targets.size() == 2
                             : kind == kLayerNorm ? targets.size() == 2 && tensors.size() == 2
                                                  : targets.size() == 1 && ints.size() == 3;
             if (!ok) {
               throw py::value_error("WeightLayer: kind " + std::to_string(kind) + " got " +
                                     std::to_string(targets.size()) + " targets, " +
                                     std::to_string(tensors.size()) + " tensors and " +
                                     std::to_string(ints.size()) + " ints");
             }
             return std::make_shared<Layer>(
                 Layer{kind, std::move(targets), std::move(tensors), std::move(ints), eps});
           }),
           py::arg("kind"), py::arg("targets"), py::arg("tensors"), py::arg("ints"), py::arg("eps"));
  m.def("weight_grads", &weight_grads, py::arg("layers"), py::arg("kept"), py::arg("gs"), py::arg("fuse"),
        py::arg("blocks") = std::vector<std::shared_ptr<Calls>>{},
        "W of deferred layers: the calls of `blocks`, then call i is (layers[i], kept[i], gs[i]); "
        "with the GIL released. The blocks are empty afterwards.");
  py::class_<Calls, std::shared_ptr<Calls>>(m, "Calls")
      .def(py::init<>())
      .def("__len__", [](const Calls& c) { return c.calls.size(); })
      .def_property_readonly(
          "waiting", [](const Calls& c) { return c.edges.size(); },
          "Calls whose output gradient I has not filled in yet.")
      .def_property_readonly(
          "grads",
          [](const Calls& c) {
            std::vector<std::optional<at::Tensor>> out;
            for (const Call& call : c.calls) {
              out.push_back(call.g.defined() ? std::optional<at::Tensor>(call.g) : std::nullopt);
            }
            return out;
          },
          "Each call's output gradient (None until I has run), in order.")
      .def(
          "scan",
          [](const Calls& c, const std::vector<std::pair<std::uintptr_t, std::uintptr_t>>& borrowed) {
            // WeightQueue.add's look at them, as scan_entries's.
            std::int64_t rows = 0;
            bool gather = true, reads = false;
            for (const Call& call : c.calls) {
              reads = reads || within(call.kept, borrowed) || within(call.g, borrowed);
              rows = std::max(rows, call_rows(*call.layer, call.kept, call.g, gather));
            }
            return py::make_tuple(gather && rows > 0 ? py::object(py::int_(rows)) : py::none(), reads);
          },
          py::arg("borrowed"),
          "(rows or None, whether a tensor reads `borrowed` memory) of these calls.")
      .def(
          "own",
          [](Calls& c, const std::vector<std::pair<std::uintptr_t, std::uintptr_t>>& borrowed) {
            for (Call& call : c.calls) {
              if (within(call.kept, borrowed)) call.kept = call.kept.clone();
              if (within(call.g, borrowed)) call.g = call.g.clone();
            }
          },
          py::arg("borrowed"), "Clones what reads `borrowed` memory (a buffer handed back before W runs).")
      .def_property_readonly(
          "limit_rows",
          [](const Calls& c) -> py::object {
            // WeightQueue._limit's: the rows whose kept bytes match the
            // smallest weight matrix of these calls, out*in // (out+in).
            std::int64_t best = -1;
            bool gather = true;
            for (const Call& call : c.calls) {
              const auto& w = call.layer->targets.front();
              if (!w.has_value() || w->dim() != 2 || call_rows(*call.layer, call.kept, call.g, gather) == 0) continue;
              const std::int64_t o = w->size(0), i = w->size(1);
              const std::int64_t limit = o + i > 0 ? o * i / (o + i) : 0;
              best = best < 0 ? limit : std::min(best, limit);
            }
            return best < 0 ? py::none() : py::object(py::int_(best));
          })
      .def_property_readonly(
          "weights",
          [](const Calls& c) {
            std::vector<std::optional<at::Tensor>> out;
            for (const Call& call : c.calls) out.push_back(call.layer->targets.front());
            return out;
          },
          "Each call's weight (None where it wants no gradient), in order.")
      .def_property_readonly(
          "spans",
          [](const Calls& c) {
            std::vector<std::pair<std::uintptr_t, std::int64_t>> out;
            for (const Call& call : c.calls) {
              for (const at::Tensor* t : {&call.kept, &call.g}) {
                if (t->defined()) {
                  out.emplace_back(reinterpret_cast<std::uintptr_t>(t->data_ptr()),
                                   static_cast<std::int64_t>(t->nbytes()));
                }
              }
            }
            return out;
          },
          "(address, bytes) of each tensor W reads: the kept inputs and, once I has run, "
          "the output gradients (Pending.spans).");
  m.def("scan_entries", &scan_entries, py::arg("entries"), py::arg("borrowed"),
        "(rows or None, indices of entries reading borrowed memory) of one microbatch's "
        "deferred entries; None where one has no native WeightLayer.");
}

}  // namespace fastpipe
