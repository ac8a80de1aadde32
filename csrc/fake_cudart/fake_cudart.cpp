// A fake CUDA runtime (libcudart) for CI machines without a GPU. shm_tensor loads it instead of the
// real one when SHM_TENSOR_CUDART names it (csrc/shm_tensor/cuda_runtime.h), so its CUDA-IPC protocol
// between two processes runs on the CPU: "device memory" is host memory, every copy is done at
// enqueue time (streams are mere tokens, events complete when recorded), an opened IPC memory handle
// is a reserved address range whose bytes are read from and written to the exporting process with
// process_vm_readv/writev, and an interprocess event keeps its state in POSIX shared memory.
//
// Only the entry points shm_tensor resolves are exported, with the C signatures and error codes of
// CUDA's headers (driver_types.h), plus fake_cudart_* for tests: a marker and per-call counters.
//
// Environment (all optional):
//   FAKE_CUDART_COPY_DELAY_US=N    each non-empty cudaMemcpyAsync sleeps N µs (a slow copy); read once
//   FAKE_CUDART_REFUSE_EXPORT=1    cudaIpcGetMemHandle refuses memory that cudaMalloc did not return,
//                                  as CUDA does for torch's expandable segments (cuMemCreate)
//
// Reading another process's memory needs ptrace permission: the same uid, and under Yama
// ptrace_scope=1 an explicit allowance, which each exporting process grants once (prctl
// PR_SET_PTRACER_ANY). Test-only code: that allowance lets any same-uid process read the exporter.

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#define FAKE_CUDART_API extern "C" __attribute__((visibility("default")))

