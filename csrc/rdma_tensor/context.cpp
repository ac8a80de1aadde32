#include "context.h"

#include <ATen/ops/from_blob.h>

#include <poll.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <sstream>

#include "../common/dtype_codes.h"
#include "../common/errors.h"
#include "../common/wire_header.h"

namespace rdma_tensor {

namespace {

using Clock = std::chrono::steady_clock;
constexpr int kPollSliceMs = 100;  // the progress thread re-checks for stop at least this often
constexpr size_t kHeaderBytes = sizeof(dpp_wire::WireHeader);

Clock::time_point deadline_after(double seconds) {
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

[[noreturn]] void throw_failure(FailureKind kind, const std::string& error) {
  switch (kind) {
    case FailureKind::kTimeout:
      throw dpp_errors::TransportTimeout(error);
    case FailureKind::kPeerLost:
      throw dpp_errors::PeerLost(error);
    case FailureKind::kProtocol:
      throw dpp_errors::ProtocolError(error);
    default:
      throw dpp_errors::TransportError(error);
  }
}

}  // namespace

// A UCX request under way, owned by the progress thread (in_flight_) until its completion.
struct Context::InFlight {
  Context* context = nullptr;  // for UCX's callbacks
  uint64_t id = 0;
  bool is_send = false;
  int peer = -1;
  int64_t tag = -1;  // sends: the message's tag; receives: unknown until the header is read
  std::shared_ptr<Handle> handle;  // sends
  std::unique_ptr<RegisteredBuffer> buffer;
  size_t bytes = 0;
  void* request = nullptr;  // UCX's request while it is pending
};

// ---------------------------------------------------------------------------------------------
// Handle

bool Handle::test() {
  std::lock_guard<std::mutex> lock(context_->mutex_);
  return context_->done_or_throw(*this);
}

at::Tensor Handle::wait(double timeout_s) {
  std::vector<std::shared_ptr<Handle>> one;
  // The context's handles are shared_ptrs; wait_any needs one pointing at this handle.
  {
    std::lock_guard<std::mutex> lock(context_->mutex_);
    if (context_->done_or_throw(*this)) return tensor_;
  }
  // Aliasing constructor: shares the context's ownership of nothing, points at this handle.
  one.emplace_back(std::shared_ptr<Handle>(std::shared_ptr<Handle>(), this));
  context_->wait_any(one, timeout_s);
  return tensor_;
}

// ---------------------------------------------------------------------------------------------
// Context: setup

Context::Context(int rank, std::string node_address, ContextConfig config)
    : rank_(rank), node_address_(std::move(node_address)), config_(config) {
  ucx_ = std::make_shared<UcxContext>();
  pool_ = std::make_shared<BufferPool>(ucx_, config_.pool_cache_bytes);
  ucp_worker_params_t params{};
  params.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  params.thread_mode = UCS_THREAD_MODE_SINGLE;  // only the progress thread uses the worker
  ucs_status_t status = ucp_worker_create(ucx_->get(), &params, &worker_);
  if (status != UCS_OK) {
    throw dpp_errors::TransportError(ucx_failure("ucp_worker_create", status, "rank " + std::to_string(rank)));
  }
  status = ucp_worker_get_efd(worker_, &event_fd_);
  if (status != UCS_OK) {
    ucp_worker_destroy(worker_);
    throw dpp_errors::TransportError(ucx_failure("ucp_worker_get_efd", status, "rank " + std::to_string(rank)));
  }
  ucp_address_t* address = nullptr;
  size_t length = 0;
  status = ucp_worker_get_address(worker_, &address, &length);
  if (status != UCS_OK) {
    ucp_worker_destroy(worker_);
    throw dpp_errors::TransportError(ucx_failure("ucp_worker_get_address", status, "rank " + std::to_string(rank)));
  }
  worker_address_.assign(reinterpret_cast<const char*>(address), length);
  ucp_worker_release_address(worker_, address);
}

Context::~Context() {
  try {
    close();
  } catch (...) {
    // A destructor must not throw; close() failing here means the process is going down anyway.
  }
}

void Context::connect(const std::map<int, std::pair<std::string, std::string>>& peers) {
  if (thread_.joinable()) throw dpp_errors::TransportError("rdma_tensor.connect: already connected");
  for (const auto& [peer_rank, addresses] : peers) {
    auto peer = std::make_unique<Peer>();
    peer->rank = peer_rank;
    peer->node_address = addresses.second;
    peer->context = this;
    ucp_ep_params_t params{};
    params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                        UCP_EP_PARAM_FIELD_ERR_HANDLER;
    params.address = reinterpret_cast<const ucp_address_t*>(addresses.first.data());
    params.err_mode = UCP_ERR_HANDLING_MODE_PEER;  // a broken link calls on_endpoint_error
    params.err_handler.cb = &Context::on_endpoint_error;
    params.err_handler.arg = peer.get();
    ucs_status_t status = ucp_ep_create(worker_, &params, &peer->endpoint);
    if (status != UCS_OK) {
      throw dpp_errors::TransportError(ucx_failure(
          "ucp_ep_create", status, "rank " + std::to_string(peer_rank) + " at " + addresses.second));
    }
    peer_by_rank_[peer_rank] = peer.get();
    peers_.push_back(std::move(peer));
  }
  thread_ = std::thread([this] { progress_loop(); });
}

std::string Context::peer_description(int peer) const {
  auto found = peer_by_rank_.find(peer);
  std::string where = found != peer_by_rank_.end() ? found->second->node_address : "an unknown node";
  return "rank " + std::to_string(peer) + " at " + where;
}

std::string Context::endpoint_info(int peer) {
  Peer& target = peer_or_throw("endpoint_info", peer, -1);
  std::mutex done_mutex;
  std::condition_variable done_changed;
  bool done = false;
  std::string text;
  run_on_worker([&] {
    std::string printed = target.endpoint != nullptr ? rdma_tensor::endpoint_info(target.endpoint) : "(closed)";
    std::lock_guard<std::mutex> lock(done_mutex);
    text = std::move(printed);
    done = true;
    done_changed.notify_all();
  });
  std::unique_lock<std::mutex> lock(done_mutex);
  if (!done_changed.wait_until(lock, deadline_after(config_.timeout_s), [&] { return done; })) {
    throw dpp_errors::TransportTimeout("rdma_tensor.endpoint_info(" + peer_description(peer) +
                                       "): the progress thread did not answer");
  }
  return text;
}

// ---------------------------------------------------------------------------------------------
// Context: posting

Context::Peer& Context::peer_or_throw(const char* call, int peer, int64_t tag) {
  auto found = peer_by_rank_.find(peer);
  if (found == peer_by_rank_.end()) {
    std::ostringstream known;
    for (const auto& entry : peers_) known << " " << entry->rank;
    throw std::invalid_argument(dpp_errors::describe(call, peer, tag, "not a peer of this context (peers:" + known.str() + ")"));
  }
  return *found->second;
}

std::shared_ptr<Handle> Context::isend(const at::Tensor& tensor, int peer, int64_t tag) {
  peer_or_throw("isend", peer, tag);
  if (tag < 0) throw std::invalid_argument(dpp_errors::describe("isend", peer, tag, "tags are non-negative"));
  std::vector<int64_t> shape(tensor.sizes().begin(), tensor.sizes().end());
  uint64_t nbytes = static_cast<uint64_t>(tensor.numel()) * tensor.element_size();
  dpp_wire::WireHeader header = dpp_wire::make_header(
      tag, dpp_wire::wire_dtype_of(tensor.scalar_type()), shape.data(), static_cast<int>(shape.size()),
      nbytes, rank_);
  // Staging: header and payload in one registered buffer. The copy also gathers non-contiguous
  // tensors and brings device tensors to the host.
  std::unique_ptr<RegisteredBuffer> buffer = pool_->take(kHeaderBytes + nbytes);
  std::memcpy(buffer->data(), &header, kHeaderBytes);
  if (nbytes > 0) {
    at::Tensor staged = at::from_blob(buffer->data() + kHeaderBytes, shape,
                                      at::TensorOptions().dtype(tensor.scalar_type()));
    staged.copy_(tensor);
  }
  return queue_send(std::move(buffer), kHeaderBytes + nbytes, peer, tag);
}

std::shared_ptr<Handle> Context::send_raw(const std::string& bytes, int peer, int64_t tag) {
  peer_or_throw("send_raw", peer, tag);
  std::unique_ptr<RegisteredBuffer> buffer = pool_->take(bytes.size());
  std::memcpy(buffer->data(), bytes.data(), bytes.size());
  return queue_send(std::move(buffer), bytes.size(), peer, tag);
}

std::shared_ptr<Handle> Context::queue_send(std::unique_ptr<RegisteredBuffer> buffer, size_t bytes,
                                            int peer, int64_t tag) {
  auto handle = std::make_shared<Handle>(shared_from_this(), true, peer, tag);
  auto send = std::make_shared<InFlight>();
  send->context = this;
  send->is_send = true;
  send->peer = peer;
  send->tag = tag;
  send->handle = handle;
  send->buffer = std::move(buffer);
  send->bytes = bytes;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    Peer& target = *peer_by_rank_.at(peer);
    if (closed_) throw dpp_errors::TransportError(dpp_errors::describe("isend", peer, tag, "context closed"));
    if (target.failed) {
      throw_failure(target.failure_kind, "rdma_tensor.isend(" + peer_description(peer) + ", tag=" +
                                             std::to_string(tag) + "): " + target.failure);
    }
  }
  run_on_worker([this, send] { post_send(send); });
  return handle;
}

std::shared_ptr<Handle> Context::irecv(int peer, int64_t tag) {
  Peer& source = peer_or_throw("irecv", peer, tag);
  auto handle = std::make_shared<Handle>(shared_from_this(), false, peer, tag);
  std::lock_guard<std::mutex> lock(mutex_);
  if (closed_) throw dpp_errors::TransportError(dpp_errors::describe("irecv", peer, tag, "context closed"));
  auto key = std::make_pair(peer, tag);
  auto waiting = unclaimed_.find(key);
  if (waiting != unclaimed_.end()) {  // arrived before the receive was posted
    handle->tensor_ = std::move(waiting->second.front());
    handle->done_ = true;
    waiting->second.pop_front();
    if (waiting->second.empty()) unclaimed_.erase(waiting);
    return handle;
  }
  if (source.failed) {
    fail_handle(*handle, source.failure_kind, source.failure);
    return handle;
  }
  posted_recvs_[key].push_back(handle);
  return handle;
}

void Context::run_on_worker(std::function<void()> work) {
  bool sleeping;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!fatal_.empty()) throw dpp_errors::TransportError("rdma_tensor: " + fatal_);
    work_.push_back(std::move(work));
    sleeping = worker_sleeping_;
  }
  // Thread-safe by UCX's contract: wakes the progress thread from its event-fd poll. An awake
  // progress thread takes the work on its next turn (it checks work_ under mutex_ before it sleeps).
  if (sleeping) ucp_worker_signal(worker_);
}

