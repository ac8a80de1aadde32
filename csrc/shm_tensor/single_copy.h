// Single-copy transfer of large CPU messages by cross-memory attach (process_vm_readv(2)).
//
// The sender leaves the payload in its own tensor and writes only the wire header (flag
// kFlagSingleCopy) and a SingleCopyDescriptor into the slot; the receiver copies the payload straight
// from the sender's address space into the received tensor. One copy instead of two (into the slot,
// out of it). Reading another process's memory needs ptrace-style permission: the same uid, and no
// Yama ptrace_scope >= 1 or seccomp profile forbidding it. So every receiver probes each peer once at
// connect() by pulling a token the peer publishes, and the channel falls back to the two-copy path
// when the probe fails. Header-only: the functions are small and context.cpp alone uses them.
#pragma once

#include <sys/uio.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "../common/copy_pool.h"

namespace shm_tensor {

constexpr uint64_t kSingleCopyMagic = 0x59504f43454c4753ull;  // "SGLECOPY"

// What follows the wire header in the slot of a single-copy message.
struct SingleCopyDescriptor {
  uint64_t magic;    // kSingleCopyMagic
  uint64_t address;  // of the payload in the sender's address space
  uint64_t nbytes;   // equals the header's nbytes
  int32_t sender_pid;
  uint32_t reserved;  // zero
};
static_assert(sizeof(SingleCopyDescriptor) == 32, "single-copy descriptor layout changed");

// Reads n bytes at `remote_address` of process `pid` into `local`, looping on partial reads.
// 0 on success, else the errno of the failing call (EFAULT when a read makes no progress).
inline int pull_bytes(int pid, void* local, uint64_t remote_address, size_t n) {
  auto* destination = static_cast<char*>(local);
  size_t done = 0;
  while (done < n) {
    struct iovec local_piece = {destination + done, n - done};
    struct iovec remote_piece = {reinterpret_cast<void*>(remote_address + done), n - done};
    ssize_t got = ::process_vm_readv(pid, &local_piece, 1, &remote_piece, 1, 0);
    if (got < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    // A partial read stops at the first page it could not read; zero bytes means no progress.
    if (got == 0) return EFAULT;
    done += static_cast<size_t>(got);
  }
  return 0;
}

// The same, split over the pool's threads; the errno of a failing piece, 0 when every piece arrived.
inline int pull_bytes(dpp_copy::CopyPool& pool, int pid, void* local, uint64_t remote_address, size_t n) {
  std::vector<int> errors(static_cast<size_t>(pool.threads_for(n)), 0);  // per thread: its first failure
  auto* destination = static_cast<char*>(local);
  pool.for_each_piece(n, [&](int index, size_t begin, size_t end) {
    int& error = errors[static_cast<size_t>(index)];
    if (error == 0) error = pull_bytes(pid, destination + begin, remote_address + begin, end - begin);
  });
  for (int error : errors) {
    if (error != 0) return error;
  }
  return 0;
}

// "" when this process may read the 8-byte `expected` token at `address` of process `pid`; otherwise
// why not, e.g. "process_vm_readv(pid 42) failed: Operation not permitted (errno 1)".
inline std::string probe_single_copy(int pid, uint64_t address, uint64_t expected) {
  uint64_t token = 0;
  int error = pull_bytes(pid, &token, address, sizeof(token));
  std::ostringstream why;
  if (error != 0) {
    why << "process_vm_readv(pid " << pid << ") failed: " << std::strerror(error) << " (errno " << error << ")";
  } else if (token != expected) {
    why << "process_vm_readv(pid " << pid << ") read 0x" << std::hex << token << " instead of the token 0x"
        << expected << " the peer published";
  }
  return why.str();
}

}  // namespace shm_tensor
