#include "buffer_pool.h"

namespace rdma_tensor {

namespace {
constexpr size_t kPage = 4096;
}

std::unique_ptr<RegisteredBuffer> BufferPool::take(size_t bytes) {
  size_t rounded = (bytes + kPage - 1) / kPage * kPage;
  if (rounded == 0) rounded = kPage;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    // Exact capacity only: pipeline messages repeat a few sizes, and a larger buffer would hold
    // memory that a received tensor does not use for as long as the tensor lives.
    auto found = free_.find(rounded);
    if (found != free_.end()) {
      std::unique_ptr<RegisteredBuffer> buffer = std::move(found->second);
      free_.erase(found);
      cached_bytes_ -= rounded;
      return buffer;
    }
    ++registrations_;
  }
  return std::make_unique<RegisteredBuffer>(context_, rounded);
}

void BufferPool::give(std::unique_ptr<RegisteredBuffer> buffer) {
  std::lock_guard<std::mutex> lock(mutex_);
  size_t capacity = buffer->capacity();
  while (cached_bytes_ + capacity > max_cached_bytes_ && !free_.empty()) {
    auto smallest = free_.begin();  // large buffers are the expensive ones to register again
    cached_bytes_ -= smallest->first;
    free_.erase(smallest);
  }
  if (cached_bytes_ + capacity > max_cached_bytes_) return;  // `buffer` is released here
  free_.emplace(capacity, std::move(buffer));
  cached_bytes_ += capacity;
}

}  // namespace rdma_tensor
