// CUDA streams and events owned by fastpipe (RAII), the GPU backend of a lane.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "cuda_runtime.h"

namespace fastpipe {

// A stream created by fastpipe with a chosen priority, rather than borrowed
// from torch's pool of 32 per device, which hands the same stream to
// unrelated users. Its handle goes to torch as torch.cuda.ExternalStream.
// The destructor destroys the stream: only for streams torch never ran work
// on. Lanes take theirs from process_stream(), which never destroys one.
class CudaStream {
 public:
  CudaStream(int device, int priority);
  ~CudaStream();
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;

  cudaStream_t get() const { return stream_; }
  int device() const { return device_; }
  int priority() const { return priority_; }
  void synchronize() const;

 private:
  cudaStream_t stream_ = nullptr;
  int device_;
  int priority_;
};

// A new stream that lives until the process exits: never destroyed, not even
// by static destructors or the interpreter's teardown, because torch keeps
// the handles of streams it ran work on (autograd nodes, caching-allocator
// blocks) where fastpipe cannot clear them. Reuse (leasing) is Python's
// job: fastpipe/runtime/streams.py, which also argues the design.
CudaStream& process_stream(int device, int priority);

// An event without timing (cheaper to record and wait on).
class CudaEvent {
 public:
  CudaEvent();
  ~CudaEvent();
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;

  void record(cudaStream_t stream);
  // Makes `stream` wait on the GPU (the host does not block).
  void block(cudaStream_t stream) const;
  bool query() const;
  void synchronize() const;

 private:
  cudaEvent_t event_ = nullptr;
};

// Enqueues, on `stream` (a stream of `src_device`), one cudaMemcpyPeerAsync
// per region: `sizes[i]` bytes from `srcs[i]` on `src_device` to
// `dst + offsets[i]` on `dst_device` (the same device is allowed). The copies
// are ordered after whatever `stream` already waits for and nothing else:
// the caller makes `stream` wait on the producer's event first.
void copy_regions_async(std::uintptr_t dst, int dst_device, const std::vector<std::uintptr_t>& srcs,
                        int src_device, const std::vector<std::size_t>& offsets,
                        const std::vector<std::size_t>& sizes, cudaStream_t stream);

// Runs `fn` with `device` current, restoring the caller's device after.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

}  // namespace fastpipe
