// The transport error classes of a compiled module (shm_tensor._C, rdma_tensor._C) and the
// translation of the C++ errors (errors.h) into them. Same names and bases in every module, the
// hierarchy of megatron_dpp/comm/errors.py: TransportError (a RuntimeError), TransportTimeout (also
// a TimeoutError), PeerLostError, ProtocolError, MessageTooLargeError.
// Internal linkage on purpose: each extension keeps its own classes.
#pragma once

#include <pybind11/pybind11.h>

#include <string>

#include "errors.h"

namespace {

struct TransportErrorTypes {
  PyObject* transport_error = nullptr;
  PyObject* timeout = nullptr;
  PyObject* peer_lost = nullptr;
  PyObject* protocol_error = nullptr;
  PyObject* too_large = nullptr;
};

TransportErrorTypes g_error_types;

PyObject* new_transport_exception(pybind11::module_& module, const std::string& module_name,
                                  const char* name, PyObject* bases) {
  std::string qualified = module_name + "." + name;
  PyObject* type = PyErr_NewException(qualified.c_str(), bases, nullptr);
  if (type == nullptr) throw pybind11::error_already_set();
  module.attr(name) = pybind11::handle(type);  // the module keeps a reference
  return type;
}

// Adds the classes to `module` (named `module_name`) and translates errors.h's exceptions into them.
void register_transport_errors(pybind11::module_& module, const std::string& module_name) {
  TransportErrorTypes& types = g_error_types;
  types.transport_error = new_transport_exception(module, module_name, "TransportError", PyExc_RuntimeError);
  pybind11::tuple timeout_bases =
      pybind11::make_tuple(pybind11::handle(types.transport_error), pybind11::handle(PyExc_TimeoutError));
  types.timeout = new_transport_exception(module, module_name, "TransportTimeout", timeout_bases.ptr());
  types.peer_lost = new_transport_exception(module, module_name, "PeerLostError", types.transport_error);
  types.protocol_error = new_transport_exception(module, module_name, "ProtocolError", types.transport_error);
  types.too_large = new_transport_exception(module, module_name, "MessageTooLargeError", types.transport_error);
  pybind11::register_exception_translator([](std::exception_ptr error) {
    try {
      if (error) std::rethrow_exception(error);
    } catch (const dpp_errors::TransportTimeout& e) {
      PyErr_SetString(g_error_types.timeout, e.what());
    } catch (const dpp_errors::PeerLost& e) {
      PyErr_SetString(g_error_types.peer_lost, e.what());
    } catch (const dpp_errors::ProtocolError& e) {
      PyErr_SetString(g_error_types.protocol_error, e.what());
    } catch (const dpp_errors::MessageTooLarge& e) {
      PyErr_SetString(g_error_types.too_large, e.what());
    } catch (const dpp_errors::TransportError& e) {
      PyErr_SetString(g_error_types.transport_error, e.what());
    }
  });
}

}  // namespace
