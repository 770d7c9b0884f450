// The host backend of the lane ring: N lanes, each a worker thread draining a
// FIFO queue of Python callables, ordered across lanes by events.
#pragma once

#include <pybind11/pybind11.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "event.h"

namespace fastpipe {

namespace py = pybind11;

// A lane behaves like a CUDA stream made of a thread: work submitted to one
// lane runs in submission order; work on different lanes runs concurrently
// unless an event orders it.
//
//   submit(0, f)          lane 0: [f]──►e0
//   submit(1, g, [e0])    lane 1:        wait e0 ──► [g]──►e1
//
// A task whose dependency failed is not run: its event fails with the
// dependency's exception, so the root cause reaches whoever waits at the end
// of a chain.
class HostRing {
 public:
  explicit HostRing(int lanes);
  ~HostRing();
  HostRing(const HostRing&) = delete;
  HostRing& operator=(const HostRing&) = delete;

  // GIL held. Queues `fn` on `lane` to run after every event in `after`.
  EventPtr submit(int lane, py::object fn, std::vector<EventPtr> after);
  // GIL held. Stops accepting work, then lets each lane finish what it has
  // (or fails the queued tasks when `cancel_pending`), and joins the threads.
  // With `grace`, a lane still busy after `grace` seconds (a task blocked in
  // a wait that will only end by its own timeout) is left to finish on its
  // own: its thread is detached and keeps its state alive.
  void close(bool cancel_pending, std::optional<double> grace = std::nullopt);
  int lanes() const { return static_cast<int>(lanes_.size()); }
  bool closed() const;
  // Tasks queued or running, over all lanes.
  long pending() const;

  // Closes every ring still open, cancelling queued work and leaving lanes
  // stuck in a task after a short grace period. Registered with `atexit` so
  // no worker touches Python after the interpreter starts to go, and a
  // blocked lane cannot hold up the exit.
  static void close_all();

 private:
  struct Task {
    py::object fn;
    std::vector<EventPtr> after;
    EventPtr event;
  };
  struct Lane {
    std::mutex mu;
    std::condition_variable cv;
    std::deque<Task> queue;
    long running = 0;
    std::thread thread;
  };
  // What a worker thread reads: shared with it, so a detached worker never
  // touches a destroyed ring.
  struct Flags {
    std::atomic<bool> closing{false};
    std::atomic<bool> cancel{false};
  };

  static void run_lane(std::shared_ptr<Lane> lane, std::shared_ptr<Flags> flags);
  static void run_task(Task& task, bool cancelled);

  std::vector<std::shared_ptr<Lane>> lanes_;
  std::shared_ptr<Flags> flags_ = std::make_shared<Flags>();
  // Lock order: state_mu_ before a lane's mu. Workers read the flags without
  // state_mu_ (they are atomics) so they never take the locks the other way.
  mutable std::mutex state_mu_;
  bool joined_ = false;
};

}  // namespace fastpipe
