// The forward wrapper (forward_wrapper.h): flattening a module call's inputs / outputs into
// named tensors, the per-forward policy, and the hand-off to the capture sinks.
#include "forward_wrapper.h"

#include <cxxabi.h>

#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/python_variable.h>
#include <c10/util/SmallVector.h>

#include <algorithm>
#include <mutex>

#include "errors.h"
#include "gil.h"
#include "py_tensor.h"
#include "py_errors.h"

namespace acs {

Policy policy_from_int(int code) {
  TORCH_CHECK(code >= 0 && code <= 2, "capture policy code must be 0 (EVERY), 1 (SAMPLE_N) or 2 (MAX_K), got ",
              code);
  return static_cast<Policy>(code);
}

namespace {

using Leaves = std::vector<std::pair<std::string, at::Tensor>>;

// Containers nested deeper than this in a module's inputs / outputs are not walked (a list
// that holds itself would never end): the capture warns, naming the path (capture/compiled.py's
// _MAX_DEPTH, the same rule in a compiled graph).
constexpr int kMaxDepth = 32;

// Times an object type the walk does not enter is checked for tensors it holds before it is
// taken for one that holds none (a type that does is warned about once per tracker).
constexpr int kUnwalkedChecks = 8;

bool is_container(py::handle obj) {
  if (PyTuple_Check(obj.ptr()) || PyList_Check(obj.ptr())) return PySequence_Size(obj.ptr()) > 0;
  if (PyDict_Check(obj.ptr())) return PyDict_Size(obj.ptr()) > 0;
  return py::hasattr(reinterpret_cast<PyObject*>(Py_TYPE(obj.ptr())), "__dataclass_fields__");
}

// The name a key of a structured output (a dict key, a named tuple's or a dataclass's field)
// gives the hook points below it: its str(), which must be UTF-8 text; a str holding a lone
// surrogate (os.fsdecode of an undecodable byte) is refused naming the key and where it is.
std::string key_name(py::handle key, const std::string& prefix) {
  py::str text(key);
  Py_ssize_t n = 0;
  const char* data = PyUnicode_AsUTF8AndSize(text.ptr(), &n);
  if (data != nullptr) return std::string(data, static_cast<size_t>(n));
  PyErr_Clear();
  py::object shown = py::reinterpret_steal<py::object>(PyObject_ASCII(text.ptr()));
  if (!shown) throw py::error_already_set();
  throw UserError(c10::str("the key ", shown.cast<std::string>(), " below hook point '", prefix,
                           "' is not UTF-8 text (it holds a lone surrogate), so no hook point can be named after it; "
                           "rename the key, or leave its module out with track(exclude=...)"));
}

// Flatten a module input / output into named tensor leaves: tensors, tuples / lists
// (named tuples by field), dicts (HF ModelOutput included, by key) and dataclasses (by
// field). None and other objects are skipped. A container kMaxDepth levels down is not
// walked; with `warn`, a CaptureWarning names it (its tensors are not captured). With
// `unwalked`, another object that holds tensors (an HF Cache, a torch.distributions object)
// is named in a CaptureWarning too, once per type (compiled.warn_unwalked).
void collect(py::handle obj, const std::string& prefix, Leaves& out, int depth, bool warn = true,
             UnwalkedTypes* unwalked = nullptr) {
  if (is_tensor_object(obj.ptr())) {
    out.emplace_back(prefix, THPVariable_Unpack(obj.ptr()));
    return;
  }
  if (obj.is_none()) return;
  if (depth >= kMaxDepth) {
    if (warn && is_container(obj)) {
      call_outside_dynamo(py::module_::import("activationscope.capture.compiled").attr("warn_too_deep"),
                          py::make_tuple(prefix));
    }
    return;
  }
  if (PyTuple_Check(obj.ptr()) || PyList_Check(obj.ptr())) {
    py::sequence seq = py::reinterpret_borrow<py::sequence>(obj);
    py::object fields = py::getattr(obj, "_fields", py::none());
    const size_t n = py::len(seq);
    for (size_t i = 0; i < n; ++i) {
      std::string key = (!fields.is_none() && PyTuple_Check(fields.ptr()) && i < py::len(fields))
                            ? key_name(fields[py::int_(i)], prefix)
                            : std::to_string(i);
      collect(seq[i], prefix + "." + key, out, depth + 1, warn, unwalked);
    }
    return;
  }
  if (PyDict_Check(obj.ptr())) {
    for (auto item : py::reinterpret_borrow<py::dict>(obj)) {
      collect(item.second, prefix + "." + key_name(item.first, prefix), out, depth + 1, warn, unwalked);
    }
    return;
  }
  py::handle type = reinterpret_cast<PyObject*>(Py_TYPE(obj.ptr()));
  if (py::hasattr(type, "__dataclass_fields__")) {
    // the kind of a field of the instance; ClassVar and InitVar names have others (the test of
    // dataclasses.fields); kept for the process
    static PyObject* field_kind = py::object(py::module_::import("dataclasses").attr("_FIELD")).release().ptr();
    py::dict fields = type.attr("__dataclass_fields__");
    for (auto item : fields) {
      if (py::getattr(item.second, "_field_type", py::none()).ptr() != field_kind) continue;
      std::string name = key_name(item.first, prefix);
      collect(py::getattr(obj, name.c_str(), py::none()), prefix + "." + name, out, depth + 1, warn, unwalked);
    }
    return;
  }
  if (!unwalked || !warn) return;
  PyObject* o = obj.ptr();
  if (PyLong_Check(o) || PyFloat_Check(o) || PyUnicode_Check(o) || PyBytes_Check(o) || PyComplex_Check(o)) return;
  PyTypeObject* tp = Py_TYPE(o);
  const int checks = unwalked->checks(tp);
  if (checks < 0 || checks >= kUnwalkedChecks) return;
  // (the check runs Python: the type is held alive across it, and its entry read again after)
  py::object keep = py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(tp));
  static PyObject* check = py::object(py::module_::import("activationscope.capture.compiled").attr("warn_unwalked"))
                               .release().ptr();  // kept for the process
  const bool done = call_outside_dynamo(py::reinterpret_borrow<py::object>(check), py::make_tuple(prefix, obj))
                        .cast<bool>();
  const int now = unwalked->checks(tp);
  unwalked->set(tp, done || now < 0 ? -1 : std::max(now, checks) + 1);
}

// A PackedSequence argument (torch.nn.utils.rnn) stands for its samples: its first tensor,
// data, is (sum of the lengths, ...), one row per token of every sample, not (batch, ...).
// Returns a (batch,) placeholder of its batch (batch_sizes[0]), or undefined for any other object.
at::Tensor packed_batch(py::handle obj) {
  if (!PyTuple_Check(obj.ptr())) return at::Tensor();  // (a named tuple)
  static PyObject* packed =
      py::object(py::module_::import("torch.nn.utils.rnn").attr("PackedSequence")).release().ptr();  // kept
  if (PyObject_IsInstance(obj.ptr(), packed) != 1) return at::Tensor();
  py::object sizes = py::getattr(obj, "batch_sizes", py::none());
  if (!is_tensor_object(sizes.ptr())) return at::Tensor();
  const at::Tensor b = THPVariable_Unpack(sizes.ptr());
  if (b.dim() != 1 || b.numel() == 0 || !b.device().is_cpu() || !fixed_sizes(b)) return at::Tensor();
  return at::empty({b[0].item<int64_t>()}, at::TensorOptions().dtype(at::kBool));
}

// The model's first tensor input with a dimension (positional, else keyword), or undefined.
// Its first dimension is the forward's samples; with rows="token" its first two are (batch, pos).
// Keyword arguments are taken in the order of the forward's parameters (`kw_order`), those it
// does not name after them in the order passed: model(position_ids=p, input_ids=i) reads the
// batch from input_ids, as model(i, p) does, not from a (1, pos) position_ids. A PackedSequence
// argument gives its batch (packed_batch).
at::Tensor root_first_input(const py::args& args, const py::kwargs& kwargs, const std::vector<std::string>& kw_order) {
  Leaves leaves;
  for (size_t i = 0; i < args.size() && leaves.empty(); ++i) {
    const at::Tensor packed = packed_batch(args[i]);
    if (packed.defined()) return packed;
    collect(args[i], "", leaves, 0, false);
  }
  if (leaves.empty() && kwargs.size() > 0) {
    for (const auto& name : kw_order) {
      py::str key(name);
      if (!kwargs.contains(key)) continue;
      const at::Tensor packed = packed_batch(kwargs[key]);
      if (packed.defined()) return packed;
      collect(kwargs[key], "", leaves, 0, false);
      if (!leaves.empty()) break;
    }
  }
  if (leaves.empty()) {
    for (auto item : kwargs) {
      if (!kw_order.empty() && PyUnicode_Check(item.first.ptr()) &&
          std::find(kw_order.begin(), kw_order.end(), py::str(item.first).cast<std::string>()) != kw_order.end())
        continue;  // (looked at above)
      const at::Tensor packed = packed_batch(item.second);
      if (packed.defined()) return packed;
      collect(item.second, "", leaves, 0, false);
      if (!leaves.empty()) break;
    }
  }
  for (const auto& leaf : leaves)
    if (leaf.second.dim() >= 1 && fixed_sizes(leaf.second)) return leaf.second;  // (a nested one has no batch size to read)
  return at::Tensor();
}

}  // namespace

