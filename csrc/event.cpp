// Completion events of the host lanes.
#include "event.h"

namespace fastpipe {

std::atomic<long> EventState::live_{0};

EventState::EventState() { live_.fetch_add(1, std::memory_order_relaxed); }

EventState::~EventState() {
  live_.fetch_sub(1, std::memory_order_relaxed);
  // The last owner may be a worker thread without the GIL: release the Python
  // objects under it. Nothing to do (and no GIL to take) for an empty event.
  if (result_ || err_type_ || err_value_ || err_trace_) {
    if (!Py_IsInitialized()) {
      // Interpreter already gone: leaking beats touching freed memory.
      result_.release();
      err_type_.release();
      err_value_.release();
      err_trace_.release();
      return;
    }
    py::gil_scoped_acquire gil;
    result_ = py::object();
    err_type_ = py::object();
    err_value_ = py::object();
    err_trace_ = py::object();
  }
}

void EventState::finish_locked() {
  done_ = true;
  cv_.notify_all();
}

void EventState::set_result(py::object value) {
  std::lock_guard<std::mutex> lock(mu_);
  result_ = std::move(value);
  finish_locked();
}

void EventState::set_error_from_python() {
  PyObject *type = nullptr, *value = nullptr, *trace = nullptr;
  PyErr_Fetch(&type, &value, &trace);
  if (type == nullptr) {
    // Called without a pending error: record that fact instead of a null type.
    PyErr_SetString(PyExc_RuntimeError, "task failed without setting a Python error");
    PyErr_Fetch(&type, &value, &trace);
  }
  PyErr_NormalizeException(&type, &value, &trace);
  if (trace != nullptr && value != nullptr) PyException_SetTraceback(value, trace);
  std::lock_guard<std::mutex> lock(mu_);
  err_type_ = py::reinterpret_steal<py::object>(type);
  err_value_ = py::reinterpret_steal<py::object>(value);
  err_trace_ = py::reinterpret_steal<py::object>(trace);
  failed_ = true;
  finish_locked();
}

void EventState::set_error_from(const EventState& other) {
  py::object type, value, trace;
  {
    std::lock_guard<std::mutex> lock(other.mu_);
    type = other.err_type_;
    value = other.err_value_;
    trace = other.err_trace_;
  }
  std::lock_guard<std::mutex> lock(mu_);
  err_type_ = std::move(type);
  err_value_ = std::move(value);
  err_trace_ = std::move(trace);
  failed_ = true;
  finish_locked();
}

void EventState::set_runtime_error(const std::string& message) {
  PyErr_SetString(PyExc_RuntimeError, message.c_str());
  set_error_from_python();
}

bool EventState::wait_for(std::optional<double> seconds) const {
  std::unique_lock<std::mutex> lock(mu_);
  if (!seconds) {
    cv_.wait(lock, [this] { return done_; });
    return true;
  }
  auto span = std::chrono::duration<double>(*seconds);
  return cv_.wait_for(lock, span, [this] { return done_; });
}

bool EventState::done() const {
  std::lock_guard<std::mutex> lock(mu_);
  return done_;
}

bool EventState::failed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return failed_;
}

py::object EventState::result_or_raise() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (!failed_) return result_ ? result_ : py::none();
  // PyErr_Restore steals references: hand it new ones so the event keeps its
  // copy and every waiter (there may be several) gets the same exception.
  PyErr_Restore(err_type_.inc_ref().ptr(), err_value_.inc_ref().ptr(),
                err_trace_ ? err_trace_.inc_ref().ptr() : nullptr);
  throw py::error_already_set();
}

long EventState::live() { return live_.load(std::memory_order_relaxed); }

}  // namespace fastpipe