// ---------------------------------------------------------------------------------------------
// Context: waiting

void Context::fail_handle(Handle& handle, FailureKind kind, const std::string& error) {
  if (handle.done_ || handle.failure_ != FailureKind::kNone) return;
  handle.failure_ = kind;
  std::ostringstream text;
  text << "rdma_tensor." << (handle.is_send_ ? "isend" : "irecv") << "(" << peer_description(handle.peer_)
       << ", tag=" << handle.tag_ << "): " << error;
  handle.error_ = text.str();
  notify_changed();
}

bool Context::done_or_throw(Handle& handle) {
  if (handle.failure_ != FailureKind::kNone) throw_failure(handle.failure_, handle.error_);
  if (handle.done_) return true;
  if (!fatal_.empty()) throw dpp_errors::TransportError("rdma_tensor: " + fatal_);
  return false;
}

int Context::test_any(const std::vector<std::shared_ptr<Handle>>& handles) {
  if (handles.empty()) throw std::invalid_argument("rdma_tensor.test_any: no handles given");
  std::lock_guard<std::mutex> lock(mutex_);
  for (size_t index = 0; index < handles.size(); ++index) {
    if (done_or_throw(*handles[index])) return static_cast<int>(index);
  }
  return -1;
}

int Context::wait_any(const std::vector<std::shared_ptr<Handle>>& handles, double timeout_s) {
  if (handles.empty()) throw std::invalid_argument("rdma_tensor.wait_any: no handles given");
  double limit = timeout_s < 0 ? config_.timeout_s : timeout_s;
  auto deadline = deadline_after(limit);
  // A bounded spin first (spin_us, capped by the deadline): a completion within it costs no
  // futex wake-up. It watches changes_ without the mutex and yields the core meanwhile.
  const auto spin_until = std::min(
      deadline, Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                   std::chrono::duration<double, std::micro>(config_.spin_us)));
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    for (size_t index = 0; index < handles.size(); ++index) {
      if (done_or_throw(*handles[index])) return static_cast<int>(index);
    }
    if (Clock::now() < spin_until) {
      const uint64_t seen = changes_.load(std::memory_order_acquire);
      lock.unlock();
      while (changes_.load(std::memory_order_acquire) == seen && Clock::now() < spin_until) {
        std::this_thread::yield();
      }
      lock.lock();
      continue;
    }
    if (changed_.wait_until(lock, deadline) == std::cv_status::timeout) {
      bool any_done = false;
      for (const auto& handle : handles) any_done = any_done || handle->done_ || handle->failure_ != FailureKind::kNone;
      if (any_done) continue;
      std::ostringstream waited;
      for (size_t index = 0; index < handles.size() && index < 8; ++index) {
        const Handle& handle = *handles[index];
        waited << (index ? ", " : "") << (handle.is_send_ ? "send to " : "receive from ")
               << peer_description(handle.peer_) << " tag " << handle.tag_;
      }
      if (handles.size() > 8) waited << ", ...";
      const Handle& first = *handles.front();
      std::ostringstream text;
      text << "rdma_tensor.wait(" << peer_description(first.peer_) << ", tag=" << first.tag_
           << "): timed out after " << limit << " s waiting for " << waited.str();
      throw dpp_errors::TransportTimeout(text.str());
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Progress thread

void Context::progress_loop() {
  const auto spin = std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double, std::micro>(config_.spin_us));
  auto last_activity = Clock::now();
  try {
    while (true) {
      std::deque<std::function<void()>> work;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        if (stopping_) break;
        work.swap(work_);
      }
      for (auto& item : work) item();
      bool busy = !work.empty();
      while (ucp_worker_progress(worker_) != 0) busy = true;
      busy = receive_probed_messages() || busy;
      if (busy) {
        last_activity = Clock::now();
        continue;
      }
      if (Clock::now() - last_activity < spin) {
        std::this_thread::yield();
        continue;
      }
      // Nothing to do: arm the event fd and sleep on it. BUSY means events came in meanwhile.
      ucs_status_t status = ucp_worker_arm(worker_);
      if (status == UCS_ERR_BUSY) continue;
      if (status != UCS_OK) throw dpp_errors::TransportError(ucx_failure("ucp_worker_arm", status, "rank " + std::to_string(rank_)));
      {
        std::lock_guard<std::mutex> lock(mutex_);
        if (stopping_ || !work_.empty()) continue;
        worker_sleeping_ = true;  // from now on callers signal the worker when they queue work
      }
      pollfd event{event_fd_, POLLIN, 0};
      int polled = poll(&event, 1, kPollSliceMs);
      int poll_errno = errno;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        worker_sleeping_ = false;
      }
      last_activity = Clock::now();  // woken: spin again before the next sleep
      if (polled < 0 && poll_errno != EINTR) {
        errno = poll_errno;
        throw dpp_errors::TransportError(dpp_errors::syscall_failure("poll", "UCX worker event fd"));
      }
    }
  } catch (const std::exception& error) {
    std::lock_guard<std::mutex> lock(mutex_);
    fatal_ = std::string("the progress thread stopped: ") + error.what();
    notify_changed();
  }
  shut_down_worker();
}

