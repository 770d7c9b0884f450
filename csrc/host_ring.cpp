// The host backend of the lane ring.
#include "host_ring.h"

#include <algorithm>
#include <set>

#include "checks.h"

namespace fastpipe {

namespace {

// Every open ring, so `close_all` can reach them at interpreter exit.
std::mutex& registry_mu() {
  static std::mutex mu;
  return mu;
}
std::set<HostRing*>& registry() {
  static std::set<HostRing*> rings;
  return rings;
}

}  // namespace

HostRing::HostRing(int lanes) {
  FP_CHECK_VALUE(lanes >= 1 && lanes <= 1024, "lanes must be in [1, 1024], got ", lanes);
  lanes_.reserve(lanes);
  for (int i = 0; i < lanes; ++i) lanes_.push_back(std::make_shared<Lane>());
  for (auto& lane : lanes_) {
    lane->thread = std::thread([lane, flags = flags_] { run_lane(lane, flags); });
  }
  std::lock_guard<std::mutex> lock(registry_mu());
  registry().insert(this);
}

HostRing::~HostRing() {
  {
    std::lock_guard<std::mutex> lock(registry_mu());
    registry().erase(this);
  }
  if (!Py_IsInitialized()) {
    // No interpreter left for the workers to finish in: let the threads go
    // rather than terminate the process by destroying joinable threads.
    for (auto& lane : lanes_) {
      if (lane->thread.joinable()) lane->thread.detach();
    }
    return;
  }
  try {
    py::gil_scoped_acquire gil;
    close(/*cancel_pending=*/false);
  } catch (...) {
    // Destroyed from one of its own lanes: nothing safe to do but detach.
    for (auto& lane : lanes_) {
      if (lane->thread.joinable()) lane->thread.detach();
    }
  }
}

EventPtr HostRing::submit(int lane, py::object fn, std::vector<EventPtr> after) {
  FP_CHECK_INDEX(lane >= 0 && lane < lanes(), "lane ", lane, " out of range for a ring of ",
                 lanes(), " lanes");
  FP_CHECK_TYPE(PyCallable_Check(fn.ptr()), "fn must be callable, got ",
                std::string(py::str(py::type::of(fn).attr("__name__"))));
  for (const auto& ev : after) FP_CHECK_TYPE(ev != nullptr, "after must hold Events, got None");
  auto event = std::make_shared<EventState>();
  Lane& l = *lanes_[lane];
  {
    std::lock_guard<std::mutex> state(state_mu_);
    FP_CHECK_STATE(!flags_->closing, "submit on a closed ring (lane ", lane, ")");
    std::lock_guard<std::mutex> lock(l.mu);
    l.queue.push_back(Task{std::move(fn), std::move(after), event});
  }
  l.cv.notify_one();
  return event;
}

void HostRing::run_task(Task& task, bool cancelled) {
  // Dependencies first, without the GIL: they complete on other lanes.
  const EventState* failed_dep = nullptr;
  if (!cancelled) {
    for (const auto& dep : task.after) {
      dep->wait_for(std::nullopt);
      if (failed_dep == nullptr && dep->failed()) failed_dep = dep.get();
    }
  }
  py::gil_scoped_acquire gil;
  if (cancelled) {
    task.event->set_runtime_error("task cancelled: its ring was closed before it ran");
  } else if (failed_dep != nullptr) {
    task.event->set_error_from(*failed_dep);
  } else {
    PyObject* out = PyObject_CallNoArgs(task.fn.ptr());
    if (out == nullptr) {
      task.event->set_error_from_python();
    } else {
      task.event->set_result(py::reinterpret_steal<py::object>(out));
    }
  }
  // Drop the Python references while the GIL is held.
  task.fn = py::object();
  task.after.clear();
  task.event.reset();
}

void HostRing::run_lane(std::shared_ptr<Lane> lane_ptr, std::shared_ptr<Flags> flags) {
  Lane& lane = *lane_ptr;
  for (;;) {
    Task task;
    bool cancelled;
    {
      std::unique_lock<std::mutex> lock(lane.mu);
      lane.cv.wait(lock, [&] { return !lane.queue.empty() || flags->closing.load(); });
      if (lane.queue.empty()) return;  // closing and drained
      task = std::move(lane.queue.front());
      lane.queue.pop_front();
      ++lane.running;
      cancelled = flags->cancel.load();
    }
    run_task(task, cancelled);
    std::lock_guard<std::mutex> lock(lane.mu);
    --lane.running;
    lane.cv.notify_all();  // close() may be waiting for this lane to go idle
  }
}

void HostRing::close(bool cancel_pending, std::optional<double> grace) {
  {
    std::lock_guard<std::mutex> state(state_mu_);
    if (joined_) return;
    for (const auto& lane : lanes_) {
      FP_CHECK_STATE(lane->thread.get_id() != std::this_thread::get_id(),
                     "a ring cannot be closed from one of its own lanes");
    }
    if (cancel_pending) flags_->cancel = true;
    flags_->closing = true;
    joined_ = true;
  }
  for (auto& lane : lanes_) {
    std::lock_guard<std::mutex> lock(lane->mu);
    lane->cv.notify_all();
  }
  // Workers need the GIL to run and to cancel what is queued.
  py::gil_scoped_release nogil;
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                            std::chrono::duration<double>(grace.value_or(0.0)));
  for (auto& lane : lanes_) {
    if (!lane->thread.joinable()) continue;
    if (grace) {
      std::unique_lock<std::mutex> lock(lane->mu);
      bool idle = lane->cv.wait_until(lock, deadline, [&] {
        return lane->queue.empty() && lane->running == 0;
      });
      if (!idle) {
        lane->thread.detach();  // it owns a reference to its lane and flags
        continue;
      }
    }
    lane->thread.join();
  }
}

bool HostRing::closed() const { return flags_->closing.load(); }

long HostRing::pending() const {
  long n = 0;
  for (const auto& lane : lanes_) {
    std::lock_guard<std::mutex> lock(lane->mu);
    n += static_cast<long>(lane->queue.size()) + lane->running;
  }
  return n;
}

void HostRing::close_all() {
  std::vector<HostRing*> rings;
  {
    std::lock_guard<std::mutex> lock(registry_mu());
    rings.assign(registry().begin(), registry().end());
  }
  for (HostRing* ring : rings) ring->close(/*cancel_pending=*/true, /*grace=*/1.0);
}

}  // namespace fastpipe
