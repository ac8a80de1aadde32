// Transport errors. Every message names the call, the peer and the tag so that a failure in a
// pipeline of many ranks points at the one message that went wrong.
#pragma once

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <string>

namespace dpp_errors {

class TransportError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};
// A wait ran out of time.
class TransportTimeout : public TransportError {
 public:
  using TransportError::TransportError;
};
// The peer process exited while a message to or from it was outstanding.
class PeerLost : public TransportError {
 public:
  using TransportError::TransportError;
};
// A header with bad magic, version, checksum or an inconsistent size.
class ProtocolError : public TransportError {
 public:
  using TransportError::TransportError;
};
// A message larger than one slot.
class MessageTooLarge : public TransportError {
 public:
  using TransportError::TransportError;
};

inline std::string describe(const char* call, int peer, int64_t tag, const std::string& what) {
  std::ostringstream msg;
  msg << call << "(peer=" << peer << ", tag=" << tag << "): " << what;
  return msg.str();
}

// "<syscall> failed: <strerror(errno)>" captured right after the failing call.
inline std::string syscall_failure(const char* syscall_name, const std::string& object) {
  int err = errno;
  std::ostringstream msg;
  msg << syscall_name << "(" << object << ") failed: " << std::strerror(err) << " (errno " << err
      << ")";
  return msg.str();
}

}  // namespace dpp_errors