void Context::post_send(std::shared_ptr<InFlight> send) {
  Peer& target = *peer_by_rank_.at(send->peer);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (target.failed || target.endpoint == nullptr) {
      fail_handle(*send->handle, target.failed ? target.failure_kind : FailureKind::kPeerLost,
                  target.failed ? target.failure : "endpoint closed");
      return;
    }
  }
  send->id = next_id_++;
  in_flight_[send->id] = send;
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                       UCP_OP_ATTR_FIELD_DATATYPE | UCP_OP_ATTR_FIELD_MEMH;
  param.cb.send = &Context::on_send_done;
  param.user_data = send.get();  // owned by in_flight_ until complete(): the address is stable
  param.datatype = ucp_dt_make_contig(1);
  param.memh = send->buffer->memh();
  ucs_status_ptr_t request = ucp_tag_send_nbx(target.endpoint, send->buffer->data(), send->bytes,
                                              static_cast<ucp_tag_t>(rank_), &param);
  if (request == nullptr) {
    complete(send->id, UCS_OK);  // finished inline: UCX calls no callback then
  } else if (UCS_PTR_IS_ERR(request)) {
    complete(send->id, UCS_PTR_STATUS(request));
  } else {
    send->request = request;
  }
}

bool Context::receive_probed_messages() {
  bool received_any = false;
  while (true) {
    ucp_tag_recv_info_t info{};
    ucp_tag_message_h message = ucp_tag_probe_nb(worker_, 0, 0, /*remove=*/1, &info);
    if (message == nullptr) break;
    received_any = true;
    auto receive = std::make_shared<InFlight>();
    receive->context = this;
    receive->id = next_id_++;
    receive->peer = static_cast<int>(info.sender_tag);
    receive->bytes = info.length;
    receive->buffer = pool_->take(std::max<size_t>(info.length, 1));
    in_flight_[receive->id] = receive;
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                         UCP_OP_ATTR_FIELD_DATATYPE | UCP_OP_ATTR_FIELD_MEMH;
    param.cb.recv = &Context::on_recv_done;
    param.user_data = receive.get();
    param.datatype = ucp_dt_make_contig(1);
    param.memh = receive->buffer->memh();
    ucs_status_ptr_t request = ucp_tag_msg_recv_nbx(worker_, receive->buffer->data(), info.length,
                                                    message, &param);
    if (request == nullptr) {
      complete(receive->id, UCS_OK);
    } else if (UCS_PTR_IS_ERR(request)) {
      complete(receive->id, UCS_PTR_STATUS(request));
    } else {
      receive->request = request;
    }
  }
  return received_any;
}

