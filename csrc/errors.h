// A user-facing error raised from native code. py_errors.cpp maps it to the Python class
// activationscope.errors.CaptureError (an ActivationScopeError and a RuntimeError).
#pragma once

#include <cctype>
#include <stdexcept>
#include <string>

#include <c10/core/ScalarType.h>
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

// The torch name of a dtype, as a Python user writes it (torch.float32, not Float): every
// native message names dtypes so.
inline std::string dtype_name(c10::ScalarType t) {
  switch (t) {
    case c10::kFloat: return "torch.float32";
    case c10::kDouble: return "torch.float64";
    case c10::kHalf: return "torch.float16";
    case c10::kComplexHalf: return "torch.complex32";
    case c10::kComplexFloat: return "torch.complex64";
    case c10::kComplexDouble: return "torch.complex128";
    case c10::kChar: return "torch.int8";
    case c10::kShort: return "torch.int16";
    case c10::kInt: return "torch.int32";
    case c10::kLong: return "torch.int64";
    case c10::kByte: return "torch.uint8";
    default: {  // c10's name in Python's spelling: BFloat16 -> bfloat16, Float8_e4m3fn -> float8_e4m3fn, Bits8 -> bits8
      std::string name = c10::toString(t);
      for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
      return "torch." + name;
    }
  }
}

}  // namespace acs
