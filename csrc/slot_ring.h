// The buffer ring's bookkeeping: which of N reusable buffers may be handed out.
//
// P2P buffers are preallocated per stage boundary and reused. The one rule:
// a slot is handed out again only after the operation that last used it is
// finished, which its user states with a fence event at release time.
//
//   acquire() -> 2        [slot 2 in use: packed into, sent...]
//   release(2, fence)     free list: ... (2, fence)
//   acquire() -> 2        only once `fence` is done (waits, GIL released)
//
// Freed slots are handed out oldest first, so with releases in order the
// slots go round-robin. No `record_stream`-style guessing: reuse waits for
// the fence, deterministically. (The Python side owns the tensors.)
#pragma once

#include <pybind11/pybind11.h>

#include <condition_variable>
#include <deque>
#include <mutex>
#include <optional>
#include <vector>

#include "event.h"

namespace fastpipe {

class SlotRing {
 public:
  // `slots` buffers to start with; `growable` rings add a slot instead of
  // waiting when no free slot's fence is done yet (send side: never block
  // the producer), bounded rings wait (receive side: bounded memory).
  SlotRing(int slots, bool growable);

  // GIL held on entry, released while waiting. Returns a slot index.
  // Raises TimeoutError after `timeout` seconds, RuntimeError once cancelled.
  int acquire(std::optional<double> timeout);
  // Any thread, GIL held. Frees `slot`; it is handed out again after `fence`.
  void release(int slot, EventPtr fence);
  // Wakes every waiter with RuntimeError(reason) and frees all slots, so a
  // failed step leaves no one blocked. The ring is usable again afterwards.
  void cancel(const std::string& reason);

  int size() const;
  int held() const;          // slots handed out and not released
  long acquisitions() const; // total acquire() results, for tests
  bool growable() const { return growable_; }

 private:
  struct Free {
    int slot;
    EventPtr fence;  // may be null: free at once
  };
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Free> free_;
  std::vector<bool> in_use_;
  bool growable_;
  long acquisitions_ = 0;
  long generation_ = 0;  // bumped by cancel(): waiters from before it give up
  std::string cancel_reason_;
};

}  // namespace fastpipe
