#include "cuda_ipc.h"

#include <ATen/ops/empty.h>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <sstream>
#include <thread>

#include "../common/errors.h"
#include "../common/dtype_codes.h"

namespace shm_tensor {
namespace cuda {

namespace {

using Clock = std::chrono::steady_clock;
constexpr double kLivenessPeriodS = 0.05;
constexpr auto kPollSleep = std::chrono::microseconds(20);
std::atomic<uint64_t> g_pool_counter{0};

Stream as_stream(uintptr_t handle) { return reinterpret_cast<Stream>(handle); }

// The device a tensor's bytes live on: a CPU tensor (the fake runtime's host path) counts as device 0.
int tensor_device(const at::Tensor& tensor) { return tensor.is_cuda() ? tensor.device().index() : 0; }

bool same_bytes(const void* a, const void* b, size_t n) { return std::memcmp(a, b, n) == 0; }

// The received tensor: on `device`, or on the CPU where the fake runtime stands for the device.
at::Tensor allocate(const dpp_wire::WireHeader& header, int device, bool host_tensors) {
  std::vector<int64_t> shape(header.shape, header.shape + header.ndim);
  auto options = at::TensorOptions().dtype(dpp_wire::scalar_type_of(header.dtype));
  return at::empty(shape, host_tensors ? options : options.device(at::kCUDA, device));
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// RAII wrappers. Destructors ignore errors: at process exit the runtime may already be unloading.

DeviceGuard::DeviceGuard(const Runtime& runtime, int device, const char* call, int peer, int64_t tag)
    : runtime_(runtime) {
  check(runtime_.GetDevice(&previous_), "cudaGetDevice", call, peer, tag);
  if (device != previous_) {
    check(runtime_.SetDevice(device), "cudaSetDevice", call, peer, tag);
  } else {
    previous_ = -1;  // nothing to restore
  }
}

DeviceGuard::~DeviceGuard() {
  if (previous_ >= 0) runtime_.SetDevice(previous_);
}

OwnedEvent::OwnedEvent(const Runtime& runtime, unsigned flags, const char* call, int peer, int64_t tag)
    : runtime_(runtime) {
  check(runtime_.EventCreateWithFlags(&event_, flags), "cudaEventCreateWithFlags", call, peer, tag);
}

OwnedEvent::~OwnedEvent() {
  if (event_ != nullptr) runtime_.EventDestroy(event_);
}

OwnedStream::OwnedStream(const Runtime& runtime, const char* call, int peer, int64_t tag)
    : runtime_(runtime) {
  // Non-blocking: it must not serialise with the legacy default stream that torch computes on.
  check(runtime_.StreamCreateWithFlags(&stream_, kStreamNonBlocking), "cudaStreamCreateWithFlags",
        call, peer, tag);
}

OwnedStream::~OwnedStream() {
  if (stream_ != nullptr) runtime_.StreamDestroy(stream_);
}

DeviceBuffer::DeviceBuffer(const Runtime& runtime, size_t bytes, const char* call, int peer, int64_t tag)
    : runtime_(runtime) {
  check(runtime_.Malloc(&data_, bytes == 0 ? 1 : bytes), "cudaMalloc", call, peer, tag);
}

DeviceBuffer::~DeviceBuffer() {
  if (data_ != nullptr) runtime_.Free(data_);
}

OpenedMemory::OpenedMemory(const Runtime& runtime, const IpcMemHandle& handle, const char* call,
                           int peer, int64_t tag)
    : runtime_(runtime) {
  check(runtime_.IpcOpenMemHandle(&data_, handle, kIpcMemLazyEnablePeerAccess),
        "cudaIpcOpenMemHandle", call, peer, tag);
}

OpenedMemory::~OpenedMemory() {
  if (data_ != nullptr) runtime_.IpcCloseMemHandle(data_);
}

OpenedEvent::OpenedEvent(const Runtime& runtime, const IpcEventHandle& handle, const char* call,
                         int peer, int64_t tag)
    : runtime_(runtime) {
  check(runtime_.IpcOpenEventHandle(&event_, handle), "cudaIpcOpenEventHandle", call, peer, tag);
}

OpenedEvent::~OpenedEvent() {
  if (event_ != nullptr) runtime_.EventDestroy(event_);
}

// ---------------------------------------------------------------------------------------------
// Pools and caches

CudaIpc::~CudaIpc() = default;

void CudaIpc::make_interprocess_events(uint64_t count, std::vector<std::unique_ptr<OwnedEvent>>* events,
                                       std::vector<IpcEventHandle>* handles, const char* call, int peer,
                                       int64_t tag) {
  events->clear();
  handles->clear();
  for (uint64_t i = 0; i < count; ++i) {
    events->push_back(
        std::make_unique<OwnedEvent>(runtime_, kEventDisableTiming | kEventInterprocess, call, peer, tag));
    IpcEventHandle handle;
    check(runtime_.IpcGetEventHandle(&handle, events->back()->get()), "cudaIpcGetEventHandle", call, peer,
          tag);
    handles->push_back(handle);
  }
}

OwnedStream& CudaIpc::stream_for(int device, const char* call, int peer, int64_t tag) {
  auto found = streams_.find(device);
  if (found != streams_.end()) return *found->second;
  DeviceGuard guard(runtime_, device, call, peer, tag);
  auto stream = std::make_unique<OwnedStream>(runtime_, call, peer, tag);
  OwnedStream& result = *stream;
  streams_[device] = std::move(stream);
  return result;
}

std::shared_ptr<OwnedEvent> CudaIpc::record_ready(const at::Tensor& source, uintptr_t caller_stream,
                                                  const char* call, int peer, int64_t tag) {
  DeviceGuard guard(runtime_, tensor_device(source), call, peer, tag);
  auto event = std::make_shared<OwnedEvent>(runtime_, kEventDisableTiming, call, peer, tag);
  check(runtime_.EventRecord(event->get(), as_stream(caller_stream)), "cudaEventRecord", call, peer,
        tag);
  return event;
}

IpcDescriptor CudaIpc::send(int peer, int64_t tag, const at::Tensor& source, const OwnedEvent& ready,
                            uintptr_t caller_stream, uint64_t slot, uint64_t slot_bytes,
                            uint64_t num_slots) {
  const char* call = "shm_tensor.isend";
  auto& pool_entry = send_pools_[peer];
  if (pool_entry == nullptr) {
    auto pool = std::make_unique<SendPool>();
    pool->device = tensor_device(source);
    pool->id = (static_cast<uint64_t>(::getpid()) << 24) | (++g_pool_counter & 0xffffff);
    pool->slot_bytes = slot_bytes;
    pool->num_slots = num_slots;
    DeviceGuard guard(runtime_, pool->device, call, peer, tag);
    pool->buffer = std::make_unique<DeviceBuffer>(runtime_, slot_bytes * num_slots, call, peer, tag);
    check(runtime_.IpcGetMemHandle(&pool->memory_handle, pool->buffer->data()), "cudaIpcGetMemHandle",
          call, peer, tag);
    make_interprocess_events(num_slots, &pool->events, &pool->event_handles, call, peer, tag);
    pool->sources.resize(num_slots);
    pool_entry = std::move(pool);
  }
  SendPool& pool = *pool_entry;
  if (slot >= pool.num_slots || pool.slot_bytes != slot_bytes) {
    throw dpp_errors::TransportError(dpp_errors::describe(
        call, peer, tag, "the peer's slot geometry changed after its device pool was created"));
  }
  uint64_t nbytes = static_cast<uint64_t>(source.numel()) * source.element_size();
  DeviceGuard guard(runtime_, pool.device, call, peer, tag);
  Stream stream = stream_for(pool.device, call, peer, tag).get();
  Event slot_event = pool.events[slot]->get();
  check(runtime_.StreamWaitEvent(stream, ready.get(), 0), "cudaStreamWaitEvent", call, peer, tag);
  if (nbytes > 0) {
    check(runtime_.MemcpyAsync(pool.buffer->data() + slot * slot_bytes, source.data_ptr(), nbytes,
                               kMemcpyDefault, stream),
          "cudaMemcpyAsync", call, peer, tag);
  }
  check(runtime_.EventRecord(slot_event, stream), "cudaEventRecord", call, peer, tag);
  // Later work of the caller on its stream (say, overwriting the tensor) runs after the copy.
  check(runtime_.StreamWaitEvent(as_stream(caller_stream), slot_event, 0), "cudaStreamWaitEvent",
        call, peer, tag);
  pool.sources[slot] = source;

  IpcDescriptor descriptor;
  std::memset(&descriptor, 0, sizeof(descriptor));
  descriptor.magic = kDescriptorMagic;
  descriptor.pool_id = pool.id;
  descriptor.device = pool.device;
  descriptor.slot = static_cast<uint32_t>(slot);
  descriptor.offset = slot * slot_bytes;
  descriptor.pool_bytes = slot_bytes * pool.num_slots;
  descriptor.memory = pool.memory_handle;
  descriptor.event = pool.event_handles[slot];
  return descriptor;
}

void CudaIpc::wait_for(Event event, int peer, int64_t tag, const std::function<bool()>& peer_alive,
                       double timeout_s, double spin_us) {
  const char* call = "shm_tensor.irecv";
  Clock::time_point start = Clock::now();
  Clock::time_point spin_until = start + std::chrono::duration_cast<Clock::duration>(
                                             std::chrono::duration<double, std::micro>(spin_us));
  Clock::time_point next_check = start + std::chrono::duration_cast<Clock::duration>(
                                             std::chrono::duration<double>(kLivenessPeriodS));
  Clock::time_point deadline = start + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(timeout_s));
  // Polled rather than cudaEventSynchronize: a sender that dies before its copy ran would leave
  // a synchronising receiver blocked for ever.
  while (true) {
    Error status = runtime_.EventQuery(event);
    if (status == kSuccess) return;
    if (status != kErrorNotReady) check(status, "cudaEventQuery", call, peer, tag);
    Clock::time_point now = Clock::now();
    if (now >= next_check) {
      if (!peer_alive()) {
        throw dpp_errors::PeerLost(dpp_errors::describe(
            call, peer, tag, "peer process exited before its device copy completed"));
      }
      next_check = now + std::chrono::duration_cast<Clock::duration>(
                             std::chrono::duration<double>(kLivenessPeriodS));
    }
    if (now >= deadline) {
      std::ostringstream what;
      what << "timed out after " << timeout_s << " s waiting for the device copy of the message";
      throw dpp_errors::TransportTimeout(dpp_errors::describe(call, peer, tag, what.str()));
    }
    if (now < spin_until) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(kPollSleep);
    }
  }
}

at::Tensor CudaIpc::receive(int peer, const dpp_wire::WireHeader& header,
                            const IpcDescriptor& descriptor, int device, uintptr_t caller_stream,
                            bool host_tensors, const std::function<bool()>& peer_alive,
                            double timeout_s, double spin_us) {
  const char* call = "shm_tensor.irecv";
  int64_t tag = header.tag;
  if (descriptor.magic != kDescriptorMagic || descriptor.offset + header.nbytes > descriptor.pool_bytes) {
    throw dpp_errors::ProtocolError(dpp_errors::describe(
        call, peer, tag, "device message carries an invalid CUDA IPC descriptor"));
  }
  if (device < 0) check(runtime_.GetDevice(&device), "cudaGetDevice", call, peer, tag);
  DeviceGuard guard(runtime_, device, call, peer, tag);

  at::Tensor tensor = allocate(header, device, host_tensors);
  if (header.nbytes == 0) return tensor;

  auto& cache_entry = receive_caches_[peer];
  if (cache_entry == nullptr || cache_entry->pool_id != descriptor.pool_id) {
    // A peer has one pool for the life of its context; a new id means a new context of that rank.
    cache_entry.reset();
    auto cache = std::make_unique<ReceiveCache>();
    cache->pool_id = descriptor.pool_id;
    cache->memory = std::make_unique<OpenedMemory>(runtime_, descriptor.memory, call, peer, tag);
    cache_entry = std::move(cache);
  }
  ReceiveCache& cache = *cache_entry;
  auto& opened = cache.events[descriptor.slot];
  if (opened == nullptr) opened = std::make_unique<OpenedEvent>(runtime_, descriptor.event, call, peer, tag);
  if (cache.device != device) {
    cache.allocated = std::make_unique<OwnedEvent>(runtime_, kEventDisableTiming, call, peer, tag);
    cache.copied = std::make_unique<OwnedEvent>(runtime_, kEventDisableTiming, call, peer, tag);
    cache.device = device;
  }

  Stream stream = stream_for(device, call, peer, tag).get();
  // The caching allocator may hand out memory that work queued on the caller's stream still uses.
  check(runtime_.EventRecord(cache.allocated->get(), as_stream(caller_stream)), "cudaEventRecord", call,
        peer, tag);
  check(runtime_.StreamWaitEvent(stream, cache.allocated->get(), 0), "cudaStreamWaitEvent", call, peer,
        tag);
  check(runtime_.StreamWaitEvent(stream, opened->get(), 0), "cudaStreamWaitEvent", call, peer, tag);
  check(runtime_.MemcpyAsync(tensor.data_ptr(), cache.memory->data() + descriptor.offset, header.nbytes,
                             kMemcpyDefault, stream),
        "cudaMemcpyAsync", call, peer, tag);
  check(runtime_.EventRecord(cache.copied->get(), stream), "cudaEventRecord", call, peer, tag);
  wait_for(cache.copied->get(), peer, tag, peer_alive, timeout_s, spin_us);
  return tensor;
}

// ---------------------------------------------------------------------------------------------
// Direct path

bool CudaIpc::export_tensor(const at::Tensor& source, int device, Export* out, std::string* why,
                            int peer, int64_t tag) {
  const char* call = "shm_tensor.isend";
  if (runtime_.MemGetAddressRange == nullptr) {
    *why = "the driver's cuMemGetAddressRange_v2 is not available";
    return false;
  }
  DeviceGuard guard(runtime_, device, call, peer, tag);
  auto address = reinterpret_cast<unsigned long long>(source.data_ptr());
  unsigned long long base = 0;
  size_t size = 0;
  int result = runtime_.MemGetAddressRange(&base, &size, address);
  if (result != 0) {
    *why = "cuMemGetAddressRange_v2 failed (CUresult " + std::to_string(result) + ")";
    return false;
  }
  Error error = runtime_.IpcGetMemHandle(&out->memory, reinterpret_cast<void*>(base));
  if (error != kSuccess) {
    const char* text = runtime_.GetErrorString(error);
    // torch's expandable segments (cuMemCreate) cannot be exported by cudaIpcGetMemHandle.
    *why = std::string("cudaIpcGetMemHandle failed: ") + (text ? text : "unknown error") +
           " (cudaError " + std::to_string(error) + ")";
    return false;
  }
  out->offset = address - base;
  out->allocation_bytes = size;
  out->device = device;
  return true;
}

DirectDescriptor CudaIpc::send_direct(int peer, int64_t tag, const Export& exported,
                                      const OwnedEvent* ready, uintptr_t caller_stream, uint64_t slot,
                                      uint64_t num_slots) {
  const char* call = "shm_tensor.isend";
  DeviceGuard guard(runtime_, exported.device, call, peer, tag);
  DirectSendState& state = direct_sends_[peer];
  if (state.device != exported.device || state.ready.size() != num_slots) {
    // First message to this peer, or from another device: events are tied to their device.
    make_interprocess_events(num_slots, &state.ready, &state.ready_handles, call, peer, tag);
    state.device = exported.device;
  }
  if (slot >= num_slots) {
    throw dpp_errors::TransportError(dpp_errors::describe(call, peer, tag, "host slot out of range"));
  }
  Event slot_event = state.ready[slot]->get();
  if (ready == nullptr) {
    // Inside this message's own isend: the caller's stream holds exactly the producing work.
    check(runtime_.EventRecord(slot_event, as_stream(caller_stream)), "cudaEventRecord", call, peer, tag);
  } else {
    // Queued earlier: our stream orders the slot's event after the event taken at isend.
    Stream stream = stream_for(exported.device, call, peer, tag).get();
    check(runtime_.StreamWaitEvent(stream, ready->get(), 0), "cudaStreamWaitEvent", call, peer, tag);
    check(runtime_.EventRecord(slot_event, stream), "cudaEventRecord", call, peer, tag);
  }
  DirectDescriptor descriptor;
  std::memset(&descriptor, 0, sizeof(descriptor));
  descriptor.magic = kDirectMagic;
  descriptor.device = exported.device;
  descriptor.slot = static_cast<uint32_t>(slot);
  descriptor.offset = exported.offset;
  descriptor.allocation_bytes = exported.allocation_bytes;
  descriptor.memory = exported.memory;
  descriptor.ready = state.ready_handles[slot];
  return descriptor;
}

at::Tensor CudaIpc::receive_direct(int peer, const dpp_wire::WireHeader& header,
                                   DirectDescriptor* descriptor, int device, uintptr_t caller_stream,
                                   bool host_tensors, uint64_t num_slots,
                                   const std::function<bool()>& peer_alive) {
  const char* call = "shm_tensor.irecv";
  int64_t tag = header.tag;
  if (descriptor->slot >= num_slots ||
      (descriptor->allocation_bytes != 0 &&
       (descriptor->offset > descriptor->allocation_bytes ||
        header.nbytes > descriptor->allocation_bytes - descriptor->offset))) {
    throw dpp_errors::ProtocolError(dpp_errors::describe(
        call, peer, tag, "device message carries an invalid direct descriptor (slot or bounds)"));
  }
  if (device < 0) check(runtime_.GetDevice(&device), "cudaGetDevice", call, peer, tag);
  DeviceGuard guard(runtime_, device, call, peer, tag);
  at::Tensor tensor = allocate(header, device, host_tensors);
  if (header.nbytes == 0) return tensor;  // nothing read: the sender waits for nothing
  try {
    queue_direct_copy(peer, header, descriptor, tensor, device, caller_stream, num_slots);
  } catch (const dpp_errors::TransportError&) {
    // A sender that died took its memory and events with it: that is a lost peer, not a bad message.
    if (!peer_alive()) {
      throw dpp_errors::PeerLost(dpp_errors::describe(
          call, peer, tag, "peer process exited before its device message was read"));
    }
    throw;
  }
  return tensor;
}

void CudaIpc::queue_direct_copy(int peer, const dpp_wire::WireHeader& header, DirectDescriptor* descriptor,
                                const at::Tensor& tensor, int device, uintptr_t caller_stream,
                                uint64_t num_slots) {
  const char* call = "shm_tensor.irecv";
  int64_t tag = header.tag;
  DirectReceiveState& state = direct_receives_[peer];
  // The sender's allocation, mapped once (most recently used last).
  std::string key(descriptor->memory.reserved, sizeof(descriptor->memory.reserved));
  auto found = std::find_if(state.memories.begin(), state.memories.end(),
                            [&key](const auto& entry) { return entry.first == key; });
  if (found == state.memories.end()) {
    if (state.memories.size() >= kMaxOpenedAllocationsPerPeer) state.memories.erase(state.memories.begin());
    state.memories.emplace_back(key, std::make_unique<OpenedMemory>(runtime_, descriptor->memory, call, peer, tag));
  } else if (found + 1 != state.memories.end()) {
    std::rotate(found, found + 1, state.memories.end());
  }
  const char* source = state.memories.back().second->data() + descriptor->offset;

  if (state.ready.size() != num_slots) {
    state.ready.clear();
    state.ready.resize(num_slots);
    state.ready_handles.assign(num_slots, IpcEventHandle{});
  }
  uint32_t slot = descriptor->slot;
  if (state.ready[slot] == nullptr ||
      !same_bytes(&state.ready_handles[slot], &descriptor->ready, sizeof(IpcEventHandle))) {
    state.ready[slot] = std::make_unique<OpenedEvent>(runtime_, descriptor->ready, call, peer, tag);
    state.ready_handles[slot] = descriptor->ready;
  }
  if (state.copied_device != device || state.copied.size() != num_slots) {
    make_interprocess_events(num_slots, &state.copied, &state.copied_handles, call, peer, tag);
    state.copied_device = device;
  }
  // All on the caller's stream: the fresh tensor's allocation, then the copy, in that stream's order.
  Stream stream = as_stream(caller_stream);
  check(runtime_.StreamWaitEvent(stream, state.ready[slot]->get(), 0), "cudaStreamWaitEvent", call, peer,
        tag);
  check(runtime_.MemcpyAsync(tensor.data_ptr(), source, header.nbytes, kMemcpyDefault, stream),
        "cudaMemcpyAsync", call, peer, tag);
  check(runtime_.EventRecord(state.copied[slot]->get(), stream), "cudaEventRecord", call, peer, tag);
  descriptor->copied = state.copied_handles[slot];
  descriptor->copied_magic = kCopiedMagic;
}

void CudaIpc::complete_direct(int peer, int64_t tag, const DirectDescriptor& descriptor, int device,
                              uintptr_t caller_stream, uint64_t num_slots) {
  const char* call = "shm_tensor.isend";
  if (descriptor.copied_magic != kCopiedMagic) return;  // an empty message: nothing was read
  uint32_t slot = descriptor.slot;
  if (slot >= num_slots) {
    throw dpp_errors::ProtocolError(dpp_errors::describe(call, peer, tag, "freed slot names no slot"));
  }
  DeviceGuard guard(runtime_, device, call, peer, tag);
  DirectSendState& state = direct_sends_[peer];
  if (state.copied.size() != num_slots) {
    state.copied.clear();
    state.copied.resize(num_slots);
    state.copied_handles.assign(num_slots, IpcEventHandle{});
  }
  if (state.copied[slot] == nullptr ||
      !same_bytes(&state.copied_handles[slot], &descriptor.copied, sizeof(IpcEventHandle))) {
    state.copied[slot] = std::make_unique<OpenedEvent>(runtime_, descriptor.copied, call, peer, tag);
    state.copied_handles[slot] = descriptor.copied;
  }
  // Whatever the caller queues next on its stream (say, reusing the tensor's memory) runs after the
  // receiver's copy. No host wait.
  check(runtime_.StreamWaitEvent(as_stream(caller_stream), state.copied[slot]->get(), 0),
        "cudaStreamWaitEvent", call, peer, tag);
}

}  // namespace cuda
}  // namespace shm_tensor
