#include "ucx_objects.h"

#include <cstdio>
#include <cstdlib>
#include <new>
#include <stdexcept>

#include "../common/errors.h"

namespace rdma_tensor {

std::string ucx_failure(const char* call, ucs_status_t status, const std::string& object) {
  return std::string(call) + "(" + object + ") failed: " + ucs_status_string(status);
}

UcxContext::UcxContext() {
  ucp_config_t* config = nullptr;  // UCX_* environment variables (UCX_TLS, UCX_NET_DEVICES, ...)
  ucs_status_t status = ucp_config_read(nullptr, nullptr, &config);
  if (status != UCS_OK) throw dpp_errors::TransportError(ucx_failure("ucp_config_read", status, "UCX_*"));
  // Defaults of ours for UCX settings the user has not set (a UCX_* variable always wins):
  //   UCX_TCP_RX_SEG_SIZE=512k (UCX: 64k). Over TCP, with peer error handling (which needs memory
  //   invalidation that the tcp memory domain lacks, so no PUT-zcopy rendezvous lane), large
  //   messages travel as active-message fragments of at most RX_SEG_SIZE: 512 KiB fragments take
  //   8x fewer sends, receive calls and callbacks per byte than 64 KiB ones (measured with
  //   benchmarks/transport_bench.py --cross-namespace: about 2x the bandwidth at 1 MiB). It only
  //   sizes the tcp transport's receive buffers (2 x 512 KiB each, from a pool that grows on demand).
  // ucp_config_modify passes names it does not know on to every transport's table, unprefixed:
  // "RX_SEG_SIZE" is the tcp transport's field only (UCX 1.13), and it overrides the environment,
  // hence the check for the user's variable first.
  struct Default {
    const char* variable;  // the user's way to set it
    const char* name;      // the name ucp_config_modify takes
    const char* value;
  };
  for (const Default& setting : {Default{"UCX_TCP_RX_SEG_SIZE", "RX_SEG_SIZE", "512k"}}) {
    if (std::getenv(setting.variable) != nullptr) continue;
    status = ucp_config_modify(config, setting.name, setting.value);
    if (status != UCS_OK) {
      ucp_config_release(config);
      throw dpp_errors::TransportError(ucx_failure("ucp_config_modify", status, setting.variable));
    }
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
  params.features = UCP_FEATURE_TAG | UCP_FEATURE_WAKEUP;
  params.mt_workers_shared = 0;  // one worker, owned by one progress thread
  status = ucp_init(&params, config, &context_);
  ucp_config_release(config);
  if (status != UCS_OK) throw dpp_errors::TransportError(ucx_failure("ucp_init", status, "tag+wakeup"));
}

UcxContext::~UcxContext() {
  if (context_ != nullptr) ucp_cleanup(context_);
}

RegisteredBuffer::RegisteredBuffer(std::shared_ptr<UcxContext> context, size_t capacity)
    : context_(std::move(context)), capacity_(capacity) {
  data_ = static_cast<char*>(std::aligned_alloc(4096, capacity));
  if (data_ == nullptr) throw std::bad_alloc();
  ucp_mem_map_params_t params{};
  params.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
  params.address = data_;
  params.length = capacity;
  ucs_status_t status = ucp_mem_map(context_->get(), &params, &memh_);
  if (status != UCS_OK) {
    std::free(data_);
    throw dpp_errors::TransportError(
        ucx_failure("ucp_mem_map", status, std::to_string(capacity) + " B buffer"));
  }
}

RegisteredBuffer::~RegisteredBuffer() {
  if (memh_ != nullptr) ucp_mem_unmap(context_->get(), memh_);
  std::free(data_);
}

std::string endpoint_info(ucp_ep_h endpoint) {
  char* text = nullptr;
  size_t length = 0;
  FILE* stream = open_memstream(&text, &length);
  if (stream == nullptr) return "(open_memstream failed)";
  ucp_ep_print_info(endpoint, stream);
  std::fclose(stream);
  std::string result(text, length);
  std::free(text);
  return result;
}

}  // namespace rdma_tensor