PyObject* stop_forward_type() {
  static PyObject* type = PyErr_NewExceptionWithDoc(
      "activationscope._C._StopForward",
      "Internal: ends a tracked forward after its last hook point (stop_after_last).",
      PyExc_BaseException, nullptr);
  return type;
}

namespace {

std::mutex g_wrappers_mu;
std::unordered_map<int64_t, ForwardWrapper*>& wrappers() {
  static auto* m = new std::unordered_map<int64_t, ForwardWrapper*>();  // kept for the process
  return *m;
}
int64_t g_next_key = 1;

// The trackers with a root forward open on this thread (depth > 0), outermost first: a
// tracker's stop point ends a forward only when no other of them still captures in it.
thread_local std::vector<TrackerCore*> t_open_roots;

// The trackers with a call of one of their modules in progress on this thread, one entry per
// call (TrackerCore::in_flight counts those of every thread).
thread_local std::vector<TrackerCore*> t_in_calls;

// Calls of tracked modules made on their own (outside a root forward of their tracker) open on
// this thread, one per tracker: (tracker, key of the outermost such call). The tracked modules
// called inside one are named "#k" from their second call on, as in a root forward.
thread_local std::vector<std::pair<TrackerCore*, int64_t>> t_outside_calls;

// Ends, when it goes out of scope, the outside calls that take_call opened for it.
struct OutsideCalls {
  c10::SmallVector<TrackerCore*, 2> opened;
  void close() {
    for (TrackerCore* c : opened) {
      auto it = std::find_if(t_outside_calls.begin(), t_outside_calls.end(),
                             [c](const auto& entry) { return entry.first == c; });
      if (it != t_outside_calls.end()) t_outside_calls.erase(it);
    }
    opened.clear();
  }
  ~OutsideCalls() { close(); }
};

// torch._C._dynamo.eval_frame.<name> (a new reference, kept for the process), or None where
// this torch lacks it.
PyObject* eval_frame_attr(const char* name) {
  try {
    return py::object(py::module_::import("torch._C._dynamo.eval_frame").attr(name)).release().ptr();
  } catch (py::error_already_set&) {
    Py_INCREF(Py_None);
    return Py_None;
  }
}

// torch._C._dynamo.eval_frame.set_eval_frame, or None where this torch lacks it.
PyObject* set_eval_frame_fn() {
  static PyObject* fn = eval_frame_attr("set_eval_frame");
  return fn;
}

// Whether TorchDynamo's frame hook is set on this thread (a compiled region runs this code).
bool under_dynamo() {
  static PyObject* get = eval_frame_attr("get_eval_frame_callback");
  if (get == Py_None) return false;
  PyObject* cb = PyObject_CallNoArgs(get);
  if (cb == nullptr) {
    PyErr_Clear();
    return false;
  }
  const bool on = cb != Py_None && cb != Py_False;
  Py_DECREF(cb);
  return on;
}

}  // namespace

