// The wire header that precedes every tensor message, shared by every transport (shm_tensor, the
// torch.distributed transport through shm_tensor._C.encode_header/decode_header, later rdma_tensor).
// Fixed size, little-endian, no pointers: it is copied byte for byte into shared memory or a socket.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace dpp_wire {

constexpr uint32_t kMagic = 0x54505044;  // "DPPT" read as little-endian bytes
constexpr uint16_t kVersion = 1;
constexpr int kMaxDims = 8;
// flags: the tensor lives in device memory; what follows the header is a shm_tensor CUDA IPC
// descriptor (csrc/shm_tensor/cuda_ipc.h) naming the device slot, not the payload bytes.
constexpr uint32_t kFlagCudaIpc = 1u << 0;
// flags: the payload stays in the sender's memory; what follows the header is a shm_tensor
// single-copy descriptor (csrc/shm_tensor/single_copy.h: address and byte count) from which the
// receiver pulls the payload with process_vm_readv.
constexpr uint32_t kFlagSingleCopy = 1u << 1;
constexpr uint32_t kKnownFlags = kFlagCudaIpc | kFlagSingleCopy;

// Stable dtype codes: independent of torch's ScalarType numbering so the wire format survives a
// torch upgrade on one side of a cross-node link.
enum class DType : int32_t {
  kBool = 1,
  kUInt8 = 2,
  kInt8 = 3,
  kInt16 = 4,
  kInt32 = 5,
  kInt64 = 6,
  kUInt16 = 7,
  kUInt32 = 8,
  kUInt64 = 9,
  kFloat16 = 10,
  kBFloat16 = 11,
  kFloat32 = 12,
  kFloat64 = 13,
  kComplex32 = 14,
  kComplex64 = 15,
  kComplex128 = 16,
  kFloat8E4M3FN = 17,
  kFloat8E5M2 = 18,
  kFloat8E4M3FNUZ = 19,
  kFloat8E5M2FNUZ = 20,
};

struct WireHeader {
  uint32_t magic;
  uint16_t version;
  uint16_t header_bytes;  // sizeof(WireHeader) of the writer; a mismatch is a version error
  int64_t tag;
  int32_t dtype;  // a DType code
  int32_t ndim;
  int64_t shape[kMaxDims];
  uint64_t nbytes;  // payload bytes that follow the header
  int32_t src_rank;
  uint32_t flags;  // kFlag* bits; zero for a plain host payload
  uint64_t reserved_for_extensions[2];  // zero; pads the header to 128 B (two cache lines)
  uint64_t checksum;  // FNV-1a 64 over all bytes before this field
};
static_assert(sizeof(WireHeader) == 128, "wire header layout changed");

// Bytes per element of a DType code; 0 for an unknown code.
size_t dtype_itemsize(int32_t code);
const char* dtype_name(int32_t code);

uint64_t header_checksum(const WireHeader& header);

// A complete, checksummed header. Throws std::invalid_argument for ndim > kMaxDims.
WireHeader make_header(int64_t tag, int32_t dtype, const int64_t* shape, int ndim, uint64_t nbytes,
                       int32_t src_rank, uint32_t flags = 0);

// Empty string when the header is valid and its payload fits in max_payload_bytes, otherwise one
// sentence saying what is wrong (bad magic, version, checksum, dtype, shape/nbytes mismatch, size).
std::string validate_header(const WireHeader& header, uint64_t max_payload_bytes);

}  // namespace dpp_wire
