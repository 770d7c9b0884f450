// Same-host links over shared memory (see shm_link.h).
#include "shm_link.h"
#include "spin.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <new>
#include <thread>

namespace fastpipe {

namespace {

constexpr std::uint64_t kMagic = 0x6b6e696c70667366ULL;  // "fsfplink"
constexpr std::uint64_t kFrame = 16;                     // tag + length
constexpr std::uint32_t kWriterAborted = 1, kReaderAborted = 2;
constexpr std::size_t kReason = 1024;
constexpr std::int64_t kSliceNs = 2'000'000;     // longest futex sleep between checks
constexpr std::int64_t kLivenessNs = 20'000'000;  // how often a sleeper looks at its peer

inline std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

inline std::int64_t deadline_after(double seconds) {
  return now_ns() + static_cast<std::int64_t>(std::max(seconds, 0.0) * 1e9);
}

inline std::uint64_t padded(std::uint64_t n) { return (n + 7) & ~std::uint64_t{7}; }

long futex(std::atomic<std::uint32_t>* word, int op, std::uint32_t val, const timespec* ts) {
  // Not FUTEX_PRIVATE: the word is shared between processes.
  return syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(word), op, val, ts, nullptr, 0);
}

// True while `pid` runs: its /proc entry exists and it is not a zombie.
bool alive(std::int32_t pid) {
  if (pid <= 0) return true;  // not attached yet: nothing to say
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%d/stat", static_cast<int>(pid));
  FILE* f = std::fopen(path, "r");
  if (f == nullptr) return errno != ENOENT;
  char buf[512];
  std::size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  buf[n] = '\0';
  const char* close = std::strrchr(buf, ')');  // the name may hold spaces and parentheses
  if (close == nullptr || close[1] == '\0' || close[2] == '\0') return true;
  return close[2] != 'Z' && close[2] != 'X';
}

// OSError from errno, naming the object (GIL held).
[[noreturn]] void throw_os(const std::string& name) {
  PyErr_SetFromErrnoWithFilename(PyExc_OSError, name.c_str());
  throw py::error_already_set();
}

}  // namespace

// Lives at the start of each shared object; the ring's bytes follow it. The
// writer's and the reader's counters sit on separate cache lines.
struct alignas(64) ShmHeader {
  std::uint64_t magic;
  std::uint64_t capacity;
  alignas(64) std::atomic<std::uint64_t> written;  // bytes published by the writer
  std::atomic<std::uint32_t> data_seq;             // futex: bumped when the reader sleeps
  std::atomic<std::uint32_t> reader_sleeps;
  alignas(64) std::atomic<std::uint64_t> consumed;  // bytes the reader is done with
  std::atomic<std::uint32_t> space_seq;              // futex: bumped when the writer sleeps
  std::atomic<std::uint32_t> writer_sleeps;
  alignas(64) std::atomic<std::int32_t> writer_pid;
  std::atomic<std::int32_t> reader_pid;
  std::atomic<std::uint32_t> aborted;  // kWriterAborted | kReaderAborted
  std::uint32_t reason_len[2];         // [writer, reader]
  char reason[2][kReason];
};

static_assert(std::atomic<std::uint64_t>::is_always_lock_free, "shared counters must be lock-free");
static_assert(std::atomic<std::uint32_t>::is_always_lock_free, "futex words must be lock-free");

ShmLink::ShmLink(double spin) : spin_(std::max(spin, 0.0)) {}

ShmLink::~ShmLink() { close(); }

void ShmLink::close() {
  for (auto& c : channels_) {
    if (c.h != nullptr) munmap(c.h, c.map_len);
    c.h = nullptr;
    c.data = nullptr;
  }
  channels_.clear();
}

