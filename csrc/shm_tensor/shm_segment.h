// One POSIX shared-memory segment, mapped MAP_SHARED. Created 0600 and exclusively (a stale name
// from another job is an error, never silently reused); the creator unlinks the name as soon as every
// peer has mapped it, and at the latest in its destructor.
#pragma once

#include <cstddef>
#include <string>

namespace shm_tensor {

class ShmSegment {
 public:
  ShmSegment() = default;
  static ShmSegment create(const std::string& name, size_t bytes);
  static ShmSegment open(const std::string& name, int peer_rank);
  ~ShmSegment();
  ShmSegment(ShmSegment&& other) noexcept;
  ShmSegment& operator=(ShmSegment&& other) noexcept;
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;

  // Removes the name from /dev/shm; the mapping stays valid. Idempotent.
  void unlink();
  char* data() const { return static_cast<char*>(addr_); }
  size_t size() const { return size_; }
  const std::string& name() const { return name_; }

 private:
  void release() noexcept;
  std::string name_;
  void* addr_ = nullptr;
  size_t size_ = 0;
  bool owns_name_ = false;  // true until unlinked, for the creator only
};

}  // namespace shm_tensor