namespace {

bool interpreter_ending() {
#if PY_VERSION_HEX >= 0x030D0000
  return !Py_IsInitialized() || Py_IsFinalizing();
#else
  return !Py_IsInitialized() || _Py_IsFinalizing();
#endif
}

// Whether the weak reference `ref` still leads to `obj` (obj null: to any object).
bool refers_to(PyObject* ref, PyObject* obj) {
#if PY_VERSION_HEX >= 0x030D0000
  PyObject* got = nullptr;
  if (PyWeakref_GetRef(ref, &got) <= 0) {
    PyErr_Clear();
    return false;
  }
  const bool same = obj == nullptr || got == obj;
  Py_DECREF(got);
  return same;
#else
  PyObject* got = PyWeakref_GET_OBJECT(ref);
  return got != Py_None && (obj == nullptr || got == obj);
#endif
}

}  // namespace

UnwalkedTypes::~UnwalkedTypes() {
  if (entries_.empty() || interpreter_ending()) return;  // (an ending interpreter frees them all)
  PyGILState_STATE gil = PyGILState_Ensure();
  for (auto& kv : entries_) Py_DECREF(kv.second.ref);  // (a weak reference without callback: runs no code)
  PyGILState_Release(gil);
}

bool UnwalkedTypes::alive(const Entry& e, PyTypeObject* type) {
  return refers_to(e.ref, reinterpret_cast<PyObject*>(type));
}

int UnwalkedTypes::checks(PyTypeObject* type) {
  auto it = entries_.find(type);
  if (it == entries_.end()) return 0;
  if (alive(it->second, type)) return it->second.checks;
  // the type it was made for was freed, and `type` is another at its address
  Py_DECREF(it->second.ref);
  entries_.erase(it);
  return 0;
}

void UnwalkedTypes::drop_dead() {
  for (auto it = entries_.begin(); it != entries_.end();) {
    if (!refers_to(it->second.ref, nullptr)) {
      Py_DECREF(it->second.ref);
      it = entries_.erase(it);
    } else {
      ++it;
    }
  }
}

void UnwalkedTypes::set(PyTypeObject* type, int n) {
  auto it = entries_.find(type);
  if (it != entries_.end()) {
    if (alive(it->second, type)) {
      it->second.checks = n;
      return;
    }
    Py_DECREF(it->second.ref);
    entries_.erase(it);
  }
  if (entries_.size() >= kCap) drop_dead();
  if (entries_.size() >= kCap) return;  // full of live types: `type` is checked each time it is met
  PyObject* ref = PyWeakref_NewRef(reinterpret_cast<PyObject*>(type), nullptr);
  if (ref == nullptr) {  // (every type takes weak references; out of memory)
    PyErr_Clear();
    return;
  }
  entries_.emplace(type, Entry{ref, n});
}

int64_t TrackerCore::calls_elsewhere() const {
  return in_flight - std::count(t_in_calls.begin(), t_in_calls.end(), this);
}

void ForwardWrapper::warn_eager_once() {
  if (warned_eager_) return;
  warned_eager_ = true;
  call_outside_dynamo(py::module_::import("activationscope.capture.compiled").attr("warn_eager"),
                      py::make_tuple(paths()));
}