int ShmLink::open(const std::string& name, bool create, bool writer, std::uint64_t capacity) {
  const std::size_t head = sizeof(ShmHeader);
  int fd = shm_open(name.c_str(), O_RDWR | (create ? O_CREAT | O_EXCL : 0), 0600);
  if (fd < 0) throw_os(name);
  std::size_t len;
  if (create) {
    if (capacity < 64 || capacity % 8 != 0) {
      ::close(fd);
      shm_unlink(name.c_str());
      throw py::value_error("capacity must be a multiple of 8 and at least 64, got " +
                            std::to_string(capacity));
    }
    len = head + capacity;
    // Reserve the pages now: a tmpfs too small for the ring (Docker's
    // default /dev/shm is 64 MiB) then fails here, with ENOSPC, instead of
    // a SIGBUS on the first write past what it holds.
    int err = ftruncate(fd, static_cast<off_t>(len)) != 0 ? errno
                                                           : posix_fallocate(fd, 0, static_cast<off_t>(len));
    if (err != 0) {
      ::close(fd);
      shm_unlink(name.c_str());
      errno = err;
      throw_os(name);
    }
  } else {
    struct stat st {};
    if (fstat(fd, &st) != 0) {
      ::close(fd);
      throw_os(name);
    }
    len = static_cast<std::size_t>(st.st_size);
    if (len < head + 64) {
      ::close(fd);
      throw py::value_error("shared memory object " + name + " is not a fastpipe link");
    }
  }
  void* mem = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (mem == MAP_FAILED) {
    if (create) shm_unlink(name.c_str());
    throw_os(name);
  }
  auto* h = static_cast<ShmHeader*>(mem);
  if (create) {
    new (h) ShmHeader();  // zeroed by ftruncate; the atomics constructed in place
    h->capacity = capacity;
    h->magic = kMagic;
  } else if (h->magic != kMagic || h->capacity + head != len) {
    munmap(mem, len);
    throw py::value_error("shared memory object " + name + " is not a fastpipe link");
  }
  (writer ? h->writer_pid : h->reader_pid).store(static_cast<std::int32_t>(getpid()));
  Channel c;
  c.name = name;
  c.h = h;
  c.data = static_cast<std::uint8_t*>(mem) + head;
  c.map_len = len;
  c.cap = h->capacity;
  c.writer = writer;
  c.pos = writer ? h->written.load() : h->consumed.load();
  channels_.push_back(std::move(c));
  return static_cast<int>(channels_.size()) - 1;
}

void ShmLink::unlink(const std::string& name) {
  if (shm_unlink(name.c_str()) != 0) throw_os(name);
}

ShmLink::Channel& ShmLink::at(int ch, bool writer) {
  if (ch < 0 || ch >= static_cast<int>(channels_.size()) || channels_[ch].h == nullptr)
    throw py::index_error("no channel " + std::to_string(ch));
  Channel& c = channels_[ch];
  if (c.writer != writer)
    throw py::value_error("channel " + std::to_string(ch) + (writer ? " is read" : " is written") +
                          " by this process");
  return c;
}

std::uint64_t ShmLink::capacity(int ch) const {
  if (ch < 0 || ch >= static_cast<int>(channels_.size())) throw py::index_error("no channel");
  return channels_[ch].cap;
}

std::size_t ShmLink::staged() const {
  std::size_t n = 0;
  for (const auto& c : channels_) n += c.staged.size();
  return n;
}

std::uint64_t ShmLink::available(const Channel& c) const {
  return c.h->written.load(std::memory_order_seq_cst) - c.pos;
}

void ShmLink::consume(Channel& c, std::uint8_t* dst, std::uint64_t n) {
  if (dst != nullptr) {
    const std::uint64_t at = c.pos % c.cap;
    const std::uint64_t first = std::min(n, c.cap - at);
    std::memcpy(dst, c.data + at, first);
    if (first < n) std::memcpy(dst + first, c.data, n - first);
  }
  c.pos += n;
  // Sequentially consistent: a sleeping writer's flag and this store are
  // ordered both ways (Dekker), so a writer that checked for room before
  // this store is seen asleep here and woken.
  c.h->consumed.store(c.pos, std::memory_order_seq_cst);
  if (c.h->writer_sleeps.load(std::memory_order_seq_cst)) {
    c.h->space_seq.fetch_add(1, std::memory_order_release);
    futex(&c.h->space_seq, FUTEX_WAKE, 1, nullptr);
  }
}

bool ShmLink::try_frame(Channel& c) {
  if (c.in_body) return true;
  if (available(c) < kFrame) return false;
  std::uint64_t frame[2];
  consume(c, reinterpret_cast<std::uint8_t*>(frame), kFrame);
  c.tag = frame[0];
  c.len = frame[1];
  c.got = 0;
  c.in_body = true;
  c.partial.clear();
  return true;
}

void ShmLink::drain_one(Channel& c) {
  for (;;) {
    if (!try_frame(c)) return;
    const std::uint64_t body = padded(c.len);
    if (c.partial.size() < c.len) c.partial.resize(c.len);
    const std::uint64_t n = std::min(available(c), body - c.got);
    if (n == 0 && c.got < body) return;
    // Body bytes go to `partial`; the padding after them is skipped.
    const std::uint64_t data_n = c.got < c.len ? std::min(n, c.len - c.got) : 0;
    consume(c, c.partial.data() + c.got, data_n);
    consume(c, nullptr, n - data_n);
    c.got += n;
    if (c.got < body) return;
    c.staged.push_back({c.tag, std::move(c.partial)});
    ++staged_total_;
    c.partial = {};
    c.in_body = false;
  }
}