void Context::on_send_done(void* request, ucs_status_t status, void* user_data) {
  auto* send = static_cast<InFlight*>(user_data);
  send->request = nullptr;
  ucp_request_free(request);
  send->context->complete(send->id, status);
}

void Context::on_recv_done(void* request, ucs_status_t status, const ucp_tag_recv_info_t*,
                           void* user_data) {
  auto* receive = static_cast<InFlight*>(user_data);
  receive->request = nullptr;
  ucp_request_free(request);
  receive->context->complete(receive->id, status);
}


void Context::complete(uint64_t id, ucs_status_t status) {
  auto found = in_flight_.find(id);
  if (found == in_flight_.end()) return;
  std::shared_ptr<InFlight> done = std::move(found->second);
  in_flight_.erase(found);
  if (done->is_send) {
    pool_->give(std::move(done->buffer));
    std::lock_guard<std::mutex> lock(mutex_);
    if (status == UCS_OK) {
      done->handle->done_ = true;
      notify_changed();
    } else {
      Peer& target = *peer_by_rank_.at(done->peer);
      bool lost = target.failed || status == UCS_ERR_CONNECTION_RESET || status == UCS_ERR_ENDPOINT_TIMEOUT ||
                  status == UCS_ERR_UNREACHABLE || status == UCS_ERR_CANCELED;
      FailureKind kind = target.failed ? target.failure_kind : lost ? FailureKind::kPeerLost : FailureKind::kTransport;
      fail_handle(*done->handle, kind,
                  target.failed ? target.failure : ucx_failure("ucp_tag_send_nbx", status, peer_description(done->peer)));
    }
    return;
  }
  if (status == UCS_ERR_CANCELED) return;  // close() cancelled it
  if (status != UCS_OK) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto source = peer_by_rank_.find(done->peer);
    if (source != peer_by_rank_.end()) {
      peer_failed(*source->second, ucx_failure("ucp_tag_msg_recv_nbx", status, peer_description(done->peer)));
    }
    return;
  }
  deliver(*done);
}

