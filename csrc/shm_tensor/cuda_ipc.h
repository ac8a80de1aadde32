// CUDA IPC for shm_tensor: GPU tensors travel device to device, only a small descriptor goes through
// the shared-memory channel, and no side waits on the device from the host.
//
// DIRECT (the default): one copy. At isend the sender exports the allocation that holds its tensor
// (cuMemGetAddressRange + cudaIpcGetMemHandle, so any tensor of torch's caching allocator, of any
// size) and records its event for host slot i on the caller's stream, after the work that produced
// the tensor. Host slot i carries the wire header and a DirectDescriptor. The receiver, in its next
// progress call: opens the allocation (once per allocation, cached) and event i (once per slot);
// on the stream of whoever called progress (torch's current stream) it waits for event i, copies
// the bytes into a fresh tensor and records its own event i ("copied"); writes that event's handle
// into the slot and frees it. The receive is complete at once: later work on that stream is ordered
// after the copy. The send completes when the sender sees the slot freed: the caller's stream then
// waits for the receiver's "copied" event (opened once per slot), so the tensor is not overwritten
// while it is read, and the handle drops its reference to the tensor.
//
// STAGED (only where the tensor's memory cannot be exported, e.g. torch's expandable segments):
// the sender owns, per peer, a pool of device staging slots (one cudaMalloc, `num_slots` x
// `slot_bytes`, so such messages are capped at the slot size) and one interprocess event per slot.
// Send: its own stream waits for the caller's stream, copies the tensor into device slot i, records
// event i, and the caller's stream waits for that event. RECEIVE: the receiver opens the pool once
// per peer, copies out on its own stream after event i and waits for the copy (polled on the host,
// checking that the sender lives) before it frees host slot i, which frees device slot i.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
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

// What follows a kFlagCudaIpc wire header on the direct path.
struct DirectDescriptor {
  uint64_t magic;             // kDirectMagic
  int32_t device;             // the sender's device of the tensor
  uint32_t slot;              // the host slot, = the index of the sender's "ready" event
  uint64_t offset;            // of the tensor's first byte in its allocation
  uint64_t allocation_bytes;  // the allocation's size (0: unknown, the fake runtime), bounds offset + nbytes
  IpcMemHandle memory;        // the allocation holding the tensor
  IpcEventHandle ready;       // recorded after the work that produced the tensor
  // Written by the receiver before it frees the slot: its event recorded after its copy.
  uint64_t copied_magic;      // kCopiedMagic once `copied` is valid
  IpcEventHandle copied;
};
static_assert(sizeof(DirectDescriptor) == 232, "direct descriptor layout changed");
constexpr uint64_t kDirectMagic = 0x5443455249444450ull;  // "PDDIRECT"
constexpr uint64_t kCopiedMagic = 0x4445495059434450ull;  // "PDCOPIED"
// The host slot room a device message needs, whichever path it takes.
constexpr size_t kDeviceDescriptorBytes = 232;
// The largest device message a receiver accepts (a sanity bound on a header's byte count).
constexpr uint64_t kMaxDeviceMessageBytes = 1ull << 40;

// A tensor's memory as another process can open it.
struct Export {
  IpcMemHandle memory;
  uint64_t offset = 0;            // of the tensor's data in the allocation
  uint64_t allocation_bytes = 0;  // 0: unknown
  int device = 0;
};

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

// Direct path, sender side, per receiving peer.
struct DirectSendState {
  int device = -1;  // of the events below
  std::vector<std::unique_ptr<OwnedEvent>> ready;  // per host slot, interprocess
  std::vector<IpcEventHandle> ready_handles;
  std::vector<std::unique_ptr<OpenedEvent>> copied;  // the receiver's, per slot, opened on first use
  std::vector<IpcEventHandle> copied_handles;        // what each was opened from
};

// Direct path, receiver side, per sending peer.
struct DirectReceiveState {
  // The sender's allocations mapped here, by handle bytes, least recently used first. Bounded: a
  // mapping keeps the sender's memory alive after the sender freed it.
  std::vector<std::pair<std::string, std::unique_ptr<OpenedMemory>>> memories;
  std::vector<std::unique_ptr<OpenedEvent>> ready;  // the sender's, per slot
  std::vector<IpcEventHandle> ready_handles;
  int copied_device = -1;
  std::vector<std::unique_ptr<OwnedEvent>> copied;  // ours, per slot, interprocess
  std::vector<IpcEventHandle> copied_handles;
};
constexpr size_t kMaxOpenedAllocationsPerPeer = 64;

// The CUDA state of one shm_tensor context. Not thread-safe: the context's lock is held.
class CudaIpc {
 public:
  explicit CudaIpc(const Runtime& runtime) : runtime_(runtime) {}
  ~CudaIpc();
  CudaIpc(const CudaIpc&) = delete;
  CudaIpc& operator=(const CudaIpc&) = delete;

  // Direct path. False (with the reason in `why`) when the tensor's memory cannot be exported.
  bool export_tensor(const at::Tensor& source, int device, Export* out, std::string* why, int peer,
                     int64_t tag);
  // Records the sender's event for `slot`: on `caller_stream` when `ready` is null (inside the
  // isend of this very message), else on our stream after `ready`. Returns the descriptor.
  DirectDescriptor send_direct(int peer, int64_t tag, const Export& exported, const OwnedEvent* ready,
                               uintptr_t caller_stream, uint64_t slot, uint64_t num_slots);
  // Queues the copy out of the sender's tensor on `caller_stream` and fills descriptor->copied.
  // host_tensors: the fake runtime stands for the device and the tensor is a CPU tensor.
  at::Tensor receive_direct(int peer, const dpp_wire::WireHeader& header, DirectDescriptor* descriptor,
                            int device, uintptr_t caller_stream, bool host_tensors, uint64_t num_slots,
                            const std::function<bool()>& peer_alive);
  // A direct send is complete (its slot came back): `caller_stream` waits for the receiver's copy.
  void complete_direct(int peer, int64_t tag, const DirectDescriptor& descriptor, int device,
                       uintptr_t caller_stream, uint64_t num_slots);

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
                     int device, uintptr_t caller_stream, bool host_tensors,
                     const std::function<bool()>& peer_alive, double timeout_s, double spin_us);

 private:
  OwnedStream& stream_for(int device, const char* call, int peer, int64_t tag);
  // `count` new interprocess events (on the current device) and their IPC handles, replacing any.
  void make_interprocess_events(uint64_t count, std::vector<std::unique_ptr<OwnedEvent>>* events,
                                std::vector<IpcEventHandle>* handles, const char* call, int peer,
                                int64_t tag);
  void queue_direct_copy(int peer, const dpp_wire::WireHeader& header, DirectDescriptor* descriptor,
                         const at::Tensor& tensor, int device, uintptr_t caller_stream, uint64_t num_slots);
  void wait_for(Event event, int peer, int64_t tag, const std::function<bool()>& peer_alive,
                double timeout_s, double spin_us);

  const Runtime& runtime_;
  std::map<int, std::unique_ptr<OwnedStream>> streams_;  // per device
  std::map<int, std::unique_ptr<SendPool>> send_pools_;  // per receiving peer
  std::map<int, std::unique_ptr<ReceiveCache>> receive_caches_;  // per sending peer
  std::map<int, DirectSendState> direct_sends_;        // per receiving peer
  std::map<int, DirectReceiveState> direct_receives_;  // per sending peer
};

}  // namespace cuda
}  // namespace shm_tensor
