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
#include <thread>
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
  std::thread::id owner;            // the thread running the current root forward (depth > 0)
  bool capturing = true;            // decision for the current root forward
  int64_t batch_size = -1;          // first dim of the first tensor captured in this forward
  // rows="token": without a mask, (batch, pos) are the first two dims of the model's first
  // tensor input; auto_mask is that all-true (batch, pos) mask of the current forward.
  bool token_rows = false;
  at::Tensor auto_mask;
  // stop_after_last: end a captured forward once it has made as many captures as the first
  // whole captured forward and the last of them was that forward's last hook point.
  bool stop_after_last = false;
  int64_t n_consumed = 0;           // captures (sink calls) in this root forward
  std::shared_ptr<Sink> last_sink;  // the sink of the last of them
  int64_t stop_count = -1;          // captures of the first whole captured forward (-1: not learnt)
  std::shared_ptr<Sink> stop_sink;  // its last hook point
  bool stop_now = false;            // this forward has reached the stop point
  bool stopped = false;             // the last root forward was stopped there
  py::object on_new_hook_point;     // (name: str, tensor) -> Sink | None
  py::object on_forward_start;      // () -> None, or None
  py::object on_forward_end;        // () -> None, or None
  std::unordered_map<std::string, std::shared_ptr<Sink>> sinks;  // nullptr = not captured

  // The token mask of this forward: the user's (set_batch), else the rows="token" one.
  at::Tensor mask() const { return token_mask.defined() ? token_mask : auto_mask; }

  // One capture of `sink` in a root forward: counts towards the stop point.
  void note(const std::shared_ptr<Sink>& sink) {
    if (!stop_after_last || depth == 0) return;
    ++n_consumed;
    last_sink = sink;
    if (stop_count > 0 && n_consumed == stop_count && sink == stop_sink) stop_now = true;
  }

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

// The private exception type that ends a forward at its stop point (stop_after_last): raised
// by the wrapper whose capture completed the forward, caught by the root wrapper of the same
// tracker (its argument is the tracker core's address). A BaseException, so that model code's
// `except Exception:` does not swallow it. Bound as activationscope._C._StopForward.
PyObject* stop_forward_type();

class ForwardWrapper {
 public:
  // A site that captures the current call, and the name it captures under.
  struct Active {
    Site* site;
    std::string base;  // "<path>" or "<path>#k"
    int64_t k;
  };

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
  static bool stop_point(const std::vector<Active>& active, const std::vector<Site*>& roots);
  static void consume_one(TrackerCore& core, const std::shared_ptr<Sink>& sink, const at::Tensor& t);
  static void consume_all(TrackerCore& core, const std::vector<std::pair<std::string, at::Tensor>>& leaves);

  py::object original_;
  std::vector<std::shared_ptr<Site>> sites_;
};

// tp_call slot of the ForwardWrapper Python type (installed by the bindings).
PyObject* forward_wrapper_tp_call(PyObject* self, PyObject* args, PyObject* kwargs);

}  // namespace acs
