// Python bindings of rdma_tensor._C. The typed, documented API is the rdma_tensor package.
// torch's pybind11 with its at::Tensor <-> torch.Tensor conversion (torch/extension.h would add
// the whole C++ frontend: 3x the compile time).
#include <torch/csrc/utils/pybind.h>
#include <ucp/api/ucp_version.h>

#include "../common/errors.h"
#include "../common/python_errors.h"
#include "../common/wire_header.h"
#include "context.h"

namespace py = pybind11;
using namespace rdma_tensor;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "rdma_tensor: tag-matched point-to-point tensor messages between nodes over UCX";
  register_transport_errors(m, "rdma_tensor._C");
  // The build self-check (tools/check_extensions.py, run by setup_env.sh after every build).
  m.def("raise_for_build_check", &raise_for_build_check, py::arg("error_class"));

  m.attr("HEADER_BYTES") = py::int_(sizeof(dpp_wire::WireHeader));
  m.def("ucx_version", [] {
    unsigned major = 0, minor = 0, release = 0;
    ucp_get_version(&major, &minor, &release);
    return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(release);
  });

  py::class_<ContextConfig>(m, "ContextConfig")
      .def(py::init<>())
      .def_readwrite("timeout_s", &ContextConfig::timeout_s)
      .def_readwrite("pool_cache_bytes", &ContextConfig::pool_cache_bytes)
      .def_readwrite("close_timeout_s", &ContextConfig::close_timeout_s)
      .def_readwrite("spin_us", &ContextConfig::spin_us);

  py::class_<Handle, std::shared_ptr<Handle>>(m, "Handle")
      .def("test", &Handle::test, py::call_guard<py::gil_scoped_release>())
      .def("wait", &Handle::wait, py::arg("timeout_s") = -1.0, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("is_send", &Handle::is_send)
      .def_property_readonly("peer", &Handle::peer)
      .def_property_readonly("tag", &Handle::tag);

  py::class_<Context, std::shared_ptr<Context>>(m, "Context")
      .def(py::init<int, std::string, ContextConfig>(), py::arg("rank"), py::arg("node_address"),
           py::arg("config"))
      .def_property_readonly("worker_address",
                             [](const Context& context) { return py::bytes(context.worker_address()); })
      .def("connect", &Context::connect, py::arg("peers"), py::call_guard<py::gil_scoped_release>())
      .def("isend", &Context::isend, py::arg("tensor"), py::arg("peer"), py::arg("tag"),
           py::call_guard<py::gil_scoped_release>())
      .def("irecv", &Context::irecv, py::arg("peer"), py::arg("tag"), py::call_guard<py::gil_scoped_release>())
      .def("wait_any", &Context::wait_any, py::arg("handles"), py::arg("timeout_s") = -1.0,
           py::call_guard<py::gil_scoped_release>())
      .def("test_any", &Context::test_any, py::arg("handles"), py::call_guard<py::gil_scoped_release>())
      .def("send_raw", &Context::send_raw, py::arg("bytes"), py::arg("peer"), py::arg("tag"))
      .def("endpoint_info", &Context::endpoint_info, py::arg("peer"), py::call_guard<py::gil_scoped_release>())
      .def("peer_description", &Context::peer_description, py::arg("peer"))
      .def("buffer_registrations", &Context::buffer_registrations)
      .def("close", &Context::close, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("rank", &Context::rank);
}