namespace {

// cudaError_t values (driver_types.h).
constexpr int kSuccess = 0;
constexpr int kErrorInvalidValue = 1;
constexpr int kErrorMemoryAllocation = 2;
constexpr int kErrorInvalidDevice = 101;
constexpr int kErrorDeviceUninitialized = 201;
constexpr int kErrorOperatingSystem = 304;
constexpr int kErrorInvalidResourceHandle = 400;
constexpr int kErrorNotReady = 600;
constexpr int kErrorLaunchFailure = 719;
constexpr int kCuErrorInvalidValue = 1;  // CUresult CUDA_ERROR_INVALID_VALUE

constexpr unsigned kEventInterprocess = 0x04;  // cudaEventInterprocess
constexpr int kDeviceCount = 8;
constexpr size_t kAlignment = 256;  // cudaMalloc's guaranteed alignment
// An opened handle does not say how large the exported allocation is (a torch CPU tensor has no
// known size), so each opening reserves this much address space: PROT_NONE and MAP_NORESERVE, so it
// costs no memory, only virtual addresses (a 47-bit space holds about 127 such ranges at once).
constexpr size_t kOpenedSpan = size_t{1} << 40;

// The 64 opaque bytes of cudaIpcMemHandle_t / cudaIpcEventHandle_t, and what the fake puts in them.
struct IpcMemHandle {
  char reserved[64];
};
struct IpcEventHandle {
  char reserved[64];
};
constexpr char kMemMagic[8] = {'F', 'A', 'K', 'E', 'M', 'E', 'M', '\0'};
constexpr char kEventMagic[8] = {'F', 'A', 'K', 'E', 'E', 'V', 'T', '\0'};
struct MemHandleLayout {
  char magic[8];
  int64_t pid;       // the exporter
  uint64_t address;  // in the exporter's address space
  char unused[40];
};
struct EventHandleLayout {
  char magic[8];
  char name[56];  // the shm_open name, NUL-terminated
};
static_assert(sizeof(MemHandleLayout) == 64 && sizeof(EventHandleLayout) == 64, "IPC handle size");

// ---------------------------------------------------------------------------------------------
// Call counters: tests check how often the transport opens handles, copies, queries events.

enum Call : int {
  kGetDevice, kSetDevice, kMalloc, kFree, kIpcGetMemHandle, kIpcOpenMemHandle, kIpcCloseMemHandle,
  kStreamCreateWithFlags, kStreamDestroy, kStreamWaitEvent, kMemcpyAsync, kEventCreateWithFlags,
  kEventDestroy, kEventRecord, kEventQuery, kIpcGetEventHandle, kIpcOpenEventHandle, kGetErrorString,
  kMemGetAddressRange, kCallCount
};
constexpr const char* kCallNames[kCallCount] = {
    "cudaGetDevice", "cudaSetDevice", "cudaMalloc", "cudaFree", "cudaIpcGetMemHandle",
    "cudaIpcOpenMemHandle", "cudaIpcCloseMemHandle", "cudaStreamCreateWithFlags", "cudaStreamDestroy",
    "cudaStreamWaitEvent", "cudaMemcpyAsync", "cudaEventCreateWithFlags", "cudaEventDestroy",
    "cudaEventRecord", "cudaEventQuery", "cudaIpcGetEventHandle", "cudaIpcOpenEventHandle",
    "cudaGetErrorString", "cuMemGetAddressRange_v2"};
std::atomic<unsigned long long> g_counts[kCallCount];

void count(Call call) { g_counts[call].fetch_add(1, std::memory_order_relaxed); }

// ---------------------------------------------------------------------------------------------
// Per-thread state: the current device, and the text of the last failure whose code alone says too
// little (cudaGetErrorString returns it, as the message of the caller's check()).

thread_local int t_device = 0;
thread_local std::string t_launch_failure;  // for kErrorLaunchFailure
thread_local std::string t_os_failure;      // for kErrorOperatingSystem

int fail_os(const std::string& what, int error) {
  t_os_failure = "fake cudart: " + what + " failed: " + std::strerror(error);
  return kErrorOperatingSystem;
}

// ---------------------------------------------------------------------------------------------
// RAII owners of what the tables hold.

struct FreeDeleter {
  void operator()(void* memory) const { std::free(memory); }
};

// A mapping made with mmap. release() reports munmap's failure; the destructor (error paths, process
// exit) cannot report it, and munmap of a range this object mapped fails only on a kernel bug.
class Mapping {
 public:
  Mapping() = default;
  Mapping(void* address, size_t size) : address_(address), size_(size) {}
  Mapping(Mapping&& other) noexcept
      : address_(std::exchange(other.address_, nullptr)), size_(other.size_) {}
  Mapping& operator=(Mapping&& other) noexcept {
    std::swap(address_, other.address_);
    std::swap(size_, other.size_);
    return *this;
  }
  Mapping(const Mapping&) = delete;
  ~Mapping() {
    if (address_ != nullptr) ::munmap(address_, size_);
  }
  void* get() const { return address_; }
  int release() {  // 0 or errno
    if (address_ == nullptr) return 0;
    int result = ::munmap(address_, size_);
    address_ = nullptr;
    return result == 0 ? 0 : errno;
  }

 private:
  void* address_ = nullptr;
  size_t size_ = 0;
};

class FileDescriptor {
 public:
  explicit FileDescriptor(int fd) : fd_(fd) {}
  FileDescriptor(const FileDescriptor&) = delete;
  FileDescriptor& operator=(const FileDescriptor&) = delete;
  // Only shared-memory descriptors, closed once mapped: close cannot lose data, so its result is moot.
  ~FileDescriptor() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const { return fd_; }

 private:
  int fd_;
};

// The name of a shared-memory segment this process created: unlinked when the owner goes, so
// nothing is left in /dev/shm (openers keep their mappings; the segment lives until the last unmaps).
class OwnedShmName {
 public:
  OwnedShmName() = default;
  explicit OwnedShmName(std::string name) : name_(std::move(name)) {}
  OwnedShmName(const OwnedShmName&) = delete;
  OwnedShmName& operator=(OwnedShmName&& other) noexcept {
    std::swap(name_, other.name_);
    return *this;
  }
  ~OwnedShmName() {
    if (!name_.empty()) ::shm_unlink(name_.c_str());  // error paths and exit only; see release()
  }
  int release() {  // 0 or errno
    if (name_.empty()) return 0;
    int result = ::shm_unlink(name_.c_str());
    name_.clear();
    return result == 0 ? 0 : errno;
  }

