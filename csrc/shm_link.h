// Same-host links between the processes of a CPU pipeline: one byte ring per
// direction in POSIX shared memory, written by one process, read by another.
//
// Why: gloo's P2P over loopback TCP costs every message a socket write and
// two thread wake-ups on the receiving side (gloo's loop thread, then the
// waiting one). With both cores busy, an isend of 2 KB took ~90 us and its
// wait ~60 us on the 2-core benchmark machine, once per microbatch and
// direction, on the critical path of a narrow pipeline. Here a message is
// one memcpy into the ring and one atomic store; a receiver waits with the
// GIL released, spinning for a bounded time first (the message is then one
// cache line away), then on a futex in the shared memory, which a writer
// only touches when the reader sleeps.
//
// Framing: [tag u64][length u64][payload][padding to 8 bytes]. A message
// longer than the free space streams through the ring as the reader takes
// it. The reader learns a message's length from its frame, so there is no
// size protocol: `next` returns (tag, length), the caller provides a buffer
// of that length, `read` fills it.
//
// Deadlock freedom: a rank blocked on one channel (a full ring to a peer,
// or a message that has not come yet) keeps taking in what its other
// incoming channels hold, into private memory ("staged" messages, returned
// by `next` first, in order). Two ranks each sending to the other more than
// a ring holds therefore both make progress.
//
// Failures: `abort(reason)` marks every channel of this link (both
// directions); a peer waiting on one of them gets kAborted and the reason,
// once nothing published before the abort is left to take. A peer process
// that dies is noticed within ~20 ms by a liveness check of its pid (a
// zombie counts as dead). Every wait has a deadline (kTimeout).
//
// One thread at a time: a link has no lock (its one user is a rank's
// executor thread).
#pragma once

#include <pybind11/pybind11.h>

#include <atomic>
#include <cstdint>
#include <deque>
#include <string>
#include <vector>

namespace fastpipe {

namespace py = pybind11;

struct ShmHeader;

class ShmLink {
 public:
  enum Status : int { kOk = 0, kAborted = 1, kTimeout = 2, kPeerGone = 3 };

  // `spin`: seconds a wait busy-polls before it sleeps (0: sleep at once).
  explicit ShmLink(double spin);
  ~ShmLink();
  ShmLink(const ShmLink&) = delete;
  ShmLink& operator=(const ShmLink&) = delete;

  // Maps the shared-memory object `name` ("/..."), creating it (exclusively,
  // `capacity` ring bytes) when `create`. `writer`: this process writes into
  // it. Returns the channel's index. Raises OSError.
  int open(const std::string& name, bool create, bool writer, std::uint64_t capacity);
  // Removes `name` from the namespace (mappings stay valid). Raises OSError.
  static void unlink(const std::string& name);

  // Writer. Copies `nbytes` from `src` into the ring (GIL released).
  int send(int ch, std::uint64_t tag, std::uintptr_t src, std::uint64_t nbytes, double timeout);
  // Writer. One message of `total` bytes gathered from host regions: region
  // i (`sizes[i]` bytes at `addrs[i]`) lands at `offsets[i]` (ascending, not
  // overlapping); the gaps between them are zeros. Saves packing into a
  // send buffer first.
  int send_regions(int ch, std::uint64_t tag, std::uint64_t total,
                   const std::vector<std::uint64_t>& offsets, const std::vector<std::uintptr_t>& addrs,
                   const std::vector<std::uint64_t>& sizes, double timeout);
  // Reader. Waits for the next message: (status, tag, length) (GIL released).
  py::tuple next(int ch, double timeout);
  // Reader. Copies the message `next` returned into `dst` (its length).
  int read(int ch, std::uintptr_t dst, double timeout);
  // Marks every channel aborted with `reason` (kept to 1 KiB).
  void abort(const std::string& reason);
  // What the peer on `ch` gave as its reason when it aborted.
  std::string peer_reason(int ch) const;
  std::uint64_t capacity(int ch) const;
  int channels() const { return static_cast<int>(channels_.size()); }
  // Staged messages (taken in while waiting elsewhere) across all channels.
  std::size_t staged() const;
  // Messages ever staged (tests: to see that draining happened).
  std::uint64_t staged_total() const { return staged_total_; }
  void close();

 private:
  enum Announced : int { kNone = 0, kStagedFront = 1, kRingFront = 2 };
  struct Staged {
    std::uint64_t tag;
    std::vector<std::uint8_t> data;
  };
  struct Channel {
    std::string name;
    ShmHeader* h = nullptr;
    std::uint8_t* data = nullptr;
    std::size_t map_len = 0;
    std::uint64_t cap = 0;
    bool writer = false;
    std::uint64_t pos = 0;  // writer: bytes written; reader: bytes consumed
    // Reader: the message at the front of the ring, once its frame is read.
    bool in_body = false;
    std::uint64_t tag = 0, len = 0, got = 0;  // got: body bytes (with padding) consumed
    std::vector<std::uint8_t> partial;         // body bytes taken in by a drain
    std::deque<Staged> staged;                 // complete messages taken in by a drain
    int announced = kNone;                     // what `next` returned, for `read`
    std::int64_t next_check_ns = 0;            // peer liveness: when to look again
  };

  Channel& at(int ch, bool writer);
  // Reader: bytes published and not consumed.
  std::uint64_t available(const Channel& c) const;
  // Reader: copies `n` ring bytes (dst may be null: skip them), publishes the space.
  void consume(Channel& c, std::uint8_t* dst, std::uint64_t n);
  // Reader: reads the frame of the front message if it is all there.
  bool try_frame(Channel& c);
  // Takes in what every reading channel but `except` holds (see above).
  void drain(int except);
  void drain_one(Channel& c);
  // Why waiting on `c` cannot succeed (kAborted / kPeerGone), or kOk.
  int check_peer(Channel& c, std::int64_t now_ns);
  template <class Ready>
  int wait(Channel& c, int ch, bool for_data, std::int64_t deadline_ns, Ready ready);
  // Writer: appends `n` bytes from `src` (null: zeros) to the ring, waiting for room.
  int put(Channel& c, int ch, const std::uint8_t* src, std::uint64_t n, std::int64_t deadline);

  const double spin_;
  std::vector<Channel> channels_;
  std::uint64_t staged_total_ = 0;
};

}  // namespace fastpipe
