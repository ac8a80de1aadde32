// rdma_tensor context: tag-matched, non-blocking point-to-point tensor messages between nodes over
// UCX's tag API (InfiniBand/RoCE verbs where the cluster has them, TCP otherwise; UCX chooses).
//
// One message per tensor: the 128-byte wire header (csrc/common/wire_header.h, the format every
// transport shares) followed by the payload, sent with ucp_tag_send_nbx under the UCX tag = the
// sender's rank. The receiving side probes (ucp_tag_probe_nb) for any message, takes a registered
// buffer of the message's length from the pool, receives into it (ucp_tag_msg_recv_nbx), checks the
// header and matches the tensor to a posted receive by (peer, tag), or keeps it until one is posted.
// So sends and receives may be posted in any order, and variable shapes need no size agreement.
//
// Threads. One progress thread owns the UCX worker (UCS_THREAD_MODE_SINGLE): it posts the sends
// that callers queue, progresses the worker, receives probed messages, and sleeps on the worker's
// event fd (poll, in slices) when there is nothing to do. Callers never touch the worker: a send
// copies (stages) the tensor into a registered buffer, queues the post and signals the worker; a
// wait sleeps on a condition variable with a deadline.
//
// Failures. Endpoints use UCX's peer error handling: a broken link or a killed peer calls the
// endpoint's error handler, which fails that peer's pending sends and receives with PeerLost naming
// the peer rank, its node address and the tag; the endpoint is then closed in force mode. A peer that
// stops without its link breaking (a stopped process) is not seen by UCX: waits run out of time
// (TransportTimeout) and the DPP runtime's watchdog ends the job. close() cancels in-flight receives,
// closes the endpoints (flush, or force for failed peers, bounded in time) and joins the thread.
#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "buffer_pool.h"
#include "ucx_objects.h"

namespace rdma_tensor {

struct ContextConfig {
  double timeout_s = 300.0;                 // default for waits without an explicit timeout
  uint64_t pool_cache_bytes = 512ull << 20;  // free registered buffers kept for reuse
  double close_timeout_s = 10.0;            // longest close() waits for endpoints to flush
  // After its last activity the progress thread keeps polling the worker this long before it
  // sleeps on the event fd: a reply within a few tens of microseconds then costs no wake-up.
  // A waiter likewise watches for a completion this long before it sleeps on the condition
  // variable. Bounded, and both yield the core while they poll.
  double spin_us = 50.0;
};

enum class FailureKind { kNone, kTimeout, kPeerLost, kProtocol, kTransport };

class Context;

// One isend or irecv. A send completes when UCX has finished with its staged buffer (the tensor
// itself may be reused as soon as isend returns: it was copied); a receive when a matching message
// has arrived in full.
class Handle {
 public:
  Handle(std::shared_ptr<Context> context, bool is_send, int peer, int64_t tag)
      : context_(std::move(context)), is_send_(is_send), peer_(peer), tag_(tag) {}
  bool test();
  // The received tensor (undefined for a send). timeout_s < 0: the context default.
  at::Tensor wait(double timeout_s);
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
  FailureKind failure_ = FailureKind::kNone;
  std::string error_;
  at::Tensor tensor_;  // a receive's result
};

class Context : public std::enable_shared_from_this<Context> {
 public:
  // `node_address`: this rank's node (as given by --node-ips or the host name), for error messages.
  Context(int rank, std::string node_address, ContextConfig config);
  ~Context();

  // This worker's UCX address, to publish to the peers.
  std::string worker_address() const { return worker_address_; }
  // Creates an endpoint to each peer from its worker address, then starts the progress thread.
  // peers: rank -> (worker address, node address).
  void connect(const std::map<int, std::pair<std::string, std::string>>& peers);

  std::shared_ptr<Handle> isend(const at::Tensor& tensor, int peer, int64_t tag);
  std::shared_ptr<Handle> irecv(int peer, int64_t tag);
  int wait_any(const std::vector<std::shared_ptr<Handle>>& handles, double timeout_s);
  // Index of a completed handle, or -1; never waits (the progress thread moves the messages).
  int test_any(const std::vector<std::shared_ptr<Handle>>& handles);
  // Sends `bytes` verbatim as one message (no tensor): tests of the receiver's header checks.
  std::shared_ptr<Handle> send_raw(const std::string& bytes, int peer, int64_t tag);
  void close();

