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
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "sink.h"

namespace acs {

// Which root forwards a tracker captures (activationscope.capture.scope's policy codes).
enum class Policy : int { EVERY = 0, SAMPLE_N = 1, MAX_K = 2 };

// The policy of code `code`; TORCH_CHECK fails on a code outside the enum.
Policy policy_from_int(int code);

// Types of objects met in a tracker's modules' inputs / outputs that the walk does not enter
// (not a tensor, tuple, list, dict or dataclass) -> times checked for tensors they hold
// (-1: warned about, or never to check again). An entry keeps a weak reference to its type and
// applies only while that reference still leads to it: Python clears a weak reference before
// it frees the object, so a class freed and another allocated at its address never inherits
// its verdict (the stale entry is dropped when met). At most kCap entries: when full, the
// entries of types since freed are dropped; a type met while kCap live types are cached is
// checked each time it is met (its verdict is not kept). Used with the GIL held; the destructor
// takes the GIL to release the references, and leaves them to an interpreter that is ending.
class UnwalkedTypes {
 public:
  static constexpr size_t kCap = 256;

  UnwalkedTypes() = default;
  UnwalkedTypes(const UnwalkedTypes&) = delete;
  UnwalkedTypes& operator=(const UnwalkedTypes&) = delete;
  ~UnwalkedTypes();

  // The checks recorded for `type` (0: none, or not cached). `type` must be alive.
  int checks(PyTypeObject* type);
  // Records `n` checks for `type` (not kept when the cache is full of live types). `type`
  // must be alive.
  void set(PyTypeObject* type, int n);
  // Entries held (live or not yet dropped).
  size_t size() const { return entries_.size(); }

 private:
  struct Entry {
    PyObject* ref;  // a weak reference to the type (owned)
    int checks;
  };
  static bool alive(const Entry& e, PyTypeObject* type);
  void drop_dead();
  std::unordered_map<PyTypeObject*, Entry> entries_;
};

// State shared by every wrapped module of one tracker.
struct TrackerCore {
  bool active = true;
  // The tracker is being closed (its `with` block ends, remove()): a call that starts now
  // outside an open root forward is not captured (as after the close); a root forward
  // already open goes on capturing until it ends.
  bool closing = false;
  // Calls of this tracker's modules in progress (all threads; changed with the GIL held): the
  // close waits for those of other threads (calls_elsewhere()) before it removes the wrappers.
  int64_t in_flight = 0;
  Policy policy = Policy::EVERY;
  int64_t sample_every = 1;
  int64_t max_k = -1;
  at::Tensor token_mask;            // (batch, pos) bool, or undefined
  int64_t n_forwards = 0;           // root forwards started
  int depth = 0;                    // root forward nesting
  int op_depth = 0;                 // of which opened by the in-graph path (call_begin ops)
  bool in_graph = false;            // resolving hook points of a capture inside a compiled graph
  std::thread::id owner;            // the thread running the current root forward (depth > 0)
  bool capturing = true;            // decision for the current root forward
  int64_t batch_size = -1;          // first dim of the model's first tensor input in this forward
  int64_t second_dim = -1;          // its second dim (the batch of a sequence-first input), or -1
  // rows="token": without a mask, (batch, pos) are the first two dims of the model's first
  // tensor input; auto_mask is that all-true (batch, pos) mask of the current forward.
  bool token_rows = false;
  at::Tensor auto_mask;
  // stop_after_last: end a captured forward once it has made as many captures as the first
  // whole captured forward and the last of them was that forward's last hook point.
  bool stop_after_last = false;
  bool roots_only = false;          // capture only inside root forwards (a store: rows follow its row table)
  int64_t outside_calls = 0;        // calls of tracked modules outside a root forward left out (roots_only)
  int64_t outside_keys = 0;         // outermost calls of tracked modules on their own (in memory), numbered
  // Types of objects met in tracked modules' inputs / outputs that the walk does not enter,
  // with the checks made of them (UnwalkedTypes). Touched with the GIL held.
  UnwalkedTypes unwalked_types;
  int64_t n_consumed = 0;           // captures (sink calls) in this root forward
  std::shared_ptr<Sink> last_sink;  // the sink of the last of them
  int64_t stop_count = -1;          // captures of the first whole captured forward (-1: not learnt)
  std::shared_ptr<Sink> stop_sink;  // its last hook point
  bool stop_now = false;            // this forward has reached the stop point
  bool stopped = false;             // the last root forward was stopped there
  // ... or reached it but went on, because another tracker was still capturing that forward
  bool past_stop = false;
  py::object on_new_hook_point;     // (name: str, tensor) -> Sink | None
  py::object on_forward_start;      // () -> None, or None
  py::object on_forward_end;        // () -> None, or None
  std::unordered_map<std::string, std::shared_ptr<Sink>> sinks;  // nullptr = not captured
  // alias hook point -> (its calls, its target's calls) at the last alias_mismatch() check
  std::unordered_map<std::string, std::pair<int64_t, int64_t>> alias_rows;
  // Every sink's calls against its aliases' (see AliasTally): alias_mismatch() scans the sinks
  // only when it moved since the last check, or a sink was added since.
  std::shared_ptr<AliasTally> alias_tally = std::make_shared<AliasTally>();
  uint64_t alias_checked = 0;      // the tally at the last scan
  bool alias_scan_needed = false;  // a sink was added since the last scan

