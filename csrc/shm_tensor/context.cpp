#include "context.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>

#include <poll.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <set>
#include <sstream>

#include "../common/errors.h"
#include "../common/dtype_codes.h"
#include "single_copy.h"
#include "sleep_policy.h"

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434  // same number on every architecture
#endif

namespace shm_tensor {

using dpp_errors::describe;
using dpp_errors::MessageTooLarge;
using dpp_errors::PeerLost;
using dpp_errors::ProtocolError;
using dpp_errors::TransportError;
using dpp_errors::TransportTimeout;
using dpp_wire::WireHeader;
using Clock = std::chrono::steady_clock;

namespace {

constexpr uint64_t kInboxMagic = 0x58424e4950504455ull;  // "UDPPINBX"
constexpr uint32_t kLayoutVersion = 3;  // 3: slot pool with free mask and lending
constexpr int kMaxPeers = 256;
constexpr uint64_t kPage = 4096;
constexpr uint64_t kChannelHeaderBytes = kPage;
// Between two sleeps the waiter checks that the peers it waits on are alive.
constexpr double kLivenessPeriodS = 0.05;
// Smaller received tensors come from the ordinary allocator (no page faults to save).
constexpr uint64_t kRecycleFromBytes = 64 * 1024;
// ChannelHeader::single_copy: the receiver's decision, written at its connect().
constexpr uint32_t kSingleCopyUndecided = 0;
constexpr uint32_t kSingleCopyAccepted = 1;
constexpr uint32_t kSingleCopyRefused = 2;

uint64_t align_up(uint64_t value, uint64_t alignment) {
  return (value + alignment - 1) / alignment * alignment;
}

double seconds_until(Clock::time_point when) {
  return std::chrono::duration<double>(when - Clock::now()).count();
}

}  // namespace

struct ChannelEntry {
  int32_t sender_rank;
  uint32_t pad;
  uint64_t offset;
};

struct ControlBlock {
  std::atomic<uint64_t> magic;  // written last: a peer that sees it sees the whole block
  uint32_t layout_version;
  int32_t owner_rank;
  int32_t owner_pid;
  uint32_t num_channels;
  uint32_t num_slots;
  uint32_t pad;
  uint64_t slot_bytes;
  uint64_t slot_stride;
  // A token in the owner's private memory, which peers pull at connect() to probe single copy.
  uint64_t probe_address;
  uint64_t probe_value;
  // The owner lends slots for messages of at least this many bytes (UINT64_MAX: never). Senders read
  // it with the channel's loans_left to prefer a lent slot over single copy.
  uint64_t lend_min_bytes;
  // Set by the owner's close() before it releases the sources of unpulled single-copy sends: a
  // receiver that sees it after a pull discards what it pulled; a sender stops waiting for a pull.
  alignas(64) std::atomic<uint32_t> closed;
  alignas(64) Doorbell doorbell;
  alignas(64) ChannelEntry channels[kMaxPeers];
};

struct ChannelHeader {
  alignas(64) std::atomic<uint64_t> head;  // messages published, written by the sender
  alignas(64) std::atomic<uint64_t> tail;  // messages consumed, written by the receiver
  alignas(64) std::atomic<uint32_t> single_copy;  // kSingleCopy*: may the sender use single copy?
  // Bit i set: slot i is free. Only the sender clears bits (taking a slot), only the receiver sets
  // them (after copying out, or when a lent tensor is freed, from whatever thread frees it).
  alignas(64) std::atomic<uint64_t> free_slots;
  // How many more slots the receiver may lend (it takes loans, freed tensors give them back).
  alignas(64) std::atomic<int32_t> loans_left;
  // The slot of the message at ring position p is slot_of[p % num_slots]; written by the sender
  // before it publishes p (head), read by the receiver after.
  alignas(64) uint32_t slot_of[kMaxSlots];
};
static_assert(sizeof(ChannelHeader) <= kChannelHeaderBytes, "channel header outgrew its page");

// A single-copy send written into the ring at `position`, complete once the tail has passed it.
struct InFlightSend {
  uint64_t position;
  std::shared_ptr<Handle> handle;
  uint32_t slot;  // the slot it went in (a direct device send reads the receiver's answer there)
};

struct Context::Peer {
  int rank = -1;
  std::shared_ptr<ShmSegment> segment;  // the peer's inbox (shared with tensors in our lent slots)
  ControlBlock* control = nullptr;
  // Our channel in the peer's inbox (we send), with the peer's geometry.
  ChannelHeader* out_channel = nullptr;
  char* out_slots = nullptr;
  uint64_t out_slot_bytes = 0;
  uint64_t out_stride = 0;
  uint64_t out_num_slots = 0;
  // The peer's channel in our inbox (we receive).
  ChannelHeader* in_channel = nullptr;
  char* in_slots = nullptr;
  int pid = 0;
  int pidfd = -1;
  bool lost = false;
  std::string lost_detail;  // receive side: the single-copy message the peer took with it
  std::string broken;       // why the inbound channel was abandoned
  bool broken_by_pull = false;  // a failed pull (TransportError), else a rejected message (ProtocolError)
  // Single copy: does the peer pull our messages (its decision, read once decided), and why do we
  // not pull its messages ("" when we do).
  uint32_t receiver_single_copy = kSingleCopyUndecided;
  std::string single_copy_refusal;
  std::deque<std::shared_ptr<Handle>> pending_sends;
  std::deque<InFlightSend> in_flight_sends;  // in ring order

  Peer() = default;
  Peer(const Peer&) = delete;
  Peer& operator=(const Peer&) = delete;
  ~Peer() {
    if (pidfd >= 0) ::close(pidfd);
  }

