// Python bindings of the CUDA lane backend (built only with CUDA headers).
#include <pybind11/pybind11.h>

#include <pybind11/stl.h>

#include <cstdint>
#include <utility>
#include <vector>

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

  m.def(
      "process_cuda_stream",
      [](int device, int priority) { return &process_stream(device, priority); },
      py::arg("device"), py::arg("priority") = 0, py::return_value_policy::reference,
      "A new CudaStream that is never destroyed: it lives until the process exits (streams "
      "torch ran work on must; fastpipe/runtime/streams.py leases them out).");

  py::class_<CudaEvent>(m, "CudaEvent")
      .def(py::init<>())
      .def(
          "record", [](CudaEvent& e, const CudaStream& s) { e.record(s.get()); },
          py::arg("stream"))
      .def(
          "wait", [](const CudaEvent& e, const CudaStream& s) { e.block(s.get()); },
          py::arg("stream"), "Make `stream` wait for this event on the GPU; the host does not block.")
      // The same on a stream fastpipe does not own (torch's current stream), by handle.
      .def(
          "record_handle",
          [](CudaEvent& e, std::uintptr_t h) { e.record(reinterpret_cast<cudaStream_t>(h)); },
          py::arg("stream"), "record() on a stream given as its cudaStream_t (an int).")
      .def(
          "wait_handle",
          [](const CudaEvent& e, std::uintptr_t h) { e.block(reinterpret_cast<cudaStream_t>(h)); },
          py::arg("stream"), "wait() on a stream given as its cudaStream_t (an int).")
      .def("query", &CudaEvent::query)
      .def("synchronize", &CudaEvent::synchronize, py::call_guard<py::gil_scoped_release>());

  m.def(
      "cuda_priority_range",
      [](int device) {
        DeviceGuard guard(device);
        int least = 0, greatest = 0;
        cuda_check(cuda_api_or_throw().DeviceGetStreamPriorityRange(&least, &greatest),
                   "cudaDeviceGetStreamPriorityRange");
        return std::make_pair(least, greatest);
      },
      py::arg("device"),
      "(least, greatest) stream priority of `device`; CUDA's greatest is the lowest number.");

  m.def(
      "copy_regions_async",
      [](std::uintptr_t dst, int dst_device, const std::vector<std::uintptr_t>& srcs, int src_device,
         const std::vector<std::size_t>& offsets, const std::vector<std::size_t>& sizes,
         const CudaStream& stream) {
        copy_regions_async(dst, dst_device, srcs, src_device, offsets, sizes, stream.get());
      },
      py::arg("dst"), py::arg("dst_device"), py::arg("srcs"), py::arg("src_device"),
      py::arg("offsets"), py::arg("sizes"), py::arg("stream"),
      "cudaMemcpyPeerAsync(dst + offsets[i] on dst_device, srcs[i] on src_device, sizes[i]) on "
      "`stream` for every i: a copy lane's transfer, asynchronous to the host.",
      py::call_guard<py::gil_scoped_release>());
}

}  // namespace fastpipe
