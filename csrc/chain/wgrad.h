// Deferred weight gradients in C++ (wgrad.cpp): the W of
// fastpipe/runtime/deferred.py's built-in rules, run with the GIL released.
#pragma once

#include <torch/extension.h>

namespace fastpipe {

// Adds `weight_grads` to the module (called from chain.cpp's PYBIND11_MODULE).
void register_wgrad(pybind11::module_& m);

}  // namespace fastpipe