  bool alive() const {
    if (pidfd >= 0) {
      struct pollfd entry = {pidfd, POLLIN, 0};
      return ::poll(&entry, 1, 0) == 0;  // readable once the process has exited
    }
    return !(::kill(pid, 0) != 0 && errno == ESRCH);
  }
};

// ---------------------------------------------------------------------------------------------
// Handle

bool Handle::test(int cuda_device, uintptr_t cuda_stream) {
  std::lock_guard<std::mutex> lock(context_->mutex_);
  if (done_) return true;
  context_->caller_cuda_device_ = cuda_device;
  context_->caller_cuda_stream_ = cuda_stream;
  context_->progress({shared_from_this()});
  return context_->handle_done_or_throw(*this);
}

at::Tensor Handle::wait(double timeout_s, int cuda_device, uintptr_t cuda_stream) {
  context_->wait_any({shared_from_this()}, timeout_s, cuda_device, cuda_stream);
  std::lock_guard<std::mutex> lock(context_->mutex_);
  return tensor_;
}

// ---------------------------------------------------------------------------------------------
// Context setup

Context::Context(int rank, std::vector<int> peers, std::string job_name, ContextConfig config)
    : rank_(rank),
      peer_ranks_(std::move(peers)),
      job_name_(std::move(job_name)),
      config_(config),
      copy_pool_(config.copy_threads, config.bytes_per_thread),
      recv_buffers_(std::make_shared<BufferPool>(config.recv_cache_bytes)) {
  if (rank_ < 0) throw std::invalid_argument("shm_tensor: rank must be >= 0");
  if (config_.num_slots < 1 || config_.num_slots > kMaxSlots) {
    throw std::invalid_argument("shm_tensor: num_slots must be 1.." + std::to_string(kMaxSlots));
  }
  if (config_.zero_copy_min_bytes < 1) throw std::invalid_argument("shm_tensor: zero_copy_min_bytes must be >= 1");
  if (config_.timeout_s <= 0) throw std::invalid_argument("shm_tensor: timeout_s must be > 0");
  if (config_.spin_us < 0) throw std::invalid_argument("shm_tensor: spin_us must be >= 0");
  if (config_.single_copy_min_bytes < 4096) {
    throw std::invalid_argument("shm_tensor: single_copy_min_bytes must be >= 4096");
  }
  if (job_name_.empty() || job_name_.size() > 200 ||
      job_name_.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-") !=
          std::string::npos) {
    throw std::invalid_argument("shm_tensor: job name '" + job_name_ +
                                "' must be 1-200 characters of [A-Za-z0-9_.-]");
  }
  if (config_.host_tensors_by_cuda_ipc) {
    const cuda::Runtime& runtime = cuda::runtime_or_throw("shm_tensor.Context", -1, 0);
    if (!runtime.fake) {
      throw std::invalid_argument("shm_tensor: host_tensors_by_cuda_ipc needs the fake CUDA runtime "
                                  "(SHM_TENSOR_CUDART); " + runtime.library + " is a real one");
    }
  }
  if (static_cast<int>(peer_ranks_.size()) > kMaxPeers) {
    throw std::invalid_argument("shm_tensor: at most " + std::to_string(kMaxPeers) + " peers");
  }
  std::set<int> unique(peer_ranks_.begin(), peer_ranks_.end());
  if (unique.size() != peer_ranks_.size() || unique.count(rank_) || (!unique.empty() && *unique.begin() < 0)) {
    throw std::invalid_argument("shm_tensor: peers must be distinct non-negative ranks other than " +
                                std::to_string(rank_));
  }

  slot_stride_ = align_up(sizeof(WireHeader) + config_.slot_bytes, kPage);
  uint64_t control_bytes = align_up(sizeof(ControlBlock), kPage);
  uint64_t channel_bytes = kChannelHeaderBytes + config_.num_slots * slot_stride_;
  uint64_t total = control_bytes + peer_ranks_.size() * channel_bytes;
  inbox_ = std::make_shared<ShmSegment>(ShmSegment::create(inbox_name(rank_), total));

  control_ = reinterpret_cast<ControlBlock*>(inbox_->data());
  control_->layout_version = kLayoutVersion;
  control_->owner_rank = rank_;
  control_->owner_pid = static_cast<int32_t>(::getpid());
  control_->num_channels = static_cast<uint32_t>(peer_ranks_.size());
  control_->num_slots = static_cast<uint32_t>(config_.num_slots);
  control_->slot_bytes = config_.slot_bytes;
  control_->slot_stride = slot_stride_;
  std::random_device entropy;
  probe_token_ = (static_cast<uint64_t>(entropy()) << 32) ^ entropy() ^ 0x5a5a5a5a00000001ull;
  control_->probe_address = reinterpret_cast<uint64_t>(&probe_token_);
  control_->probe_value = probe_token_;
  int max_loans = config_.zero_copy_receive ? config_.num_slots / 2 : 0;
  control_->lend_min_bytes = max_loans > 0 ? config_.zero_copy_min_bytes : UINT64_MAX;
  uint64_t all_free = config_.num_slots == 64 ? ~0ull : (1ull << config_.num_slots) - 1;
  for (size_t i = 0; i < peer_ranks_.size(); ++i) {
    uint64_t offset = control_bytes + i * channel_bytes;
    control_->channels[i].sender_rank = peer_ranks_[i];
    control_->channels[i].offset = offset;
    auto peer = std::make_unique<Peer>();
    peer->rank = peer_ranks_[i];
    peer->in_channel = reinterpret_cast<ChannelHeader*>(inbox_->data() + offset);
    peer->in_channel->free_slots.store(all_free, std::memory_order_relaxed);
    peer->in_channel->loans_left.store(max_loans, std::memory_order_relaxed);
    peer->in_slots = inbox_->data() + offset + kChannelHeaderBytes;
    peer_by_rank_[peer->rank] = peer.get();
    peers_.push_back(std::move(peer));
  }
  control_->magic.store(kInboxMagic, std::memory_order_release);
}

Context::~Context() {
  try {
    close();
  } catch (...) {
    // Destructors do not throw; close() only unmaps and unlinks.
  }
}

std::string Context::inbox_name(int rank) const {
  return "/" + job_name_ + "-r" + std::to_string(rank);
}

void Context::connect() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (closed_) throw TransportError("shm_tensor.connect: context is closed");
  if (connected_) return;
  for (auto& peer : peers_) {
    peer->segment = std::make_shared<ShmSegment>(ShmSegment::open(inbox_name(peer->rank), peer->rank));
    if (peer->segment->size() < sizeof(ControlBlock)) {
      throw TransportError("shm_tensor.connect: inbox of peer " + std::to_string(peer->rank) +
                           " is too small to be one");
    }
    auto* control = reinterpret_cast<ControlBlock*>(peer->segment->data());
    if (control->magic.load(std::memory_order_acquire) != kInboxMagic ||
        control->layout_version != kLayoutVersion || control->owner_rank != peer->rank ||
        control->num_slots < 1 || control->num_slots > kMaxSlots) {
      throw TransportError("shm_tensor.connect: inbox " + peer->segment->name() + " of peer " +
                           std::to_string(peer->rank) +
                           " has a foreign layout; are both sides built from the same source?");
    }
    const ChannelEntry* entry = nullptr;
    for (uint32_t i = 0; i < control->num_channels; ++i) {
      if (control->channels[i].sender_rank == rank_) entry = &control->channels[i];
    }
    if (entry == nullptr) {
      throw TransportError("shm_tensor.connect: peer " + std::to_string(peer->rank) +
                           " does not list rank " + std::to_string(rank_) +
                           " as a peer; both sides must list each other");
    }
    peer->control = control;
    peer->out_channel = reinterpret_cast<ChannelHeader*>(peer->segment->data() + entry->offset);
    peer->out_slots = peer->segment->data() + entry->offset + kChannelHeaderBytes;
    peer->out_slot_bytes = control->slot_bytes;
    peer->out_stride = control->slot_stride;
    peer->out_num_slots = control->num_slots;
    peer->pid = control->owner_pid;
    peer->pidfd = static_cast<int>(::syscall(SYS_pidfd_open, peer->pid, 0));
    // pidfd_open fails on old kernels or across pid namespaces; kill(pid, 0) is the fallback.
    if (peer->pidfd < 0) peer->pidfd = -1;
    // May we pull this peer's messages? Written into our inbox, where the peer reads it after the
    // rendezvous barrier (Context::use_single_copy).
    peer->single_copy_refusal = config_.single_copy
                                    ? probe_single_copy(peer->pid, control->probe_address, control->probe_value)
                                    : "single copy disabled here (ShmConfig.single_copy=False)";
    peer->in_channel->single_copy.store(
        peer->single_copy_refusal.empty() ? kSingleCopyAccepted : kSingleCopyRefused, std::memory_order_release);
  }
  connected_ = true;
}

