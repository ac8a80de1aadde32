// shm_tensor context: tag-matched, non-blocking point-to-point messages between the processes of one
// node through POSIX shared memory.
//
// Layout. Every process owns one "inbox" segment: a control block (owner pid, doorbell) and, per
// peer that may send to it, a channel = a bounded ring of `num_slots` slots of `slot_bytes` payload
// each (the per-directed-pair slot pool). The sender writes a wire header and the payload into the
// next free slot of its channel in the receiver's inbox and rings the receiver's doorbell; the
// receiver copies the message out into a fresh tensor, frees the slot and rings the sender's
// doorbell. Channels are single-producer single-consumer rings (head written by the sender, tail by
// the receiver), so no lock is shared between processes.
//
// Matching. Every progress call drains all inbound channels into private tensors, matched to posted
// receives by (peer, tag) or kept until one is posted. Because slots never wait for a matching
// receive, any order of sends and receives completes: back-pressure (a full ring) only delays a
// send until the receiver next makes progress, it cannot deadlock.
//
// Waiting. A process blocks on its own doorbell with futex(2), in slices, checking between slices
// whether a peer it waits on is still alive (pidfd, fallback kill(pid, 0)).
#pragma once

#include <ATen/ATen.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "../common/copy_pool.h"
#include "../common/wire_header.h"
#include "buffer_pool.h"
#include "cuda_ipc.h"
#include "doorbell.h"
#include "shm_segment.h"

namespace shm_tensor {

struct ContextConfig {
  int num_slots = 4;
  uint64_t slot_bytes = 64ull << 20;
  int copy_threads = 2;                    // at most this many threads copy one message
  uint64_t bytes_per_thread = 8ull << 20;  // --workload: bytes each copy thread handles
  double timeout_s = 300.0;                // default for waits without an explicit timeout
  // Received tensors of at least 64 KiB live in recycled buffers; at most this many bytes of
  // buffers wait for reuse.
  uint64_t recv_cache_bytes = 256ull << 20;
  // Before sleeping on the doorbell a waiter watches it this long: an answer that comes within a
  // few microseconds then costs no sleep and wake-up. Bounded, so it never occupies a core.
  double spin_us = 20.0;
};

class Context;

// One isend or irecv. Completion: a send when its bytes are in a slot (the tensor may be reused),
// a receive when its tensor has been copied out of the slot. CUDA tensors: a send completes when its
// device copy is queued (the caller's stream waits for it), a receive when the copy has finished.
// `cuda_device`/`cuda_stream` name the caller's current device and torch stream (-1/0 when torch
// has not initialised CUDA: the thread's current device and the legacy default stream).
class Handle : public std::enable_shared_from_this<Handle> {
 public:
  Handle(std::shared_ptr<Context> context, bool is_send, int peer, int64_t tag)
      : context_(std::move(context)), is_send_(is_send), peer_(peer), tag_(tag) {}
  bool test(int cuda_device = -1, uintptr_t cuda_stream = 0);
  // The received tensor (an undefined tensor for a send). timeout_s < 0: the context default.
  at::Tensor wait(double timeout_s, int cuda_device = -1, uintptr_t cuda_stream = 0);
  bool is_send() const { return is_send_; }
  int peer() const { return peer_; }
  int64_t tag() const { return tag_; }

 private:
  friend class Context;
  std::shared_ptr<Context> context_;
  bool is_send_;
  int peer_;
  int64_t tag_;
  bool done_ = false;
  at::Tensor tensor_;  // send: the contiguous source until written; recv: the result
  std::vector<char> raw_header_;  // a raw-header send (tests of the receiver's validation)
  // A CUDA send: the caller's stream and an event recorded on it after the tensor was produced.
  uintptr_t cuda_stream_ = 0;
  std::shared_ptr<cuda::OwnedEvent> cuda_ready_;
};

class Context : public std::enable_shared_from_this<Context> {
 public:
  Context(int rank, std::vector<int> peers, std::string job_name, ContextConfig config);
  ~Context();

  // Rendezvous, in this order on every process with a barrier between the steps:
  // construct (creates this inbox) -> connect() (maps peers' inboxes) -> unlink() (removes names).
  void connect();
  void unlink();

  // cuda_stream: the caller's torch stream on the tensor's device (CUDA tensors only).
  std::shared_ptr<Handle> isend(const at::Tensor& tensor, int peer, int64_t tag, uintptr_t cuda_stream = 0);
  std::shared_ptr<Handle> irecv(int peer, int64_t tag);
  // Index of a completed handle; blocks on the doorbell meanwhile. timeout_s < 0: default.
  int wait_any(const std::vector<std::shared_ptr<Handle>>& handles, double timeout_s,
               int cuda_device = -1, uintptr_t cuda_stream = 0);
  // Sends `header` verbatim with no payload: lets tests check that receivers reject bad headers.
  std::shared_ptr<Handle> send_raw_header(const std::string& header, int peer);
  void close();

  int rank() const { return rank_; }
  const ContextConfig& config() const { return config_; }
  std::string inbox_name(int rank) const;

 private:
  friend class Handle;
  struct Peer;

  Peer& peer_or_throw(const char* call, int peer, int64_t tag);
  bool handle_done_or_throw(Handle& handle);  // lock held
  void progress();                            // lock held
  void drain_inbound(Peer& peer);             // lock held
  void push_sends(Peer& peer);                // lock held
  void write_slot(Peer& peer, Handle& handle);
  void check_liveness(const std::vector<std::shared_ptr<Handle>>& handles);  // lock held
  void deliver(int peer, int64_t tag, at::Tensor tensor);
  at::Tensor allocate_received(const dpp_wire::WireHeader& header);
  at::Tensor receive_device_message(Peer& peer, const dpp_wire::WireHeader& header, const char* slot,
                                    uint64_t slot_index);
  cuda::CudaIpc& cuda_ipc(const char* call, int peer, int64_t tag);  // lock held; loads on first use

  int rank_;
  std::vector<int> peer_ranks_;
  std::string job_name_;
  ContextConfig config_;
  uint64_t slot_stride_;
  ShmSegment inbox_;
  struct ControlBlock* control_ = nullptr;
  std::vector<std::unique_ptr<Peer>> peers_;
  std::unordered_map<int, Peer*> peer_by_rank_;
  std::map<std::pair<int, int64_t>, std::deque<at::Tensor>> unclaimed_;
  std::map<std::pair<int, int64_t>, std::deque<std::shared_ptr<Handle>>> posted_recvs_;
  dpp_copy::CopyPool copy_pool_;
  std::shared_ptr<BufferPool> recv_buffers_;
  std::unique_ptr<cuda::CudaIpc> cuda_;  // created by the first CUDA message either way
  // The caller of the progress call under way (set with the lock held): where device messages land.
  int caller_cuda_device_ = -1;
  uintptr_t caller_cuda_stream_ = 0;
  std::mutex mutex_;
  bool connected_ = false;
  bool closed_ = false;
};

}  // namespace shm_tensor
