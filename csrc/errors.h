// A user-facing error raised from native code. py_errors.cpp maps it to the Python class
// activationscope.errors.CaptureError (an ActivationScopeError and a RuntimeError).
#pragma once

#include <stdexcept>
#include <string>

#include <c10/util/ArrayRef.h>
#include <c10/util/StringUtil.h>

namespace acs {

class UserError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A store's bytes changed under a reader (activationscope.errors.StoreCorruptError).
class StoreCorruptNativeError : public UserError {
 public:
  using UserError::UserError;
};

// ACS_CHECK(cond, "hook point ", name, " must ..., got ", x): throws acs::UserError.
#define ACS_CHECK(cond, ...)                                   \
  do {                                                         \
    if (!(cond)) {                                             \
      throw ::acs::UserError(::c10::str(__VA_ARGS__));         \
    }                                                          \
  } while (0)

// A shape for error messages: "(2, 3)", "(4,)", "()".
inline std::string shape_str(c10::IntArrayRef s) {
  std::string out = "(";
  for (size_t i = 0; i < s.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(s[i]);
  }
  if (s.size() == 1) out += ",";
  return out + ")";
}

}  // namespace acs
