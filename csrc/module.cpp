// fastpipe._C: the lane ring. Loaded only through fastpipe/_ext.py.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <optional>

#include "checks.h"
#include "event.h"
#include "host_ring.h"
#include "mailbox.h"
#include "shm_link.h"
#include "slot_ring.h"

namespace py = pybind11;

namespace fastpipe {

#ifdef FASTPIPE_WITH_CUDA
void bind_cuda(py::module_& m);
#endif

namespace {

// Waits in short slices so Ctrl-C reaches the main thread while it waits.
py::object event_wait(const EventPtr& event, std::optional<double> timeout) {
  FP_CHECK_VALUE(!timeout || *timeout >= 0.0, "timeout must be >= 0 or None, got ",
                 timeout.value_or(0.0));
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  for (;;) {
    double slice = 0.05;
    if (timeout) {
      double left = *timeout - std::chrono::duration<double>(clock::now() - start).count();
      slice = std::max(0.0, std::min(slice, left));
    }
    bool done;
    {
      py::gil_scoped_release nogil;
      done = event->wait_for(slice);
    }
    if (done) break;
    if (PyErr_CheckSignals() != 0) throw py::error_already_set();
    if (timeout && std::chrono::duration<double>(clock::now() - start).count() >= *timeout) {
      std::string msg = fp_msg("event not done within timeout=", *timeout, " s");
      PyErr_SetString(PyExc_TimeoutError, msg.c_str());
      throw py::error_already_set();
    }
  }
  return event->result_or_raise();
}

// Copies regions between host addresses with the GIL released: the CPU path
// of send-buffer packing (fastpipe/runtime/packing.py), which passes
// data_ptr()s of live tensors it holds for the duration of the call.
void copy_regions(std::uintptr_t dst, const std::vector<std::uintptr_t>& srcs,
                  const std::vector<std::size_t>& offsets, const std::vector<std::size_t>& sizes) {
  FP_CHECK_VALUE(srcs.size() == offsets.size() && srcs.size() == sizes.size(),
                 "srcs, offsets and sizes must have one entry per region, got ", srcs.size(), ", ",
                 offsets.size(), " and ", sizes.size());
  py::gil_scoped_release nogil;
  auto* out = reinterpret_cast<unsigned char*>(dst);
  for (std::size_t i = 0; i < srcs.size(); ++i) {
    if (sizes[i] != 0) std::memcpy(out + offsets[i], reinterpret_cast<const void*>(srcs[i]), sizes[i]);
  }
}

}  // namespace

}  // namespace fastpipe