 private:
  std::string name_;
};

struct Allocation {
  size_t size;
  std::unique_ptr<void, FreeDeleter> memory;
};

struct OpenedMemory {
  pid_t pid;        // the exporter
  uint64_t remote;  // what local_base stands for in the exporter
  Mapping reservation;
};

// An event's state. Interprocess: in shared memory, updated by several processes, so only through
// GCC's __atomic builtins (C++17 has no atomic_ref; they are lock-free on uint64_t).
struct EventState {
  uint64_t recorded;
  uint64_t completed;
};

struct Event {
  unsigned flags = 0;
  EventState local{};  // the state of a process-local event
  EventState* state = &local;
  Mapping mapping;     // interprocess: the shared state
  OwnedShmName name;   // interprocess and created here (not opened): the segment's name
  std::string shm_name;
};

struct StreamToken {
  unsigned flags;
};

// ---------------------------------------------------------------------------------------------
// The tables, all under one mutex.

std::mutex g_mutex;
std::map<uintptr_t, Allocation> g_allocations;     // by base
std::map<uintptr_t, OpenedMemory> g_opened;        // by local base
std::unordered_map<void*, std::unique_ptr<Event>> g_events;
std::unordered_map<void*, std::unique_ptr<StreamToken>> g_streams;
std::atomic<uint64_t> g_event_counter{0};

// The entry of `table` (keyed by base) whose [base, base + span) holds `address`, or end().
template <typename Table, typename Span>
typename Table::iterator find_containing(Table& table, uintptr_t address, Span span) {
  auto next = table.upper_bound(address);
  if (next == table.begin()) return table.end();
  auto found = std::prev(next);
  return address - found->first < span(found->second) ? found : table.end();
}

std::map<uintptr_t, Allocation>::iterator find_allocation(uintptr_t address) {
  return find_containing(g_allocations, address, [](const Allocation& a) { return a.size; });
}

std::map<uintptr_t, OpenedMemory>::iterator find_opened(uintptr_t address) {
  return find_containing(g_opened, address, [](const OpenedMemory&) { return kOpenedSpan; });
}

Event* find_event(void* event) {
  auto found = g_events.find(event);
  return found == g_events.end() ? nullptr : found->second.get();
}

// Lets any process of this uid read and write this one with process_vm_readv/writev even under Yama
// ptrace_scope=1 (where only ancestors may), once per process. EINVAL: no Yama, nothing to allow.
int allow_peers_to_read_me() {
  static const int error = [] {
    if (::prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0) == 0) return 0;
    return errno == EINVAL ? 0 : errno;
  }();
  return error;
}

// A process killed (or leaving by _exit) before destroying its interprocess events leaves their names
// in /dev/shm. The first such event of each process removes the names of owners that are gone, so
// test runs do not pile them up (mappings of those segments stay valid; only new opens fail).
void remove_names_of_dead_owners() {
  const std::string prefix = "fake_cudart_ev_";
  std::error_code error;
  std::filesystem::directory_iterator entry("/dev/shm", error);
  // Best effort throughout: without a listing there is nothing to tidy, and events work regardless.
  for (; !error && entry != std::filesystem::directory_iterator(); entry.increment(error)) {
    std::string name = entry->path().filename().string();
    if (name.compare(0, prefix.size(), prefix) != 0) continue;
    long pid = std::strtol(name.c_str() + prefix.size(), nullptr, 10);
    if (pid <= 0 || pid == ::getpid()) continue;
    // Alive (0), or not ours to judge (EPERM): kept. Only a pid naming no process is gone.
    if (::kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH) continue;
    // Failure (ENOENT: another process tidied it first; EACCES: another user's) leaves it as it was.
    if (::shm_unlink(("/" + name).c_str()) != 0) continue;
  }
}

