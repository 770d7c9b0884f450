// Fused weight-gradient accumulation for Linears on CPU: C += G^T X for a
// list of layers in one call, with the GIL released.
//
// Why native: fastpipe's fused mode (fastpipe/runtime/_backward.py) replaces
// autograd's "fresh weight gradient, then add it into .grad" by one GEMM
// with beta = 1 per Linear. Issued from Python as torch ops, each op hands the
// GIL over when another rank's thread of a local pipeline wants it, and on a
// stage of eight 2048x512 Linears those hand-overs doubled the time of the
// accumulation (450 us per Linear against 216 us alone). Here the whole list
// runs in one call without the GIL, on the BLAS that torch itself links (its
// sgemm_/dgemm_, whose addresses Python finds in torch's library and passes
// in once), so the arithmetic is the one torch's addmm_ would do.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <tuple>
#include <vector>

#include "checks.h"

namespace fastpipe {

namespace py = pybind11;

namespace {

// Fortran BLAS, LP64 (32-bit integers), as torch's MKL and OpenBLAS builds export it.
template <typename T>
using Gemm = void (*)(const char*, const char*, const int*, const int*, const int*, const T*,
                      const T*, const int*, const T*, const int*, const T*, T*, const int*);

Gemm<float> g_sgemm = nullptr;
Gemm<double> g_dgemm = nullptr;

// One Linear: its weight gradient C (M x N, row-major), the gradient G of its
// output (K x M) and its input X (K x N), all contiguous; the bias gradient
// (M) or 0. overwrite: C and the bias are written, not added to (.grad was None).
using Item = std::tuple<std::uintptr_t, std::uintptr_t, std::uintptr_t, std::int64_t, std::int64_t,
                        std::int64_t, std::uintptr_t, bool>;

template <typename T>
void run(Gemm<T> gemm, const Item& item) {
  auto [c, g, x, m64, n64, k64, bias, overwrite] = item;
  const int m = static_cast<int>(m64), n = static_cast<int>(n64), k = static_cast<int>(k64);
  auto* cp = reinterpret_cast<T*>(c);
  const auto* gp = reinterpret_cast<const T*>(g);
  const auto* xp = reinterpret_cast<const T*>(x);
  const T one = 1, beta = overwrite ? 0 : 1;
  if (k > 0) {
    // Row-major C = G^T X is column-major C' (n x m) = X' (n x k) * G'^T, G' (m x k).
    gemm("N", "T", &n, &m, &k, &one, xp, &n, gp, &m, &beta, cp, &n);
  } else if (overwrite) {
    for (std::int64_t i = 0; i < m64 * n64; ++i) cp[i] = 0;
  }
  if (bias != 0) {
    auto* bp = reinterpret_cast<T*>(bias);
    for (int j = 0; j < m; ++j) {
      T s = 0;
      for (int r = 0; r < k; ++r) s += gp[static_cast<std::int64_t>(r) * m + j];
      bp[j] = overwrite ? s : bp[j] + s;
    }
  }
}

void set_blas(std::uintptr_t sgemm, std::uintptr_t dgemm) {
  g_sgemm = reinterpret_cast<Gemm<float>>(sgemm);
  g_dgemm = reinterpret_cast<Gemm<double>>(dgemm);
}

bool have_blas() { return g_sgemm != nullptr && g_dgemm != nullptr; }

void accumulate_linear_grads(const std::vector<Item>& items, const std::vector<bool>& f64) {
  FP_CHECK_STATE(have_blas(), "no BLAS: call _set_blas first");
  FP_CHECK_VALUE(items.size() == f64.size(), "items and f64 must have one entry each, got ",
                 items.size(), " and ", f64.size());
  for (const auto& item : items) {
    const auto m = std::get<3>(item), n = std::get<4>(item), k = std::get<5>(item);
    FP_CHECK_VALUE(m >= 0 && n >= 0 && k >= 0 && m < (1LL << 31) && n < (1LL << 31) &&
                       k < (1LL << 31) && m * n < (1LL << 62),
                   "matrix sizes out of range: ", m, " x ", n, " x ", k);
  }
  py::gil_scoped_release nogil;
  for (std::size_t i = 0; i < items.size(); ++i) {
    if (f64[i]) {
      run(g_dgemm, items[i]);
    } else {
      run(g_sgemm, items[i]);
    }
  }
}

}  // namespace

void bind_accumulate(py::module_& m) {
  m.def("_set_blas", &set_blas, py::arg("sgemm"), py::arg("dgemm"),
        "Addresses of the Fortran sgemm_/dgemm_ (LP64) that _accumulate_linear_grads calls.");
  m.def("_have_blas", &have_blas);
  m.def("_accumulate_linear_grads", &accumulate_linear_grads, py::arg("items"), py::arg("f64"),
        "For each (C, G, X, M, N, K, bias, overwrite): C (M x N) += G^T X and bias += sum of "
        "G's rows (written instead with overwrite), GIL released. Host addresses of live, "
        "contiguous buffers only (fastpipe.runtime._backward holds them for the call).");
}

}  // namespace fastpipe
