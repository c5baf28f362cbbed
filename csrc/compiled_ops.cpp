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
// `complex_leaves`: the positions in `leaves` of complex tensors the traced call passed as
// torch.view_as_real(x) (inductor cannot lower a mutating op given complex tensors: "auto_functionalized_v2
// was not removed"); they are viewed as complex again here, before anything is captured.
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

// `leaves` with those at `complex_leaves` (real (..., 2) views of complex tensors) viewed as
// complex again: the values the model computed, in their dtype. `leaves` itself when there is
// none (no copy of the list per call); else the list is made in `out`.
at::TensorList as_captured(at::TensorList leaves, at::IntArrayRef complex_leaves, std::vector<at::Tensor>& out) {
  if (complex_leaves.empty()) return leaves;
  out.assign(leaves.begin(), leaves.end());
  for (const int64_t i : complex_leaves) {
    TORCH_CHECK(i >= 0 && i < static_cast<int64_t>(out.size()), "activationscope call op: complex leaf ", i,
                " of ", out.size(), " leaves");
    at::Tensor r = out[static_cast<size_t>(i)];
    bool viewable = r.dim() >= 1 && r.size(-1) == 2 && r.stride(-1) == 1 && r.storage_offset() % 2 == 0;
    for (int64_t d = 0; viewable && d + 1 < r.dim(); ++d) viewable = r.stride(d) % 2 == 0;
    out[static_cast<size_t>(i)] = at::view_as_complex(viewable ? r : r.contiguous());
  }
  return out;
}

void call_begin(const at::Tensor& /*token*/, c10::string_view wrapper, at::TensorList leaves,
                const std::vector<std::string>& names, const std::optional<at::Tensor>& first,
                at::IntArrayRef complex_leaves) {
  const int64_t key = parse_key(wrapper);
  std::vector<at::Tensor> complex_again;
  const at::TensorList captured = as_captured(leaves, complex_leaves, complex_again);
  with_gil([&] {
    if (ForwardWrapper* w = ForwardWrapper::find(key)) w->op_begin(captured, names, first ? *first : at::Tensor());
  });
}

void call_end(const at::Tensor& /*token*/, c10::string_view wrapper, at::TensorList leaves,
              const std::vector<std::string>& names, at::IntArrayRef complex_leaves) {
  const int64_t key = parse_key(wrapper);
  std::vector<at::Tensor> complex_again;
  const at::TensorList captured = as_captured(leaves, complex_leaves, complex_again);
  with_gil([&] {
    if (ForwardWrapper* w = ForwardWrapper::find(key)) w->op_end(captured, names);
  });
}

void call_begin_meta(const at::Tensor&, c10::string_view, at::TensorList, const std::vector<std::string>&,
                     const std::optional<at::Tensor>&, at::IntArrayRef) {}
void call_end_meta(const at::Tensor&, c10::string_view, at::TensorList, const std::vector<std::string>&,
                   at::IntArrayRef) {}

}  // namespace

TORCH_LIBRARY(activationscope, m) {
  m.def("call_begin(Tensor(a!) token, str wrapper, Tensor[] leaves, str[] names, Tensor? first, "
        "int[] complex_leaves=[]) -> ()");
  m.def("call_end(Tensor(a!) token, str wrapper, Tensor[] leaves, str[] names, int[] complex_leaves=[]) -> ()");
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
