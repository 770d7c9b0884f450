// The buffer ring's bookkeeping (see slot_ring.h).
#include "slot_ring.h"

#include <algorithm>
#include <chrono>

#include "checks.h"

namespace fastpipe {

SlotRing::SlotRing(int slots, bool growable) : growable_(growable) {
  FP_CHECK_VALUE(slots >= 1 && slots <= (1 << 20), "slots must be in [1, 2**20], got ", slots);
  in_use_.assign(slots, false);
  for (int i = 0; i < slots; ++i) free_.push_back(Free{i, nullptr});
}

int SlotRing::acquire(std::optional<double> timeout) {
  FP_CHECK_VALUE(!timeout || *timeout >= 0.0, "timeout must be >= 0 or None, got ",
                 timeout.value_or(0.0));
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  auto left = [&]() -> std::optional<double> {
    if (!timeout) return std::nullopt;
    return std::max(0.0, *timeout - std::chrono::duration<double>(clock::now() - start).count());
  };
  // Fences taken off the free list die here, after the GIL is back: the last
  // reference to an event may hold Python objects.
  std::vector<EventPtr> graveyard;
  std::string failure;
  bool timed_out = false;
  int slot = -1;
  size_t slots = 0;
  {
    py::gil_scoped_release nogil;
    std::unique_lock<std::mutex> lock(mu_);
    const long generation = generation_;
    for (;;) {
      if (generation_ != generation) {
        failure = cancel_reason_;
        break;
      }
      EventPtr fence;
      if (!free_.empty()) {
        fence = free_.front().fence;
        if (!fence || fence->done()) {
          slot = free_.front().slot;
          graveyard.push_back(std::move(free_.front().fence));
          free_.pop_front();
          graveyard.push_back(std::move(fence));
          break;
        }
      }
      if (growable_) {  // nothing reusable yet: a new slot rather than a wait
        graveyard.push_back(std::move(fence));
        slot = static_cast<int>(in_use_.size());
        in_use_.push_back(false);
        break;
      }
      auto wait = left();
      if (wait && *wait <= 0.0) {
        timed_out = true;
        graveyard.push_back(std::move(fence));
        break;
      }
      // Short slices, so a cancel() or a newly freed slot is noticed promptly.
      double slice = wait ? std::min(*wait, 0.05) : 0.05;
      if (fence) {
        lock.unlock();
        fence->wait_for(slice);
        graveyard.push_back(std::move(fence));
        lock.lock();
      } else {
        cv_.wait_for(lock, std::chrono::duration<double>(slice));
      }
    }
    if (slot >= 0) {
      in_use_[slot] = true;
      ++acquisitions_;
    }
    slots = in_use_.size();
  }
  graveyard.clear();
  if (timed_out) {
    std::string msg = fp_msg("no free buffer slot within timeout=", timeout.value_or(0.0),
                             " s (all ", slots, " slots in use)");
    PyErr_SetString(PyExc_TimeoutError, msg.c_str());
    throw py::error_already_set();
  }
  FP_CHECK_STATE(failure.empty(), "buffer ring cancelled: ", failure);
  return slot;
}

void SlotRing::release(int slot, EventPtr fence) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    FP_CHECK_INDEX(slot >= 0 && slot < static_cast<int>(in_use_.size()), "slot ", slot,
                   " out of range for a ring of ", in_use_.size(), " slots");
    FP_CHECK_VALUE(in_use_[slot], "slot ", slot, " released twice (it is not in use)");
    in_use_[slot] = false;
    free_.push_back(Free{slot, std::move(fence)});
  }
  cv_.notify_all();
}

void SlotRing::cancel(const std::string& reason) {
  std::deque<Free> dropped;  // destroyed after the lock: see acquire()
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++generation_;
    cancel_reason_ = reason;
    dropped.swap(free_);
    for (size_t i = 0; i < in_use_.size(); ++i) {
      in_use_[i] = false;
      free_.push_back(Free{static_cast<int>(i), nullptr});
    }
  }
  cv_.notify_all();
}

int SlotRing::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int>(in_use_.size());
}

int SlotRing::held() const {
  std::lock_guard<std::mutex> lock(mu_);
  int n = 0;
  for (bool b : in_use_) n += b;
  return n;
}

long SlotRing::acquisitions() const {
  std::lock_guard<std::mutex> lock(mu_);
  return acquisitions_;
}

}  // namespace fastpipe
