// The CUDA runtime, resolved at run time: fastpipe compiles against the CUDA
// headers but never links libcudart, so one build imports everywhere and, on
// a GPU machine, uses the very libcudart that torch has already loaded.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

namespace fastpipe {

// Function pointers into libcudart, filled by dlsym.
struct CudaApi {
  decltype(&cudaGetDeviceCount) GetDeviceCount = nullptr;
  decltype(&cudaGetDevice) GetDevice = nullptr;
  decltype(&cudaSetDevice) SetDevice = nullptr;
  decltype(&cudaGetErrorString) GetErrorString = nullptr;
  decltype(&cudaDeviceGetStreamPriorityRange) DeviceGetStreamPriorityRange = nullptr;
  decltype(&cudaStreamCreateWithPriority) StreamCreateWithPriority = nullptr;
  decltype(&cudaStreamDestroy) StreamDestroy = nullptr;
  decltype(&cudaStreamSynchronize) StreamSynchronize = nullptr;
  decltype(&cudaStreamWaitEvent) StreamWaitEvent = nullptr;
  decltype(&cudaEventCreateWithFlags) EventCreateWithFlags = nullptr;
  decltype(&cudaEventDestroy) EventDestroy = nullptr;
  decltype(&cudaEventRecord) EventRecord = nullptr;
  decltype(&cudaEventQuery) EventQuery = nullptr;
  decltype(&cudaEventSynchronize) EventSynchronize = nullptr;
  decltype(&cudaMemcpyPeerAsync) MemcpyPeerAsync = nullptr;

  bool loaded = false;
  std::string library;  // the soname that was found, e.g. "libcudart.so.12"
  std::string error;    // why loading failed, when it did
};

// Loads libcudart once (thread-safe) and returns the table. Never throws.
const CudaApi& cuda_api();

// Returns the table or throws RuntimeError saying why CUDA is unusable.
const CudaApi& cuda_api_or_throw();

// Throws RuntimeError("<what>: <cuda error string>") unless `status` is success.
void cuda_check(cudaError_t status, const char* what);

}  // namespace fastpipe