py::object call_outside_dynamo(const py::object& fn, const py::tuple& args) {
  PyObject* set = set_eval_frame_fn();
  if (set == Py_None) return fn(*args);
  py::object prior = py::reinterpret_borrow<py::object>(set)(py::none());
  struct Restore {
    PyObject* set;
    py::object prior;
    ~Restore() {
      PyObject* r = PyObject_CallOneArg(set, prior.ptr());
      if (r == nullptr) PyErr_Clear();  // set_eval_frame does not fail on a callback it returned
      Py_XDECREF(r);
    }
  } restore{set, std::move(prior)};
  return fn(*args);
}

ForwardWrapper::ForwardWrapper(py::object original) : original_(std::move(original)) {
  std::lock_guard<std::mutex> lock(g_wrappers_mu);
  key_ = g_next_key++;
  wrappers()[key_] = this;
}

ForwardWrapper::~ForwardWrapper() {
  std::lock_guard<std::mutex> lock(g_wrappers_mu);
  wrappers().erase(key_);
}

ForwardWrapper* ForwardWrapper::find(int64_t key) {
  std::lock_guard<std::mutex> lock(g_wrappers_mu);
  auto it = wrappers().find(key);
  return it == wrappers().end() ? nullptr : it->second;
}

std::tuple<bool, bool, bool, bool> ForwardWrapper::plan() const {
  bool in = false, out = false, root = false, eager = false;
  for (const auto& s : sites_) {
    in = in || s->capture_input;
    out = out || s->capture_output;
    root = root || s->is_root;
    eager = eager || s->core->stop_after_last;  // ends a forward by an exception: not in a graph
  }
  return {in, out, root, eager};
}

std::vector<std::string> ForwardWrapper::paths() const {
  std::vector<std::string> out;
  for (const auto& s : sites_) out.push_back(s->path);
  return out;
}

// One tracker records one forward at a time: a call from another thread while a root
// forward runs would interleave its records, names (#k) and forward boundaries with that
// forward's. The fields read here change only with the GIL held. A submodule shared with
// another tracked model, called in a forward of that model open on this thread, is that
// forward's call: it is no call of this tracker (take_call leaves it out), so it is let through.
void ForwardWrapper::check_one_thread() const {
  for (auto& s : sites_) {
    const TrackerCore& c = *s->core;
    if (c.active && c.depth > 0 && c.owner != std::this_thread::get_id() &&
        (s->is_root || !in_other_forward(c, sites_))) {
      throw UserError("module '" + (s->path.empty() ? std::string("(the tracked model)") : s->path) +
                      "' was called from one thread while the tracked model runs a forward in another; a "
                      "tracker records one forward at a time: call the tracked model from one thread at a "
                      "time, or give each thread its own copy of the model with its own tracker");
    }
  }
}

// The start of a root forward of tracker `c` (its depth already raised to 1): the capture
// decision, batch size, token mask and the start callback. A callback that raises leaves the
// forward uncounted.
void ForwardWrapper::start_forward(TrackerCore& c, const at::Tensor& first) {
  c.capturing = c.decide(c.n_forwards);
  c.batch_size = first.defined() ? first.size(0) : -1;
  c.second_dim = first.defined() && first.dim() >= 2 ? first.size(1) : -1;
  if (c.token_rows) {
    if (first.defined() && first.dim() >= 2) {
      if (!c.auto_mask.defined() || c.auto_mask.size(0) != first.size(0) || c.auto_mask.size(1) != first.size(1))
        c.auto_mask = at::ones({first.size(0), first.size(1)}, at::TensorOptions().dtype(at::kBool));
    } else {
      c.auto_mask = at::Tensor();
    }
  }
  c.n_consumed = 0;
  c.last_sink.reset();
  c.stop_now = false;
  c.stopped = false;
  c.past_stop = false;
  ++c.n_forwards;
  if (c.on_forward_start && !c.on_forward_start.is_none()) {
    try {
      call_outside_dynamo(c.on_forward_start, py::tuple());
    } catch (...) {
      --c.n_forwards;
      throw;
    }
  }
}

// Whether another tracker wrapping this module captures the call as part of a root forward of
// its own, open on this thread (a submodule shared by two tracked models, called in the other's forward).
bool ForwardWrapper::in_other_forward(const TrackerCore& c, const std::vector<std::shared_ptr<Site>>& sites) {
  const std::thread::id me = std::this_thread::get_id();
  for (const auto& o : sites) {
    const TrackerCore& oc = *o->core;
    if (&oc != &c && oc.active && oc.depth > 0 && oc.owner == me) return true;
  }
  return false;
}