bool refuse_unallocated_exports() {
  // Read at each call, not once: a test sets it in a process that may have loaded the library.
  const char* value = std::getenv("FAKE_CUDART_REFUSE_EXPORT");
  return value != nullptr && value[0] != '\0' && std::strcmp(value, "0") != 0;
}

std::chrono::microseconds copy_delay() {
  static const std::chrono::microseconds delay = [] {
    const char* value = std::getenv("FAKE_CUDART_COPY_DELAY_US");
    if (value == nullptr || value[0] == '\0') return std::chrono::microseconds(0);
    char* end = nullptr;
    errno = 0;
    unsigned long long us = std::strtoull(value, &end, 10);
    // Not a number: no delay rather than a guess.
    if (errno != 0 || *end != '\0') return std::chrono::microseconds(0);
    return std::chrono::microseconds(static_cast<long long>(us));
  }();
  return delay;
}

// n bytes between `local` and `remote` of process `pid`, looping on partial transfers.
int transfer(bool read, pid_t pid, char* local, uint64_t remote, size_t n) {
  const char* call = read ? "process_vm_readv" : "process_vm_writev";
  const char* direction = read ? "from" : "to";
  size_t done = 0;
  while (done < n) {
    struct iovec local_piece = {local + done, n - done};
    struct iovec remote_piece = {reinterpret_cast<void*>(remote + done), n - done};
    ssize_t moved = read ? ::process_vm_readv(pid, &local_piece, 1, &remote_piece, 1, 0)
                         : ::process_vm_writev(pid, &local_piece, 1, &remote_piece, 1, 0);
    if (moved < 0 && errno == EINTR) continue;
    if (moved <= 0) {
      // A peer that exited (ESRCH) or may not be read (EPERM), or a range it does not map.
      std::string why = moved < 0 ? std::strerror(errno)
                                  : "short transfer, " + std::to_string(done) + " of " +
                                        std::to_string(n) + " bytes";
      t_launch_failure = std::string("fake cudart: ") + call + " " + direction + " pid " +
                         std::to_string(pid) + " failed: " + why;
      return kErrorLaunchFailure;
    }
    done += static_cast<size_t>(moved);
  }
  return kSuccess;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Devices and memory

FAKE_CUDART_API int cudaGetDevice(int* device) {
  count(kGetDevice);
  if (device == nullptr) return kErrorInvalidValue;
  *device = t_device;
  return kSuccess;
}

FAKE_CUDART_API int cudaSetDevice(int device) {
  count(kSetDevice);
  if (device < 0 || device >= kDeviceCount) return kErrorInvalidDevice;
  t_device = device;
  return kSuccess;
}

FAKE_CUDART_API int cudaMalloc(void** pointer, size_t size) {
  count(kMalloc);
  if (pointer == nullptr) return kErrorInvalidValue;
  *pointer = nullptr;
  if (size == 0) return kSuccess;  // as CUDA: a null pointer, no allocation
  if (size > SIZE_MAX - kAlignment) return kErrorMemoryAllocation;
  size_t rounded = (size + kAlignment - 1) / kAlignment * kAlignment;  // aligned_alloc requires it
  std::unique_ptr<void, FreeDeleter> memory(std::aligned_alloc(kAlignment, rounded));
  if (memory == nullptr) return kErrorMemoryAllocation;
  void* base = memory.get();
  std::lock_guard<std::mutex> lock(g_mutex);
  g_allocations.emplace(reinterpret_cast<uintptr_t>(base), Allocation{size, std::move(memory)});
  *pointer = base;
  return kSuccess;
}

FAKE_CUDART_API int cudaFree(void* pointer) {
  count(kFree);
  if (pointer == nullptr) return kSuccess;  // as CUDA
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_allocations.erase(reinterpret_cast<uintptr_t>(pointer)) == 0) return kErrorInvalidValue;
  return kSuccess;
}

