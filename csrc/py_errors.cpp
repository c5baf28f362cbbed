#include "py_errors.h"

#include <torch/csrc/Exceptions.h>

#include "errors.h"
#include "shard_writer.h"

namespace py = pybind11;

namespace acs {

namespace {

void set_error(const char* cls_name, const char* what) {
  py::object cls = py::module_::import("activationscope.errors").attr(cls_name);
  PyErr_SetString(cls.ptr(), what);
}

}  // namespace

bool set_acs_python_error(const std::exception_ptr& p) {
  if (!p) return false;
  try {
    std::rethrow_exception(p);
  } catch (const StoreIOError& e) {  // a UserError: caught first
    set_error("StoreError", e.what());
    return true;
  } catch (const StoreCorruptNativeError& e) {  // a UserError: caught first
    set_error("StoreCorruptError", e.what());
    return true;
  } catch (const UserError& e) {
    set_error("CaptureError", e.what());
    return true;
  } catch (...) {
    return false;
  }
}

void set_python_error(const std::exception_ptr& p) {
  if (set_acs_python_error(p)) return;
  try {
    std::rethrow_exception(p);
  } catch (py::error_already_set& e) {
    e.restore();
  } catch (const py::builtin_exception& e) {
    e.set_error();
  } catch (const std::exception&) {
    torch::translate_exception_to_python(p);
  } catch (...) {
    PyErr_SetString(PyExc_RuntimeError, "activationscope native core: unknown C++ exception");
  }
}

void register_error_translators() {
  py::register_exception_translator([](std::exception_ptr p) {
    if (!set_acs_python_error(p)) std::rethrow_exception(p);
  });
}

}  // namespace acs