// Whether site `s` captures this call; if so, the name base it captures under ("<path>" or
// "<path>#k" for its k-th call in this root forward).
bool ForwardWrapper::take_call(Site& s, const std::vector<std::shared_ptr<Site>>& sites, std::string* base,
                               int64_t* k, bool* outside, void* opened) {
  TrackerCore& c = *s.core;
  if (!c.live()) return false;
  // (a root forward of this tracker open on another thread: this call, let through by
  // check_one_thread, is part of another tracked model's forward on this one)
  if (c.depth > 0 && c.owner != std::this_thread::get_id()) return false;
  *outside = c.depth == 0;
  // A module shared with another tracked model, called in a forward of that model, is part of
  // that forward (its tracker records it), never a call on its own of this one: in memory its
  // records would no longer be this model's calls, one per forward
  if (c.depth == 0 && in_other_forward(c, sites)) return false;
  if (c.depth == 0 && c.roots_only) {
    // a tracked module called on its own, outside a forward of the tracked model: a store's
    // rows follow its row table, one entry per sample of a forward, so it records nothing
    ++c.outside_calls;
    return false;
  }
  const bool take = c.depth > 0 ? c.capturing : c.decide(s.n_calls++);
  // The call this one is part of: the root forward, or the outermost call of a tracked module
  // made on its own on this thread (keys -1, -2, ...: never a forward's), which this call
  // opens when there is none. Repeated calls of a module within one are "#k".
  int64_t key = c.n_forwards;
  if (c.depth == 0) {
    auto it = std::find_if(t_outside_calls.begin(), t_outside_calls.end(),
                           [&c](const auto& entry) { return entry.first == &c; });
    if (it != t_outside_calls.end()) {
      key = it->second;
    } else {
      key = -(++c.outside_keys);
      t_outside_calls.emplace_back(&c, key);
      static_cast<OutsideCalls*>(opened)->opened.push_back(&c);
    }
  }
  *k = 0;
  if (s.fwd_seen == key) {
    *k = s.calls_in_fwd++;
  } else {
    s.fwd_seen = key;
    s.calls_in_fwd = 1;
  }
  if (!take) return false;
  *base = s.path;
  if (*k > 0) *base += "#" + std::to_string(*k);
  return true;
}

py::object ForwardWrapper::call(py::args args, py::kwargs kwargs) {
  if (sites_.empty() || torch::autograd::get_current_graph_task_id() != -1) {
    // Not tracked, or a recompute of activation checkpointing during backward.
    return call_original(args, kwargs);
  }
  if (needs_eager_ && !warned_eager_ && under_dynamo()) warn_eager_once();  // compiled, but not in a graph
  check_one_thread();
  // Calls in progress per tracker: the close of a tracker waits for those of other threads.
  // The sites and cores of this call are owned here (a close that gives up waiting removes
  // them from the wrapper while the call runs).
  c10::SmallVector<std::shared_ptr<TrackerCore>, 2> flying;  // (no heap allocation per call)
  struct FlightGuard {
    c10::SmallVector<std::shared_ptr<TrackerCore>, 2>& cores;
    ~FlightGuard() {
      for (auto& c : cores) {
        --c->in_flight;
        auto it = std::find(t_in_calls.rbegin(), t_in_calls.rend(), c.get());
        if (it != t_in_calls.rend()) t_in_calls.erase(std::next(it).base());
      }
    }
  } flight{flying};
  for (auto& s : sites_) {
    if (!s->core->live()) continue;
    ++s->core->in_flight;
    t_in_calls.push_back(s->core.get());
    flying.push_back(s->core);
  }
  // Root bookkeeping (forward boundaries) for every tracker rooted here. The guard exists
  // before any increment, so a start callback that raises leaves depth (and the #k names
  // of later forwards) intact, and a forward that never ran is not counted. Depth and owner
  // are set for every tracker before any Python runs (the start callback, the model's input
  // read): another thread entering meanwhile is refused by check_one_thread.
  std::vector<std::shared_ptr<Site>> roots;
  struct RootGuard {
    std::vector<std::shared_ptr<Site>>& roots;
    ~RootGuard() {
      for (auto& s : roots) {
        TrackerCore* c = s->core.get();
        if (--c->depth == 0) {
          auto it = std::find(t_open_roots.begin(), t_open_roots.end(), c);
          if (it != t_open_roots.end()) t_open_roots.erase(it);
        }
      }
    }
  } guard{roots};
  std::vector<TrackerCore*> starting;
  for (auto& s : sites_) {
    if (s->is_root && s->core->live()) {
      TrackerCore& c = *s->core;
      const bool outer = c.depth++ == 0;
      roots.push_back(s);
      if (outer) {
        c.owner = std::this_thread::get_id();
        t_open_roots.push_back(&c);
        starting.push_back(&c);
      }
    }
  }
  if (!starting.empty()) {
    const at::Tensor first = root_first_input(args, kwargs, kw_order_);
    for (TrackerCore* c : starting) start_forward(*c, first);
  }

  // Which sites capture this call, and under which names.
  OutsideCalls outside_calls;
  std::vector<Active> active;
  for (auto& s : sites_) {
    std::string base;
    int64_t k;
    bool outside = false;
    if (take_call(*s, sites_, &base, &k, &outside, &outside_calls)) active.push_back({s, std::move(base), k, outside});
  }
  if (!active.empty()) {
    Leaves in_leaves;
    for (auto& a : active) {
      if (!a.site->capture_input) continue;
      if (a.k == 0 && args.size() == 1 && kwargs.empty() && is_tensor_object(args[0].ptr())) {
        Site& s = *a.site;
        if (!s.in0_resolved) {
          s.in0_sink = resolve(*s.core, join(a.base, "input") + ".0", THPVariable_Unpack(args[0].ptr()));
          s.in0_resolved = true;
        }
        if (s.in0_sink) consume_one(*s.core, s.in0_sink, THPVariable_Unpack(args[0].ptr()), a.outside);
        continue;
      }
      in_leaves.clear();
      std::string prefix = join(a.base, "input");
      const size_t n = args.size();
      auto* unwalked = &a.site->core->unwalked_types;
      for (size_t i = 0; i < n; ++i) collect(args[i], prefix + "." + std::to_string(i), in_leaves, 0, true, unwalked);
      for (auto item : kwargs) {
        collect(item.second, prefix + ".kw." + py::str(item.first).cast<std::string>(), in_leaves, 0, true, unwalked);
      }
      consume_all(*a.site->core, in_leaves, a.outside);
    }
  }

  bool stopped = stop_point(active, roots);
  py::object out = py::none();
  if (!stopped) {
    try {
      out = call_original(args, kwargs);
    } catch (py::error_already_set& e) {
      if (roots.empty() || !e.matches(stop_forward_type())) throw;
      py::object target = py::getattr(e.value(), "args")[py::int_(0)];
      void* who = PyLong_AsVoidPtr(target.ptr());
      bool mine = false;
      for (auto& s : roots) mine = mine || (s->core.get() == who && s->core->depth == 1);
      if (!mine) throw;  // another tracker's stop: its own root catches it
      stopped = true;
      static_cast<TrackerCore*>(who)->stopped = true;
    }
  }
  for (auto& a : active) {
    // closed from another thread while the original forward ran (a close that gave up
    // waiting for this call): its capture cannot be completed, and must not look whole
    if (!a.site->core->active) {
      throw UserError("the tracker of module '" + (a.site->path.empty() ? std::string("(the tracked model)")
                                                                         : a.site->path) +
                      "' was closed (its `with` block ended, or remove()) while this call ran in another thread, "
                      "so the capture of this call is incomplete; join the threads that call the tracked model "
                      "before the `with` block ends");
    }
  }

  if (!active.empty() && !stopped) {
    Leaves out_leaves;
    for (auto& a : active) {
      if (!a.site->capture_output) continue;
      if (a.k == 0 && is_tensor_object(out.ptr())) {
        Site& s = *a.site;
        if (!s.out_resolved) {
          s.out_sink = resolve(*s.core, join(a.base, "output"), THPVariable_Unpack(out.ptr()));
          s.out_resolved = true;
        }
        if (s.out_sink) consume_one(*s.core, s.out_sink, THPVariable_Unpack(out.ptr()), a.outside);
        continue;
      }
      out_leaves.clear();
      collect(out, join(a.base, "output"), out_leaves, 0, true, &a.site->core->unwalked_types);
      consume_all(*a.site->core, out_leaves, a.outside);
    }
    stopped = stop_point(active, roots);
  }

  bool none = stopped;
  for (auto& s : roots) {
    TrackerCore& c = *s->core;
    if (c.depth != 1) continue;
    if (c.stop_after_last && c.capturing) {
      none = true;  // with stop_after_last a captured forward returns None (documented)
      if (c.stop_count < 0 && !c.stopped && c.n_consumed > 0) {
        c.stop_count = c.n_consumed;  // the first whole captured forward: learn its stop point
        c.stop_sink = c.last_sink;
      }
    }
    if (c.on_forward_end && !c.on_forward_end.is_none()) call_outside_dynamo(c.on_forward_end, py::tuple());
  }
  return none ? py::none() : out;
}