void Context::unlink() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (inbox_ != nullptr) inbox_->unlink();
}

void Context::close() {
  std::vector<std::shared_ptr<Handle>> released;  // destroyed after the lock is dropped
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (closed_) return;
    closed_ = true;
    // Before the sources of unpulled single-copy sends are released (after the lock is dropped):
    // a receiver that pulls one of them afterwards sees the flag and discards what it read.
    if (control_ != nullptr) control_->closed.store(1, std::memory_order_seq_cst);
    for (auto& entry : posted_recvs_) {
      for (auto& handle : entry.second) released.push_back(std::move(handle));
    }
    for (auto& peer : peers_) {
      for (auto& handle : peer->pending_sends) released.push_back(std::move(handle));
      for (auto& sent : peer->in_flight_sends) released.push_back(std::move(sent.handle));
      // A peer waiting for us to take its message learns at once that we will not. A failed wake is
      // not raised from close(): the peer's wait re-checks every liveness slice (50 ms) anyway.
      if (peer->control != nullptr) (void)ring(peer->control->doorbell);
    }
    posted_recvs_.clear();
    unclaimed_.clear();
    peer_by_rank_.clear();
    peers_.clear();
    cuda_.reset();  // closes peers' mappings, frees our device slots (after their copies)
    control_ = nullptr;
    inbox_.reset();  // unmapped once no received tensor borrows a slot any more
  }
}

// ---------------------------------------------------------------------------------------------
// Sending and receiving

Context::Peer& Context::peer_or_throw(const char* call, int peer, int64_t tag) {
  if (closed_) throw TransportError(describe(call, peer, tag, "context is closed"));
  if (!connected_) throw TransportError(describe(call, peer, tag, "context is not connected yet"));
  auto found = peer_by_rank_.find(peer);
  if (found == peer_by_rank_.end()) {
    throw std::invalid_argument(describe(call, peer, tag, "rank " + std::to_string(peer) +
                                                              " is not a peer of this context"));
  }
  if (tag < 0) throw std::invalid_argument(describe(call, peer, tag, "tags must be >= 0"));
  return *found->second;
}

cuda::CudaIpc& Context::cuda_ipc(const char* call, int peer, int64_t tag) {
  if (cuda_ == nullptr) cuda_ = std::make_unique<cuda::CudaIpc>(cuda::runtime_or_throw(call, peer, tag));
  return *cuda_;
}

std::shared_ptr<Handle> Context::isend(const at::Tensor& tensor, int peer, int64_t tag,
                                       uintptr_t cuda_stream) {
  const char* call = "shm_tensor.isend";
  Clock::time_point posted = Clock::now();
  bool on_cuda = tensor.device().is_cuda() || (config_.host_tensors_by_cuda_ipc && tensor.device().is_cpu());
  if (!tensor.device().is_cpu() && !tensor.device().is_cuda()) {
    throw std::invalid_argument(describe(call, peer, tag,
                                         "tensor is on " + tensor.device().str() +
                                             "; shm_tensor carries CPU and CUDA tensors only"));
  }
  if (on_cuda) cuda::runtime_or_throw(call, peer, tag);  // before any work: a clear error
  at::Tensor source = tensor.contiguous();
  uint64_t nbytes = static_cast<uint64_t>(source.numel()) * source.element_size();
  int32_t dtype;
  try {
    dtype = dpp_wire::wire_dtype_of(source.scalar_type());
  } catch (const std::invalid_argument& error) {
    throw std::invalid_argument(describe(call, peer, tag, error.what()));
  }
  std::vector<int64_t> shape(source.sizes().begin(), source.sizes().end());
  if (shape.size() > static_cast<size_t>(dpp_wire::kMaxDims)) {
    throw std::invalid_argument(describe(call, peer, tag,
                                         "tensor has " + std::to_string(shape.size()) +
                                             " dimensions; the wire header carries at most " +
                                             std::to_string(dpp_wire::kMaxDims)));
  }

  std::lock_guard<std::mutex> lock(mutex_);
  Peer& target = peer_or_throw(call, peer, tag);
  // A device message goes direct (no size cap) when its memory can be exported; else staged.
  cuda::Export exported;
  std::string export_failure;
  bool direct = on_cuda && nbytes > 0 &&
                cuda_ipc(call, peer, tag).export_tensor(source, source.is_cuda() ? source.device().index() : 0,
                                                        &exported, &export_failure, peer, tag);
  if (nbytes > target.out_slot_bytes && !(on_cuda && (direct || nbytes == 0))) {
    std::ostringstream what;
    what << "message of " << nbytes << " B exceeds the slot size of " << target.out_slot_bytes
         << " B; raise ShmConfig.slot_bytes (--shm-slot-mb) or send smaller tensors";
    if (on_cuda) what << " (a device tensor goes without that cap only where its memory can be exported: " << export_failure << ")";
    throw MessageTooLarge(describe(call, peer, tag, what.str()));
  }
  if (on_cuda && target.out_slot_bytes < cuda::kDeviceDescriptorBytes) {
    throw MessageTooLarge(describe(call, peer, tag,
                                   "a CUDA message needs slots of at least " +
                                       std::to_string(cuda::kDeviceDescriptorBytes) +
                                       " B for its IPC descriptor; raise ShmConfig.slot_bytes"));
  }
  // Single copy or not is decided when the message gets its slot (push_sends), with the receiver's
  // loans as they are then.
  uint32_t flags = on_cuda ? dpp_wire::kFlagCudaIpc : 0u;
  WireHeader header =
      dpp_wire::make_header(tag, dtype, shape.data(), static_cast<int>(shape.size()), nbytes, rank_, flags);
  auto handle = std::make_shared<Handle>(shared_from_this(), true, peer, tag);
  // An alias, not `source` itself: Megatron's deallocate_output_tensor sets `tensor.data` right after
  // the send, which swaps the storage of that TensorImpl; the alias keeps the original storage alive
  // and unchanged until the send completes.
  handle->tensor_ = source.detach();
  if (on_cuda) {
    handle->cuda_ = true;
    handle->cuda_stream_ = cuda_stream;
    handle->cuda_direct_ = direct;
    handle->export_ = exported;
    // Direct and written inside this isend (the usual case): its slot's event goes on the caller's
    // stream then. Otherwise an event taken now orders the later copy or slot event.
    if (!direct) handle->cuda_ready_ = cuda_ipc(call, peer, tag).record_ready(source, cuda_stream, call, peer, tag);
  }
  handle->raw_header_.assign(reinterpret_cast<const char*>(&header),
                             reinterpret_cast<const char*>(&header) + sizeof(header));
  target.pending_sends.push_back(handle);
  ++post_stats_.sends_posted;
  // Counted before push_sends may throw (a failed wake): the message is posted either way.
  struct PostTimer {
    PostStats& stats;
    Clock::time_point posted;
    ~PostTimer() {
      auto ns = static_cast<uint64_t>(
          std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - posted).count());
      stats.post_ns += ns;
      stats.max_post_ns = std::max(stats.max_post_ns, ns);
    }
  } timer{post_stats_, posted};
  push_sends(target, true);
  if (!target.pending_sends.empty() && target.pending_sends.back() == handle) {
    ++post_stats_.queued_at_post;  // no free slot: a later progress call writes it
    if (handle->cuda_direct_) {
      handle->cuda_ready_ = cuda_ipc(call, peer, tag).record_ready(source, cuda_stream, call, peer, tag);
    }
  }
  return handle;
}

