// The scheduling policy of a thread while it sleeps on its doorbell.
//
// Why. A thread asleep in wait() is woken by a peer's futex(FUTEX_WAKE) (a sender that posted a
// message, a receiver that freed a slot). When the woken thread's CPU is busy (more runnable threads
// than cores, as on a shared machine), the kernel places it on a CPU and, for a SCHED_OTHER thread,
// preempts what runs there, often the very thread that woke it: that waker then sits on the run
// queue, in the middle of isend(), until the woken peer blocks again or its time slice ends
// (measured: 2-40 ms per isend on 2 shared cores, docs/transport.md "Posting a send"). SCHED_BATCH
// threads do not preempt on wakeup (both CFS and EEVDF skip wakeup preemption for them; the tick
// schedules them), so a waiter that sleeps as SCHED_BATCH leaves the waker its CPU: the woken thread
// runs at once on an idle core, or when the waker's slice ends on a busy one. Only the sleep is
// SCHED_BATCH; the thread is SCHED_OTHER again as soon as it runs.
//
// Only SCHED_OTHER threads are switched (a SCHED_FIFO/RR/IDLE/BATCH/DEADLINE thread is left as it
// is); the nice value and SCHED_RESET_ON_FORK are kept. An unprivileged thread may switch between
// SCHED_OTHER and SCHED_BATCH at its own nice value; where a seccomp profile refuses the call the
// guard reports the failure and the caller stops trying.
#pragma once

#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#ifndef SCHED_RESET_ON_FORK
#define SCHED_RESET_ON_FORK 0x40000000
#endif

namespace shm_tensor {

// RAII: SCHED_BATCH from construction to restore() (or destruction, on an exception path).
class BatchWhileAsleep {
 public:
  explicit BatchWhileAsleep(bool wanted) {
    if (!wanted) return;
    int current = ::sched_getscheduler(0);
    if (current < 0) {
      failure_ = failure("sched_getscheduler", "");
      return;
    }
    int flags = current & SCHED_RESET_ON_FORK;
    if ((current & ~SCHED_RESET_ON_FORK) != SCHED_OTHER) return;  // not ours to change
    struct sched_param param = {};
    if (::sched_setscheduler(0, SCHED_BATCH | flags, &param) != 0) {
      failure_ = failure("sched_setscheduler", ", SCHED_BATCH");
      return;
    }
    restore_flags_ = flags;
    switched_ = true;
  }
  ~BatchWhileAsleep() { restore(); }  // a failure here can only be ignored: destructors do not throw
  BatchWhileAsleep(const BatchWhileAsleep&) = delete;
  BatchWhileAsleep& operator=(const BatchWhileAsleep&) = delete;

  // Back to SCHED_OTHER: "" or what failed.
  std::string restore() {
    if (!switched_) return std::string();
    switched_ = false;
    struct sched_param param = {};
    if (::sched_setscheduler(0, SCHED_OTHER | restore_flags_, &param) != 0) {
      return failure("sched_setscheduler", ", SCHED_OTHER");
    }
    return std::string();
  }

  bool switched() const { return switched_; }
  // "" or why the thread could not be switched to SCHED_BATCH.
  const std::string& failure() const { return failure_; }

 private:
  static std::string failure(const char* call, const char* what) {
    int error = errno;
    return std::string(call) + "(thread " + std::to_string(static_cast<long>(::syscall(SYS_gettid))) + what +
           ") failed: " + std::strerror(error) + " (errno " + std::to_string(error) + ")";
  }

  bool switched_ = false;
  int restore_flags_ = 0;
  std::string failure_;
};

}  // namespace shm_tensor
