// The forward wrapper: the Python-facing side of the capture hot path.
//
// Why a forward wrapper rather than register_forward_hook: once any hook is registered on a
// module, nn.Module.__call__ leaves its fast path and pays tens of microseconds per call in
// Python. A native callable installed as the module's instance `forward` keeps that fast
// path; it calls the original forward and captures its inputs / outputs in C++, handing the
// tensors to the capture sinks (sink.h) without the GIL.
#pragma once

#include <torch/extension.h>

#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "sink.h"

namespace acs {

// Which root forwards a tracker captures (activationscope.capture.scope's policy codes).
enum class Policy : int { EVERY = 0, SAMPLE_N = 1, MAX_K = 2 };

// The policy of code `code`; TORCH_CHECK fails on a code outside the enum.
Policy policy_from_int(int code);

// State shared by every wrapped module of one tracker.
struct TrackerCore {
  bool active = true;
  Policy policy = Policy::EVERY;
  int64_t sample_every = 1;
  int64_t max_k = -1;
  at::Tensor token_mask;            // (batch, pos) bool, or undefined
  int64_t n_forwards = 0;           // root forwards started
  int depth = 0;                    // root forward nesting
  bool capturing = true;            // decision for the current root forward
  int64_t batch_size = -1;          // first dim of the first tensor captured in this forward
  py::object on_new_hook_point;     // (name: str, tensor) -> Sink | None
  py::object on_forward_start;      // () -> None, or None
  py::object on_forward_end;        // () -> None, or None
  std::unordered_map<std::string, std::shared_ptr<Sink>> sinks;  // nullptr = not captured

  bool decide(int64_t index) const {
    switch (policy) {
      case Policy::EVERY: return true;
      case Policy::SAMPLE_N: return index % sample_every == 0;
      case Policy::MAX_K: return index < max_k;
    }
    return true;
  }
};

// One tracked module of one tracker.
struct Site {
  std::shared_ptr<TrackerCore> core;
  std::string path;  // module path ("" for the root)
  bool capture_input = false;
  bool capture_output = true;
  bool is_root = false;
  int64_t n_calls = 0;        // calls outside any root forward (policy fallback)
  int64_t fwd_seen = -1;      // core->n_forwards at the last call
  int64_t calls_in_fwd = 0;   // for the #k suffix
  // Fast path of the common case (first call in a forward, one positional tensor input,
  // a tensor output): hook point names and sinks resolved once.
  bool in0_resolved = false, out_resolved = false;
  std::shared_ptr<Sink> in0_sink, out_sink;
};

class ForwardWrapper {
 public:
  explicit ForwardWrapper(py::object original) : original_(std::move(original)) {}

  void add_site(std::shared_ptr<Site> site) { sites_.push_back(std::move(site)); }
  bool remove_site(const std::shared_ptr<Site>& site) {
    for (auto it = sites_.begin(); it != sites_.end(); ++it) {
      if (*it == site) {
        sites_.erase(it);
        return true;
      }
    }
    return false;
  }
  size_t n_sites() const { return sites_.size(); }
  py::object original() const { return original_; }

  // The module call: original_(*args, **kwargs), capturing the tracked sites' inputs and
  // outputs around it.
  py::object call(py::args args, py::kwargs kwargs);

 private:
  static std::string join(const std::string& base, const char* what);
  static std::shared_ptr<Sink> resolve(TrackerCore& core, const std::string& name, const at::Tensor& t);
  py::object call_original(const py::args& args, const py::kwargs& kwargs) const;
  static void consume_one(TrackerCore& core, Sink& sink, const at::Tensor& t);
  static void consume_all(TrackerCore& core, const std::vector<std::pair<std::string, at::Tensor>>& leaves);

  py::object original_;
  std::vector<std::shared_ptr<Site>> sites_;
};

// tp_call slot of the ForwardWrapper Python type (installed by the bindings).
PyObject* forward_wrapper_tp_call(PyObject* self, PyObject* args, PyObject* kwargs);

}  // namespace acs