// The driver's query: the cudaMalloc allocation holding `pointer`; any other address (a CPU tensor's
// memory) is its own base with size 0, "size unknown", so the transport exports it as it is.
FAKE_CUDART_API int cuMemGetAddressRange_v2(unsigned long long* base, size_t* size,
                                            unsigned long long pointer) {
  count(kMemGetAddressRange);
  if (pointer == 0) return kCuErrorInvalidValue;
  unsigned long long found_base = pointer;
  size_t found_size = 0;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto found = find_allocation(static_cast<uintptr_t>(pointer));
    if (found != g_allocations.end()) {
      found_base = found->first;
      found_size = found->second.size;
    }
  }
  if (base != nullptr) *base = found_base;  // either may be null, as in the driver
  if (size != nullptr) *size = found_size;
  return kSuccess;
}

// ---------------------------------------------------------------------------------------------
// IPC memory

FAKE_CUDART_API int cudaIpcGetMemHandle(IpcMemHandle* handle, void* pointer) {
  count(kIpcGetMemHandle);
  if (handle == nullptr || pointer == nullptr) return kErrorInvalidValue;
  if (refuse_unallocated_exports()) {
    std::lock_guard<std::mutex> lock(g_mutex);
    if (find_allocation(reinterpret_cast<uintptr_t>(pointer)) == g_allocations.end()) {
      return kErrorInvalidValue;
    }
  }
  int error = allow_peers_to_read_me();
  if (error != 0) return fail_os("prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY)", error);
  MemHandleLayout layout{};
  std::memcpy(layout.magic, kMemMagic, sizeof(kMemMagic));
  layout.pid = ::getpid();
  layout.address = reinterpret_cast<uintptr_t>(pointer);
  std::memcpy(handle, &layout, sizeof(layout));
  return kSuccess;
}

FAKE_CUDART_API int cudaIpcOpenMemHandle(void** pointer, IpcMemHandle handle, unsigned /*flags*/) {
  count(kIpcOpenMemHandle);
  if (pointer == nullptr) return kErrorInvalidValue;
  MemHandleLayout layout;
  std::memcpy(&layout, &handle, sizeof(layout));
  if (std::memcmp(layout.magic, kMemMagic, sizeof(kMemMagic)) != 0 || layout.pid <= 0) {
    return kErrorInvalidValue;
  }
  if (layout.pid == ::getpid()) return kErrorDeviceUninitialized;  // CUDA refuses its own handles
  // A fresh address range stands for the exporter's memory: unique, never touched (copies translate
  // it to the exporter's address), so no access to it can silently read the wrong bytes.
  void* base = ::mmap(nullptr, kOpenedSpan, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                      -1, 0);
  if (base == MAP_FAILED) {
    // Usually ENOMEM: the address space is full of open handles.
    return errno == ENOMEM ? kErrorMemoryAllocation : fail_os("mmap of an IPC range", errno);
  }
  Mapping reservation(base, kOpenedSpan);
  std::lock_guard<std::mutex> lock(g_mutex);
  g_opened.emplace(reinterpret_cast<uintptr_t>(base),
                   OpenedMemory{static_cast<pid_t>(layout.pid), layout.address,
                                std::move(reservation)});
  *pointer = base;
  return kSuccess;
}

FAKE_CUDART_API int cudaIpcCloseMemHandle(void* pointer) {
  count(kIpcCloseMemHandle);
  std::lock_guard<std::mutex> lock(g_mutex);
  auto found = g_opened.find(reinterpret_cast<uintptr_t>(pointer));
  if (found == g_opened.end()) return kErrorInvalidValue;
  int error = found->second.reservation.release();
  g_opened.erase(found);
  return error == 0 ? kSuccess : fail_os("munmap of an IPC range", error);
}

