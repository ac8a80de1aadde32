// Registered host buffers, recycled: every message is staged in (send) or lands in (receive) one of
// them, so UCX registers memory once per buffer, not once per message. Received tensors point into
// their buffer and give it back from their deleter (which keeps the pool, and through it the UCP
// context, alive), so a tensor may outlive the transport's context.
#pragma once

#include <map>
#include <memory>
#include <mutex>

#include "ucx_objects.h"

namespace rdma_tensor {

class BufferPool : public std::enable_shared_from_this<BufferPool> {
 public:
  BufferPool(std::shared_ptr<UcxContext> context, size_t max_cached_bytes)
      : context_(std::move(context)), max_cached_bytes_(max_cached_bytes) {}

  // A registered buffer of at least `bytes` (whole pages); throws std::bad_alloc or TransportError.
  std::unique_ptr<RegisteredBuffer> take(size_t bytes);
  // Keeps the buffer for reuse while the cache holds at most max_cached_bytes; else releases it.
  void give(std::unique_ptr<RegisteredBuffer> buffer);
  size_t registrations() const { return registrations_; }

 private:
  std::shared_ptr<UcxContext> context_;
  size_t max_cached_bytes_;
  size_t cached_bytes_ = 0;
  size_t registrations_ = 0;  // buffers registered so far (a test checks reuse)
  std::multimap<size_t, std::unique_ptr<RegisteredBuffer>> free_;  // capacity -> buffer
  std::mutex mutex_;
};

}  // namespace rdma_tensor
