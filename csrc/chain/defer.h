// The deferring forward in C++ (defer.cpp): the per-call side of
// fastpipe/runtime/deferred.py's `_Forward` for the built-in rules.
#pragma once

#include <torch/extension.h>

namespace fastpipe {

// Adds `DeferringForward`, `set_pending` and `configure_defer` to the module
// (called from chain.cpp's PYBIND11_MODULE).
void register_defer(pybind11::module_& m);

}  // namespace fastpipe
