// A doorbell: a 32-bit counter in shared memory that peers bump after publishing a message or
// freeing a slot, and that its owner sleeps on with futex(2). FUTEX_WAIT without FUTEX_PRIVATE_FLAG
// works across processes on MAP_SHARED memory. `sleepers` lets a ringer skip the wake syscall when
// nobody sleeps.
#pragma once

#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cerrno>
#include <climits>
#include <cstdint>

namespace shm_tensor {

struct Doorbell {
  std::atomic<uint32_t> counter;
  std::atomic<uint32_t> sleepers;
};
static_assert(std::atomic<uint32_t>::is_always_lock_free, "futex needs a lock-free 32-bit atomic");

// What ring() did: whether it made the FUTEX_WAKE call (someone slept), and that call's errno (0: ok).
struct Rung {
  bool woke = false;
  int error = 0;
};

inline Rung ring(Doorbell& bell) {
  Rung rung;
  bell.counter.fetch_add(1, std::memory_order_seq_cst);
  if (bell.sleepers.load(std::memory_order_seq_cst) > 0) {
    rung.woke = true;
    if (::syscall(SYS_futex, reinterpret_cast<uint32_t*>(&bell.counter), FUTEX_WAKE, INT_MAX, nullptr,
                  nullptr, 0) < 0) {
      rung.error = errno;
    }
  }
  return rung;
}

// Watches the counter for at most `microseconds`; true as soon as it differs from `seen`.
inline bool spin_until_rung(Doorbell& bell, uint32_t seen, double microseconds) {
  if (microseconds <= 0) return false;
  auto deadline = std::chrono::steady_clock::now() +
                  std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                      std::chrono::duration<double, std::micro>(microseconds));
  while (std::chrono::steady_clock::now() < deadline) {
    for (int i = 0; i < 64; ++i) {
      if (bell.counter.load(std::memory_order_acquire) != seen) return true;
#if defined(__x86_64__) || defined(__i386__)
      __builtin_ia32_pause();
#endif
    }
  }
  return false;
}

// Sleeps while the counter still equals `seen`, at most `seconds`. Spurious returns are fine: the
// caller re-checks its condition. Returns 0, or the errno of a FUTEX_WAIT that failed for another
// reason than a wake-up, a changed counter, a timeout or a signal.
inline int sleep_on(Doorbell& bell, uint32_t seen, double seconds) {
  if (seconds <= 0) return 0;
  struct timespec timeout;
  timeout.tv_sec = static_cast<time_t>(seconds);
  timeout.tv_nsec = static_cast<long>((seconds - static_cast<double>(timeout.tv_sec)) * 1e9);
  if (::syscall(SYS_futex, reinterpret_cast<uint32_t*>(&bell.counter), FUTEX_WAIT, seen, &timeout,
                nullptr, 0) < 0) {
    int error = errno;
    if (error != EAGAIN && error != ETIMEDOUT && error != EINTR) return error;
  }
  return 0;
}

}  // namespace shm_tensor