std::shared_ptr<Handle> Context::send_raw_header(const std::string& header, int peer, const std::string& body) {
  if (header.size() != sizeof(WireHeader)) {
    throw std::invalid_argument("shm_tensor.send_raw_header: header must be " +
                                std::to_string(sizeof(WireHeader)) + " bytes");
  }
  std::lock_guard<std::mutex> lock(mutex_);
  Peer& target = peer_or_throw("shm_tensor.send_raw_header", peer, 0);
  if (body.size() > target.out_slot_bytes) {
    throw std::invalid_argument("shm_tensor.send_raw_header: body of " + std::to_string(body.size()) +
                                " B exceeds the slot size");
  }
  auto handle = std::make_shared<Handle>(shared_from_this(), true, peer, 0);
  handle->raw_header_.assign(header.begin(), header.end());
  handle->raw_header_.insert(handle->raw_header_.end(), body.begin(), body.end());
  target.pending_sends.push_back(handle);
  push_sends(target);
  return handle;
}

std::shared_ptr<Handle> Context::irecv(int peer, int64_t tag) {
  std::lock_guard<std::mutex> lock(mutex_);
  peer_or_throw("shm_tensor.irecv", peer, tag);
  auto handle = std::make_shared<Handle>(shared_from_this(), false, peer, tag);
  auto key = std::make_pair(peer, tag);
  auto found = unclaimed_.find(key);
  if (found != unclaimed_.end()) {
    handle->tensor_ = std::move(found->second.front());
    handle->done_ = true;
    found->second.pop_front();
    if (found->second.empty()) unclaimed_.erase(found);
  } else {
    posted_recvs_[key].push_back(handle);
  }
  return handle;
}

bool Context::use_single_copy(Peer& peer, uint64_t nbytes) {
  if (!config_.single_copy || nbytes < config_.single_copy_min_bytes) return false;
  // A slot the receiver will lend costs one copy too (ours into the slot), completes the send
  // sooner and needs no cross-memory attach. A hint: if the loan is gone by the time the receiver
  // drains the message, it copies out.
  if (nbytes >= peer.control->lend_min_bytes && peer.out_channel->loans_left.load(std::memory_order_acquire) > 0) {
    return false;
  }
  if (peer.receiver_single_copy == kSingleCopyUndecided) {
    // Decided at the receiver's connect(), before the rendezvous barrier that precedes any send; a
    // send without that barrier (undecided) takes two copies and asks again next time.
    peer.receiver_single_copy = peer.out_channel->single_copy.load(std::memory_order_acquire);
  }
  return peer.receiver_single_copy == kSingleCopyAccepted;
}

uint64_t Context::write_slot(Peer& peer, Handle& handle, uint32_t index) {
  uint64_t head = peer.out_channel->head.load(std::memory_order_relaxed);
  char* slot = peer.out_slots + index * peer.out_stride;
  if (handle.cuda_direct_) {
    cuda::DirectDescriptor descriptor =
        cuda_ipc("shm_tensor.isend", peer.rank, handle.tag_)
            .send_direct(peer.rank, handle.tag_, handle.export_, handle.cuda_ready_.get(), handle.cuda_stream_,
                         index, peer.out_num_slots);
    std::memcpy(slot, handle.raw_header_.data(), sizeof(WireHeader));
    std::memcpy(slot + sizeof(WireHeader), &descriptor, sizeof(descriptor));
  } else if (handle.cuda_) {
    // Device copy first: if it fails nothing has been written to the slot.
    cuda::IpcDescriptor descriptor =
        cuda_ipc("shm_tensor.isend", peer.rank, handle.tag_)
            .send(peer.rank, handle.tag_, handle.tensor_, *handle.cuda_ready_, handle.cuda_stream_, index,
                  peer.out_slot_bytes, peer.out_num_slots);
    std::memcpy(slot, handle.raw_header_.data(), sizeof(WireHeader));
    std::memcpy(slot + sizeof(WireHeader), &descriptor, sizeof(descriptor));
  } else if (handle.single_copy_) {
    SingleCopyDescriptor descriptor = {};
    descriptor.magic = kSingleCopyMagic;
    descriptor.address = reinterpret_cast<uint64_t>(handle.tensor_.data_ptr());
    descriptor.nbytes = handle.tensor_.nbytes();
    descriptor.sender_pid = control_->owner_pid;
    std::memcpy(slot, handle.raw_header_.data(), sizeof(WireHeader));
    std::memcpy(slot + sizeof(WireHeader), &descriptor, sizeof(descriptor));
  } else {
    // A raw send's body (tests: a descriptor) follows its header; a tensor send's is the header only.
    std::memcpy(slot, handle.raw_header_.data(), handle.raw_header_.size());
    if (handle.tensor_.defined() && handle.tensor_.numel() > 0) {
      copy_pool_.copy(slot + sizeof(WireHeader), handle.tensor_.data_ptr(), handle.tensor_.nbytes());
    }
  }
  peer.out_channel->slot_of[head % peer.out_num_slots] = index;
  peer.out_channel->head.store(head + 1, std::memory_order_release);
  return head;
}