void Context::deliver(InFlight& received) {
  // Check the header before trusting any of it: from a peer we know, complete, consistent.
  std::string problem;
  dpp_wire::WireHeader header{};
  if (peer_by_rank_.count(received.peer) == 0) {
    problem = "a message from rank " + std::to_string(received.peer) + ", which is not a peer";
  } else if (received.bytes < kHeaderBytes) {
    problem = "a message of " + std::to_string(received.bytes) + " B, shorter than the " +
              std::to_string(kHeaderBytes) + " B wire header";
  } else {
    std::memcpy(&header, received.buffer->data(), kHeaderBytes);
    problem = dpp_wire::validate_header(header, received.bytes - kHeaderBytes);
    if (problem.empty() && header.nbytes != received.bytes - kHeaderBytes) {
      problem = "the header announces " + std::to_string(header.nbytes) + " payload bytes, the message has " +
                std::to_string(received.bytes - kHeaderBytes);
    } else if (problem.empty() && header.src_rank != received.peer) {
      problem = "the header names rank " + std::to_string(header.src_rank) + " as sender, UCX rank " +
                std::to_string(received.peer);
    } else if (problem.empty() && header.flags != 0) {
      problem = "header flags " + std::to_string(header.flags) + " name a path of another transport";
    }
  }
  std::lock_guard<std::mutex> lock(mutex_);
  if (!problem.empty()) {
    auto source = peer_by_rank_.find(received.peer);
    if (source == peer_by_rank_.end()) {
      fatal_ = "protocol error: " + problem;
      notify_changed();
      return;
    }
    // The stream from this peer can no longer be trusted: its pending receives fail with the cause.
    for (auto& [key, handles] : posted_recvs_) {
      if (key.first != received.peer) continue;
      for (auto& handle : handles) fail_handle(*handle, FailureKind::kProtocol, "protocol error: " + problem);
      handles.clear();
    }
    source->second->failed = true;
    source->second->failure = "protocol error: " + problem;
    source->second->failure_kind = FailureKind::kProtocol;
    notify_changed();
    return;
  }
  std::vector<int64_t> shape(header.shape, header.shape + header.ndim);
  char* payload = received.buffer->data() + kHeaderBytes;
  auto buffer = std::make_shared<std::unique_ptr<RegisteredBuffer>>(std::move(received.buffer));
  std::shared_ptr<BufferPool> pool = pool_;
  // The tensor points into its registered buffer (no copy); freeing the tensor gives the buffer back.
  at::Tensor tensor = at::from_blob(
      payload, shape, [pool, buffer](void*) { pool->give(std::move(*buffer)); },
      at::TensorOptions().dtype(dpp_wire::scalar_type_of(header.dtype)));
  auto key = std::make_pair(received.peer, header.tag);
  auto posted = posted_recvs_.find(key);
  if (posted != posted_recvs_.end() && !posted->second.empty()) {
    std::shared_ptr<Handle> handle = posted->second.front();
    posted->second.pop_front();
    if (posted->second.empty()) posted_recvs_.erase(posted);
    handle->tensor_ = std::move(tensor);
    handle->done_ = true;
    notify_changed();
  } else {
    unclaimed_[key].push_back(std::move(tensor));
  }
}

