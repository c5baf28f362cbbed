// Telling a torch.Tensor object from any other Python object, safely.
#pragma once

#include <Python.h>
#include <torch/csrc/autograd/python_variable.h>

namespace acs {

// Whether `obj` is a torch.Tensor (or an instance of a subclass), by its type alone.
// THPVariable_Check falls back to isinstance(), which reads obj.__class__: an object whose
// __class__ claims torch.Tensor (a mock, a proxy) passed it, ran that property, and
// THPVariable_Unpack then read memory that holds no tensor (the process crashed).
inline bool is_tensor_object(PyObject* obj) {
  return THPVariableClass != nullptr &&
         (THPVariable_CheckExact(obj) || PyObject_TypeCheck(obj, reinterpret_cast<PyTypeObject*>(THPVariableClass)));
}

}  // namespace acs