void Context::choose_payload_path(Peer& peer, Handle& handle) {
  // Raw sends (tests) keep their header as given; CUDA messages always go by IPC.
  if (!handle.tensor_.defined() || handle.cuda_) return;
  bool single_copy = use_single_copy(peer, handle.tensor_.nbytes());
  if (single_copy == handle.single_copy_) return;
  handle.single_copy_ = single_copy;
  WireHeader header;
  std::memcpy(&header, handle.raw_header_.data(), sizeof(header));
  header.flags = single_copy ? dpp_wire::kFlagSingleCopy : 0u;
  header.checksum = dpp_wire::header_checksum(header);
  std::memcpy(handle.raw_header_.data(), &header, sizeof(header));
}

void Context::push_sends(Peer& peer, bool posting) {
  complete_pulled_sends(peer);
  if (peer.lost) return;
  while (!peer.pending_sends.empty()) {
    // Acquire: the receiver set the bit after it finished with the slot (copied out, pulled, or the
    // lent tensor was freed).
    uint64_t free = peer.out_channel->free_slots.load(std::memory_order_acquire);
    if (free == 0) break;  // every slot taken: back-pressure
    // The receiver advances the tail before it frees a slot: a send still in flight in a slot seen
    // free is completed now, before that slot (and its answer in it) is reused.
    complete_pulled_sends(peer);
    // Every message in the ring holds a slot, so a free slot implies ring room; checked anyway, as
    // slot_of[head % num_slots] must not overwrite an unread entry.
    uint64_t head = peer.out_channel->head.load(std::memory_order_relaxed);
    if (head - peer.out_channel->tail.load(std::memory_order_acquire) >= peer.out_num_slots) break;
    choose_payload_path(peer, *peer.pending_sends.front());
    uint32_t index = static_cast<uint32_t>(__builtin_ctzll(free));  // lowest: the warmest in cache
    uint64_t bit = 1ull << index;
    // Taken before the message is published (the receiver may free it right after).
    peer.out_channel->free_slots.fetch_and(~bit, std::memory_order_relaxed);
    uint64_t position;
    try {
      // Written before it leaves the queue: a failing (CUDA) copy leaves the send pending, not lost.
      position = write_slot(peer, *peer.pending_sends.front(), index);
    } catch (...) {
      peer.out_channel->free_slots.fetch_or(bit, std::memory_order_relaxed);  // never published
      throw;
    }
    std::shared_ptr<Handle> handle = std::move(peer.pending_sends.front());
    peer.pending_sends.pop_front();
    if (posting && handle->tensor_.defined()) {
      ++post_stats_.written_at_post;
      if (!handle->single_copy_ && !handle->cuda_) {
        post_stats_.bytes_copied_at_post += handle->tensor_.nbytes();
      }
    }
    int64_t tag = handle->tag_;
    if (handle->single_copy_ || handle->cuda_direct_) {
      // The receiver reads our memory until it frees the slot: keep the source until then.
      ++(handle->cuda_direct_ ? counts_.sent_device_direct : counts_.sent_single_copy);
      peer.in_flight_sends.push_back({position, std::move(handle), index});
    } else {
      if (handle->cuda_) {
        ++counts_.sent_device_staged;
      } else if (handle->tensor_.defined()) {
        ++counts_.sent_two_copy;
      }
      handle->done_ = true;
      handle->tensor_ = at::Tensor();  // the caller may reuse or free its tensor now
      handle->cuda_ready_.reset();
    }
    ring_peer(peer, "shm_tensor.isend", tag, posting);
  }
}

void Context::ring_peer(Peer& peer, const char* call, int64_t tag, bool posting) {
  Clock::time_point start = posting ? Clock::now() : Clock::time_point();
  Rung rung = ring(peer.control->doorbell);
  if (posting && rung.woke) {
    ++post_stats_.wakes_at_post;
    post_stats_.wake_ns += static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count());
  }
  if (rung.error != 0) {
    errno = rung.error;
    // The message or the freed slot is published already; only the peer's wake-up failed.
    throw TransportError(describe(call, peer.rank, tag,
                                  dpp_errors::syscall_failure("futex", "FUTEX_WAKE, doorbell of peer " +
                                                                           std::to_string(peer.rank))));
  }
}

void Context::complete_pulled_sends(Peer& peer) {
  if (peer.in_flight_sends.empty()) return;
  uint64_t tail = peer.out_channel->tail.load(std::memory_order_acquire);
  while (!peer.in_flight_sends.empty() && peer.in_flight_sends.front().position < tail) {
    Handle& handle = *peer.in_flight_sends.front().handle;
    if (handle.cuda_direct_) {
      // The receiver's answer in the slot: the event its copy recorded; the caller's stream waits.
      cuda::DirectDescriptor answer;
      std::memcpy(&answer, peer.out_slots + peer.in_flight_sends.front().slot * peer.out_stride + sizeof(WireHeader),
                  sizeof(answer));
      cuda_ipc("shm_tensor.isend", peer.rank, handle.tag_)
          .complete_direct(peer.rank, handle.tag_, answer, handle.export_.device, handle.cuda_stream_,
                           peer.out_num_slots);
      handle.cuda_ready_.reset();
    }
    handle.done_ = true;
    handle.tensor_ = at::Tensor();  // pulled: the caller may reuse or free its tensor now
    peer.in_flight_sends.pop_front();
  }
}

bool Context::receiver_closed(Peer& peer) {
  if (peer.control->closed.load(std::memory_order_acquire) == 0) return false;
  // Whatever it took before closing is final now (it freed slots before setting the flag).
  complete_pulled_sends(peer);
  return true;
}

void Context::deliver(int peer, int64_t tag, at::Tensor tensor) {
  auto key = std::make_pair(peer, tag);
  auto posted = posted_recvs_.find(key);
  if (posted != posted_recvs_.end()) {
    std::shared_ptr<Handle> handle = std::move(posted->second.front());
    posted->second.pop_front();
    if (posted->second.empty()) posted_recvs_.erase(posted);
    handle->tensor_ = std::move(tensor);
    handle->done_ = true;
    return;
  }
  unclaimed_[key].push_back(std::move(tensor));
}