  // The token mask of this forward: the user's (set_batch), else the rows="token" one. A
  // set_batch without attention_mask leaves token_mask an empty 1-D tensor (what Python's
  // torch.Tensor() binds to), never a (batch, pos) mask: that is "no mask", not a mask of
  // no positions.
  at::Tensor mask() const { return token_mask.defined() && token_mask.dim() == 2 ? token_mask : auto_mask; }

  // Whether a call starting now is captured by this tracker: attached, and not being closed
  // unless a root forward is open (its own calls go on).
  bool live() const { return active && !(closing && depth == 0); }
  // in_flight less the calls of this thread (call with the GIL held).
  int64_t calls_elsewhere() const;

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
  // core->n_forwards at the last call, or -k in the k-th outermost call on its own (in memory)
  int64_t fwd_seen = 0;
  int64_t calls_in_fwd = 0;   // calls in that forward or call, for the #k suffix
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
    std::shared_ptr<Site> site;  // (owned: the tracker may be closed from another thread meanwhile)
    std::string base;  // "<path>" or "<path>#k"
    int64_t k;
    // a call outside any root forward (its own capture, in memory): it never counts as a
    // capture of a root forward that another thread starts while it runs
    bool outside;
  };

  explicit ForwardWrapper(py::object original);
  ~ForwardWrapper();
  ForwardWrapper(const ForwardWrapper&) = delete;
  ForwardWrapper& operator=(const ForwardWrapper&) = delete;

  void add_site(std::shared_ptr<Site> site) {
    sites_.push_back(std::move(site));
    needs_eager_ = std::get<3>(plan());
  }
  bool remove_site(const std::shared_ptr<Site>& site) {
    for (auto it = sites_.begin(); it != sites_.end(); ++it) {
      if (*it == site) {
        sites_.erase(it);
        needs_eager_ = std::get<3>(plan());
        return true;
      }
    }
    return false;
  }
  // The CaptureWarning of a wrapper that cannot capture inside a compiled graph, once.
  void warn_eager_once();
  size_t n_sites() const { return sites_.size(); }
  py::object original() const { return original_; }
  // The names of the wrapped forward's parameters that a keyword can fill, in their order:
  // the order in which a root forward's keyword arguments are searched for its first tensor
  // input (the batch). Empty: the order they are passed in.
  void set_kw_order(std::vector<std::string> names) { kw_order_ = std::move(names); }
  const std::vector<std::string>& kw_order() const { return kw_order_; }

