#include "cuda_runtime.h"

#include <dlfcn.h>

#include <cstdlib>
#include <memory>
#include <mutex>
#include <sstream>
#include <stdexcept>

#include "../common/errors.h"

namespace shm_tensor {
namespace cuda {

namespace {

std::mutex g_mutex;
std::vector<std::string> g_extra_candidates;
bool g_attempted = false;
std::unique_ptr<Runtime> g_runtime;
std::string g_failure;

std::vector<std::string> candidates() {
  const char* forced = std::getenv("SHM_TENSOR_CUDART");
  if (forced != nullptr && forced[0] != '\0') return {forced};
  std::vector<std::string> names = {"libcudart.so", "libcudart.so.12", "libcudart.so.13"};
  names.insert(names.end(), g_extra_candidates.begin(), g_extra_candidates.end());
  return names;
}

template <typename Fn>
bool resolve(void* library, const char* symbol, Fn* slot, std::string* missing) {
  void* address = ::dlsym(library, symbol);
  if (address == nullptr) {
    *missing += std::string(missing->empty() ? "" : ", ") + symbol;
    return false;
  }
  *slot = reinterpret_cast<Fn>(address);
  return true;
}

// Fills `runtime` from `library`; false with the missing symbol names otherwise.
bool resolve_all(void* library, Runtime* runtime, std::string* missing) {
  bool ok = true;
  ok &= resolve(library, "cudaGetDevice", &runtime->GetDevice, missing);
  ok &= resolve(library, "cudaSetDevice", &runtime->SetDevice, missing);
  ok &= resolve(library, "cudaMalloc", &runtime->Malloc, missing);
  ok &= resolve(library, "cudaFree", &runtime->Free, missing);
  ok &= resolve(library, "cudaIpcGetMemHandle", &runtime->IpcGetMemHandle, missing);
  ok &= resolve(library, "cudaIpcOpenMemHandle", &runtime->IpcOpenMemHandle, missing);
  ok &= resolve(library, "cudaIpcCloseMemHandle", &runtime->IpcCloseMemHandle, missing);
  ok &= resolve(library, "cudaStreamCreateWithFlags", &runtime->StreamCreateWithFlags, missing);
  ok &= resolve(library, "cudaStreamDestroy", &runtime->StreamDestroy, missing);
  ok &= resolve(library, "cudaStreamWaitEvent", &runtime->StreamWaitEvent, missing);
  ok &= resolve(library, "cudaMemcpyAsync", &runtime->MemcpyAsync, missing);
  ok &= resolve(library, "cudaEventCreateWithFlags", &runtime->EventCreateWithFlags, missing);
  ok &= resolve(library, "cudaEventDestroy", &runtime->EventDestroy, missing);
  ok &= resolve(library, "cudaEventRecord", &runtime->EventRecord, missing);
  ok &= resolve(library, "cudaEventQuery", &runtime->EventQuery, missing);
  ok &= resolve(library, "cudaIpcGetEventHandle", &runtime->IpcGetEventHandle, missing);
  ok &= resolve(library, "cudaIpcOpenEventHandle", &runtime->IpcOpenEventHandle, missing);
  ok &= resolve(library, "cudaGetErrorString", &runtime->GetErrorString, missing);
  return ok;
}

// Optional entry points: the driver's address-range query and the fake runtime's marker.
void resolve_driver_entry_points(void* library, Runtime* runtime) {
  using RangeFn = int (*)(unsigned long long*, size_t*, unsigned long long);
  void* range = ::dlsym(library, "cuMemGetAddressRange_v2");
  if (range == nullptr) {
    // The driver is loaded already wherever the runtime works; RTLD_NOLOAD first, never a second one.
    void* driver = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
    if (driver == nullptr) driver = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (driver != nullptr) range = ::dlsym(driver, "cuMemGetAddressRange_v2");
  }
  runtime->MemGetAddressRange = reinterpret_cast<RangeFn>(range);
  runtime->fake = ::dlsym(library, "fake_cudart_is_fake") != nullptr;
}

void load_locked() {
  g_attempted = true;
  std::vector<std::string> names = candidates();
  std::ostringstream failures;
  // First pass: a libcudart torch already loaded (same runtime state as torch); second: any.
  for (int flags : {RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD, RTLD_NOW | RTLD_LOCAL}) {
    for (const std::string& name : names) {
      void* library = ::dlopen(name.c_str(), flags);
      if (library == nullptr) {
        if (!(flags & RTLD_NOLOAD)) {
          const char* error = ::dlerror();
          failures << "\n  dlopen(" << name << "): " << (error ? error : "failed");
        }
        continue;
      }
      auto runtime = std::make_unique<Runtime>();
      std::string missing;
      if (!resolve_all(library, runtime.get(), &missing)) {
        if (!(flags & RTLD_NOLOAD)) failures << "\n  " << name << ": missing symbols " << missing;
        ::dlclose(library);
        continue;
      }
      // Kept open for the life of the process: handles it created may be released at exit.
      runtime->library = name;
      resolve_driver_entry_points(library, runtime.get());
      g_runtime = std::move(runtime);
      return;
    }
  }
  g_failure = "could not load the CUDA runtime (libcudart); tried:" + failures.str();
}

}  // namespace

void add_runtime_candidates(const std::vector<std::string>& paths) {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_extra_candidates.insert(g_extra_candidates.end(), paths.begin(), paths.end());
}

const Runtime* runtime(std::string* why) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (!g_attempted) load_locked();
  if (g_runtime == nullptr && why != nullptr) *why = g_failure;
  return g_runtime.get();
}

const Runtime& runtime_or_throw(const char* call, int peer, int64_t tag) {
  std::string why;
  const Runtime* loaded = runtime(&why);
  if (loaded == nullptr) {
    throw std::invalid_argument(dpp_errors::describe(
        call, peer, tag, why + "\nuse --p2p-transport torch for GPU tensors on this machine"));
  }
  return *loaded;
}

void check(Error error, const char* cuda_call, const char* call, int peer, int64_t tag) {
  if (error == kSuccess) return;
  std::string name = "unknown error";
  const Runtime* loaded = runtime();
  if (loaded != nullptr) {
    const char* text = loaded->GetErrorString(error);
    if (text != nullptr) name = text;
  }
  std::ostringstream what;
  what << cuda_call << " failed: " << name << " (cudaError " << error << ")";
  throw dpp_errors::TransportError(dpp_errors::describe(call, peer, tag, what.str()));
}

}  // namespace cuda
}  // namespace shm_tensor
