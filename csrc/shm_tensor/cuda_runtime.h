// The CUDA runtime (libcudart), loaded with dlopen on first use, so that one CPU-only build of
// shm_tensor._C serves CPU and GPU machines: no CUDA headers or libraries at build time. Only the
// few entry points shm_tensor needs are resolved; their types and constants are declared here with
// the values of CUDA's own headers (driver_types.h), which are part of CUDA's stable ABI.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace shm_tensor {
namespace cuda {

using Error = int;  // cudaError_t; 0 is cudaSuccess
using Stream = void*;  // cudaStream_t (a CUstream)
using Event = void*;   // cudaEvent_t (a CUevent)

constexpr Error kSuccess = 0;
constexpr Error kErrorNotReady = 600;  // cudaErrorNotReady
constexpr unsigned kStreamNonBlocking = 0x01;      // cudaStreamNonBlocking
constexpr unsigned kEventDisableTiming = 0x02;     // cudaEventDisableTiming
constexpr unsigned kEventInterprocess = 0x04;      // cudaEventInterprocess
constexpr unsigned kIpcMemLazyEnablePeerAccess = 0x01;  // cudaIpcMemLazyEnablePeerAccess
constexpr int kMemcpyDefault = 4;  // cudaMemcpyDefault: direction from unified virtual addresses

// cudaIpcMemHandle_t and cudaIpcEventHandle_t: 64 opaque bytes each (CUDA_IPC_HANDLE_SIZE).
struct IpcMemHandle {
  char reserved[64];
};
struct IpcEventHandle {
  char reserved[64];
};
static_assert(sizeof(IpcMemHandle) == 64 && sizeof(IpcEventHandle) == 64, "CUDA IPC handle size");

// Entry points of libcudart. Every pointer is resolved when load succeeds.
struct Runtime {
  Error (*GetDevice)(int*);
  Error (*SetDevice)(int);
  Error (*Malloc)(void**, size_t);
  Error (*Free)(void*);
  Error (*IpcGetMemHandle)(IpcMemHandle*, void*);
  Error (*IpcOpenMemHandle)(void**, IpcMemHandle, unsigned);
  Error (*IpcCloseMemHandle)(void*);
  Error (*StreamCreateWithFlags)(Stream*, unsigned);
  Error (*StreamDestroy)(Stream);
  Error (*StreamWaitEvent)(Stream, Event, unsigned);
  Error (*MemcpyAsync)(void*, const void*, size_t, int, Stream);
  Error (*EventCreateWithFlags)(Event*, unsigned);
  Error (*EventDestroy)(Event);
  Error (*EventRecord)(Event, Stream);
  Error (*EventQuery)(Event);
  Error (*IpcGetEventHandle)(IpcEventHandle*, Event);
  Error (*IpcOpenEventHandle)(Event*, IpcEventHandle);
  const char* (*GetErrorString)(Error);
  // The driver's cuMemGetAddressRange_v2 (CUresult, CUdeviceptr* base, size_t* size, CUdeviceptr):
  // the allocation that holds a pointer, so a tensor inside a caching-allocator block can be
  // exported by its allocation's IPC handle plus an offset. Resolved from the loaded library first
  // (the fake runtime has it), else from libcuda.so.1; nullptr when neither has it (then device
  // messages go through the sender's staging pool).
  int (*MemGetAddressRange)(unsigned long long*, size_t*, unsigned long long) = nullptr;
  // True for the fake runtime of the tests (it exports fake_cudart_is_fake): host memory stands for
  // device memory, so CPU tensors may take the CUDA path (ContextConfig::host_tensors_by_cuda_ipc).
  bool fake = false;
  std::string library;  // what was loaded
};

// Extra libraries to try after the standard names (Python adds the one torch's install suggests).
// Only effective before the first load attempt.
void add_runtime_candidates(const std::vector<std::string>& paths);

// The loaded runtime, or nullptr; `why` then says what was tried and how each attempt failed. The
// environment variable SHM_TENSOR_CUDART, when set, replaces the candidate list (tests use it to
// simulate a machine without CUDA). Loaded once per process; later calls return the same result.
const Runtime* runtime(std::string* why = nullptr);

// The loaded runtime; throws std::invalid_argument(describe(call, peer, tag, ...)) when it is absent.
const Runtime& runtime_or_throw(const char* call, int peer, int64_t tag);

// Throws dpp_errors::TransportError naming the CUDA call, the peer and the tag when error != 0.
void check(Error error, const char* cuda_call, const char* call, int peer, int64_t tag);

}  // namespace cuda
}  // namespace shm_tensor
