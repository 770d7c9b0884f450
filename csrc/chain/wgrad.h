// Deferred weight gradients in C++ (wgrad.cpp): the W of
// fastpipe/runtime/deferred.py's built-in rules, run with the GIL released.
#pragma once

#include <torch/extension.h>

#include <cstdint>

namespace fastpipe {

// The built-in rules' kinds, as weight_rules.py numbers them (`native`,
// `_fast`): W in wgrad.cpp knows the first three, the deferring forward in
// defer.cpp all four.
enum RuleKind : std::int64_t { kLinear = 0, kLayerNorm = 1, kEmbedding = 2, kRMSNorm = 3 };

// Adds `weight_grads` to the module (called from chain.cpp's PYBIND11_MODULE).
void register_wgrad(pybind11::module_& m);

}  // namespace fastpipe