// ---------------------------------------------------------------------------------------------
// Streams and copies

FAKE_CUDART_API int cudaStreamCreateWithFlags(void** stream, unsigned flags) {
  count(kStreamCreateWithFlags);
  if (stream == nullptr) return kErrorInvalidValue;
  auto token = std::make_unique<StreamToken>(StreamToken{flags});
  void* key = token.get();
  std::lock_guard<std::mutex> lock(g_mutex);
  g_streams.emplace(key, std::move(token));
  *stream = key;
  return kSuccess;
}

FAKE_CUDART_API int cudaStreamDestroy(void* stream) {
  count(kStreamDestroy);
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_streams.erase(stream) == 1 ? kSuccess : kErrorInvalidResourceHandle;
}

// Streams are not checked where work is enqueued: callers pass torch's current stream too (0, the
// legacy default, or one torch made), which this library never created.
FAKE_CUDART_API int cudaStreamWaitEvent(void* /*stream*/, void* event, unsigned /*flags*/) {
  count(kStreamWaitEvent);
  if (event == nullptr) return kErrorInvalidResourceHandle;
  std::lock_guard<std::mutex> lock(g_mutex);
  // Work completes when enqueued, so the event is complete already: nothing to wait for.
  return find_event(event) != nullptr ? kSuccess : kErrorInvalidResourceHandle;
}

FAKE_CUDART_API int cudaMemcpyAsync(void* destination, const void* source, size_t n, int /*kind*/,
                                    void* /*stream*/) {
  count(kMemcpyAsync);
  if (n == 0) return kSuccess;
  if (destination == nullptr || source == nullptr) return kErrorInvalidValue;
  if (copy_delay().count() > 0) std::this_thread::sleep_for(copy_delay());
  struct Remote {
    bool opened = false;
    pid_t pid = 0;
    uint64_t address = 0;
  } from, to;
  {
    // Copied out of the table so the copy itself runs unlocked (copies on several threads at once).
    std::lock_guard<std::mutex> lock(g_mutex);
    auto resolve = [](const void* pointer, size_t bytes, Remote* remote) {
      auto address = reinterpret_cast<uintptr_t>(pointer);
      auto found = find_opened(address);
      if (found == g_opened.end()) return true;
      uintptr_t offset = address - found->first;
      if (bytes > kOpenedSpan - offset) return false;  // runs past the opened range
      *remote = Remote{true, found->second.pid, found->second.remote + offset};
      return true;
    };
    if (!resolve(source, n, &from) || !resolve(destination, n, &to)) return kErrorInvalidValue;
  }
  auto* local_destination = static_cast<char*>(destination);
  if (from.opened && to.opened) {
    // Between two opened ranges (peer to peer): through a local buffer.
    std::vector<char> bounce(n);
    int error = transfer(true, from.pid, bounce.data(), from.address, n);
    return error != kSuccess ? error : transfer(false, to.pid, bounce.data(), to.address, n);
  }
  if (from.opened) return transfer(true, from.pid, local_destination, from.address, n);
  if (to.opened) {
    return transfer(false, to.pid, const_cast<char*>(static_cast<const char*>(source)), to.address, n);
  }
  std::memmove(destination, source, n);  // memmove: a caller's overlapping ranges stay defined
  return kSuccess;
}

// ---------------------------------------------------------------------------------------------
// Events