void ShmLink::drain(int except) {
  for (int i = 0; i < static_cast<int>(channels_.size()); ++i) {
    Channel& c = channels_[i];
    if (i == except || c.writer || c.h == nullptr) continue;
    // A message `next` announced stays where it is: `read` takes it.
    if (c.announced != kNone) continue;
    drain_one(c);
  }
}

int ShmLink::check_peer(Channel& c, std::int64_t now) {
  const std::uint32_t theirs = c.writer ? kReaderAborted : kWriterAborted;
  if (c.h->aborted.load(std::memory_order_acquire) & theirs) return kAborted;
  if (now >= c.next_check_ns) {
    c.next_check_ns = now + kLivenessNs;
    const std::int32_t pid = (c.writer ? c.h->reader_pid : c.h->writer_pid).load();
    if (!alive(pid)) return kPeerGone;
  }
  return kOk;
}

template <class Ready>
int ShmLink::wait(Channel& c, int ch, bool for_data, std::int64_t deadline, Ready ready) {
  if (ready()) return kOk;
  const std::int64_t start = now_ns();
  const std::int64_t spin_end = std::min(deadline, start + static_cast<std::int64_t>(spin_ * 1e9));
  c.next_check_ns = start + kLivenessNs;
  for (unsigned n = 1; now_ns() < spin_end || n == 1; ++n) {
    for (int k = 0; k < 64; ++k) {
      if (ready()) return kOk;
      cpu_relax();
    }
    drain(ch);
    if (ready()) return kOk;
    if (int s = check_peer(c, now_ns())) return s;
    if (n % 16 == 0) std::this_thread::yield();
    if (spin_end <= start) break;
  }
  auto& sleeps = for_data ? c.h->reader_sleeps : c.h->writer_sleeps;
  auto& seq = for_data ? c.h->data_seq : c.h->space_seq;
  for (;;) {
    sleeps.store(1, std::memory_order_seq_cst);  // then `ready` reads the counter (seq_cst)
    const std::uint32_t seen = seq.load(std::memory_order_acquire);
    if (ready()) {
      sleeps.store(0, std::memory_order_relaxed);
      return kOk;
    }
    const std::int64_t now = now_ns();
    if (int s = check_peer(c, now)) {
      sleeps.store(0, std::memory_order_relaxed);
      return s;
    }
    if (now >= deadline) {
      sleeps.store(0, std::memory_order_relaxed);
      return kTimeout;
    }
    const std::int64_t nap = std::min(kSliceNs, deadline - now);
    timespec ts{static_cast<time_t>(nap / 1'000'000'000), static_cast<long>(nap % 1'000'000'000)};
    futex(&seq, FUTEX_WAIT, seen, &ts);
    sleeps.store(0, std::memory_order_relaxed);
    drain(ch);
  }
}

int ShmLink::put(Channel& c, int ch, const std::uint8_t* src, std::uint64_t n,
                 std::int64_t deadline) {
  static const std::uint8_t zeros[256] = {};
  auto space = [&c] { return c.cap - (c.pos - c.h->consumed.load(std::memory_order_seq_cst)); };
  std::uint64_t done = 0;
  while (done < n) {
    std::uint64_t free = space();
    if (free == 0) {
      if (int s = wait(c, ch, false, deadline, [&] { return space() > 0; })) return s;
      free = space();
    }
    std::uint64_t k = std::min(free, n - done);
    if (src == nullptr) k = std::min<std::uint64_t>(k, sizeof(zeros));
    const std::uint8_t* from = src != nullptr ? src + done : zeros;
    const std::uint64_t at = c.pos % c.cap;
    const std::uint64_t first = std::min(k, c.cap - at);
    std::memcpy(c.data + at, from, first);
    if (first < k) std::memcpy(c.data, from + first, k - first);
    c.pos += k;
    done += k;
    c.h->written.store(c.pos, std::memory_order_seq_cst);  // ordered against reader_sleeps
    if (c.h->reader_sleeps.load(std::memory_order_seq_cst)) {
      c.h->data_seq.fetch_add(1, std::memory_order_release);
      futex(&c.h->data_seq, FUTEX_WAKE, 1, nullptr);
    }
  }
  return kOk;
}

int ShmLink::send(int ch, std::uint64_t tag, std::uintptr_t src, std::uint64_t nbytes,
                  double timeout) {
  return send_regions(ch, tag, nbytes, {0}, {src}, {nbytes}, timeout);
}