PYBIND11_MODULE(_C, m) {
  using namespace fastpipe;
  m.doc() = "fastpipe's native lane ring (private; use fastpipe.runtime).";

  py::class_<EventState, EventPtr>(m, "Event",
                                   "Completion of one task submitted to a ring lane.")
      .def("wait", &event_wait, py::arg("timeout") = py::none(),
           "Block (GIL released) until the task ran; return its value or re-raise its "
           "exception. Raises TimeoutError after `timeout` seconds.")
      .def("done", &EventState::done)
      .def("failed", &EventState::failed)
      .def("__repr__", [](const EventState& e) {
        return std::string("<fastpipe._C.Event ") +
               (e.done() ? (e.failed() ? "failed>" : "done>") : "pending>");
      });

  py::class_<HostRing>(m, "HostRing", "N lanes, each a worker thread with a FIFO queue.")
      .def(py::init<int>(), py::arg("lanes"))
      .def("submit", &HostRing::submit, py::arg("lane"), py::arg("fn"),
           py::arg("after") = std::vector<EventPtr>{},
           "Queue fn() on `lane`, to run after every event in `after`; returns its Event.")
      .def("close", &HostRing::close, py::arg("cancel_pending") = false,
           py::arg("grace") = py::none(),
           "Stop accepting work; finish (or cancel) what is queued; join the lanes. With "
           "`grace` (seconds), lanes still busy then are detached instead of joined.")
      .def_property_readonly("lanes", &HostRing::lanes)
      .def_property_readonly("closed", &HostRing::closed)
      .def("pending", &HostRing::pending)
      .def("__enter__", [](HostRing& r) -> HostRing& { return r; },
           py::return_value_policy::reference)
      .def("__exit__", [](HostRing& r, py::args) { r.close(/*cancel_pending=*/false, std::nullopt); });

  py::class_<SlotRing>(m, "SlotRing",
                       "Which of N reusable buffers may be handed out: a slot is reused "
                       "only after the fence of its last use is done.")
      .def(py::init<int, bool>(), py::arg("slots"), py::arg("growable") = false)
      .def("acquire", &SlotRing::acquire, py::arg("timeout") = py::none(),
           "The oldest free slot whose fence is done. A bounded ring waits (GIL released; "
           "TimeoutError after `timeout` s); a growable one adds a slot instead.")
      .def("release", &SlotRing::release, py::arg("slot"), py::arg("fence") = nullptr,
           "Free `slot`; it is handed out again only once `fence` (an Event, or None) is done.")
      .def("cancel", &SlotRing::cancel, py::arg("reason"),
           "Wake every waiter with RuntimeError(reason) and free all slots.")
      .def_property_readonly("size", &SlotRing::size)
      .def_property_readonly("held", &SlotRing::held)
      .def_property_readonly("acquisitions", &SlotRing::acquisitions)
      .def_property_readonly("growable", &SlotRing::growable)
      .def("__repr__", [](const SlotRing& r) {
        return fp_msg("<fastpipe._C.SlotRing size=", r.size(), " held=", r.held(),
                      r.growable() ? " growable>" : ">");
      });

  py::class_<Mailbox>(m, "Mailbox",
                      "One slot per message key between the threads of a local pipeline; "
                      "a receiver waits with the GIL released, spinning for `spin` seconds "
                      "before it sleeps.")
      .def(py::init<double>(), py::arg("spin") = 0.0)
      .def("put", &Mailbox::put, py::arg("key"), py::arg("payload"),
           "Store `payload` under the integer `key`.")
      .def("take", &Mailbox::take, py::arg("key"), py::arg("timeout"),
           "(0, payload), or (1, None) once failed, or (2, None) after `timeout` seconds.")
      .def("fail", &Mailbox::fail, "Wake every receiver; takes of missing keys answer 1.")
      .def_property_readonly("failed", &Mailbox::failed)
      .def_property_readonly("spin", &Mailbox::spin)
      .def("__len__", &Mailbox::size);

  py::class_<ShmLink>(m, "ShmLink",
                      "One process's end of same-host channels: a byte ring per direction in "
                      "POSIX shared memory (see csrc/shm_link.h). Statuses: 0 ok, 1 the peer "
                      "aborted, 2 timeout, 3 the peer process is gone. One thread at a time.")
      .def(py::init<double>(), py::arg("spin") = 0.0)
      .def("open", &ShmLink::open, py::arg("name"), py::arg("create"), py::arg("writer"),
           py::arg("capacity") = 0, "Map (or create) the channel `name`; returns its index.")
      .def_static("unlink", &ShmLink::unlink, py::arg("name"))
      .def("send", &ShmLink::send, py::arg("channel"), py::arg("tag"), py::arg("address"),
           py::arg("nbytes"), py::arg("timeout"),
           "Copy `nbytes` at host `address` into the ring as one message; a status.")
      .def("send_regions", &ShmLink::send_regions, py::arg("channel"), py::arg("tag"),
           py::arg("total"), py::arg("offsets"), py::arg("addrs"), py::arg("sizes"),
           py::arg("timeout"),
           "One message of `total` bytes gathered from host regions placed at `offsets` "
           "(gaps are zeros); a status.")
      .def("next", &ShmLink::next, py::arg("channel"), py::arg("timeout"),
           "Wait for the next message: (status, tag, nbytes).")
      .def("read", &ShmLink::read, py::arg("channel"), py::arg("address"), py::arg("timeout"),
           "Copy the message `next` announced to host `address`; a status.")
      .def("abort", &ShmLink::abort, py::arg("reason"),
           "Mark every channel aborted; peers waiting on one get status 1.")
      .def("peer_reason", &ShmLink::peer_reason, py::arg("channel"))
      .def("capacity", &ShmLink::capacity, py::arg("channel"))
      .def("close", &ShmLink::close, "Unmap every channel.")
      .def_property_readonly("staged", &ShmLink::staged)
      .def_property_readonly("staged_total", &ShmLink::staged_total)
      .def("__len__", &ShmLink::channels);

  m.def("_copy_regions", &copy_regions, py::arg("dst"), py::arg("srcs"), py::arg("offsets"),
        py::arg("sizes"),
        "memcpy(dst + offsets[i], srcs[i], sizes[i]) for every i, GIL released (host "
        "addresses of live buffers only; used by fastpipe.pack).");
  m.def("_live_events", &EventState::live, "EventState objects alive (for leak tests).");

#ifdef FASTPIPE_WITH_CUDA
  m.attr("has_cuda") = true;
  bind_cuda(m);
#else
  m.attr("has_cuda") = false;
  m.def("cuda_runtime_available", [] { return false; });
  m.def("cuda_status", [] {
    return std::string("fastpipe was built without the CUDA backend (FASTPIPE_CUDA=0 or no "
                       "CUDA headers at build time)");
  });
#endif

  // Close every ring before the interpreter tears down, so no worker thread
  // tries to take the GIL of a dying interpreter.
  py::module_::import("atexit").attr("register")(
      py::cpp_function([] { HostRing::close_all(); }));
}