  // The module call: original_(*args, **kwargs), capturing the tracked sites' inputs and
  // outputs around it.
  py::object call(py::args args, py::kwargs kwargs);

  // --- The in-graph path (torch.compile; compiled_ops.cpp, capture/compiled.py) ---------
  // Under TorchDynamo the wrapper's Python-level __call__ is traced instead of call(): it
  // calls the original forward in the graph, between two custom ops that run the same
  // bookkeeping and captures as call() does, at run time:
  //   call_begin: root forward start, which sites capture this call (and #k), inputs;
  //   call_end: outputs, root forward end.
  // Leaves are the flattened inputs / outputs, named by their suffix ("input.0",
  // "input.kw.mask", "output", "output.0.last_hidden_state"), as call() names them.
  int64_t key() const { return key_; }
  // (any site captures inputs, any captures outputs, any is a root, any needs the eager path)
  std::tuple<bool, bool, bool, bool> plan() const;
  std::vector<std::string> paths() const;
  void op_begin(at::TensorList leaves, const std::vector<std::string>& names, const at::Tensor& first);
  void op_end(at::TensorList leaves, const std::vector<std::string>& names);
  // The wrapper of key `key` (nullptr once it is gone). Call with the GIL held; the pointer
  // stays valid while the GIL is held.
  static ForwardWrapper* find(int64_t key);

 private:
  // One call_begin not yet matched by its call_end.
  struct OpFrame {
    bool skip = false;
    std::vector<std::pair<std::shared_ptr<Site>, std::string>> active;  // site, name base
    std::vector<std::shared_ptr<TrackerCore>> roots;  // trackers rooted here (depth raised)
  };
  void check_one_thread() const;
  // `opened`: an OutsideCalls (forward_wrapper.cpp) that ends the outside call this one opens.
  static bool take_call(Site& s, const std::vector<std::shared_ptr<Site>>& sites, std::string* base, int64_t* k,
                        bool* outside, void* opened);
  static bool in_other_forward(const TrackerCore& c, const std::vector<std::shared_ptr<Site>>& sites);
  static void start_forward(TrackerCore& c, const at::Tensor& first);
  static void capture_named(TrackerCore& core, const std::string& base, at::TensorList leaves,
                            const std::vector<std::string>& names);

  static std::string join(const std::string& base, const char* what);
  static std::shared_ptr<Sink> resolve(TrackerCore& core, const std::string& name, const at::Tensor& t);
  py::object call_original(const py::args& args, const py::kwargs& kwargs) const;
  static bool stop_point(const std::vector<Active>& active, const std::vector<std::shared_ptr<Site>>& roots);
  static void consume_one(TrackerCore& core, const std::shared_ptr<Sink>& sink, const at::Tensor& t, bool outside);
  static void consume_all(TrackerCore& core, const std::vector<std::pair<std::string, at::Tensor>>& leaves,
                          bool outside);

  py::object original_;
  std::vector<std::string> kw_order_;
  std::vector<std::shared_ptr<Site>> sites_;
  int64_t key_ = 0;
  // the in-graph calls open on each thread, innermost last (two models sharing this module,
  // compiled and run in two threads, can both be inside it at once)
  std::unordered_map<std::thread::id, std::vector<OpFrame>> op_frames_;
  bool needs_eager_ = false;  // plan()'s last field
  bool warned_eager_ = false;
};

// Call a Python callback of the capture (bookkeeping, not model code) with TorchDynamo's
// frame hook off: callbacks run from inside a compiled model's graph (the custom ops) and
// from the eager wrapper of a model compiled around it, and dynamo must not trace them.
py::object call_outside_dynamo(const py::object& fn, const py::tuple& args);

// tp_call slot of the ForwardWrapper Python type (installed by the bindings).
PyObject* forward_wrapper_tp_call(PyObject* self, PyObject* args, PyObject* kwargs);

}  // namespace acs