  // What UCX says about the endpoint to `peer` (lanes, transports, devices).
  std::string endpoint_info(int peer);
  std::string peer_description(int peer) const;  // "rank 3 at 10.0.0.2"
  size_t buffer_registrations() const { return pool_->registrations(); }
  int rank() const { return rank_; }
  const ContextConfig& config() const { return config_; }

 private:
  friend class Handle;
  struct Peer {
    int rank = -1;
    std::string node_address;
    ucp_ep_h endpoint = nullptr;
    bool failed = false;
    std::string failure;
    // What later operations with this peer raise: a lost peer, or a stream broken by a bad
    // message (a receive posted after the bad message arrived must see the same error).
    FailureKind failure_kind = FailureKind::kPeerLost;
    Context* context = nullptr;  // for the error handler
  };
  struct InFlight;  // a UCX request under way: a send's staged buffer, or a receive's buffer

  Peer& peer_or_throw(const char* call, int peer, int64_t tag);
  std::shared_ptr<Handle> queue_send(std::unique_ptr<RegisteredBuffer> buffer, size_t bytes, int peer,
                                     int64_t tag);
  bool done_or_throw(Handle& handle);  // lock held
  void fail_handle(Handle& handle, FailureKind kind, const std::string& error);  // lock held
  void notify_changed() {  // lock held
    changes_.fetch_add(1, std::memory_order_release);
    changed_.notify_all();
  }
  void run_on_worker(std::function<void()> work);  // queue for the progress thread; wakes it
  void progress_loop();
  bool receive_probed_messages();  // progress thread
  void post_send(std::shared_ptr<InFlight> send);  // progress thread
  void complete(uint64_t id, ucs_status_t status);  // progress thread (UCX callbacks)
  void deliver(InFlight& received);           // progress thread
  void peer_failed(Peer& peer, const std::string& why);  // lock held
  void shut_down_worker();         // progress thread, at exit
  static void on_send_done(void* request, ucs_status_t status, void* user_data);
  static void on_recv_done(void* request, ucs_status_t status, const ucp_tag_recv_info_t* info,
                           void* user_data);
  static void on_endpoint_error(void* arg, ucp_ep_h endpoint, ucs_status_t status);

  int rank_;
  std::string node_address_;
  ContextConfig config_;
  std::shared_ptr<UcxContext> ucx_;
  std::shared_ptr<BufferPool> pool_;
  ucp_worker_h worker_ = nullptr;
  int event_fd_ = -1;
  std::string worker_address_;
  std::vector<std::unique_ptr<Peer>> peers_;
  std::unordered_map<int, Peer*> peer_by_rank_;

  // Shared between the callers and the progress thread, under mutex_.
  std::mutex mutex_;
  std::condition_variable changed_;  // a handle completed or failed
  // Bumped (under mutex_) with every notify of changed_: a waiter's bounded spin watches it
  // without taking the mutex.
  std::atomic<uint64_t> changes_{0};
  // The progress thread is (about to be) asleep on the event fd: callers that queue work must
  // signal the worker. Written under mutex_; while it is false queued work is seen without a
  // wake-up (a signal is a syscall on each side).
  bool worker_sleeping_ = false;
  std::deque<std::function<void()>> work_;
  std::map<std::pair<int, int64_t>, std::deque<at::Tensor>> unclaimed_;
  std::map<std::pair<int, int64_t>, std::deque<std::shared_ptr<Handle>>> posted_recvs_;
  std::string fatal_;  // the progress thread stopped on an error: every wait reports it
  bool stopping_ = false;
  bool closed_ = false;

  // Owned by the progress thread.
  std::map<uint64_t, std::shared_ptr<InFlight>> in_flight_;
  uint64_t next_id_ = 1;
  std::thread thread_;
};

}  // namespace rdma_tensor