at::Tensor Context::allocate_received(const WireHeader& header) {
  std::vector<int64_t> shape(header.shape, header.shape + header.ndim);
  auto options = at::TensorOptions().dtype(dpp_wire::scalar_type_of(header.dtype));
  if (header.nbytes < kRecycleFromBytes) return at::empty(shape, options);
  size_t capacity = 0;
  void* buffer = recv_buffers_->take(header.nbytes, &capacity);
  std::shared_ptr<BufferPool> pool = recv_buffers_;
  return at::from_blob(
      buffer, shape, [pool, capacity](void* data) { pool->give(data, capacity); }, options);
}

bool Context::lendable(const WireHeader& header) const {
  return config_.zero_copy_receive && header.nbytes > 0 && header.nbytes >= config_.zero_copy_min_bytes;
}

bool Context::lend_slot(Peer& peer, const WireHeader& header) {
  if (!lendable(header)) return false;
  // Only this thread (under the lock) takes loans; freed tensors give them back from any thread.
  if (peer.in_channel->loans_left.load(std::memory_order_acquire) <= 0) return false;
  peer.in_channel->loans_left.fetch_sub(1, std::memory_order_acq_rel);
  return true;
}

at::Tensor Context::lent_tensor(Peer& peer, const WireHeader& header, char* slot, uint32_t index) {
  std::vector<int64_t> shape(header.shape, header.shape + header.ndim);
  auto options = at::TensorOptions().dtype(dpp_wire::scalar_type_of(header.dtype));
  // The storage's deleter may run on any thread, after close(), after the sender died: it touches
  // only shared memory, and keeps both mappings (our inbox holds the slot, the sender's inbox its
  // doorbell) until it has run.
  std::shared_ptr<ShmSegment> inbox = inbox_;
  std::shared_ptr<ShmSegment> sender_inbox = peer.segment;
  ChannelHeader* channel = peer.in_channel;
  Doorbell* sender_bell = &peer.control->doorbell;
  uint64_t bit = 1ull << index;
  pid_t lender = control_->owner_pid;
  return at::from_blob(
      slot + sizeof(WireHeader), shape,
      [inbox, sender_inbox, channel, sender_bell, bit, lender](void*) {
        // A forked child freeing its copy of the tensor must not return the parent's slot.
        if (::getpid() != lender) return;
        channel->free_slots.fetch_or(bit, std::memory_order_release);
        channel->loans_left.fetch_add(1, std::memory_order_release);
        // The sender may be waiting for a free slot. A deleter cannot raise: were the wake to fail,
        // the sender's wait would still see the slot at its next liveness slice (50 ms).
        (void)ring(*sender_bell);
      },
      options);
}

// The outcome of pulling one single-copy payload.
struct Context::Pull {
  enum Kind { kDone, kRejected, kFailed, kSenderLost } kind = kDone;
  std::string why;  // for all but kDone
};

Context::Pull Context::pull_payload(Peer& peer, const WireHeader& header, const char* slot,
                                    const at::Tensor& tensor) {
  std::string message = "single-copy message from peer " + std::to_string(peer.rank) + " (header tag " +
                        std::to_string(header.tag) + ")";
  if (peer.in_channel->single_copy.load(std::memory_order_relaxed) != kSingleCopyAccepted) {
    return {Pull::kRejected, message + " rejected: this channel refused single copy at connect()"};
  }
  SingleCopyDescriptor descriptor;
  std::memcpy(&descriptor, slot + sizeof(WireHeader), sizeof(descriptor));
  if (descriptor.magic != kSingleCopyMagic || descriptor.nbytes != header.nbytes ||
      descriptor.sender_pid != peer.pid) {
    std::ostringstream why;
    why << message << " rejected: bad descriptor (magic 0x" << std::hex << descriptor.magic << std::dec
        << ", " << descriptor.nbytes << " B from pid " << descriptor.sender_pid << "; expected " << header.nbytes
        << " B from pid " << peer.pid << ")";
    return {Pull::kRejected, why.str()};
  }
  int error = pull_bytes(copy_pool_, peer.pid, tensor.data_ptr(), descriptor.address, descriptor.nbytes);
  // Read after the pull (the fence orders it): if the sender had not closed by now, it had not
  // released the source before or during the pull either.
  std::atomic_thread_fence(std::memory_order_seq_cst);
  bool sender_closed = peer.control->closed.load(std::memory_order_acquire) != 0;
  // A sender that has exited may have died before the pull, its pid reused: nothing read counts.
  if (error == ESRCH || !peer.alive()) {
    return {Pull::kSenderLost, "peer process (pid " + std::to_string(peer.pid) + ") exited before its " +
                                   message + " was pulled"};
  }
  if (sender_closed) {
    return {Pull::kFailed, "peer " + std::to_string(peer.rank) + " closed its shm_tensor context before its " +
                               message + " was pulled; wait for sends to complete before close()"};
  }
  if (error != 0) {
    std::ostringstream why;
    why << "pulling " << message << " failed: process_vm_readv(pid " << peer.pid << ", " << descriptor.nbytes
        << " B at 0x" << std::hex << descriptor.address << std::dec << ") failed: " << std::strerror(error)
        << " (errno " << error << ")";
    return {Pull::kFailed, why.str()};
  }
  return {};
}

