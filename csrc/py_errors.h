// Native exceptions as Python errors: acs::UserError -> activationscope.errors.CaptureError,
// acs::StoreIOError -> activationscope.errors.StoreError (both ActivationScopeError and
// RuntimeError), everything else as torch and pybind11 translate it.
#pragma once

#include <torch/extension.h>

#include <exception>

namespace acs {

// Set the Python error for `p` when it is one of ours (UserError, StoreIOError); false, with
// no error set, when it is not.
bool set_acs_python_error(const std::exception_ptr& p);

// Set the Python error for any exception `p`: ours as above, py::error_already_set restored,
// pybind11's built-in exceptions as themselves, the rest as torch translates them (c10::Error
// -> RuntimeError / ValueError / ..., std::exception -> RuntimeError). For code that CPython
// calls directly (a type slot), where pybind11's dispatcher does not translate.
void set_python_error(const std::exception_ptr& p);

// Register set_acs_python_error with pybind11, for every bound function of the module.
void register_error_translators();

}  // namespace acs
