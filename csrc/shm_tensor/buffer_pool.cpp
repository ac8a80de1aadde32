#include "buffer_pool.h"

#include <cstdlib>
#include <new>

namespace shm_tensor {

namespace {
constexpr size_t kPage = 4096;
}

BufferPool::~BufferPool() {
  for (auto& entry : free_) std::free(entry.second);
}

void* BufferPool::take(size_t bytes, size_t* capacity) {
  size_t rounded = (bytes + kPage - 1) / kPage * kPage;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    // Exact capacity only: pipeline messages repeat a few sizes, and a larger buffer would hold
    // memory the tensor does not use.
    auto found = free_.find(rounded);
    if (found != free_.end()) {
      void* buffer = found->second;
      free_.erase(found);
      cached_bytes_ -= rounded;
      *capacity = rounded;
      return buffer;
    }
  }
  void* buffer = std::aligned_alloc(kPage, rounded);
  if (buffer == nullptr) throw std::bad_alloc();
  *capacity = rounded;
  return buffer;
}

void BufferPool::give(void* buffer, size_t capacity) {
  std::lock_guard<std::mutex> lock(mutex_);
  while (cached_bytes_ + capacity > max_cached_bytes_ && !free_.empty()) {
    auto oldest = free_.begin();  // the smallest: large buffers are the expensive ones to refault
    cached_bytes_ -= oldest->first;
    std::free(oldest->second);
    free_.erase(oldest);
  }
  if (cached_bytes_ + capacity > max_cached_bytes_) {
    std::free(buffer);
    return;
  }
  free_.emplace(capacity, buffer);
  cached_bytes_ += capacity;
}

}  // namespace shm_tensor