int ShmLink::send_regions(int ch, std::uint64_t tag, std::uint64_t total,
                          const std::vector<std::uint64_t>& offsets,
                          const std::vector<std::uintptr_t>& addrs,
                          const std::vector<std::uint64_t>& sizes, double timeout) {
  Channel& c = at(ch, true);
  if (offsets.size() != addrs.size() || offsets.size() != sizes.size())
    throw py::value_error("offsets, addrs and sizes must have one entry per region");
  std::uint64_t end = 0;
  for (std::size_t i = 0; i < offsets.size(); ++i) {
    if (offsets[i] < end || offsets[i] + sizes[i] > total)
      throw py::value_error("regions must be ascending, disjoint and within the message");
    end = offsets[i] + sizes[i];
  }
  const std::uint64_t frame[2] = {tag, total};
  py::gil_scoped_release nogil;
  const std::int64_t deadline = deadline_after(timeout);
  if (c.h->aborted.load(std::memory_order_acquire) & kReaderAborted) return kAborted;
  if (int s = put(c, ch, reinterpret_cast<const std::uint8_t*>(frame), kFrame, deadline)) return s;
  std::uint64_t pos = 0;
  for (std::size_t i = 0; i < offsets.size(); ++i) {
    if (int s = put(c, ch, nullptr, offsets[i] - pos, deadline)) return s;
    if (int s = put(c, ch, reinterpret_cast<const std::uint8_t*>(addrs[i]), sizes[i], deadline))
      return s;
    pos = offsets[i] + sizes[i];
  }
  return put(c, ch, nullptr, padded(total) - pos, deadline);
}

py::tuple ShmLink::next(int ch, double timeout) {
  Channel& c = at(ch, false);
  int status = kOk;
  {
    py::gil_scoped_release nogil;
    if (!c.staged.empty()) {
      c.announced = kStagedFront;
    } else {
      status = wait(c, ch, true, deadline_after(timeout), [&] { return try_frame(c); });
      if (status == kOk) c.announced = kRingFront;
    }
  }
  if (status != kOk) return py::make_tuple(status, 0, 0);
  if (c.announced == kStagedFront)
    return py::make_tuple(0, c.staged.front().tag, c.staged.front().data.size());
  return py::make_tuple(0, c.tag, c.len);
}

int ShmLink::read(int ch, std::uintptr_t dst_addr, double timeout) {
  Channel& c = at(ch, false);
  auto* dst = reinterpret_cast<std::uint8_t*>(dst_addr);
  py::gil_scoped_release nogil;
  if (c.announced == kNone) throw std::logic_error("ShmLink.read without a message from next()");
  if (c.announced == kStagedFront) {
    Staged& s = c.staged.front();
    std::memcpy(dst, s.data.data(), s.data.size());
    c.staged.pop_front();
    c.announced = kNone;
    return kOk;
  }
  // Whatever a drain took in since `next` first, then straight from the ring.
  const std::uint64_t body = padded(c.len);
  if (c.got > 0) std::memcpy(dst, c.partial.data(), std::min(c.got, c.len));
  const std::int64_t deadline = deadline_after(timeout);
  while (c.got < body) {
    std::uint64_t n = std::min(available(c), body - c.got);
    if (n == 0) {
      if (int s = wait(c, ch, true, deadline, [&] { return available(c) > 0; })) return s;
      continue;
    }
    const std::uint64_t data_n = c.got < c.len ? std::min(n, c.len - c.got) : 0;
    consume(c, dst + c.got, data_n);
    consume(c, nullptr, n - data_n);
    c.got += n;
  }
  c.in_body = false;
  c.partial = {};
  c.announced = kNone;
  return kOk;
}

void ShmLink::abort(const std::string& reason) {
  const std::size_t n = std::min(reason.size(), kReason);
  for (auto& c : channels_) {
    if (c.h == nullptr) continue;
    const int side = c.writer ? 0 : 1;
    std::memcpy(c.h->reason[side], reason.data(), n);
    c.h->reason_len[side] = static_cast<std::uint32_t>(n);
    c.h->aborted.fetch_or(c.writer ? kWriterAborted : kReaderAborted, std::memory_order_release);
    // Wake a peer asleep on either futex of the channel.
    c.h->data_seq.fetch_add(1, std::memory_order_release);
    c.h->space_seq.fetch_add(1, std::memory_order_release);
    futex(&c.h->data_seq, FUTEX_WAKE, 1, nullptr);
    futex(&c.h->space_seq, FUTEX_WAKE, 1, nullptr);
  }
}

std::string ShmLink::peer_reason(int ch) const {
  if (ch < 0 || ch >= static_cast<int>(channels_.size()) || channels_[ch].h == nullptr)
    throw py::index_error("no channel " + std::to_string(ch));
  const Channel& c = channels_[ch];
  const int side = c.writer ? 1 : 0;
  if (!(c.h->aborted.load(std::memory_order_acquire) & (c.writer ? kReaderAborted : kWriterAborted)))
    return "";
  return std::string(c.h->reason[side], std::min<std::size_t>(c.h->reason_len[side], kReason));
}

}  // namespace fastpipe
