// The hand-off point between the ranks of a local pipeline: one slot per
// message key, filled by the sender's thread and emptied by the receiver's.
//
// Why native: a rank waiting for a message in Python (threading.Condition)
// sleeps in the kernel, and waking a sleeping thread costs tens of
// microseconds on a virtual machine (an interrupt to an idle CPU), several
// times a microbatch: measured 88–146 µs from put to the receiver running on
// the benchmark machine. Here the receiver waits with the GIL released,
// first spinning for a bounded time (a put is then one atomic store away),
// then sleeping on a condition variable; a put only makes a system call when
// a receiver sleeps.
#pragma once

#include <pybind11/pybind11.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <unordered_map>

namespace fastpipe {

namespace py = pybind11;

class Mailbox {
 public:
  // What `take` found.
  enum Status : int { kOk = 0, kFailed = 1, kTimeout = 2 };

  // `spin` seconds of busy waiting before a receiver sleeps (0: sleep at once).
  explicit Mailbox(double spin);
  ~Mailbox();  // GIL held (pybind11 deallocates with it)
  Mailbox(const Mailbox&) = delete;
  Mailbox& operator=(const Mailbox&) = delete;

  // GIL held. Stores `payload` under `key` (a key is put once and taken once).
  void put(std::int64_t key, py::object payload);
  // GIL held on entry and exit, released while waiting. Returns (status,
  // payload); payload is None unless status is kOk. A failed mailbox
  // answers kFailed to every take of a key that is not there.
  py::tuple take(std::int64_t key, double timeout);
  // Wakes every receiver; later takes of missing keys answer kFailed.
  void fail();
  bool failed() const { return failed_.load(std::memory_order_acquire); }
  std::size_t size() const;
  double spin() const { return spin_; }

 private:
  // No GIL. The payload of `key` (a new reference) or nullptr.
  PyObject* pop_locked(std::int64_t key);

  const double spin_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::unordered_map<std::int64_t, PyObject*> slots_;  // owned references
  int sleepers_ = 0;                                   // under mu_
  std::atomic<std::uint64_t> puts_{0};                 // bumped by every put
  std::atomic<bool> failed_{false};
};

}  // namespace fastpipe
