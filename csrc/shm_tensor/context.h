// shm_tensor context: tag-matched, non-blocking point-to-point messages between the processes of one
// node through POSIX shared memory.
//
// Layout. Every process owns one "inbox" segment: a control block (owner pid, doorbell, the
// single-copy probe token, a closed flag) and, per peer that may send to it, a channel = a pool of
// `num_slots` slots of `slot_bytes` payload each (the per-directed-pair slot pool, at most 64) with a
// bitmask of free slots, and a ring of messages in send order, each naming its slot. The sender
// clears free bits and advances the ring head; the receiver sets free bits and advances the tail, so
// no lock is shared between processes. The sender takes the lowest free slot, so a stream of
// messages reuses the same, cache-warm slots.
//
// Three ways to carry a CPU payload. Through a slot (messages below `single_copy_min_bytes`, or where
// single copy is off or refused): the sender writes the wire header and the payload into a free slot
// and rings the receiver's doorbell; the send is complete once its bytes are in the slot. The
// receiver then either copies the message out into a fresh tensor and frees the slot at once, or,
// for messages of at least `zero_copy_min_bytes` while it has loans left, *lends* the slot: the
// received tensor points into the slot (zero copies on this side) and the slot is freed when that
// tensor's storage is. Single copy (messages of at least `single_copy_min_bytes` to a receiver with
// no loan left, single_copy.h): the slot gets the header and a descriptor (address, byte count)
// only; the receiver pulls the payload from the sender's memory with process_vm_readv into a fresh
// tensor, then frees the slot; the send completes only when the ring tail has passed its message,
// and until then the handle holds its own alias of the source storage.
//
// Matching and deadlock freedom. Every progress call (test, wait, wait_any, whatever handle it is
// made for) drains all inbound channels into tensors, pulling single-copy payloads as it goes, and
// matches them to posted receives by (peer, tag) or keeps them until one is posted. No message ever
// waits in a slot for a matching receive beyond the receiver's next progress call. A lent slot stays
// taken for as long as the program holds its tensor, which may be forever (an activation kept for
// the backward pass); so a receiver lends at most num_slots / 2 slots per sender at a time and the
// other slots circulate as in a pool without lending. Once no loan is left, a progress call copies
// messages out only while none of the handles it was called for is complete (it stops at the one it
// waits for); later messages stay in their slots for the next call, which may lend them by then: a
// receiver that consumes messages one by one keeps lending instead of copying out bursts. So a
// send, of any kind, waits at most for the receiver's next progress call: a send through a slot only
// when no slot is free, a single-copy send always. That is the condition a full pool always imposed,
// and it holds in any order of sends and receives: as long as every process keeps making progress
// calls while it has an incomplete handle (any wait does), every message is drained and every send
// completes. What it implies: a send may not complete while its receiver is blocked outside this
// transport (a collective, say) and has no free slot left for it.
//
// Waiting. A process blocks on its own doorbell with futex(2), in slices, checking between slices
// whether a peer it waits on is still alive (pidfd, fallback kill(pid, 0)); waiting single-copy sends
// are handles like any other, so a dead receiver is noticed the same way. While it sleeps the thread
// is SCHED_BATCH (sleep_policy.h), so the peer that wakes it is not preempted by it.
//
// Posting. isend never waits for the receiver: it writes the message into a free slot (the payload
// copy, inline below bytes_per_thread), or queues it when none is free (a later progress call writes
// it), and rings the receiver's doorbell. PostStats count what it did on the caller's thread.
#pragma once

#include <ATen/core/Tensor.h>

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
  // CPU messages of at least single_copy_min_bytes go in one copy (the receiver pulls them from the
  // sender's memory) to receivers whose probe allowed it; false: always two copies.
  bool single_copy = true;
  uint64_t single_copy_min_bytes = 16ull << 20;  // the crossover on the 2-vCPU VM (docs/transport.md)
  // Received CPU messages of at least zero_copy_min_bytes borrow their slot (no copy out) while
  // fewer than num_slots / 2 of that sender's slots are lent; false: always copy out.
  bool zero_copy_receive = true;
  uint64_t zero_copy_min_bytes = 256ull << 10;
  // A thread asleep on the doorbell is SCHED_BATCH (sleep_policy.h): the peer whose message or freed
  // slot wakes it keeps its CPU instead of being preempted by the woken thread in mid-isend.
  bool batch_while_sleeping = true;
  // Tests only: CPU tensors take the CUDA IPC path, through the fake CUDA runtime (SHM_TENSOR_CUDART
  // names it; csrc/fake_cudart), so that path's protocol runs on machines without a GPU. Refused
  // with the real runtime.
  bool host_tensors_by_cuda_ipc = false;
};

