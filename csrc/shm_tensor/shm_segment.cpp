#include "shm_segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <utility>

#include "../common/errors.h"

namespace shm_tensor {

using dpp_errors::syscall_failure;
using dpp_errors::TransportError;

namespace {
// Closes a descriptor on every path out of create/open.
struct FdCloser {
  int fd;
  ~FdCloser() {
    if (fd >= 0) ::close(fd);
  }
};
}  // namespace

ShmSegment ShmSegment::create(const std::string& name, size_t bytes) {
  int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) throw TransportError("shm_tensor: " + syscall_failure("shm_open", name));
  FdCloser closer{fd};
  ShmSegment segment;
  segment.name_ = name;
  segment.owns_name_ = true;  // from here on the destructor unlinks the name
  if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    throw TransportError("shm_tensor: " + syscall_failure("ftruncate", name));
  }
  void* addr = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (addr == MAP_FAILED) throw TransportError("shm_tensor: " + syscall_failure("mmap", name));
  segment.addr_ = addr;
  segment.size_ = bytes;
  return segment;
}

ShmSegment ShmSegment::open(const std::string& name, int peer_rank) {
  std::string what = name + " of peer " + std::to_string(peer_rank);
  int fd = ::shm_open(name.c_str(), O_RDWR, 0600);
  if (fd < 0) throw TransportError("shm_tensor: " + syscall_failure("shm_open", what));
  FdCloser closer{fd};
  struct stat info;
  if (::fstat(fd, &info) != 0) throw TransportError("shm_tensor: " + syscall_failure("fstat", what));
  void* addr = ::mmap(nullptr, static_cast<size_t>(info.st_size), PROT_READ | PROT_WRITE,
                      MAP_SHARED, fd, 0);
  if (addr == MAP_FAILED) throw TransportError("shm_tensor: " + syscall_failure("mmap", what));
  ShmSegment segment;
  segment.name_ = name;
  segment.addr_ = addr;
  segment.size_ = static_cast<size_t>(info.st_size);
  return segment;
}

void ShmSegment::unlink() {
  if (!owns_name_) return;
  owns_name_ = false;
  if (::shm_unlink(name_.c_str()) != 0 && errno != ENOENT) {
    throw TransportError("shm_tensor: " + syscall_failure("shm_unlink", name_));
  }
}

void ShmSegment::release() noexcept {
  if (addr_ != nullptr) ::munmap(addr_, size_);
  if (owns_name_) ::shm_unlink(name_.c_str());
  addr_ = nullptr;
  size_ = 0;
  owns_name_ = false;
}

ShmSegment::~ShmSegment() { release(); }

ShmSegment::ShmSegment(ShmSegment&& other) noexcept
    : name_(std::move(other.name_)), addr_(other.addr_), size_(other.size_),
      owns_name_(other.owns_name_) {
  other.addr_ = nullptr;
  other.size_ = 0;
  other.owns_name_ = false;
}

ShmSegment& ShmSegment::operator=(ShmSegment&& other) noexcept {
  if (this != &other) {
    release();
    name_ = std::move(other.name_);
    addr_ = other.addr_;
    size_ = other.size_;
    owns_name_ = other.owns_name_;
    other.addr_ = nullptr;
    other.size_ = 0;
    other.owns_name_ = false;
  }
  return *this;
}

}  // namespace shm_tensor
