// RAII owners of UCX objects and the one way UCX failures become error text.
#pragma once

#include <ucp/api/ucp.h>

#include <cstddef>
#include <memory>
#include <string>

namespace rdma_tensor {

// "<call> failed: <UCX status text> (<peer>)" for a UCX call that returned `status`.
std::string ucx_failure(const char* call, ucs_status_t status, const std::string& object);

// The UCP context (ucp_init / ucp_cleanup). Shared: registered buffers and the worker need it alive,
// and received tensors may hold a registered buffer after the transport's context has closed.
class UcxContext {
 public:
  UcxContext();  // features: tag matching and worker wake-up (event fd)
  ~UcxContext();
  UcxContext(const UcxContext&) = delete;
  UcxContext& operator=(const UcxContext&) = delete;
  ucp_context_h get() const { return context_; }

 private:
  ucp_context_h context_ = nullptr;
};

// One page-aligned host buffer registered with UCX once (ucp_mem_map); unregistered and freed on
// destruction.
class RegisteredBuffer {
 public:
  RegisteredBuffer(std::shared_ptr<UcxContext> context, size_t capacity);
  ~RegisteredBuffer();
  RegisteredBuffer(const RegisteredBuffer&) = delete;
  RegisteredBuffer& operator=(const RegisteredBuffer&) = delete;
  char* data() const { return data_; }
  size_t capacity() const { return capacity_; }
  ucp_mem_h memh() const { return memh_; }

 private:
  std::shared_ptr<UcxContext> context_;
  char* data_ = nullptr;
  size_t capacity_ = 0;
  ucp_mem_h memh_ = nullptr;
};

// Text that UCX prints about an endpoint (its lanes and transports), via ucp_ep_print_info.
std::string endpoint_info(ucp_ep_h endpoint);

}  // namespace rdma_tensor
