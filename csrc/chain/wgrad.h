// Deferred weight gradients in C++ (wgrad.cpp): the W of
// fastpipe/runtime/deferred.py's built-in rules, run with the GIL released.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

namespace fastpipe {

// The built-in rules' kinds, as weight_rules.py numbers them (`native`,
// `_fast`): W in wgrad.cpp knows all but RMSNorm, the deferring forward in
// defer.cpp all five. kConv1D is Hugging Face's Conv1D: a Linear whose
// weight is stored transposed, (in, out).
enum RuleKind : std::int64_t { kLinear = 0, kLayerNorm = 1, kEmbedding = 2, kRMSNorm = 3, kConv1D = 4 };

// What a layer's W needs that does not change from call to call within a
// step (a `fastpipe._chain.WeightLayer`; made once per layer and step).
struct Layer {
  std::int64_t kind;
  std::vector<std::optional<at::Tensor>> targets;  // the parameters; nullopt: no gradient wanted
  std::vector<std::optional<at::Tensor>> tensors;  // LayerNorm: its (detached) weight and bias
  std::vector<std::int64_t> ints;                  // LayerNorm: normalized shape; Embedding: rows, pad, freq
  double eps;
};

// One call's W: its layer, what the forward kept (the input; Embedding: the
// ids) and the output's gradient.
struct Call {
  std::shared_ptr<Layer> layer;
  at::Tensor kept;
  at::Tensor g;
};

// A microbatch's calls made in C++ (`fastpipe._chain.Calls`: a chain stage's I,
// or the deferring forwards of defer.cpp): Python holds one object for them,
// not an entry per call, and W reads them here. `edges` are the outputs'
// gradient edges of calls whose g I has not filled in yet (one per call, in
// order, while any are left; empty once I has run or for a chain's calls).
struct Calls {
  std::vector<Call> calls;
  std::vector<torch::autograd::Edge> edges;
};

// Adds `weight_grads` to the module (called from chain.cpp's PYBIND11_MODULE).
void register_wgrad(pybind11::module_& m);

}  // namespace fastpipe
