// Run-time resolution of the CUDA runtime (see cuda_runtime.h).
#include "cuda_runtime.h"

#include <dlfcn.h>

#include <stdexcept>

#include "checks.h"

namespace fastpipe {

namespace {

template <typename Fn>
bool resolve(void* lib, const char* name, Fn& slot, std::string& error) {
  slot = reinterpret_cast<Fn>(dlsym(lib, name));
  if (slot == nullptr && error.empty()) error = fp_msg("symbol ", name, " missing");
  return slot != nullptr;
}

CudaApi load() {
  CudaApi api;
  // Prefer a runtime already in the process (torch's), then any on the path.
  static const char* names[] = {"libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0",
                                "libcudart.so"};
  void* lib = nullptr;
  for (int pass = 0; pass < 2 && lib == nullptr; ++pass) {
    for (const char* name : names) {
      lib = dlopen(name, pass == 0 ? (RTLD_NOW | RTLD_NOLOAD) : (RTLD_NOW | RTLD_LOCAL));
      if (lib != nullptr) {
        api.library = name;
        break;
      }
    }
  }
  if (lib == nullptr) {
    api.error = "no libcudart found (import torch with CUDA first, or add it to LD_LIBRARY_PATH)";
    return api;
  }
  std::string& e = api.error;
  bool ok = resolve(lib, "cudaGetDeviceCount", api.GetDeviceCount, e) &
            resolve(lib, "cudaGetDevice", api.GetDevice, e) &
            resolve(lib, "cudaSetDevice", api.SetDevice, e) &
            resolve(lib, "cudaGetErrorString", api.GetErrorString, e) &
            resolve(lib, "cudaDeviceGetStreamPriorityRange", api.DeviceGetStreamPriorityRange, e) &
            resolve(lib, "cudaStreamCreateWithPriority", api.StreamCreateWithPriority, e) &
            resolve(lib, "cudaStreamDestroy", api.StreamDestroy, e) &
            resolve(lib, "cudaStreamSynchronize", api.StreamSynchronize, e) &
            resolve(lib, "cudaStreamWaitEvent", api.StreamWaitEvent, e) &
            resolve(lib, "cudaEventCreateWithFlags", api.EventCreateWithFlags, e) &
            resolve(lib, "cudaEventDestroy", api.EventDestroy, e) &
            resolve(lib, "cudaEventRecord", api.EventRecord, e) &
            resolve(lib, "cudaEventQuery", api.EventQuery, e) &
            resolve(lib, "cudaEventSynchronize", api.EventSynchronize, e) &
            resolve(lib, "cudaMemcpyPeerAsync", api.MemcpyPeerAsync, e);
  if (!ok) {
    api.error = fp_msg(api.library, ": ", api.error);
    return api;
  }
  int count = 0;
  cudaError_t status = api.GetDeviceCount(&count);
  if (status != cudaSuccess || count == 0) {
    api.error = fp_msg(api.library, " loaded but no usable device: ",
                       status != cudaSuccess ? api.GetErrorString(status) : "0 devices");
    return api;
  }
  api.loaded = true;
  return api;
}

}  // namespace

const CudaApi& cuda_api() {
  static const CudaApi api = load();  // magic static: loaded once, thread-safe
  return api;
}

const CudaApi& cuda_api_or_throw() {
  const CudaApi& api = cuda_api();
  FP_CHECK_STATE(api.loaded, "CUDA is unavailable: ", api.error);
  return api;
}

void cuda_check(cudaError_t status, const char* what) {
  if (status == cudaSuccess) return;
  throw std::runtime_error(fp_msg(what, ": ", cuda_api().GetErrorString(status)));
}

}  // namespace fastpipe
