// Recycles the page-aligned host buffers that received tensors live in. A fresh large allocation
// costs a page fault per 4 KiB page (the kernel zeroes each one), which for large messages costs more
// than the copy itself; recycled buffers are already mapped. Tensors return their buffer from their
// deleter, which keeps the pool alive, so a tensor may outlive its context.
#pragma once

#include <cstddef>
#include <map>
#include <memory>
#include <mutex>

namespace shm_tensor {

class BufferPool : public std::enable_shared_from_this<BufferPool> {
 public:
  explicit BufferPool(size_t max_cached_bytes) : max_cached_bytes_(max_cached_bytes) {}
  ~BufferPool();
  BufferPool(const BufferPool&) = delete;
  BufferPool& operator=(const BufferPool&) = delete;

  // A buffer of at least `bytes` (rounded up to whole pages); throws std::bad_alloc.
  void* take(size_t bytes, size_t* capacity);
  void give(void* buffer, size_t capacity);

 private:
  size_t max_cached_bytes_;
  size_t cached_bytes_ = 0;
  std::multimap<size_t, void*> free_;  // capacity -> buffer
  std::mutex mutex_;
};

}  // namespace shm_tensor