void Context::peer_failed(Peer& peer, const std::string& why) {
  if (peer.failed) return;
  peer.failed = true;
  peer.failure = why;
  for (auto& [key, handles] : posted_recvs_) {
    if (key.first != peer.rank) continue;
    for (auto& handle : handles) fail_handle(*handle, FailureKind::kPeerLost, why);
    handles.clear();
  }
  notify_changed();
}

void Context::on_endpoint_error(void* arg, ucp_ep_h, ucs_status_t status) {
  auto* peer = static_cast<Peer*>(arg);
  Context* context = peer->context;
  std::lock_guard<std::mutex> lock(context->mutex_);
  context->peer_failed(*peer, std::string("peer lost: the UCX endpoint failed (") +
                                  ucs_status_string(status) + "); the process or its node went away");
  // UCX fails the endpoint's outstanding sends through their callbacks. The endpoint itself is
  // closed in force mode by the progress thread (not from inside UCX's callback).
  context->work_.push_back([context, peer] {
    if (peer->endpoint == nullptr) return;
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = UCP_EP_CLOSE_FLAG_FORCE;
    ucs_status_ptr_t request = ucp_ep_close_nbx(peer->endpoint, &param);
    peer->endpoint = nullptr;
    if (request != nullptr && !UCS_PTR_IS_ERR(request)) {
      while (ucp_request_check_status(request) == UCS_INPROGRESS) ucp_worker_progress(context->worker_);
      ucp_request_free(request);
    }
  });
}