constexpr int kMaxSlots = 64;  // the free-slot bitmask is one 64-bit word

// Messages this context sent and received, by path.
struct MessageCounts {
  uint64_t sent_single_copy = 0;
  uint64_t sent_two_copy = 0;
  uint64_t received_single_copy = 0;
  uint64_t received_two_copy = 0;
  uint64_t received_zero_copy = 0;  // through a slot, which the received tensor borrows
  // Device messages: direct (the receiver copies from the sender's tensor) or staged (through the
  // sender's device pool, where the tensor's memory could not be exported).
  uint64_t sent_device_direct = 0;
  uint64_t sent_device_staged = 0;
  uint64_t received_device_direct = 0;
  uint64_t received_device_staged = 0;
};

// What isend() did on the caller's thread, summed over the calls (tensor sends only; the CUDA path
// is included in the time). `post_ns` is the time inside Context::isend (after the GIL is released),
// `wake_ns` the part of it spent in FUTEX_WAKE calls that woke a peer asleep on its doorbell: with
// more runnable threads than cores, the woken peer may take the CPU at that call's return, and the
// caller then waits on the run queue inside isend. Sleeps: how often a wait slept on the doorbell
// after its spin, and how many of those sleeps were SCHED_BATCH (ContextConfig::batch_while_sleeping).
struct PostStats {
  uint64_t sends_posted = 0;
  // Messages written into slots inside isend: the posted one when it found a free slot, and earlier
  // queued ones to the same peer that found one now.
  uint64_t written_at_post = 0;
  uint64_t queued_at_post = 0;        // the posted message found no free slot: queued, not waited for
  uint64_t bytes_copied_at_post = 0;  // payload bytes the caller copied into slots inside isend
  uint64_t wakes_at_post = 0;         // FUTEX_WAKE calls inside isend (the peer was asleep)
  uint64_t post_ns = 0;
  uint64_t max_post_ns = 0;
  uint64_t wake_ns = 0;
  uint64_t sleeps = 0;
  uint64_t sleeps_as_batch = 0;
};

class Context;

