// Python bindings of the CUDA lane backend (built only with CUDA headers).
#include <pybind11/pybind11.h>

#include <cstdint>

#include "cuda_lane.h"

namespace py = pybind11;

namespace fastpipe {

void bind_cuda(py::module_& m) {
  m.def(
      "cuda_status",
      [] {
        const CudaApi& api = cuda_api();
        return api.loaded ? "ok: " + api.library : api.error;
      },
      "Why the CUDA backend can or cannot be used in this process (loads libcudart once).");

  m.def(
      "cuda_runtime_available", [] { return cuda_api().loaded; },
      "True when a CUDA runtime with at least one device was found at run time.");

  py::class_<CudaStream>(m, "CudaStream")
      .def(py::init<int, int>(), py::arg("device"), py::arg("priority") = 0)
      .def_property_readonly(
          "handle", [](const CudaStream& s) { return reinterpret_cast<std::uintptr_t>(s.get()); },
          "The cudaStream_t as an int, for torch.cuda.ExternalStream.")
      .def_property_readonly("device", &CudaStream::device)
      .def_property_readonly("priority", &CudaStream::priority)
      .def("synchronize", &CudaStream::synchronize, py::call_guard<py::gil_scoped_release>());

  py::class_<CudaEvent>(m, "CudaEvent")
      .def(py::init<>())
      .def(
          "record", [](CudaEvent& e, const CudaStream& s) { e.record(s.get()); },
          py::arg("stream"))
      .def(
          "wait", [](const CudaEvent& e, const CudaStream& s) { e.block(s.get()); },
          py::arg("stream"), "Make `stream` wait for this event on the GPU; the host does not block.")
      .def("query", &CudaEvent::query)
      .def("synchronize", &CudaEvent::synchronize, py::call_guard<py::gil_scoped_release>());
}

}  // namespace fastpipe