// After captures: true when a tracker rooted at this call reached its stop point (the forward
// then ends here and returns None); raises the stop exception when the root of a tracker that
// reached it is further up the call stack.
bool ForwardWrapper::stop_point(const std::vector<Active>& active, const std::vector<std::shared_ptr<Site>>& roots) {
  for (const auto& a : active) {
    TrackerCore& c = *a.site->core;
    if (a.outside || !c.stop_now) continue;  // (an outside call never ends another thread's forward)
    c.stop_now = false;
    // Another tracker capturing this forward (and not itself past its own stop point) would
    // lose the hook points after this one: the forward goes on, this tracker has what it needs.
    bool others = false;
    for (TrackerCore* o : t_open_roots) {
      if (o != &c && o->active && o->capturing && !(o->stop_after_last && o->past_stop)) others = true;
    }
    if (others) {
      c.past_stop = true;
      continue;
    }
    for (auto& s : roots) {
      if (s->core.get() == &c && c.depth == 1) {
        c.stopped = true;
        return true;
      }
    }
    py::object target = py::reinterpret_steal<py::object>(PyLong_FromVoidPtr(&c));
    PyErr_SetObject(stop_forward_type(), target.ptr());
    throw py::error_already_set();
  }
  return false;
}

std::string ForwardWrapper::join(const std::string& base, const char* what) {
  return base.empty() ? std::string(what) : base + "." + what;
}