FAKE_CUDART_API int cudaEventCreateWithFlags(void** event, unsigned flags) {
  count(kEventCreateWithFlags);
  if (event == nullptr) return kErrorInvalidValue;
  auto created = std::make_unique<Event>();
  created->flags = flags;
  if (flags & kEventInterprocess) {
    static std::once_flag tidied;
    std::call_once(tidied, remove_names_of_dead_owners);
    // A fresh name; a stale one (left by a crashed process whose pid was reused) is skipped.
    int fd = -1;
    std::string name;
    for (int attempt = 0; attempt < 16 && fd < 0; ++attempt) {
      name = "/fake_cudart_ev_" + std::to_string(::getpid()) + "_" +
             std::to_string(g_event_counter.fetch_add(1));
      fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
      if (fd < 0 && errno != EEXIST) return fail_os("shm_open(" + name + ")", errno);
    }
    if (fd < 0) return fail_os("shm_open(" + name + ")", EEXIST);
    FileDescriptor descriptor(fd);
    created->name = OwnedShmName(name);
    if (::ftruncate(fd, sizeof(EventState)) != 0) return fail_os("ftruncate(" + name + ")", errno);
    void* address = ::mmap(nullptr, sizeof(EventState), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (address == MAP_FAILED) return fail_os("mmap(" + name + ")", errno);
    created->mapping = Mapping(address, sizeof(EventState));
    created->state = static_cast<EventState*>(address);  // zero-filled by ftruncate
    created->shm_name = name;
  }
  void* key = created.get();
  std::lock_guard<std::mutex> lock(g_mutex);
  g_events.emplace(key, std::move(created));
  *event = key;
  return kSuccess;
}

FAKE_CUDART_API int cudaEventDestroy(void* event) {
  count(kEventDestroy);
  std::unique_ptr<Event> destroyed;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto found = g_events.find(event);
    if (found == g_events.end()) return kErrorInvalidResourceHandle;
    destroyed = std::move(found->second);
    g_events.erase(found);
  }
  int error = destroyed->mapping.release();
  if (error != 0) return fail_os("munmap of an event", error);
  error = destroyed->name.release();
  // ENOENT: the name is gone already (someone cleaned /dev/shm); nothing is left behind.
  if (error != 0 && error != ENOENT) return fail_os("shm_unlink(" + destroyed->shm_name + ")", error);
  return kSuccess;
}

