// CUDA IPC for shm_tensor: GPU tensors travel device to device, only a small descriptor goes through
// the shared-memory channel.
//
// The SENDER owns, per peer, a pool of device staging slots (one cudaMalloc, `num_slots` x
// `slot_bytes`, the same geometry and ring index as the host channel) and one interprocess event per
// slot. Send: its own stream waits for the caller's stream (the tensor's producer), copies the tensor
// into device slot i, records event i, and the caller's stream waits for that event (so the caller may
// overwrite its tensor afterwards). The host slot i then carries the wire header (kFlagCudaIpc) and an
// IpcDescriptor with the pool's memory handle and event i's handle. RECEIVE: the receiver opens the
// pool once per peer (cached; cudaIpcOpenMemHandle on its own device, peer access enabled lazily, so
// peers may use different GPUs), allocates the tensor with torch on its current device, makes its
// own stream wait for the caller's stream (the allocation) and for event i, copies out, waits for the
// copy (checking that the sender lives) and only then frees host slot i, which frees device slot i.
#pragma once

#include <ATen/ATen.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "../common/wire_header.h"
#include "cuda_runtime.h"

namespace shm_tensor {
namespace cuda {

// What follows a kFlagCudaIpc wire header in the host slot.
struct IpcDescriptor {
  uint64_t magic;
  uint64_t pool_id;  // the sender's pool: (sender pid << 24) | pool counter
  int32_t device;    // the sender's device of the pool (for messages only)
  uint32_t slot;
  uint64_t offset;      // of the slot in the pool
  uint64_t pool_bytes;  // the pool's size, bounds offset + nbytes
  IpcMemHandle memory;
  IpcEventHandle event;  // the slot's event, recorded after the copy into the slot
};
static_assert(sizeof(IpcDescriptor) == 168, "IPC descriptor layout changed");
constexpr uint64_t kDescriptorMagic = 0x4350494144555044ull;  // "DPPUDAIPC" cut to 8 bytes

// Sets the current device for the scope and restores the previous one.
class DeviceGuard {
 public:
  DeviceGuard(const Runtime& runtime, int device, const char* call, int peer, int64_t tag);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  const Runtime& runtime_;
  int previous_ = -1;
};

class OwnedEvent {
 public:
  OwnedEvent(const Runtime& runtime, unsigned flags, const char* call, int peer, int64_t tag);
  ~OwnedEvent();
  OwnedEvent(const OwnedEvent&) = delete;
  OwnedEvent& operator=(const OwnedEvent&) = delete;
  Event get() const { return event_; }

 private:
  const Runtime& runtime_;
  Event event_ = nullptr;
};

class OwnedStream {
 public:
  OwnedStream(const Runtime& runtime, const char* call, int peer, int64_t tag);
  ~OwnedStream();
  OwnedStream(const OwnedStream&) = delete;
  OwnedStream& operator=(const OwnedStream&) = delete;
  Stream get() const { return stream_; }

 private:
  const Runtime& runtime_;
  Stream stream_ = nullptr;
};

class DeviceBuffer {
 public:
  DeviceBuffer(const Runtime& runtime, size_t bytes, const char* call, int peer, int64_t tag);
  ~DeviceBuffer();
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  char* data() const { return static_cast<char*>(data_); }

 private:
  const Runtime& runtime_;
  void* data_ = nullptr;
};

// A peer's device memory mapped into this process.
class OpenedMemory {
 public:
  OpenedMemory(const Runtime& runtime, const IpcMemHandle& handle, const char* call, int peer,
               int64_t tag);
  ~OpenedMemory();
  OpenedMemory(const OpenedMemory&) = delete;
  OpenedMemory& operator=(const OpenedMemory&) = delete;
  const char* data() const { return static_cast<const char*>(data_); }

 private:
  const Runtime& runtime_;
  void* data_ = nullptr;
};

// A peer's interprocess event opened in this process.
class OpenedEvent {
 public:
  OpenedEvent(const Runtime& runtime, const IpcEventHandle& handle, const char* call, int peer,
              int64_t tag);
  ~OpenedEvent();
  OpenedEvent(const OpenedEvent&) = delete;
  OpenedEvent& operator=(const OpenedEvent&) = delete;
  Event get() const { return event_; }

 private:
  const Runtime& runtime_;
  Event event_ = nullptr;
};

// One per receiving peer, owned by the sender.
struct SendPool {
  int device = -1;
  uint64_t id = 0;
  uint64_t slot_bytes = 0;
  uint64_t num_slots = 0;
  // Declared before the buffer: sources and events go first when the pool is destroyed.
  std::unique_ptr<DeviceBuffer> buffer;
  IpcMemHandle memory_handle;
  std::vector<std::unique_ptr<OwnedEvent>> events;
  std::vector<IpcEventHandle> event_handles;
  // The tensor last copied into each slot, kept alive until the slot is reused (by then the
  // receiver has freed it, so the copy is complete) in case the caller drops it at once.
  std::vector<at::Tensor> sources;
};

// One per sending peer: its pool mapped here, its slot events opened here.
struct ReceiveCache {
  uint64_t pool_id = 0;
  std::unique_ptr<OpenedMemory> memory;
  std::map<uint32_t, std::unique_ptr<OpenedEvent>> events;  // by slot
  std::unique_ptr<OwnedEvent> allocated;  // recorded on the caller's stream after the allocation
  std::unique_ptr<OwnedEvent> copied;     // recorded on our stream after the copy out
  int device = -1;                        // of the two events above
};

// The CUDA state of one shm_tensor context. Not thread-safe: the context's lock is held.
class CudaIpc {
 public:
  explicit CudaIpc(const Runtime& runtime) : runtime_(runtime) {}
  ~CudaIpc();
  CudaIpc(const CudaIpc&) = delete;
  CudaIpc& operator=(const CudaIpc&) = delete;

  // At isend: an event recorded on the caller's stream after the work that produced `source`.
  std::shared_ptr<OwnedEvent> record_ready(const at::Tensor& source, uintptr_t caller_stream,
                                           const char* call, int peer, int64_t tag);

  // Copies `source` into device slot `slot` of this context's pool for `peer` (created on first
  // use with the receiver's geometry) and returns the descriptor for the host slot.
  IpcDescriptor send(int peer, int64_t tag, const at::Tensor& source, const OwnedEvent& ready,
                     uintptr_t caller_stream, uint64_t slot, uint64_t slot_bytes, uint64_t num_slots);

  // The received tensor on `device` (< 0: the calling thread's current device), complete when it
  // returns. `peer_alive` is polled while waiting for the copy; throws PeerLost when it turns false,
  // TransportTimeout after timeout_s.
  at::Tensor receive(int peer, const dpp_wire::WireHeader& header, const IpcDescriptor& descriptor,
                     int device, uintptr_t caller_stream, const std::function<bool()>& peer_alive,
                     double timeout_s, double spin_us);

 private:
  OwnedStream& stream_for(int device, const char* call, int peer, int64_t tag);
  void wait_for(Event event, int peer, int64_t tag, const std::function<bool()>& peer_alive,
                double timeout_s, double spin_us);

  const Runtime& runtime_;
  std::map<int, std::unique_ptr<OwnedStream>> streams_;  // per device
  std::map<int, std::unique_ptr<SendPool>> send_pools_;  // per receiving peer
  std::map<int, std::unique_ptr<ReceiveCache>> receive_caches_;  // per sending peer
};

}  // namespace cuda
}  // namespace shm_tensor