void Context::drain_inbound(Peer& peer, const std::vector<std::shared_ptr<Handle>>& awaited) {
  // A rejected message, a failed pull, or a pull the dead sender can no longer serve: the ring is
  // stuck at that slot.
  if (!peer.broken.empty() || !peer.lost_detail.empty()) return;
  while (true) {
    uint64_t tail = peer.in_channel->tail.load(std::memory_order_relaxed);
    uint64_t head = peer.in_channel->head.load(std::memory_order_acquire);
    if (tail == head) return;
    uint32_t index = peer.in_channel->slot_of[tail % config_.num_slots];
    uint64_t bit = index < static_cast<uint32_t>(config_.num_slots) ? 1ull << index : 0;
    if (bit == 0 || (peer.in_channel->free_slots.load(std::memory_order_relaxed) & bit) != 0) {
      peer.broken = "message from peer " + std::to_string(peer.rank) + " at ring position " +
                    std::to_string(tail) + " names slot " + std::to_string(index) +
                    ", which is not one it took (" + std::to_string(config_.num_slots) + " slots)";
      return;
    }
    char* slot = peer.in_slots + index * slot_stride_;
    WireHeader header;
    std::memcpy(&header, slot, sizeof(header));
    // A device message's payload is not in the slot: only the descriptor is (its bounds are checked
    // against the sender's allocation or staging pool when it is read).
    std::string problem = dpp_wire::validate_header(
        header, (header.flags & dpp_wire::kFlagCudaIpc) ? cuda::kMaxDeviceMessageBytes : config_.slot_bytes);
    if (!problem.empty()) {
      // The channel cannot be trusted past this slot: every later operation with this peer fails.
      peer.broken = "message from peer " + std::to_string(peer.rank) + " (header tag " +
                    std::to_string(header.tag) + ") rejected: " + problem;
      return;
    }
    at::Tensor tensor;
    if (header.flags & dpp_wire::kFlagCudaIpc) {
      try {
        tensor = receive_device_message(peer, header, slot, index);
      } catch (const PeerLost&) {
        peer.lost = true;  // its device copy never ran; the waiting handle reports the loss
        return;
      } catch (const std::exception& error) {
        // The slot stays taken: nothing past it can be trusted. The reason loses its own
        // "call(peer, tag): " prefix; the failing handle adds one.
        std::string what = error.what();
        std::string prefix = describe("shm_tensor.irecv", peer.rank, header.tag, "");
        if (what.compare(0, prefix.size(), prefix) == 0) what.erase(0, prefix.size());
        peer.broken = "device message from peer " + std::to_string(peer.rank) + " (header tag " +
                      std::to_string(header.tag) + ") rejected: " + what;
        return;
      }
    } else if (header.flags & dpp_wire::kFlagSingleCopy) {
      tensor = allocate_received(header);
      Pull pull = pull_payload(peer, header, slot, tensor);
      if (pull.kind == Pull::kSenderLost) {
        peer.lost = true;
        peer.lost_detail = pull.why;
        complete_pulled_sends(peer);  // what it pulled before dying stays delivered
        return;
      }
      if (pull.kind != Pull::kDone) {
        peer.broken = pull.why;
        peer.broken_by_pull = pull.kind == Pull::kFailed;
        return;
      }
      ++counts_.received_single_copy;
    } else if (lend_slot(peer, header)) {
      tensor = lent_tensor(peer, header, slot, index);  // frees the slot when its storage goes
      bit = 0;
      ++counts_.received_zero_copy;
    } else if (lendable(header) &&
               std::any_of(awaited.begin(), awaited.end(), [](const auto& h) { return h->done_; })) {
      return;  // a message that could be lent later; the caller has what it waited for
    } else {
      tensor = allocate_received(header);
      if (header.nbytes > 0) copy_pool_.copy(tensor.data_ptr(), slot + sizeof(WireHeader), header.nbytes);
      ++counts_.received_two_copy;
    }
    // Tail first: a sender that sees the slot free also sees its message consumed (push_sends).
    peer.in_channel->tail.store(tail + 1, std::memory_order_release);
    if (bit != 0) peer.in_channel->free_slots.fetch_or(bit, std::memory_order_release);
    deliver(peer.rank, header.tag, std::move(tensor));
    ring_peer(peer, "shm_tensor.irecv", header.tag, false);  // the sender may be waiting for this slot
  }
}

at::Tensor Context::receive_device_message(Peer& peer, const WireHeader& header, char* slot,
                                           uint32_t slot_index) {
  const char* call = "shm_tensor.irecv";
  if (config_.slot_bytes < cuda::kDeviceDescriptorBytes) {
    throw ProtocolError(describe(call, peer.rank, header.tag,
                                 "device message in a slot too small for its IPC descriptor"));
  }
  Peer* sender = &peer;
  uint64_t magic;
  std::memcpy(&magic, slot + sizeof(WireHeader), sizeof(magic));
  if (magic == cuda::kDirectMagic) {
    cuda::DirectDescriptor direct;
    std::memcpy(&direct, slot + sizeof(WireHeader), sizeof(direct));
    if (direct.slot != slot_index) {
      throw ProtocolError(describe(call, peer.rank, header.tag,
                                   "direct descriptor names slot " + std::to_string(direct.slot) +
                                       " but arrived in slot " + std::to_string(slot_index)));
    }
    at::Tensor tensor = cuda_ipc(call, peer.rank, header.tag)
                            .receive_direct(peer.rank, header, &direct, caller_cuda_device_, caller_cuda_stream_,
                                            config_.host_tensors_by_cuda_ipc,
                                            static_cast<uint64_t>(config_.num_slots),
                                            [sender] { return sender->alive(); });
    // The answer for the sender, read once it sees the slot free.
    std::memcpy(slot + sizeof(WireHeader), &direct, sizeof(direct));
    ++counts_.received_device_direct;
    return tensor;
  }
  ++counts_.received_device_staged;
  cuda::IpcDescriptor descriptor;
  std::memcpy(&descriptor, slot + sizeof(WireHeader), sizeof(descriptor));
  // The sender's device ring mirrors our host ring: device slot i travels in host slot i.
  if (descriptor.magic == cuda::kDescriptorMagic && descriptor.slot != slot_index) {
    throw ProtocolError(describe(call, peer.rank, header.tag,
                                 "device slot " + std::to_string(descriptor.slot) + " arrived in host slot " +
                                     std::to_string(slot_index)));
  }
  return cuda_ipc(call, peer.rank, header.tag)
      .receive(peer.rank, header, descriptor, caller_cuda_device_, caller_cuda_stream_,
               config_.host_tensors_by_cuda_ipc, [sender] { return sender->alive(); }, config_.timeout_s,
               config_.spin_us);
}

void Context::progress(const std::vector<std::shared_ptr<Handle>>& awaited) {
  if (closed_ || !connected_) return;
  for (auto& peer : peers_) {
    drain_inbound(*peer, awaited);
    push_sends(*peer);
  }
}

bool Context::handle_done_or_throw(Handle& handle) {
  if (handle.done_) return true;
  const char* call = handle.is_send_ ? "shm_tensor.isend" : "shm_tensor.irecv";
  if (closed_) throw TransportError(describe(call, handle.peer_, handle.tag_, "context is closed"));
  Peer& peer = *peer_by_rank_.at(handle.peer_);
  if (!peer.broken.empty()) {  // every later operation with this peer fails, sends included
    std::string what = describe(call, handle.peer_, handle.tag_, peer.broken);
    if (peer.broken_by_pull) throw TransportError(what);
    throw ProtocolError(what);
  }
  if (peer.lost) {
    std::string what;
    if (!handle.is_send_ && !peer.lost_detail.empty()) {
      what = peer.lost_detail;
    } else {
      what = "peer process (pid " + std::to_string(peer.pid) + ") exited before the message was " +
             (!handle.is_send_ ? "sent" : handle.single_copy_ ? "pulled from this process" : "accepted into its inbox");
    }
    throw PeerLost(describe(call, handle.peer_, handle.tag_, what));
  }
  if (handle.is_send_ && receiver_closed(peer)) {
    if (handle.done_) return true;
    throw TransportError(describe(call, handle.peer_, handle.tag_,
                                  "peer " + std::to_string(peer.rank) +
                                      " closed its shm_tensor context before taking the message"));
  }
  return false;
}