std::shared_ptr<Sink> ForwardWrapper::resolve(TrackerCore& core, const std::string& name, const at::Tensor& t) {
  auto it = core.sinks.find(name);
  if (it == core.sinks.end()) {
    ACS_CHECK(core.active && !core.on_new_hook_point.is_none(), "hook point '", name, "': its tracker was closed ",
              "(its `with` block ended, or remove()) while this call ran in another thread, so the capture of ",
              "this call is incomplete; join the threads that call the tracked model before the `with` block ends");
    py::object made = call_outside_dynamo(core.on_new_hook_point, py::make_tuple(name, t));
    std::shared_ptr<Sink> sink = made.is_none() ? nullptr : made.cast<std::shared_ptr<Sink>>();
    // The callback ran Python: another thread may have resolved the name meanwhile (the
    // tracker's callback then gave it the same sink).
    it = core.sinks.find(name);
    if (it != core.sinks.end()) return it->second;
    if (sink) {
      {
        // (the sink may already be another thread's: its lock is taken without the GIL, which
        // a thread holding that lock may be waiting for in a Python reduction)
        ReleaseGil nogil;
        sink->attach_tally(core.alias_tally);
      }
      core.alias_scan_needed = true;
    }
    it = core.sinks.emplace(name, std::move(sink)).first;
  }
  return it->second;
}

