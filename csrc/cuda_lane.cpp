// CUDA streams and events owned by fastpipe.
#include "cuda_lane.h"

#include <mutex>

#include "checks.h"

namespace fastpipe {

DeviceGuard::DeviceGuard(int device) {
  const CudaApi& api = cuda_api_or_throw();
  cuda_check(api.GetDevice(&previous_), "cudaGetDevice");
  if (previous_ != device) cuda_check(api.SetDevice(device), "cudaSetDevice");
}

DeviceGuard::~DeviceGuard() {
  int now = -1;
  const CudaApi& api = cuda_api();
  if (api.GetDevice(&now) == cudaSuccess && now != previous_) api.SetDevice(previous_);
}

CudaStream::CudaStream(int device, int priority) : device_(device), priority_(priority) {
  const CudaApi& api = cuda_api_or_throw();
  int count = 0;
  cuda_check(api.GetDeviceCount(&count), "cudaGetDeviceCount");
  FP_CHECK_VALUE(device >= 0 && device < count, "device ", device, " out of range: ", count,
                 " CUDA devices");
  DeviceGuard guard(device);
  int least = 0, greatest = 0;  // CUDA: lower numbers are higher priority
  cuda_check(api.DeviceGetStreamPriorityRange(&least, &greatest),
             "cudaDeviceGetStreamPriorityRange");
  FP_CHECK_VALUE(priority <= least && priority >= greatest, "priority ", priority,
                 " outside this device's range [", greatest, ", ", least, "]");
  cuda_check(api.StreamCreateWithPriority(&stream_, cudaStreamNonBlocking, priority),
             "cudaStreamCreateWithPriority");
}

CudaStream::~CudaStream() {
  if (stream_ != nullptr) cuda_api().StreamDestroy(stream_);
}

CudaStream& process_stream(int device, int priority) {
  // Both leaked on purpose: no destructor at exit, and LeakSanitizer sees
  // the streams as reachable from a global.
  static auto* mutex = new std::mutex;
  static auto* streams = new std::vector<CudaStream*>;
  auto* stream = new CudaStream(device, priority);  // throws before anything is kept
  std::lock_guard<std::mutex> lock(*mutex);
  streams->push_back(stream);
  return *stream;
}

void CudaStream::synchronize() const {
  cuda_check(cuda_api().StreamSynchronize(stream_), "cudaStreamSynchronize");
}

CudaEvent::CudaEvent() {
  cuda_check(cuda_api_or_throw().EventCreateWithFlags(&event_, cudaEventDisableTiming),
             "cudaEventCreateWithFlags");
}

CudaEvent::~CudaEvent() {
  if (event_ != nullptr) cuda_api().EventDestroy(event_);
}

void CudaEvent::record(cudaStream_t stream) {
  cuda_check(cuda_api().EventRecord(event_, stream), "cudaEventRecord");
}

void CudaEvent::block(cudaStream_t stream) const {
  cuda_check(cuda_api().StreamWaitEvent(stream, event_, 0), "cudaStreamWaitEvent");
}

bool CudaEvent::query() const {
  cudaError_t status = cuda_api().EventQuery(event_);
  if (status == cudaErrorNotReady) return false;
  cuda_check(status, "cudaEventQuery");
  return true;
}

void copy_regions_async(std::uintptr_t dst, int dst_device, const std::vector<std::uintptr_t>& srcs,
                        int src_device, const std::vector<std::size_t>& offsets,
                        const std::vector<std::size_t>& sizes, cudaStream_t stream) {
  FP_CHECK_VALUE(srcs.size() == offsets.size() && srcs.size() == sizes.size(),
                 "srcs, offsets and sizes must have one entry per region, got ", srcs.size(), ", ",
                 offsets.size(), " and ", sizes.size());
  const CudaApi& api = cuda_api_or_throw();
  auto* out = reinterpret_cast<unsigned char*>(dst);
  for (std::size_t i = 0; i < srcs.size(); ++i) {
    if (sizes[i] == 0) continue;
    cuda_check(api.MemcpyPeerAsync(out + offsets[i], dst_device, reinterpret_cast<const void*>(srcs[i]),
                                   src_device, sizes[i], stream),
               "cudaMemcpyPeerAsync");
  }
}

void CudaEvent::synchronize() const {
  cuda_check(cuda_api().EventSynchronize(event_), "cudaEventSynchronize");
}

}  // namespace fastpipe
