// The forward wrapper (forward_wrapper.h): flattening a module call's inputs / outputs into
// named tensors, the per-forward policy, and the hand-off to the capture sinks.
#include "forward_wrapper.h"

#include <cxxabi.h>

#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/python_variable.h>

#include "errors.h"
#include "gil.h"
#include "py_errors.h"

namespace acs {

Policy policy_from_int(int code) {
  TORCH_CHECK(code >= 0 && code <= 2, "capture policy code must be 0 (EVERY), 1 (SAMPLE_N) or 2 (MAX_K), got ",
              code);
  return static_cast<Policy>(code);
}

namespace {

using Leaves = std::vector<std::pair<std::string, at::Tensor>>;

// Flatten a module input / output into named tensor leaves: tensors, tuples / lists
// (named tuples by field), dicts (HF ModelOutput included, by key) and dataclasses (by
// field). None and other objects are skipped.
void collect(py::handle obj, const std::string& prefix, Leaves& out, int depth) {
  if (THPVariable_Check(obj.ptr())) {
    out.emplace_back(prefix, THPVariable_Unpack(obj.ptr()));
    return;
  }
  if (depth > 8 || obj.is_none()) return;
  if (PyTuple_Check(obj.ptr()) || PyList_Check(obj.ptr())) {
    py::sequence seq = py::reinterpret_borrow<py::sequence>(obj);
    py::object fields = py::getattr(obj, "_fields", py::none());
    const size_t n = py::len(seq);
    for (size_t i = 0; i < n; ++i) {
      std::string key = (!fields.is_none() && PyTuple_Check(fields.ptr()) && i < py::len(fields))
                            ? py::str(fields[py::int_(i)]).cast<std::string>()
                            : std::to_string(i);
      collect(seq[i], prefix + "." + key, out, depth + 1);
    }
    return;
  }
  if (PyDict_Check(obj.ptr())) {
    for (auto item : py::reinterpret_borrow<py::dict>(obj)) {
      collect(item.second, prefix + "." + py::str(item.first).cast<std::string>(), out, depth + 1);
    }
    return;
  }
  py::handle type = reinterpret_cast<PyObject*>(Py_TYPE(obj.ptr()));
  if (py::hasattr(type, "__dataclass_fields__")) {
    py::dict fields = type.attr("__dataclass_fields__");
    for (auto item : fields) {
      std::string name = py::str(item.first).cast<std::string>();
      collect(py::getattr(obj, name.c_str(), py::none()), prefix + "." + name, out, depth + 1);
    }
  }
}

// The model's first tensor input with a dimension (positional, else keyword), or undefined.
// Its first dimension is the forward's samples; with rows="token" its first two are (batch, pos).
at::Tensor root_first_input(const py::args& args, const py::kwargs& kwargs) {
  Leaves leaves;
  for (size_t i = 0; i < args.size() && leaves.empty(); ++i) collect(args[i], "", leaves, 0);
  if (leaves.empty()) {
    for (auto item : kwargs) {
      collect(item.second, "", leaves, 0);
      if (!leaves.empty()) break;
    }
  }
  for (const auto& leaf : leaves)
    if (leaf.second.dim() >= 1) return leaf.second;
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

py::object ForwardWrapper::call(py::args args, py::kwargs kwargs) {
  if (sites_.empty() || torch::autograd::get_current_graph_task_id() != -1) {
    // Not tracked, or a recompute of activation checkpointing during backward.
    return call_original(args, kwargs);
  }
  // One tracker records one forward at a time: a call from another thread while a root
  // forward runs would interleave its records, names (#k) and forward boundaries with that
  // forward's. The fields read here change only with the GIL held.
  for (auto& s : sites_) {
    const TrackerCore& c = *s->core;
    if (c.active && c.depth > 0 && c.owner != std::this_thread::get_id()) {
      throw UserError("module '" + (s->path.empty() ? std::string("(the tracked model)") : s->path) +
                      "' was called from one thread while the tracked model runs a forward in another; a "
                      "tracker records one forward at a time: call the tracked model from one thread at a "
                      "time, or give each thread its own copy of the model with its own tracker");
    }
  }
  // Root bookkeeping (forward boundaries) for every tracker rooted here. The guard exists
  // before any increment, so a start callback that raises leaves depth (and the #k names
  // of later forwards) intact, and a forward that never ran is not counted.
  std::vector<Site*> roots;
  struct RootGuard {
    std::vector<Site*>& roots;
    ~RootGuard() {
      for (Site* s : roots) --s->core->depth;
    }
  } guard{roots};
  for (auto& s : sites_) {
    if (s->is_root && s->core->active) {
      TrackerCore& c = *s->core;
      const bool outer = c.depth++ == 0;
      roots.push_back(s.get());
      if (outer) {
        c.owner = std::this_thread::get_id();
        c.capturing = c.decide(c.n_forwards);
        at::Tensor first = root_first_input(args, kwargs);
        c.batch_size = first.defined() ? first.size(0) : -1;
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
        ++c.n_forwards;
        if (c.on_forward_start && !c.on_forward_start.is_none()) {
          try {
            c.on_forward_start();
          } catch (...) {
            --c.n_forwards;
            throw;
          }
        }
      }
    }
  }

  // Which sites capture this call, and under which names.
  std::vector<Active> active;
  for (auto& s : sites_) {
    TrackerCore& c = *s->core;
    if (!c.active) continue;
    bool take;
    if (c.depth > 0) {
      take = c.capturing;
    } else {
      take = c.decide(s->n_calls++);
    }
    int64_t k = 0;
    if (s->fwd_seen == c.n_forwards && c.depth > 0) {
      k = s->calls_in_fwd++;
    } else {
      s->fwd_seen = c.n_forwards;
      s->calls_in_fwd = 1;
    }
    if (!take) continue;
    std::string base = s->path;
    if (k > 0) base += "#" + std::to_string(k);
    active.push_back({s.get(), std::move(base), k});
  }

  if (!active.empty()) {
    Leaves in_leaves;
    for (auto& a : active) {
      if (!a.site->capture_input) continue;
      if (a.k == 0 && args.size() == 1 && kwargs.empty() && THPVariable_Check(args[0].ptr())) {
        Site& s = *a.site;
        if (!s.in0_resolved) {
          s.in0_sink = resolve(*s.core, join(a.base, "input") + ".0", THPVariable_Unpack(args[0].ptr()));
          s.in0_resolved = true;
        }
        if (s.in0_sink) consume_one(*s.core, s.in0_sink, THPVariable_Unpack(args[0].ptr()));
        continue;
      }
      in_leaves.clear();
      std::string prefix = join(a.base, "input");
      const size_t n = args.size();
      for (size_t i = 0; i < n; ++i) collect(args[i], prefix + "." + std::to_string(i), in_leaves, 0);
      for (auto item : kwargs) {
        collect(item.second, prefix + ".kw." + py::str(item.first).cast<std::string>(), in_leaves, 0);
      }
      consume_all(*a.site->core, in_leaves);
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
      for (Site* s : roots) mine = mine || (s->core.get() == who && s->core->depth == 1);
      if (!mine) throw;  // another tracker's stop: its own root catches it
      stopped = true;
      static_cast<TrackerCore*>(who)->stopped = true;
    }
  }

  if (!active.empty() && !stopped) {
    Leaves out_leaves;
    for (auto& a : active) {
      if (!a.site->capture_output) continue;
      if (a.k == 0 && THPVariable_Check(out.ptr())) {
        Site& s = *a.site;
        if (!s.out_resolved) {
          s.out_sink = resolve(*s.core, join(a.base, "output"), THPVariable_Unpack(out.ptr()));
          s.out_resolved = true;
        }
        if (s.out_sink) consume_one(*s.core, s.out_sink, THPVariable_Unpack(out.ptr()));
        continue;
      }
      out_leaves.clear();
      collect(out, join(a.base, "output"), out_leaves, 0);
      consume_all(*a.site->core, out_leaves);
    }
    stopped = stop_point(active, roots);
  }

  bool none = stopped;
  for (Site* s : roots) {
    TrackerCore& c = *s->core;
    if (c.depth != 1) continue;
    if (c.stop_after_last && c.capturing) {
      none = true;  // with stop_after_last a captured forward returns None (documented)
      if (c.stop_count < 0 && !c.stopped && c.n_consumed > 0) {
        c.stop_count = c.n_consumed;  // the first whole captured forward: learn its stop point
        c.stop_sink = c.last_sink;
      }
    }
    if (c.on_forward_end && !c.on_forward_end.is_none()) c.on_forward_end();
  }
  return none ? py::none() : out;
}

// After captures: true when a tracker rooted at this call reached its stop point (the forward
// then ends here and returns None); raises the stop exception when the root of a tracker that
// reached it is further up the call stack.
bool ForwardWrapper::stop_point(const std::vector<Active>& active, const std::vector<Site*>& roots) {
  for (const auto& a : active) {
    TrackerCore& c = *a.site->core;
    if (!c.stop_now) continue;
    c.stop_now = false;
    for (Site* s : roots) {
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
    py::object made = core.on_new_hook_point(name, t);
    std::shared_ptr<Sink> sink = made.is_none() ? nullptr : made.cast<std::shared_ptr<Sink>>();
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

void ForwardWrapper::consume_one(TrackerCore& core, const std::shared_ptr<Sink>& sink, const at::Tensor& t) {
  if (core.batch_size < 0 && t.dim() >= 1) core.batch_size = t.size(0);
  at::Tensor mask = core.mask();
  if (sink->keeps_reference_only()) {  // a few pointer updates: not worth a GIL hand-off
    sink->consume(t, mask);
  } else {
    ReleaseGil nogil;
    sink->consume(t, mask);
  }
  core.note(sink);
}

void ForwardWrapper::consume_all(TrackerCore& core, const Leaves& leaves) {
  if (leaves.empty()) return;
  if (core.batch_size < 0 && leaves.front().second.dim() >= 1) {
    core.batch_size = leaves.front().second.size(0);
  }
  std::vector<std::pair<std::shared_ptr<Sink>, const at::Tensor*>> work;
  work.reserve(leaves.size());
  for (const auto& leaf : leaves) {
    std::shared_ptr<Sink> sink = resolve(core, leaf.first, leaf.second);
    if (sink) work.emplace_back(std::move(sink), &leaf.second);
  }
  if (work.empty()) return;
  at::Tensor mask = core.mask();
  {
    ReleaseGil nogil;
    for (auto& w : work) w.first->consume(*w.second, mask);
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
