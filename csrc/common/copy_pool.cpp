#include "copy_pool.h"

#include <algorithm>
#include <cstring>

namespace dpp_copy {

CopyPool::CopyPool(int max_threads, size_t bytes_per_thread)
    : max_threads_(std::max(1, max_threads)), bytes_per_thread_(std::max<size_t>(4096, bytes_per_thread)) {
  // Workers are started lazily on the first large copy: most contexts only ever copy small messages.
}

CopyPool::~CopyPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  work_ready_.notify_all();
  for (auto& worker : workers_) worker.join();
}

int CopyPool::threads_for(size_t n) const {
  size_t wanted = (n + bytes_per_thread_ - 1) / bytes_per_thread_;
  return static_cast<int>(std::max<size_t>(1, std::min<size_t>(wanted, max_threads_)));
}

void CopyPool::worker_loop() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    work_ready_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
    if (stopping_ && queue_.empty()) return;
    auto task = std::move(queue_.front());
    queue_.pop_front();
    lock.unlock();
    task();
    lock.lock();
    if (--pieces_left_ == 0) work_done_.notify_all();
  }
}

void CopyPool::copy(void* dst, const void* src, size_t n) {
  auto* d = static_cast<char*>(dst);
  const auto* s = static_cast<const char*>(src);
  for_each_piece(n, [d, s](int, size_t begin, size_t end) { std::memcpy(d + begin, s + begin, end - begin); });
}

void CopyPool::for_each_piece(size_t n, const std::function<void(int, size_t, size_t)>& piece) {
  int threads = threads_for(n);
  if (threads <= 1) {
    piece(0, 0, n);
    return;
  }
  // Pieces are multiples of 4 KiB so that no two threads write the same page.
  size_t length = ((n / threads) + 4095) & ~size_t(4095);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    while (static_cast<int>(workers_.size()) < threads - 1) {
      workers_.emplace_back([this] { worker_loop(); });
    }
    for (int i = 1; i < threads; ++i) {
      size_t begin = std::min(n, length * i);
      size_t end = std::min(n, length * (i + 1));
      if (begin >= end) continue;
      ++pieces_left_;
      // `piece` outlives the task: this call returns only when pieces_left_ is back to zero.
      queue_.emplace_back([&piece, i, begin, end] { piece(i, begin, end); });
    }
  }
  work_ready_.notify_all();
  piece(0, 0, std::min(n, length));
  std::unique_lock<std::mutex> lock(mutex_);
  work_done_.wait(lock, [this] { return pieces_left_ == 0; });
}

}  // namespace dpp_copy
