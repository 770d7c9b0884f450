// The hand-off point between the ranks of a local pipeline (see mailbox.h).
#include "mailbox.h"

#include "spin.h"

#include <algorithm>
#include <chrono>
#include <thread>

namespace fastpipe {

Mailbox::Mailbox(double spin) : spin_(spin) {}

Mailbox::~Mailbox() {
  if (!Py_IsInitialized()) return;  // interpreter gone: leaking beats touching freed memory
  for (auto& kv : slots_) Py_XDECREF(kv.second);
}

PyObject* Mailbox::pop_locked(std::int64_t key) {
  auto it = slots_.find(key);
  if (it == slots_.end()) return nullptr;
  PyObject* got = it->second;
  slots_.erase(it);
  return got;
}

void Mailbox::put(std::int64_t key, py::object payload) {
  PyObject* fresh = payload.release().ptr();
  PyObject* old = nullptr;
  bool wake;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto [it, inserted] = slots_.emplace(key, fresh);
    if (!inserted) {
      old = it->second;
      it->second = fresh;
    }
    puts_.fetch_add(1, std::memory_order_release);
    wake = sleepers_ > 0;
  }
  if (wake) cv_.notify_all();
  Py_XDECREF(old);
}

py::tuple Mailbox::take(std::int64_t key, double timeout) {
  PyObject* got;
  {
    std::lock_guard<std::mutex> lock(mu_);
    got = pop_locked(key);
  }
  Status status = kOk;
  if (got == nullptr) {
    py::gil_scoped_release nogil;
    using clock = std::chrono::steady_clock;
    const auto start = clock::now();
    const auto deadline = start + std::chrono::duration_cast<clock::duration>(
                                      std::chrono::duration<double>(std::max(timeout, 0.0)));
    const auto spin_end =
        std::min(deadline, start + std::chrono::duration_cast<clock::duration>(
                                       std::chrono::duration<double>(spin_)));
    // Spin: look again each time a put lands, yield the core now and then
    // (other threads may need it more), stop at spin_end.
    for (;;) {
      const std::uint64_t seen = puts_.load(std::memory_order_acquire);
      {
        std::lock_guard<std::mutex> lock(mu_);
        got = pop_locked(key);
      }
      if (got != nullptr) break;
      if (failed_.load(std::memory_order_acquire)) {
        status = kFailed;
        break;
      }
      if (clock::now() >= spin_end) break;
      for (unsigned n = 1; puts_.load(std::memory_order_acquire) == seen &&
                           !failed_.load(std::memory_order_acquire);
           ++n) {
        cpu_relax();
        if (n % 256 == 0) {
          if (clock::now() >= spin_end) break;
          std::this_thread::yield();
        }
      }
      if (puts_.load(std::memory_order_acquire) == seen && clock::now() >= spin_end) break;
    }
    if (got == nullptr && status == kOk) {
      std::unique_lock<std::mutex> lock(mu_);
      ++sleepers_;
      for (;;) {
        got = pop_locked(key);
        if (got != nullptr) break;
        if (failed_.load(std::memory_order_acquire)) {
          status = kFailed;
          break;
        }
        if (cv_.wait_until(lock, deadline) == std::cv_status::timeout) {
          got = pop_locked(key);
          if (got == nullptr) status = failed_.load() ? kFailed : kTimeout;
          break;
        }
      }
      --sleepers_;
    }
  }
  if (got != nullptr) return py::make_tuple(static_cast<int>(kOk), py::reinterpret_steal<py::object>(got));
  return py::make_tuple(static_cast<int>(status), py::none());
}

void Mailbox::fail() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    failed_.store(true, std::memory_order_release);
  }
  cv_.notify_all();
}

std::size_t Mailbox::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return slots_.size();
}

}  // namespace fastpipe
