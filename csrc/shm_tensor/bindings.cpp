// Python bindings of shm_tensor._C. The typed, documented API is the shm_tensor package.
// torch's pybind11 with its at::Tensor <-> torch.Tensor conversion (torch/extension.h would add
// the whole C++ frontend: 3x the compile time).
#include <torch/csrc/utils/pybind.h>

#include "../common/dtype_codes.h"
#include "../common/errors.h"
#include "../common/python_errors.h"
#include "../common/wire_header.h"
#include "context.h"
#include "cuda_runtime.h"

#include <ATen/ops/empty.h>


namespace py = pybind11;
using namespace shm_tensor;

namespace {

py::bytes encode_header(const at::Tensor& tensor, int64_t tag, int32_t src_rank, uint32_t flags) {
  std::vector<int64_t> shape(tensor.sizes().begin(), tensor.sizes().end());
  uint64_t nbytes = static_cast<uint64_t>(tensor.numel()) * tensor.element_size();
  dpp_wire::WireHeader header = dpp_wire::make_header(
      tag, dpp_wire::wire_dtype_of(tensor.scalar_type()), shape.data(), static_cast<int>(shape.size()), nbytes,
      src_rank, flags);
  return py::bytes(reinterpret_cast<const char*>(&header), sizeof(header));
}

// (tag, src_rank, an uninitialised tensor of the header's dtype and shape); raises ProtocolError.
py::tuple decode_header(const std::string& bytes, uint64_t max_payload_bytes, int peer) {
  if (bytes.size() != sizeof(dpp_wire::WireHeader)) {
    throw dpp_errors::ProtocolError("decode_header(peer=" + std::to_string(peer) + "): got " +
                                    std::to_string(bytes.size()) + " bytes, a header has " +
                                    std::to_string(sizeof(dpp_wire::WireHeader)));
  }
  dpp_wire::WireHeader header;
  std::memcpy(&header, bytes.data(), sizeof(header));
  std::string problem = dpp_wire::validate_header(header, max_payload_bytes);
  if (!problem.empty()) {
    throw dpp_errors::ProtocolError(dpp_errors::describe("decode_header", peer, header.tag, problem));
  }
  std::vector<int64_t> shape(header.shape, header.shape + header.ndim);
  at::Tensor tensor = at::empty(shape, at::TensorOptions().dtype(dpp_wire::scalar_type_of(header.dtype)));
  return py::make_tuple(header.tag, header.src_rank, tensor);
}

// The flags field of a header (checked like decode_header first).
uint32_t header_flags(const std::string& bytes, int peer) {
  if (bytes.size() != sizeof(dpp_wire::WireHeader)) {
    throw dpp_errors::ProtocolError("header_flags(peer=" + std::to_string(peer) + "): got " +
                                    std::to_string(bytes.size()) + " bytes, a header has " +
                                    std::to_string(sizeof(dpp_wire::WireHeader)));
  }
  dpp_wire::WireHeader header;
  std::memcpy(&header, bytes.data(), sizeof(header));
  std::string problem = dpp_wire::validate_header(header, UINT64_MAX);
  if (!problem.empty()) {
    throw dpp_errors::ProtocolError(dpp_errors::describe("header_flags", peer, header.tag, problem));
  }
  return header.flags;
}

// "" when libcudart loads, otherwise what was tried and why each attempt failed.
std::string cuda_runtime_error() {
  std::string why;
  return cuda::runtime(&why) != nullptr ? std::string() : why;
}

std::string cuda_runtime_library() {
  const cuda::Runtime* loaded = cuda::runtime();
  return loaded != nullptr ? loaded->library : std::string();
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "shm_tensor: tag-matched point-to-point tensor messages over POSIX shared memory";

  register_transport_errors(m, "shm_tensor._C");
  // The build self-check (tools/check_extensions.py, run by setup_env.sh after every build).
  m.def("raise_for_build_check", &raise_for_build_check, py::arg("error_class"));

  m.attr("HEADER_BYTES") = py::int_(sizeof(dpp_wire::WireHeader));
  m.attr("FLAG_CUDA_IPC") = py::int_(dpp_wire::kFlagCudaIpc);
  m.attr("FLAG_SINGLE_COPY") = py::int_(dpp_wire::kFlagSingleCopy);
  m.def("encode_header", &encode_header, py::arg("tensor"), py::arg("tag"), py::arg("src_rank"),
        py::arg("flags") = 0u);
  m.def("header_flags", &header_flags, py::arg("header"), py::arg("peer"));
  m.def("add_cuda_runtime_candidates", &cuda::add_runtime_candidates, py::arg("paths"));
  m.def("cuda_runtime_error", &cuda_runtime_error, py::call_guard<py::gil_scoped_release>());
  m.def("cuda_runtime_library", &cuda_runtime_library, py::call_guard<py::gil_scoped_release>());
  m.def("decode_header", &decode_header, py::arg("header"), py::arg("max_payload_bytes"),
        py::arg("peer"));

  py::class_<ContextConfig>(m, "ContextConfig")
      .def(py::init<>())
      .def_readwrite("num_slots", &ContextConfig::num_slots)
      .def_readwrite("slot_bytes", &ContextConfig::slot_bytes)
      .def_readwrite("copy_threads", &ContextConfig::copy_threads)
      .def_readwrite("bytes_per_thread", &ContextConfig::bytes_per_thread)
      .def_readwrite("timeout_s", &ContextConfig::timeout_s)
      .def_readwrite("recv_cache_bytes", &ContextConfig::recv_cache_bytes)
      .def_readwrite("spin_us", &ContextConfig::spin_us)
      .def_readwrite("single_copy", &ContextConfig::single_copy)
      .def_readwrite("single_copy_min_bytes", &ContextConfig::single_copy_min_bytes)
      .def_readwrite("zero_copy_receive", &ContextConfig::zero_copy_receive)
      .def_readwrite("zero_copy_min_bytes", &ContextConfig::zero_copy_min_bytes)
      .def_readwrite("batch_while_sleeping", &ContextConfig::batch_while_sleeping)
      .def_readwrite("host_tensors_by_cuda_ipc", &ContextConfig::host_tensors_by_cuda_ipc);

  py::class_<Handle, std::shared_ptr<Handle>>(m, "Handle")
      .def("test", &Handle::test, py::arg("cuda_device") = -1, py::arg("cuda_stream") = 0,
           py::call_guard<py::gil_scoped_release>())
      .def("wait", &Handle::wait, py::arg("timeout_s") = -1.0, py::arg("cuda_device") = -1,
           py::arg("cuda_stream") = 0, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("is_send", &Handle::is_send)
      .def_property_readonly("peer", &Handle::peer)
      .def_property_readonly("tag", &Handle::tag);

  py::class_<Context, std::shared_ptr<Context>>(m, "Context")
      .def(py::init<int, std::vector<int>, std::string, ContextConfig>(), py::arg("rank"),
           py::arg("peers"), py::arg("job_name"), py::arg("config"))
      .def("connect", &Context::connect, py::call_guard<py::gil_scoped_release>())
      .def("unlink", &Context::unlink)
      .def("isend", &Context::isend, py::arg("tensor"), py::arg("peer"), py::arg("tag"),
           py::arg("cuda_stream") = 0, py::call_guard<py::gil_scoped_release>())
      .def("irecv", &Context::irecv, py::arg("peer"), py::arg("tag"),
           py::call_guard<py::gil_scoped_release>())
      .def("wait_any", &Context::wait_any, py::arg("handles"), py::arg("timeout_s") = -1.0,
           py::arg("cuda_device") = -1, py::arg("cuda_stream") = 0,
           py::call_guard<py::gil_scoped_release>())
      .def("test_any", &Context::test_any, py::arg("handles"), py::arg("cuda_device") = -1,
           py::arg("cuda_stream") = 0, py::call_guard<py::gil_scoped_release>())
      .def("send_raw_header", &Context::send_raw_header, py::arg("header"), py::arg("peer"),
           py::arg("body") = py::bytes())
      .def("close", &Context::close, py::call_guard<py::gil_scoped_release>())
      .def("inbox_name", &Context::inbox_name)
      .def("single_copy_peers", &Context::single_copy_peers, py::call_guard<py::gil_scoped_release>())
      .def("single_copy_fallbacks", &Context::single_copy_fallbacks,
           py::call_guard<py::gil_scoped_release>())
      .def("message_counts",
           [](Context& context) {
             MessageCounts counts = context.message_counts();
             py::dict result;
             result["sent_single_copy"] = counts.sent_single_copy;
             result["sent_two_copy"] = counts.sent_two_copy;
             result["received_single_copy"] = counts.received_single_copy;
             result["received_two_copy"] = counts.received_two_copy;
             result["received_zero_copy"] = counts.received_zero_copy;
             result["sent_device_direct"] = counts.sent_device_direct;
             result["sent_device_staged"] = counts.sent_device_staged;
             result["received_device_direct"] = counts.received_device_direct;
             result["received_device_staged"] = counts.received_device_staged;
             return result;
           })
      .def("post_stats",
           [](Context& context) {
             PostStats stats = context.post_stats();
             py::dict result;
             result["sends_posted"] = stats.sends_posted;
             result["written_at_post"] = stats.written_at_post;
             result["queued_at_post"] = stats.queued_at_post;
             result["bytes_copied_at_post"] = stats.bytes_copied_at_post;
             result["wakes_at_post"] = stats.wakes_at_post;
             result["post_ns"] = stats.post_ns;
             result["max_post_ns"] = stats.max_post_ns;
             result["wake_ns"] = stats.wake_ns;
             result["sleeps"] = stats.sleeps;
             result["sleeps_as_batch"] = stats.sleeps_as_batch;
             return result;
           })
      .def("batch_sleep_fallback", &Context::batch_sleep_fallback)
      .def_property_readonly("rank", &Context::rank);
}