void Context::shut_down_worker() {
  // Receives under way are cancelled (their callbacks run with UCS_ERR_CANCELED); sends get until
  // the close deadline to finish along with the endpoints' flush.
  std::vector<void*> receives;
  for (auto& [id, entry] : in_flight_) {
    if (!entry->is_send && entry->request != nullptr) receives.push_back(entry->request);
  }
  for (void* request : receives) ucp_request_cancel(worker_, request);
  auto deadline = deadline_after(config_.close_timeout_s);
  std::vector<void*> closing;
  for (auto& peer : peers_) {
    if (peer->endpoint == nullptr) continue;
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = peer->failed ? UCP_EP_CLOSE_FLAG_FORCE : 0;  // flush healthy links
    ucs_status_ptr_t request = ucp_ep_close_nbx(peer->endpoint, &param);
    peer->endpoint = nullptr;
    if (request != nullptr && !UCS_PTR_IS_ERR(request)) closing.push_back(request);
  }
  while (Clock::now() < deadline) {
    ucp_worker_progress(worker_);
    bool pending = false;
    for (void* request : closing) pending = pending || ucp_request_check_status(request) == UCS_INPROGRESS;
    if (!pending && in_flight_.empty()) break;
  }
  for (void* request : closing) ucp_request_free(request);
  // Whatever is still in flight after the deadline fails: its peer did not answer.
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto& [id, entry] : in_flight_) {
    if (entry->is_send) fail_handle(*entry->handle, FailureKind::kPeerLost, "the send did not finish before close");
  }
}

void Context::close() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (closed_) return;
    closed_ = true;
    stopping_ = true;
  }
  if (thread_.joinable()) {
    ucp_worker_signal(worker_);
    thread_.join();
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& [key, handles] : posted_recvs_) {
      for (auto& handle : handles) fail_handle(*handle, FailureKind::kTransport, "context closed");
    }
    posted_recvs_.clear();
    unclaimed_.clear();
  }
  // Requests still owned by UCX must not outlive the worker: drop our bookkeeping first.
  in_flight_.clear();
  for (auto& peer : peers_) {
    if (peer->endpoint != nullptr) {  // connect() never started the thread
      ucp_request_param_t param{};
      param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
      param.flags = UCP_EP_CLOSE_FLAG_FORCE;
      ucs_status_ptr_t request = ucp_ep_close_nbx(peer->endpoint, &param);
      if (request != nullptr && !UCS_PTR_IS_ERR(request)) ucp_request_free(request);
      peer->endpoint = nullptr;
    }
  }
  ucp_worker_destroy(worker_);
  worker_ = nullptr;
}

}  // namespace rdma_tensor
