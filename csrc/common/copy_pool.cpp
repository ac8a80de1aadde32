#include "copy_pool.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <emmintrin.h>
#endif

namespace dpp_copy {

namespace {

// memcpy with non-temporal stores: the destination bypasses the cache, so the copy neither reads it
// first nor evicts the source. Only worth it when the destination would not stay in cache anyway.
void streaming_copy(char* dst, const char* src, size_t n) {
#if defined(__x86_64__)
  size_t head = (16 - (reinterpret_cast<uintptr_t>(dst) & 15)) & 15;  // _mm_stream_si128 needs 16-B alignment
  head = std::min(head, n);
  std::memcpy(dst, src, head);
  size_t i = head;
  for (; i + 64 <= n; i += 64) {
    __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
    __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
    __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
  }
  std::memcpy(dst + i, src + i, n - i);
  _mm_sfence();  // the stores are visible before whatever publishes the copy
#else
  std::memcpy(dst, src, n);
#endif
}

}  // namespace

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
  if (n >= kStreamingMinBytes) {
    for_each_piece(n, [d, s](int, size_t begin, size_t end) { streaming_copy(d + begin, s + begin, end - begin); });
  } else {
    for_each_piece(n, [d, s](int, size_t begin, size_t end) { std::memcpy(d + begin, s + begin, end - begin); });
  }
}

void CopyPool::for_each_piece(size_t n, const std::function<void(int, size_t, size_t)>& piece) {
  int threads = threads_for(n);
  if (threads <= 1) {
    piece(0, 0, n);
    return;
  }
  // The threads take 1 MiB pieces in turn rather than one share each: a thread that is descheduled
  // for a while (other jobs on the cores) leaves its share to the others instead of holding up the
  // whole copy. Pieces are multiples of 4 KiB so that no two threads write the same page.
  constexpr size_t kPiece = 1 << 20;
  const size_t count = (n + kPiece - 1) / kPiece;
  std::atomic<size_t> next{0};
  auto take_pieces = [&piece, &next, count, n](int index) {
    for (size_t k = next.fetch_add(1); k < count; k = next.fetch_add(1)) {
      piece(index, k * kPiece, std::min(n, (k + 1) * kPiece));
    }
  };
  {
    std::lock_guard<std::mutex> lock(mutex_);
    while (static_cast<int>(workers_.size()) < threads - 1) {
      workers_.emplace_back([this] { worker_loop(); });
    }
    for (int i = 1; i < threads; ++i) {
      ++pieces_left_;
      // `take_pieces` outlives the task: this call returns only when pieces_left_ is back to zero.
      queue_.emplace_back([&take_pieces, i] { take_pieces(i); });
    }
  }
  work_ready_.notify_all();
  take_pieces(0);
  std::unique_lock<std::mutex> lock(mutex_);
  work_done_.wait(lock, [this] { return pieces_left_ == 0; });
}

}  // namespace dpp_copy
