// W of deferred weight gradients (fastpipe/runtime/deferred.py), in C++.
//
// Why native: W is a handful of aten ops per layer. Issued from Python, each
// pays the binding's argument parsing and, where ranks are threads of one
// interpreter (local mode), hands the GIL to the other ranks' threads and
// waits to get it back; here the whole W of a microbatch runs with the GIL
// released. The ops are those of deferred.py's rules, so both paths agree
// bit for bit.
//
// An item is one layer call: (kind, targets, kept, g, tensors, ints, eps).
// A group is the items of one layer; Linear groups are gathered into one GEMM
// when `fuse` is set.
#include "wgrad.h"

#include <cstdint>
#include <optional>
#include <vector>

namespace fastpipe {
namespace {

namespace py = pybind11;

// deferred.py's native rule kinds.
enum Rule : std::int64_t { kLinear = 0, kLayerNorm = 1, kEmbedding = 2 };

struct Item {
  std::int64_t kind;
  std::vector<std::optional<at::Tensor>> targets;  // the parameters; nullopt: no gradient wanted
  std::vector<at::Tensor> kept;                    // what the forward kept
  at::Tensor g;                                    // the output's gradient
  std::vector<std::optional<at::Tensor>> tensors;  // LayerNorm: its (detached) weight and bias
  std::vector<std::int64_t> ints;                  // LayerNorm: normalized shape; Embedding: rows, pad, freq
  double eps;
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

at::Tensor rows2d(const at::Tensor& t) { return t.reshape({-1, t.size(-1)}); }

// g^T x and sum(g) over the rows; fused: straight into an existing .grad of
// the computation's dtype (addmm_), as deferred._linear_grads.
void linear(const std::vector<const Item*>& items, bool fuse) {
  const auto& targets = items.front()->targets;
  auto run = [&](const at::Tensor& g, const at::Tensor& x, bool fused) {
    if (targets[0].has_value()) {
      const at::Tensor& w = *targets[0];
      const at::Tensor& grad = w.grad();
      if (fused && grad.defined() && grad.scalar_type() == g.scalar_type() &&
          x.scalar_type() == g.scalar_type() && grad.is_contiguous()) {
        w.mutable_grad().addmm_(g.t(), x);
      } else {
        accumulate(w, at::mm(g.t(), x));
      }
    }
    if (targets.size() > 1 && targets[1].has_value()) accumulate(*targets[1], g.sum(0));
  };
  if (!fuse) {
    for (const Item* it : items) run(rows2d(it->g), it->kept[0], false);
    return;
  }
  if (items.size() == 1) {
    run(rows2d(items[0]->g), items[0]->kept[0], true);
    return;
  }
  std::vector<at::Tensor> gs, xs;
  for (const Item* it : items) {
    gs.push_back(rows2d(it->g));
    xs.push_back(it->kept[0]);
  }
  run(at::cat(gs), at::cat(xs), true);
}

// deferred.LayerNormRule.weight_grads: the statistics again, then ATen's own
// backward for the weight and bias only.
void layer_norm(const Item& it) {
  at::Tensor x = it.kept[0];
  const at::Tensor& g = it.g;
  if (g.scalar_type() != x.scalar_type() && g.scalar_type() == at::kFloat) x = x.to(at::kFloat);
  std::optional<at::Tensor> w = it.tensors[0], b = it.tensors[1];
  if (w.has_value() && w->scalar_type() != x.scalar_type() && x.scalar_type() == at::kFloat) {
    w = w->to(at::kFloat);
    if (b.has_value()) b = b->to(at::kFloat);
  }
  auto [out, mean, rstd] = at::native_layer_norm(x, it.ints, w, b, it.eps);
  bool want_w = it.targets[0].has_value(), want_b = it.targets[1].has_value();
  auto grads = at::native_layer_norm_backward(g, x, it.ints, mean, rstd, w, b, {false, want_w, want_b});
  if (want_w) accumulate(*it.targets[0], std::get<1>(grads));
  if (want_b) accumulate(*it.targets[1], std::get<2>(grads));
}

// deferred.EmbeddingRule: autograd's dense table per call, or (fused) the
// rows of every call added into an existing .grad with one index_add_.
void embedding(const std::vector<const Item*>& items, bool fuse) {
  const Item& first = *items.front();
  if (!first.targets[0].has_value()) return;
  const at::Tensor& w = *first.targets[0];
  const std::int64_t num = first.ints[0], pad = first.ints[1];
  const bool freq = first.ints[2] != 0;
  if (!fuse || freq) {
    for (const Item* it : items)
      accumulate(w, at::embedding_dense_backward(it->g, it->kept[0], num, pad, freq));
    return;
  }
  std::vector<at::Tensor> ids, gs;
  for (const Item* it : items) {
    ids.push_back(it->kept[0].reshape({-1}));
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

// W of a microbatch's (or several microbatches') deferred layers.
void weight_grads(const std::vector<std::vector<Item>>& groups, bool fuse) {
  py::gil_scoped_release nogil;
  at::NoGradGuard no_grad;
  for (const auto& group : groups) {
    if (group.empty()) continue;
    switch (group.front().kind) {
      case kLinear: {
        std::vector<const Item*> items;
        for (const Item& it : group) items.push_back(&it);
        linear(items, fuse);
        break;
      }
      case kLayerNorm:
        for (const Item& it : group) layer_norm(it);
        break;
      case kEmbedding: {
        std::vector<const Item*> items;
        for (const Item& it : group) items.push_back(&it);
        embedding(items, fuse);
        break;
      }
      default:
        throw py::value_error("weight_grads: unknown rule kind " + std::to_string(group.front().kind));
    }
  }
}

}  // namespace

void register_wgrad(py::module_& m) {
  py::class_<Item>(m, "WeightItem")
      .def(py::init<std::int64_t, std::vector<std::optional<at::Tensor>>, std::vector<at::Tensor>, at::Tensor,
                    std::vector<std::optional<at::Tensor>>, std::vector<std::int64_t>, double>(),
           py::arg("kind"), py::arg("targets"), py::arg("kept"), py::arg("g"), py::arg("tensors"), py::arg("ints"),
           py::arg("eps"));
  m.def("weight_grads", &weight_grads, py::arg("groups"), py::arg("fuse"),
        "W of deferred layers (groups of one layer's items), with the GIL released.");
}

}  // namespace fastpipe
