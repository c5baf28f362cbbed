// The custom ops of the in-graph capture path (torch.compile): activationscope::call_begin
// and activationscope::call_end, registered with the dispatcher when the extension loads.
//
// A compiled model calls them around each tracked module's original forward (the traced
// __call__ of capture/compiled.py); they run ForwardWrapper::op_begin / op_end, the same
// bookkeeping and captures as the eager wrapper. Each takes `token`, a one-element tensor
// declared mutated (Tensor(a!)) though never written: the compiler then keeps every call
// and their order (a graph cannot drop or reorder writes to one tensor). The implementations
// are registered for every backend (CompositeExplicitAutograd), with a no-op Meta kernel and
// a fake implementation (capture/compiled.py) for tracing: on fake tensors nothing is
// captured. `wrapper` is the key of the ForwardWrapper (a string, so that the compiler
// keeps it a constant); a wrapper that is gone (its tracker detached) makes them no-ops.
#include <torch/extension.h>
#include <torch/library.h>

#include <charconv>
#include <string_view>

#include "forward_wrapper.h"
#include "py_errors.h"

namespace acs {

namespace {

// A `str` argument of an op arrives as c10::string_view: std::string_view itself in torch 2.11
// and 2.13, a class of c10's own in older torch (2.4), whose op registration takes no other.
int64_t parse_key(c10::string_view key) {
  int64_t out = 0;
  auto [end, ec] = std::from_chars(key.data(), key.data() + key.size(), out);
  TORCH_CHECK(ec == std::errc() && end == key.data() + key.size(),
              "activationscope call op: wrapper key must be an integer string, got '", std::string(key), "'");
  return out;
}

// Run `fn` with the GIL; errors of ours (CaptureError, ...) and Python errors of the
// callbacks reach the caller as those Python exceptions.
template <typename F>
void with_gil(F&& fn) {
  py::gil_scoped_acquire gil;
  try {
    fn();
  } catch (py::error_already_set&) {
    throw;
  } catch (...) {
    set_python_error(std::current_exception());
    throw py::error_already_set();
  }
}

void call_begin(const at::Tensor& /*token*/, c10::string_view wrapper, at::TensorList leaves,
                const std::vector<std::string>& names, const std::optional<at::Tensor>& first) {
  const int64_t key = parse_key(wrapper);
  with_gil([&] {
    if (ForwardWrapper* w = ForwardWrapper::find(key)) w->op_begin(leaves, names, first ? *first : at::Tensor());
  });
}

void call_end(const at::Tensor& /*token*/, c10::string_view wrapper, at::TensorList leaves,
              const std::vector<std::string>& names) {
  const int64_t key = parse_key(wrapper);
  with_gil([&] {
    if (ForwardWrapper* w = ForwardWrapper::find(key)) w->op_end(leaves, names);
  });
}

void call_begin_meta(const at::Tensor&, c10::string_view, at::TensorList, const std::vector<std::string>&,
                     const std::optional<at::Tensor>&) {}
void call_end_meta(const at::Tensor&, c10::string_view, at::TensorList, const std::vector<std::string>&) {}

}  // namespace

TORCH_LIBRARY(activationscope, m) {
  m.def("call_begin(Tensor(a!) token, str wrapper, Tensor[] leaves, str[] names, Tensor? first) -> ()");
  m.def("call_end(Tensor(a!) token, str wrapper, Tensor[] leaves, str[] names) -> ()");
}

TORCH_LIBRARY_IMPL(activationscope, CompositeExplicitAutograd, m) {
  m.impl("call_begin", &call_begin);
  m.impl("call_end", &call_end);
}

TORCH_LIBRARY_IMPL(activationscope, Meta, m) {
  m.impl("call_begin", &call_begin_meta);
  m.impl("call_end", &call_end_meta);
}

}  // namespace acs