FAKE_CUDART_API int cudaEventRecord(void* event, void* /*stream*/) {
  count(kEventRecord);
  std::lock_guard<std::mutex> lock(g_mutex);
  Event* found = find_event(event);
  if (found == nullptr) return kErrorInvalidResourceHandle;
  EventState* state = found->state;
  // Work is synchronous: what the record waits for is done, so it completes at once. Completed only
  // grows, so that a slower concurrent recorder (another process) cannot move it back.
  uint64_t mine = __atomic_add_fetch(&state->recorded, 1, __ATOMIC_ACQ_REL);
  uint64_t seen = __atomic_load_n(&state->completed, __ATOMIC_ACQUIRE);
  while (seen < mine && !__atomic_compare_exchange_n(&state->completed, &seen, mine, false,
                                                     __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
  }
  return kSuccess;
}

FAKE_CUDART_API int cudaEventQuery(void* event) {
  count(kEventQuery);
  std::lock_guard<std::mutex> lock(g_mutex);
  Event* found = find_event(event);
  if (found == nullptr) return kErrorInvalidResourceHandle;
  uint64_t recorded = __atomic_load_n(&found->state->recorded, __ATOMIC_ACQUIRE);
  uint64_t completed = __atomic_load_n(&found->state->completed, __ATOMIC_ACQUIRE);
  return completed >= recorded ? kSuccess : kErrorNotReady;
}

FAKE_CUDART_API int cudaIpcGetEventHandle(IpcEventHandle* handle, void* event) {
  count(kIpcGetEventHandle);
  if (handle == nullptr) return kErrorInvalidValue;
  std::lock_guard<std::mutex> lock(g_mutex);
  Event* found = find_event(event);
  // As CUDA: only events created with cudaEventInterprocess can be shared.
  if (found == nullptr || !(found->flags & kEventInterprocess)) return kErrorInvalidResourceHandle;
  EventHandleLayout layout{};
  std::memcpy(layout.magic, kEventMagic, sizeof(kEventMagic));
  if (found->shm_name.size() >= sizeof(layout.name)) return kErrorInvalidValue;  // cannot happen
  std::memcpy(layout.name, found->shm_name.c_str(), found->shm_name.size() + 1);
  std::memcpy(handle, &layout, sizeof(layout));
  return kSuccess;
}

FAKE_CUDART_API int cudaIpcOpenEventHandle(void** event, IpcEventHandle handle) {
  count(kIpcOpenEventHandle);
  if (event == nullptr) return kErrorInvalidValue;
  EventHandleLayout layout;
  std::memcpy(&layout, &handle, sizeof(layout));
  if (std::memcmp(layout.magic, kEventMagic, sizeof(kEventMagic)) != 0 ||
      std::memchr(layout.name, '\0', sizeof(layout.name)) == nullptr) {
    return kErrorInvalidValue;
  }
  std::string name(layout.name);
  int fd = ::shm_open(name.c_str(), O_RDWR, 0);
  // ENOENT: the owner destroyed the event (or exited): the handle no longer names one.
  if (fd < 0) {
    return errno == ENOENT ? kErrorInvalidResourceHandle : fail_os("shm_open(" + name + ")", errno);
  }
  FileDescriptor descriptor(fd);
  struct stat status;
  if (::fstat(fd, &status) != 0) return fail_os("fstat(" + name + ")", errno);
  if (static_cast<size_t>(status.st_size) < sizeof(EventState)) return kErrorInvalidResourceHandle;
  void* address = ::mmap(nullptr, sizeof(EventState), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (address == MAP_FAILED) return fail_os("mmap(" + name + ")", errno);
  auto opened = std::make_unique<Event>();
  opened->flags = kEventInterprocess;
  opened->mapping = Mapping(address, sizeof(EventState));
  opened->state = static_cast<EventState*>(address);
  opened->shm_name = name;  // not owned: the creator unlinks it
  void* key = opened.get();
  std::lock_guard<std::mutex> lock(g_mutex);
  g_events.emplace(key, std::move(opened));
  *event = key;
  return kSuccess;
}

// ---------------------------------------------------------------------------------------------
// Errors

FAKE_CUDART_API const char* cudaGetErrorString(int error) {
  count(kGetErrorString);
  switch (error) {
    case kSuccess: return "no error";
    case kErrorInvalidValue: return "invalid argument";
    case kErrorMemoryAllocation: return "out of memory";
    case kErrorInvalidDevice: return "invalid device ordinal";
    case kErrorDeviceUninitialized:
      return "invalid device context (fake cudart: a process cannot open its own IPC memory handle)";
    case kErrorOperatingSystem:
      return t_os_failure.empty() ? "OS call failed or operation not supported on this OS"
                                  : t_os_failure.c_str();
    case kErrorInvalidResourceHandle: return "invalid resource handle";
    case kErrorNotReady: return "device not ready";
    case kErrorLaunchFailure:
      return t_launch_failure.empty() ? "unspecified launch failure" : t_launch_failure.c_str();
    default: return "unknown fake cudart error";
  }
}

// ---------------------------------------------------------------------------------------------
// For tests

FAKE_CUDART_API int fake_cudart_is_fake(void) { return 1; }

FAKE_CUDART_API unsigned long long fake_cudart_count(const char* name) {
  if (name == nullptr) return 0;
  for (int call = 0; call < kCallCount; ++call) {
    if (std::strcmp(name, kCallNames[call]) == 0) return g_counts[call].load(std::memory_order_relaxed);
  }
  return 0;  // not an entry point of this library
}

FAKE_CUDART_API void fake_cudart_reset_counts(void) {
  for (auto& counter : g_counts) counter.store(0, std::memory_order_relaxed);
}