// original_(*args, **kwargs) without building a new tuple and dict for the call.
py::object ForwardWrapper::call_original(const py::args& args, const py::kwargs& kwargs) const {
  PyObject* r = PyObject_Call(original_.ptr(), args.ptr(), PyDict_GET_SIZE(kwargs.ptr()) ? kwargs.ptr() : nullptr);
  if (r == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(r);
}

// Refuse a second tensor under one hook point name in one root forward: two names of the
// forward collide (a module named like another's repeated call, "a#1"; an output dict with
// keys 1 and "1"), and keeping both would give that hook point two rows per sample.
static void claim(const TrackerCore& core, Sink& sink, bool outside) {
  if (outside) return;  // a module called on its own (in memory): each call is its own
  ACS_CHECK(sink.claimed_forward() != core.n_forwards, "hook point '", sink.name(), "' was given two tensors in ",
            "forward ", core.n_forwards - 1, " of the tracked model: two names of that forward are the same (a ",
            "module named like another module's repeated call, such as 'a#1' next to a module 'a' called twice, ",
            "or an output dict with the keys 1 and '1'). Rename the module or key, or pass exclude= one of them ",
            "to track()");
  sink.set_claimed_forward(core.n_forwards);
}

void ForwardWrapper::consume_one(TrackerCore& core, const std::shared_ptr<Sink>& sink, const at::Tensor& t,
                                 bool outside) {
  claim(core, *sink, outside);
  if (!outside && core.batch_size < 0 && t.dim() >= 1 && fixed_sizes(t)) core.batch_size = t.size(0);
  at::Tensor mask = core.mask();
  if (sink->keeps_reference_only()) {  // a few pointer updates: not worth a GIL hand-off
    sink->consume(t, mask);
  } else {
    ReleaseGil nogil;
    sink->consume(t, mask);
  }
  if (!outside) core.note(sink);
}

void ForwardWrapper::consume_all(TrackerCore& core, const Leaves& leaves, bool outside) {
  if (leaves.empty()) return;
  if (!outside && core.batch_size < 0 && leaves.front().second.dim() >= 1 && fixed_sizes(leaves.front().second)) {
    core.batch_size = leaves.front().second.size(0);
  }
  std::vector<std::pair<std::shared_ptr<Sink>, const at::Tensor*>> work;
  work.reserve(leaves.size());
  for (const auto& leaf : leaves) {
    std::shared_ptr<Sink> sink = resolve(core, leaf.first, leaf.second);
    if (!sink) continue;
    claim(core, *sink, outside);
    work.emplace_back(std::move(sink), &leaf.second);
  }
  if (work.empty()) return;
  at::Tensor mask = core.mask();
  {
    ReleaseGil nogil;
    for (auto& w : work) w.first->consume(*w.second, mask);
  }
  if (!outside)
    for (auto& w : work) core.note(w.first);
}

// ---------------------------------------------------------------------------------------
// The in-graph path (see forward_wrapper.h): the same bookkeeping as call(), split at the
// original forward into call_begin / call_end ops. Both run with the GIL held.

void ForwardWrapper::op_begin(at::TensorList leaves, const std::vector<std::string>& names, const at::Tensor& first) {
  std::vector<OpFrame>& frames = op_frames_[std::this_thread::get_id()];
  if (frames.size() > 64) frames.clear();  // frames of graphs that raised midway
  if (sites_.empty() || torch::autograd::get_current_graph_task_id() != -1) {
    frames.emplace_back().skip = true;
    return;
  }
  check_one_thread();
  frames.emplace_back();
  OpFrame f;
  try {
    for (auto& s : sites_) {
      if (!s->is_root || !s->core->live()) continue;
      TrackerCore& c = *s->core;
      if (c.op_depth > 0 && c.depth > 0) {
        // A root forward opened by call_begin and never closed: its compiled graph raised
        // midway (the exception was caught). A graph does not nest its own root, so this
        // call starts the next forward; the capture's start callback reports the partial one.
        c.depth -= c.op_depth;
        c.op_depth = 0;
      }
      const bool outer = c.depth++ == 0;
      ++c.op_depth;
      f.roots.push_back(s->core);
      if (outer) {
        c.owner = std::this_thread::get_id();
        start_forward(c, first);
      }
    }
  } catch (...) {
    for (auto& c : f.roots) {
      --c->depth;
      --c->op_depth;
    }
    frames.pop_back();
    if (frames.empty()) op_frames_.erase(std::this_thread::get_id());
    throw;
  }
  // (a call on its own inside a graph names the calls inside it as before: each its own)
  OutsideCalls outside_calls;
  for (auto& s : sites_) {
    std::string base;
    int64_t k;
    bool outside = false;
    if (take_call(*s, sites_, &base, &k, &outside, &outside_calls)) f.active.emplace_back(s, std::move(base));
  }
  outside_calls.close();
  frames.back() = f;
  for (auto& [site, base] : f.active)
    if (site->capture_input && !leaves.empty()) capture_named(*site->core, base, leaves, names);
}

void ForwardWrapper::op_end(at::TensorList leaves, const std::vector<std::string>& names) {
  auto it = op_frames_.find(std::this_thread::get_id());
  if (it == op_frames_.end() || it->second.empty()) return;  // frames dropped after a graph that raised
  OpFrame f = std::move(it->second.back());
  it->second.pop_back();
  if (it->second.empty()) op_frames_.erase(it);
  if (f.skip) return;
  struct Guard {
    std::vector<std::shared_ptr<TrackerCore>>& roots;
    ~Guard() {
      for (auto& c : roots) {
        --c->depth;
        if (c->op_depth > 0) --c->op_depth;
      }
    }
  } guard{f.roots};
  for (auto& [site, base] : f.active)
    if (site->capture_output && !leaves.empty()) capture_named(*site->core, base, leaves, names);
  for (auto& c : f.roots) {
    if (c->depth != 1 || !c->active) continue;
    if (c->on_forward_end && !c->on_forward_end.is_none()) call_outside_dynamo(c->on_forward_end, py::tuple());
  }
}

// Capture `leaves` (named by their suffix) under `base`: the sinks are resolved with the GIL,
// the tensors consumed without it. A sink that keeps the tensor itself (REFERENCE in memory)
// gets a copy: a compiled graph reuses its buffers once their last reader ran, without
// moving a version counter.
void ForwardWrapper::capture_named(TrackerCore& core, const std::string& base, at::TensorList leaves,
                                   const std::vector<std::string>& names) {
  TORCH_CHECK(leaves.size() == names.size(), "activationscope call op: ", leaves.size(), " tensors but ",
              names.size(), " names");
  if (core.batch_size < 0 && leaves[0].dim() >= 1 && fixed_sizes(leaves[0])) core.batch_size = leaves[0].size(0);
  std::vector<std::pair<std::shared_ptr<Sink>, at::Tensor>> work;
  work.reserve(leaves.size());
  struct InGraph {
    TrackerCore& c;
    explicit InGraph(TrackerCore& core) : c(core) { c.in_graph = true; }
    ~InGraph() { c.in_graph = false; }
  } in_graph{core};
  for (size_t i = 0; i < leaves.size(); ++i) {
    std::shared_ptr<Sink> sink = resolve(core, base.empty() ? names[i] : base + "." + names[i], leaves[i]);
    if (!sink) continue;
    // A compiled graph reuses a buffer for another value with the same layout and no version
    // bump, so "the same tensor as that hook point" cannot be checked inside it: no aliases
    // are made here (the tracker's _alias_target), and one made in an eager forward is refused.
    ACS_CHECK(!sink->alias_of(), "hook point '", sink->name(), "' is kept as an alias of '", sink->alias_of()->name(),
              "' (the same tensor in an eager forward), which cannot be checked inside a compiled graph (it reuses "
              "buffers); track the compiled model from its first forward with a new tracker, or exclude= one of them");
    claim(core, *sink, core.depth == 0);
    const bool kept_by_reference = !sink->options().snapshot && sink->options().keep != Keep::NONE;
    work.emplace_back(std::move(sink), kept_by_reference ? leaves[i].clone() : leaves[i]);
  }
  if (work.empty()) return;
  at::Tensor mask = core.mask();
  {
    py::gil_scoped_release nogil;
    for (auto& w : work) w.first->consume(w.second, mask);
  }
  for (auto& w : work) core.note(w.first);
}

// tp_call of ForwardWrapper: the arguments exactly as CPython passes them (the caller's
// tuple, kwargs NULL or the caller's dict), without pybind11's dispatcher building a new
// args tuple and kwargs dict per call: one call per tracked module per forward, so this is
// the hot path, and fewer container objects also mean fewer garbage-collector passes.
// `__call__` stays defined for Python-level lookups; the slot is what calls go through.
PyObject* forward_wrapper_tp_call(PyObject* self, PyObject* args, PyObject* kwargs) {
  try {
    auto& w = py::cast<ForwardWrapper&>(py::handle(self));
    static PyObject* empty = PyDict_New();  // never modified; kept for the process
    auto a = py::reinterpret_borrow<py::args>(args);
    auto k = py::reinterpret_borrow<py::kwargs>(kwargs != nullptr ? kwargs : empty);
    return w.call(a, k).release().ptr();
  } catch (abi::__forced_unwind&) {  // the thread is being ended (pthread_exit at exit, see gil.h)
    throw;
  } catch (...) {
    set_python_error(std::current_exception());
    return nullptr;
  }
}

}  // namespace acs
