#include "wire_header.h"

#include <cstring>
#include <sstream>
#include <stdexcept>

namespace dpp_wire {

size_t dtype_itemsize(int32_t code) {
  switch (static_cast<DType>(code)) {
    case DType::kBool:
    case DType::kUInt8:
    case DType::kInt8:
    case DType::kFloat8E4M3FN:
    case DType::kFloat8E5M2:
    case DType::kFloat8E4M3FNUZ:
    case DType::kFloat8E5M2FNUZ:
      return 1;
    case DType::kInt16:
    case DType::kUInt16:
    case DType::kFloat16:
    case DType::kBFloat16:
      return 2;
    case DType::kInt32:
    case DType::kUInt32:
    case DType::kFloat32:
    case DType::kComplex32:
      return 4;
    case DType::kInt64:
    case DType::kUInt64:
    case DType::kFloat64:
    case DType::kComplex64:
      return 8;
    case DType::kComplex128:
      return 16;
  }
  return 0;
}

const char* dtype_name(int32_t code) {
  switch (static_cast<DType>(code)) {
    case DType::kBool: return "bool";
    case DType::kUInt8: return "uint8";
    case DType::kInt8: return "int8";
    case DType::kInt16: return "int16";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
    case DType::kUInt16: return "uint16";
    case DType::kUInt32: return "uint32";
    case DType::kUInt64: return "uint64";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat32: return "float32";
    case DType::kFloat64: return "float64";
    case DType::kComplex32: return "complex32";
    case DType::kComplex64: return "complex64";
    case DType::kComplex128: return "complex128";
    case DType::kFloat8E4M3FN: return "float8_e4m3fn";
    case DType::kFloat8E5M2: return "float8_e5m2";
    case DType::kFloat8E4M3FNUZ: return "float8_e4m3fnuz";
    case DType::kFloat8E5M2FNUZ: return "float8_e5m2fnuz";
  }
  return "unknown";
}

uint64_t header_checksum(const WireHeader& header) {
  const auto* bytes = reinterpret_cast<const unsigned char*>(&header);
  uint64_t hash = 1469598103934665603ULL;
  for (size_t i = 0; i < offsetof(WireHeader, checksum); ++i) {
    hash ^= bytes[i];
    hash *= 1099511628211ULL;
  }
  return hash;
}

WireHeader make_header(int64_t tag, int32_t dtype, const int64_t* shape, int ndim, uint64_t nbytes,
                       int32_t src_rank, uint32_t flags) {
  if (ndim < 0 || ndim > kMaxDims) {
    std::ostringstream msg;
    msg << "tensor has " << ndim << " dimensions; the wire header carries at most " << kMaxDims;
    throw std::invalid_argument(msg.str());
  }
  WireHeader header;
  std::memset(&header, 0, sizeof(header));
  header.magic = kMagic;
  header.version = kVersion;
  header.header_bytes = sizeof(WireHeader);
  header.tag = tag;
  header.dtype = dtype;
  header.ndim = ndim;
  for (int i = 0; i < ndim; ++i) header.shape[i] = shape[i];
  header.nbytes = nbytes;
  header.src_rank = src_rank;
  header.flags = flags;
  header.checksum = header_checksum(header);
  return header;
}

std::string validate_header(const WireHeader& header, uint64_t max_payload_bytes) {
  std::ostringstream msg;
  if (header.magic != kMagic) {
    msg << "bad header magic 0x" << std::hex << header.magic << " (expected 0x" << kMagic << ")";
    return msg.str();
  }
  if (header.version != kVersion || header.header_bytes != sizeof(WireHeader)) {
    msg << "header version " << header.version << " / size " << header.header_bytes
        << " does not match this build (version " << kVersion << ", size " << sizeof(WireHeader)
        << "); rebuild both sides from the same source";
    return msg.str();
  }
  if (header.checksum != header_checksum(header)) {
    msg << "header checksum mismatch (stored 0x" << std::hex << header.checksum << ", computed 0x"
        << header_checksum(header) << "): the header was corrupted";
    return msg.str();
  }
  if ((header.flags & ~kKnownFlags) != 0) {
    msg << "unknown header flags 0x" << std::hex << (header.flags & ~kKnownFlags)
        << "; rebuild both sides from the same source";
    return msg.str();
  }
  if ((header.flags & kFlagCudaIpc) && (header.flags & kFlagSingleCopy)) {
    msg << "header flags CUDA IPC and single copy exclude each other";
    return msg.str();
  }
  size_t itemsize = dtype_itemsize(header.dtype);
  if (itemsize == 0) {
    msg << "unknown dtype code " << header.dtype;
    return msg.str();
  }
  if (header.ndim < 0 || header.ndim > kMaxDims) {
    msg << "bad ndim " << header.ndim;
    return msg.str();
  }
  uint64_t numel = 1;
  for (int i = 0; i < header.ndim; ++i) {
    if (header.shape[i] < 0) {
      msg << "negative dimension " << header.shape[i];
      return msg.str();
    }
    numel *= static_cast<uint64_t>(header.shape[i]);
  }
  if (numel * itemsize != header.nbytes) {
    msg << "payload size " << header.nbytes << " B does not match shape and dtype ("
        << numel * itemsize << " B)";
    return msg.str();
  }
  if (header.nbytes > max_payload_bytes) {
    msg << "payload of " << header.nbytes << " B exceeds the slot size of " << max_payload_bytes
        << " B";
    return msg.str();
  }
  return std::string();
}

}  // namespace dpp_wire