std::vector<int> Context::single_copy_peers() {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<int> ranks;
  if (!connected_) return ranks;
  for (const auto& peer : peers_) {
    if (peer->single_copy_refusal.empty()) ranks.push_back(peer->rank);
  }
  return ranks;
}

std::map<int, std::string> Context::single_copy_fallbacks() {
  std::lock_guard<std::mutex> lock(mutex_);
  std::map<int, std::string> reasons;
  if (!connected_) return reasons;
  for (const auto& peer : peers_) {
    if (!peer->single_copy_refusal.empty()) reasons[peer->rank] = peer->single_copy_refusal;
  }
  return reasons;
}

MessageCounts Context::message_counts() {
  std::lock_guard<std::mutex> lock(mutex_);
  return counts_;
}

PostStats Context::post_stats() {
  std::lock_guard<std::mutex> lock(mutex_);
  return post_stats_;
}

std::string Context::batch_sleep_fallback() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!config_.batch_while_sleeping) return "disabled (ShmConfig.batch_while_sleeping=False)";
  return batch_sleep_failure_;
}

void Context::check_liveness(const std::vector<std::shared_ptr<Handle>>& handles) {
  bool any_lost = false;
  for (const auto& handle : handles) {
    if (handle->done_) continue;
    Peer& peer = *peer_by_rank_.at(handle->peer_);
    if (!peer.lost && !peer.alive()) {
      peer.lost = true;
      complete_pulled_sends(peer);  // pulled before it died: those sends did complete
      any_lost = true;
    }
  }
  // Messages a lost peer published before it died are still in our inbox: take them first.
  if (any_lost) {
    for (auto& peer : peers_) drain_inbound(*peer, {});  // everything, copied out if need be
  }
}

void Context::check_own_handles(const std::vector<std::shared_ptr<Handle>>& handles,
                                const char* call) const {
  if (handles.empty()) throw std::invalid_argument(std::string(call) + ": no handles given");
  for (const auto& handle : handles) {
    if (!handle || handle->context_.get() != this) {
      throw std::invalid_argument(std::string(call) + ": a handle belongs to another context");
    }
  }
}

int Context::test_any(const std::vector<std::shared_ptr<Handle>>& handles, int cuda_device,
                      uintptr_t cuda_stream) {
  check_own_handles(handles, "shm_tensor.test_any");
  std::lock_guard<std::mutex> lock(mutex_);
  for (size_t i = 0; i < handles.size(); ++i) {
    if (handles[i]->done_) return static_cast<int>(i);
  }
  caller_cuda_device_ = cuda_device;
  caller_cuda_stream_ = cuda_stream;
  progress(handles);
  for (size_t i = 0; i < handles.size(); ++i) {
    if (handle_done_or_throw(*handles[i])) return static_cast<int>(i);
  }
  return -1;
}

int Context::wait_any(const std::vector<std::shared_ptr<Handle>>& handles, double timeout_s,
                      int cuda_device, uintptr_t cuda_stream) {
  check_own_handles(handles, "shm_tensor.wait_any");
  double timeout = timeout_s < 0 ? config_.timeout_s : timeout_s;
  Clock::time_point start = Clock::now();
  Clock::time_point deadline = start + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(timeout));
  Clock::time_point next_liveness_check = start;

  std::unique_lock<std::mutex> lock(mutex_);
  caller_cuda_device_ = cuda_device;
  caller_cuda_stream_ = cuda_stream;
  while (true) {
    if (closed_) {
      const Handle& first = *handles.front();
      throw TransportError(describe("shm_tensor.wait", first.peer_, first.tag_, "context is closed"));
    }
    Doorbell& bell = control_->doorbell;
    // Announce the sleep before reading the counter, so a ringer either sees us or changes it first.
    bell.sleepers.fetch_add(1, std::memory_order_seq_cst);
    struct SleeperGuard {
      Doorbell& bell;
      ~SleeperGuard() { bell.sleepers.fetch_sub(1, std::memory_order_seq_cst); }
    } guard{bell};
    uint32_t seen = bell.counter.load(std::memory_order_seq_cst);

    progress(handles);
    for (size_t i = 0; i < handles.size(); ++i) {
      if (handle_done_or_throw(*handles[i])) return static_cast<int>(i);
    }
    if (Clock::now() >= next_liveness_check) {
      check_liveness(handles);
      for (size_t i = 0; i < handles.size(); ++i) {
        if (handle_done_or_throw(*handles[i])) return static_cast<int>(i);
      }
      next_liveness_check = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                                 std::chrono::duration<double>(kLivenessPeriodS));
    }
    double remaining = seconds_until(deadline);
    if (remaining <= 0) {
      std::ostringstream what;
      what << "timed out after " << timeout << " s waiting for";
      size_t shown = std::min<size_t>(handles.size(), 8);
      for (size_t i = 0; i < shown; ++i) {
        what << (i ? ", " : " ") << (handles[i]->is_send_ ? "send to " : "receive from ")
             << handles[i]->peer_ << " tag " << handles[i]->tag_;
      }
      if (shown < handles.size()) what << " and " << handles.size() - shown << " more";
      const Handle& first = *handles.front();
      throw TransportTimeout(describe("shm_tensor.wait", first.peer_, first.tag_, what.str()));
    }
    double nap = std::min(remaining, std::max(0.0, seconds_until(next_liveness_check)));
    bool batch = config_.batch_while_sleeping && batch_sleep_failure_.empty();
    lock.unlock();
    bool slept = false, slept_as_batch = false;
    int sleep_error = 0;
    std::string batch_failure, restore_failure;
    if (!spin_until_rung(bell, seen, config_.spin_us)) {
      // SCHED_BATCH for the sleep only (sleep_policy.h): whoever wakes us keeps its CPU.
      BatchWhileAsleep asleep(batch);
      slept = true;
      slept_as_batch = asleep.switched();
      sleep_error = sleep_on(bell, seen, std::max(nap, 1e-4));
      restore_failure = asleep.restore();
      batch_failure = asleep.failure();
    }
    lock.lock();
    if (slept) {
      ++post_stats_.sleeps;
      if (slept_as_batch) ++post_stats_.sleeps_as_batch;
    }
    if (!batch_failure.empty() && batch_sleep_failure_.empty()) batch_sleep_failure_ = batch_failure;
    const Handle& first = *handles.front();
    if (!restore_failure.empty()) {
      throw TransportError(describe("shm_tensor.wait", first.peer_, first.tag_,
                                    restore_failure + "; this thread stays SCHED_BATCH"));
    }
    if (sleep_error != 0) {
      errno = sleep_error;
      throw TransportError(describe("shm_tensor.wait", first.peer_, first.tag_,
                                    dpp_errors::syscall_failure("futex", "FUTEX_WAIT, own doorbell")));
    }
  }
}

}  // namespace shm_tensor
