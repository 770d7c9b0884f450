// Completion events of the host lanes: a one-shot latch that carries either
// the task's return value or the Python exception it raised.
#pragma once

#include <pybind11/pybind11.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <optional>

namespace fastpipe {

namespace py = pybind11;

// The state behind one `Event`. Shared by the Python handle, the task that
// completes it and the tasks that wait on it.
//
// Python objects inside (result, exception) are only touched with the GIL
// held; the latch itself (done flag, condition variable) never needs it, so
// workers can block on dependencies with the GIL released.
class EventState {
 public:
  EventState();
  ~EventState();
  EventState(const EventState&) = delete;
  EventState& operator=(const EventState&) = delete;

  // GIL held. Completes the event with a value.
  void set_result(py::object value);
  // GIL held. Completes the event with the Python error currently set
  // (PyErr_Occurred) and clears the indicator.
  void set_error_from_python();
  // GIL held. Completes the event with the same error as `other` (a failed
  // dependency), so a waiter sees the root cause, not a generic message.
  void set_error_from(const EventState& other);
  // GIL held. Completes the event with a RuntimeError(message).
  void set_runtime_error(const std::string& message);

  // No GIL needed. Blocks up to `seconds` (forever if nullopt); true if done.
  bool wait_for(std::optional<double> seconds) const;
  bool done() const;
  bool failed() const;

  // GIL held, event done. Returns the value or raises the stored exception.
  py::object result_or_raise() const;

  // Number of EventState objects alive in the process (leak tests).
  static long live();

 private:
  void finish_locked();

  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  bool done_ = false;
  bool failed_ = false;
  py::object result_;
  py::object err_type_, err_value_, err_trace_;
  static std::atomic<long> live_;
};

using EventPtr = std::shared_ptr<EventState>;

}  // namespace fastpipe