// One isend or irecv. Completion: a send through a slot when its bytes are in the slot, a single-copy
// send when the receiver has pulled them (its slot was freed); either way the tensor may be reused
// then. A receive completes when its tensor has been copied out of the slot, lent the slot, or been
// pulled from the sender.
// CUDA tensors, direct: a receive completes once its copy is queued on the caller's stream; a send
// once the receiver has queued its copy (the caller's stream then waits for that copy, on the device).
// Staged: a send completes when its copy into the staging slot is queued, a receive when the copy
// out has finished.
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
  // send: an alias of the contiguous source (its own TensorImpl, so `tensor.data = ...` by the
  // caller cannot swap the storage under us) until the send completes; recv: the result
  at::Tensor tensor_;
  bool single_copy_ = false;  // a send whose payload the receiver pulls from our memory
  // The wire header; for a raw send (tests of the receiver's validation) also the bytes after it.
  std::vector<char> raw_header_;
  // A CUDA send: the caller's stream and an event recorded on it after the tensor was produced.
  uintptr_t cuda_stream_ = 0;
  std::shared_ptr<cuda::OwnedEvent> cuda_ready_;  // null for a direct send written inside its isend
  bool cuda_ = false;         // a device message (or a host tensor on the fake runtime's CUDA path)
  bool cuda_direct_ = false;  // its memory is exported: the receiver copies from it (no size cap)
  cuda::Export export_;
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
  // Index of a completed handle, or -1; never waits. One progress pass for all of them: what a
  // test() of each would do, in one call (the DPP runtime polls its outstanding receives so).
  int test_any(const std::vector<std::shared_ptr<Handle>>& handles, int cuda_device = -1,
               uintptr_t cuda_stream = 0);
  // Sends `header` verbatim followed by `body` (no tensor payload): lets tests check that receivers
  // reject bad headers and descriptors.
  std::shared_ptr<Handle> send_raw_header(const std::string& header, int peer, const std::string& body = "");
  void close();

  // Peers whose messages this process pulls in one copy (its probe at connect() succeeded).
  std::vector<int> single_copy_peers();
  // Peers whose messages to this process take two copies, with the reason (probe failure, disabled).
  std::map<int, std::string> single_copy_fallbacks();
  MessageCounts message_counts();
  PostStats post_stats();
  // "" while sleeping waiters are SCHED_BATCH (or batch_while_sleeping is off); otherwise why not
  // (the failed sched_setscheduler call, after which this context stops trying).
  std::string batch_sleep_fallback();

  int rank() const { return rank_; }
  const ContextConfig& config() const { return config_; }
  std::string inbox_name(int rank) const;

 private:
  friend class Handle;
  struct Peer;

  Peer& peer_or_throw(const char* call, int peer, int64_t tag);
  bool handle_done_or_throw(Handle& handle);  // lock held
  // invalid_argument naming `call` unless `handles` is non-empty and all of this context's.
  void check_own_handles(const std::vector<std::shared_ptr<Handle>>& handles, const char* call) const;
  // `awaited`: the handles of the call (test, wait_any). Once no slot is left to lend, messages are
  // copied out only while none of them is complete; the rest wait for the next progress call.
  void progress(const std::vector<std::shared_ptr<Handle>>& awaited);  // lock held
  void drain_inbound(Peer& peer, const std::vector<std::shared_ptr<Handle>>& awaited);  // lock held
  // `posting`: called by isend, whose caller's time the PostStats count.
  void push_sends(Peer& peer, bool posting = false);  // lock held
  void ring_peer(Peer& peer, const char* call, int64_t tag, bool posting);  // lock held
  void complete_pulled_sends(Peer& peer);     // lock held
  bool receiver_closed(Peer& peer);           // lock held
  bool use_single_copy(Peer& peer, uint64_t nbytes);  // lock held
  void choose_payload_path(Peer& peer, Handle& handle);  // lock held; sets single_copy_ and the header
  bool lendable(const dpp_wire::WireHeader& header) const;  // large enough, lending on
  bool lend_slot(Peer& peer, const dpp_wire::WireHeader& header);  // lock held; takes a loan if so
  at::Tensor lent_tensor(Peer& peer, const dpp_wire::WireHeader& header, char* slot, uint32_t index);
  uint64_t write_slot(Peer& peer, Handle& handle, uint32_t index);  // returns the ring position written
  void check_liveness(const std::vector<std::shared_ptr<Handle>>& handles);  // lock held
  void deliver(int peer, int64_t tag, at::Tensor tensor);
  at::Tensor allocate_received(const dpp_wire::WireHeader& header);
  struct Pull;
  Pull pull_payload(Peer& peer, const dpp_wire::WireHeader& header, const char* slot, const at::Tensor& tensor);
  at::Tensor receive_device_message(Peer& peer, const dpp_wire::WireHeader& header, char* slot,
                                    uint32_t slot_index);
  cuda::CudaIpc& cuda_ipc(const char* call, int peer, int64_t tag);  // lock held; loads on first use

  int rank_;
  std::vector<int> peer_ranks_;
  std::string job_name_;
  ContextConfig config_;
  uint64_t slot_stride_;
  // Shared with the tensors that borrow its slots: the mapping outlives close() until they are freed.
  std::shared_ptr<ShmSegment> inbox_;
  struct ControlBlock* control_ = nullptr;
  std::vector<std::unique_ptr<Peer>> peers_;
  std::unordered_map<int, Peer*> peer_by_rank_;
  std::map<std::pair<int, int64_t>, std::deque<at::Tensor>> unclaimed_;
  std::map<std::pair<int, int64_t>, std::deque<std::shared_ptr<Handle>>> posted_recvs_;
  dpp_copy::CopyPool copy_pool_;
  std::shared_ptr<BufferPool> recv_buffers_;
  MessageCounts counts_;
  PostStats post_stats_;
  std::string batch_sleep_failure_;  // set once a switch to SCHED_BATCH failed; then not tried again
  // Peers pull this token at connect() to find out whether they may read our memory.
  uint64_t probe_token_ = 0;
  std::unique_ptr<cuda::CudaIpc> cuda_;  // created by the first CUDA message either way
  // The caller of the progress call under way (set with the lock held): where device messages land.
  int caller_cuda_device_ = -1;
  uintptr_t caller_cuda_stream_ = 0;
  std::mutex mutex_;
  bool connected_ = false;
  bool closed_ = false;
};

}  // namespace shm_tensor
