// The transport error classes of a compiled module (shm_tensor._C, rdma_tensor._C) and the
// translation of the C++ errors (errors.h) into them. Same names and bases in every module, the
// hierarchy of megatron_dpp/comm/errors.py: TransportError (a RuntimeError), TransportTimeout (also
// a TimeoutError), PeerLostError, ProtocolError, MessageTooLargeError.
// Internal linkage on purpose: each extension keeps its own classes.
#pragma once

#include <pybind11/pybind11.h>

#include <stdexcept>
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
  // Module-local: pybind11 tries a module's own translators before the global list, which every
  // extension of the same pybind11 ABI shares (torch's and the other transport's included). With the
  // global list, the translator registered last answers for everyone's exceptions: shm_tensor's
  // ProtocolError came out as rdma_tensor._C.ProtocolError once both were imported (their errors.h
  // classes match by name), and our exceptions ran through foreign translators, built by another
  // compiler against another libstdc++.
  pybind11::register_local_exception_translator([](std::exception_ptr error) {
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

// The build self-check (tools/check_extensions.py): throws the errors.h class named `error_class`
// ("TransportError", "TransportTimeout", "PeerLost", "ProtocolError" or "MessageTooLarge") so
// that the check can see it arrive in Python as the matching class. A build whose error path
// crashes (e.g. compiled by a g++ newer than the libstdc++ the process loads) fails at install time
// instead of at the first real error.
void raise_for_build_check(const std::string& error_class) {
  std::string what = "raise_for_build_check(" + error_class + "): raised on purpose by the build self-check";
  if (error_class == "TransportError") throw dpp_errors::TransportError(what);
  if (error_class == "TransportTimeout") throw dpp_errors::TransportTimeout(what);
  if (error_class == "PeerLost") throw dpp_errors::PeerLost(what);
  if (error_class == "ProtocolError") throw dpp_errors::ProtocolError(what);
  if (error_class == "MessageTooLarge") throw dpp_errors::MessageTooLarge(what);
  throw std::invalid_argument("raise_for_build_check(" + error_class + "): not a class of errors.h");
}

}  // namespace
