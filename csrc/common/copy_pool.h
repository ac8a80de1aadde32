// Parallel copies: a large message gets one thread per `bytes_per_thread` bytes, up to `max_threads`
// (the caller is one of them), which take its 1 MiB page-aligned pieces in turn. Used for memcpy into and
// out of shared-memory slots and for process_vm_readv pulls. Workers sleep on a condition variable
// when idle and are joined in the destructor.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace dpp_copy {

// Copies of at least this many bytes use non-temporal stores: half the L3 of the machine this was
// measured on, where they were 1.2x (16 MiB) to 1.6x (64 MiB) faster than memcpy and slower below
// 8 MiB (docs/transport.md).
constexpr size_t kStreamingMinBytes = 16ull << 20;

class CopyPool {
 public:
  CopyPool(int max_threads, size_t bytes_per_thread);
  ~CopyPool();
  CopyPool(const CopyPool&) = delete;
  CopyPool& operator=(const CopyPool&) = delete;

  // Copies n bytes (with non-temporal stores from kStreamingMinBytes); returns after every piece is done.
  void copy(void* dst, const void* src, size_t n);

  // Calls piece(index, begin, end) for the pieces of [0, n), `index` naming the thread (0: the
  // calling thread; one thread may run several pieces), and returns after every piece is done.
  // Pieces start at multiples of 4 KiB. `piece` must not throw (it reports failures through what it
  // captures); index < threads_for(n).
  void for_each_piece(size_t n, const std::function<void(int index, size_t begin, size_t end)>& piece);

  int threads_for(size_t n) const;

 private:
  void worker_loop();

  int max_threads_;
  size_t bytes_per_thread_;
  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable work_ready_;
  std::condition_variable work_done_;
  std::deque<std::function<void()>> queue_;
  size_t pieces_left_ = 0;
  bool stopping_ = false;
};

}  // namespace dpp_copy
