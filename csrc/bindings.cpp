// The only pybind11 file: the Python-facing side of the hot path (the forward wrapper that
// extracts tensors from a module call) and the bindings of the pure-ATen core
// (sink, reductions, store writer).
//
// Why a forward wrapper rather than register_forward_hook: once any hook is registered on a
// module, nn.Module.__call__ leaves its fast path and pays tens of microseconds per call in
// Python. A native callable installed as the module's instance `forward` keeps that fast
// path; it calls the original forward and captures its inputs / outputs in C++.
#include <torch/extension.h>

#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/python_variable.h>

#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "errors.h"
#include "reductions.h"
#include "row_consumer.h"
#include "shard_map.h"
#include "shard_writer.h"
#include "sink.h"
#include "staging_pool.h"

#ifndef ACS_TORCH_VERSION
#define ACS_TORCH_VERSION "unknown"
#endif

namespace py = pybind11;

namespace acs {

namespace {

enum class Policy : int { EVERY = 0, SAMPLE_N = 1, MAX_K = 2 };

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

// Samples in a root forward: the first dimension of the model's first tensor input
// (positional, else keyword); -1 when the inputs hold no tensor with a dimension.
int64_t root_batch_size(const py::args& args, const py::kwargs& kwargs) {
  Leaves leaves;
  for (size_t i = 0; i < args.size() && leaves.empty(); ++i) collect(args[i], "", leaves, 0);
  if (leaves.empty()) {
    for (auto item : kwargs) {
      collect(item.second, "", leaves, 0);
      if (!leaves.empty()) break;
    }
  }
  for (const auto& leaf : leaves)
    if (leaf.second.dim() >= 1) return leaf.second.size(0);
  return -1;
}

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

  py::object call(py::args args, py::kwargs kwargs) {
    if (sites_.empty() || torch::autograd::get_current_graph_task_id() != -1) {
      // Not tracked, or a recompute of activation checkpointing during backward.
      return call_original(args, kwargs);
    }
    // Root bookkeeping (forward boundaries) for every tracker rooted here.
    std::vector<Site*> roots;
    for (auto& s : sites_) {
      if (s->is_root && s->core->active) {
        TrackerCore& c = *s->core;
        if (c.depth++ == 0) {
          c.capturing = c.decide(c.n_forwards);
          c.batch_size = root_batch_size(args, kwargs);
          ++c.n_forwards;
          if (c.on_forward_start && !c.on_forward_start.is_none()) c.on_forward_start();
        }
        roots.push_back(s.get());
      }
    }
    struct RootGuard {
      std::vector<Site*>& roots;
      bool ok = false;
      ~RootGuard() {
        for (Site* s : roots) --s->core->depth;
      }
    } guard{roots};

    // Which sites capture this call, and under which names.
    struct Active {
      Site* site;
      std::string base;  // "<path>" or "<path>#k"
      int64_t k;
    };
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
          if (s.in0_sink) consume_one(*s.core, *s.in0_sink, THPVariable_Unpack(args[0].ptr()));
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

    py::object out = call_original(args, kwargs);

    if (!active.empty()) {
      Leaves out_leaves;
      for (auto& a : active) {
        if (!a.site->capture_output) continue;
        if (a.k == 0 && THPVariable_Check(out.ptr())) {
          Site& s = *a.site;
          if (!s.out_resolved) {
            s.out_sink = resolve(*s.core, join(a.base, "output"), THPVariable_Unpack(out.ptr()));
            s.out_resolved = true;
          }
          if (s.out_sink) consume_one(*s.core, *s.out_sink, THPVariable_Unpack(out.ptr()));
          continue;
        }
        out_leaves.clear();
        collect(out, join(a.base, "output"), out_leaves, 0);
        consume_all(*a.site->core, out_leaves);
      }
    }

    for (Site* s : roots) {
      TrackerCore& c = *s->core;
      if (c.depth == 1 && c.on_forward_end && !c.on_forward_end.is_none()) c.on_forward_end();
    }
    return out;
  }

 private:
  static std::string join(const std::string& base, const char* what) {
    return base.empty() ? std::string(what) : base + "." + what;
  }

  static std::shared_ptr<Sink> resolve(TrackerCore& core, const std::string& name, const at::Tensor& t) {
    auto it = core.sinks.find(name);
    if (it == core.sinks.end()) {
      py::object made = core.on_new_hook_point(name, t);
      std::shared_ptr<Sink> sink = made.is_none() ? nullptr : made.cast<std::shared_ptr<Sink>>();
      it = core.sinks.emplace(name, std::move(sink)).first;
    }
    return it->second;
  }

  // original_(*args, **kwargs) without building a new tuple and dict for the call.
  py::object call_original(const py::args& args, const py::kwargs& kwargs) const {
    PyObject* r = PyObject_Call(original_.ptr(), args.ptr(), PyDict_GET_SIZE(kwargs.ptr()) ? kwargs.ptr() : nullptr);
    if (r == nullptr) throw py::error_already_set();
    return py::reinterpret_steal<py::object>(r);
  }

  static void consume_one(TrackerCore& core, Sink& sink, const at::Tensor& t) {
    if (core.batch_size < 0 && t.dim() >= 1) core.batch_size = t.size(0);
    at::Tensor mask = core.token_mask;
    if (sink.keeps_reference_only()) {  // a few pointer updates: not worth a GIL hand-off
      sink.consume(t, mask);
      return;
    }
    py::gil_scoped_release nogil;
    sink.consume(t, mask);
  }

  static void consume_all(TrackerCore& core, const Leaves& leaves) {
    if (leaves.empty()) return;
    if (core.batch_size < 0 && leaves.front().second.dim() >= 1) {
      core.batch_size = leaves.front().second.size(0);
    }
    std::vector<std::pair<Sink*, const at::Tensor*>> work;
    work.reserve(leaves.size());
    for (const auto& leaf : leaves) {
      std::shared_ptr<Sink> sink = resolve(core, leaf.first, leaf.second);
      if (sink) work.emplace_back(sink.get(), &leaf.second);
    }
    if (work.empty()) return;
    at::Tensor mask = core.token_mask;
    py::gil_scoped_release nogil;
    for (auto& w : work) w.first->consume(*w.second, mask);
  }

  py::object original_;
  std::vector<std::shared_ptr<Site>> sites_;
};

// Reductions written in Python (the eager fallback of custom reductions) subclass
// _C.Reduction; the sink calls them without the GIL, so each call takes it back.
class PyReduction : public Reduction {
 public:
  void update(const at::Tensor& rows, int64_t row_offset) override {
    py::gil_scoped_acquire gil;
    method("update")(rows, row_offset);
  }
  void merge(const Reduction& other) override {
    py::gil_scoped_acquire gil;
    method("merge")(py::cast(&other, py::return_value_policy::reference));
  }
  NamedTensors result() const override {
    py::gil_scoped_acquire gil;
    return to_named(method("result")());
  }
  NamedTensors state() const override {
    py::gil_scoped_acquire gil;
    return to_named(method("state")());
  }
  void load_state(const NamedTensors& st) override {
    py::gil_scoped_acquire gil;
    py::dict d;
    for (const auto& kv : st) d[py::str(kv.first)] = kv.second;
    method("load_state")(d);
  }
  std::shared_ptr<Reduction> fresh() const override {
    py::gil_scoped_acquire gil;
    return method("fresh")().cast<std::shared_ptr<Reduction>>();
  }
  std::string kind() const override {
    py::gil_scoped_acquire gil;
    return py::str(py::getattr(self(), "kind")).cast<std::string>();
  }
  ReductionOptions options() const override {
    py::gil_scoped_acquire gil;
    py::object o = py::getattr(self(), "options");
    if (PyCallable_Check(o.ptr())) o = o();
    return o.cast<ReductionOptions>();
  }

 private:
  py::object self() const { return py::cast(static_cast<const Reduction*>(this)); }
  py::function method(const char* name) const {
    py::function f = py::get_override(static_cast<const Reduction*>(this), name);
    TORCH_CHECK(f, "Python reduction does not implement ", name, "()");
    return f;
  }
  static NamedTensors to_named(const py::object& d) {
    NamedTensors out;
    for (auto item : py::reinterpret_borrow<py::dict>(d))
      out.emplace_back(item.first.cast<std::string>(), item.second.cast<at::Tensor>());
    return out;
  }
};

at::ScalarType to_scalar_type(py::handle dtype) {
  TORCH_CHECK(THPDtype_Check(dtype.ptr()), "expected a torch.dtype, got ",
              py::str(py::type::of(dtype)).cast<std::string>());
  return reinterpret_cast<THPDtype*>(dtype.ptr())->scalar_type;
}

py::dict named_to_dict(const NamedTensors& named) {
  py::dict d;
  for (const auto& kv : named) d[py::str(kv.first)] = kv.second;
  return d;
}

NamedTensors dict_to_named(const py::dict& d) {
  NamedTensors out;
  for (auto item : d) out.emplace_back(item.first.cast<std::string>(), item.second.cast<at::Tensor>());
  return out;
}

// ------------------------------------------------------------------ store writer bindings
py::dict shard_record_to_dict(const ShardRecord& r) {
  py::dict d;
  d["shard"] = r.shard;
  d["rows_end"] = r.rows_end;
  d["file_bytes"] = r.file_bytes;
  py::list chunks;
  for (size_t j = 0; j < r.offsets.size(); ++j) {
    if (r.offsets[j] < 0) continue;
    chunks.append(py::make_tuple(static_cast<int64_t>(j), r.offsets[j], r.nbytes[j], r.crcs[j]));
  }
  d["chunks"] = chunks;  // (chunk in shard, offset, nbytes, crc32c)
  return d;
}

void bind_store_writer(py::module_& m) {
  // acs::StoreIOError -> activationscope.errors.StoreError (tried before the CaptureError
  // translator, which is registered earlier).
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const acs::StoreIOError& e) {
      py::object cls = py::module_::import("activationscope.errors").attr("StoreError");
      PyErr_SetString(cls.ptr(), e.what());
    }
  });

  m.def(
      "crc32c",
      [](py::buffer b, uint32_t crc) {
        py::buffer_info info = b.request();
        const size_t n = static_cast<size_t>(info.size * info.itemsize);
        py::gil_scoped_release nogil;
        return crc32c(crc, info.ptr, n);
      },
      py::arg("data"), py::arg("crc") = 0, "CRC-32C (Castagnoli) of a contiguous buffer.");

  py::class_<StoreCore, std::shared_ptr<StoreCore>>(m, "StoreCore")
      .def(py::init([](int64_t max_pending_bytes, bool fsync) {
             ACS_CHECK(max_pending_bytes > 0, "max_pending_bytes must be positive, got ", max_pending_bytes);
             return std::make_shared<StoreCore>(max_pending_bytes, fsync);
           }),
           py::arg("max_pending_bytes"), py::arg("fsync") = false)
      .def("drain", &StoreCore::drain, py::call_guard<py::gil_scoped_release>())
      .def("close", &StoreCore::close, py::call_guard<py::gil_scoped_release>())
      .def("check", &StoreCore::check)
      .def_property_readonly("failed", &StoreCore::failed)
      .def_property_readonly("error", &StoreCore::error)
      .def_property_readonly("pending_bytes", &StoreCore::pending_bytes)
      .def_property_readonly("durable_version", &StoreCore::durable_version)
      .def_property_readonly("max_pending_bytes", &StoreCore::max_pending_bytes)
      .def("next_to_encode",
           [](StoreCore& c) -> py::object {
             WorkItem item;
             bool ok;
             {
               py::gil_scoped_release nogil;
               ok = c.next_to_encode(&item);
             }
             if (!ok) return py::none();
             at::Tensor flat = item.raw.reshape({-1}).view(at::kByte);
             return py::make_tuple(item.id, item.array->spec().hook_point, flat,
                                   static_cast<int64_t>(c10::elementSize(item.array->spec().dtype)));
           })
      .def("submit_encoded",
           [](StoreCore& c, uint64_t id, py::buffer b) {
             py::buffer_info info = b.request();
             std::string bytes(static_cast<const char*>(info.ptr), static_cast<size_t>(info.size * info.itemsize));
             py::gil_scoped_release nogil;
             c.submit_encoded(id, std::move(bytes));
           })
      .def("fail_encoded", &StoreCore::fail_encoded);

  py::class_<ArrayWriter, RowConsumer, std::shared_ptr<ArrayWriter>>(m, "ArrayWriter")
      .def(py::init([](std::shared_ptr<StoreCore> core, std::string hook_point, std::string dir,
                       std::string tmp_dir, py::object dtype, std::vector<int64_t> feature_shape,
                       int64_t chunk_rows, int64_t shard_chunks, int64_t start_row, bool encoded) {
             ArraySpec s;
             s.hook_point = std::move(hook_point);
             s.dir = std::move(dir);
             s.tmp_dir = std::move(tmp_dir);
             s.dtype = to_scalar_type(dtype);
             s.feature_shape = std::move(feature_shape);
             s.chunk_rows = chunk_rows;
             s.shard_chunks = shard_chunks;
             s.start_row = start_row;
             s.encoded = encoded;
             return std::make_shared<ArrayWriter>(std::move(core), std::move(s));
           }),
           py::arg("core"), py::arg("hook_point"), py::arg("dir"), py::arg("tmp_dir"), py::arg("dtype"),
           py::arg("feature_shape"), py::arg("chunk_rows"), py::arg("shard_chunks"), py::arg("start_row") = 0,
           py::arg("encoded") = false)
      .def(
          "append", [](ArrayWriter& w, const at::Tensor& rows) { w.append(rows, nullptr); }, py::arg("rows"),
          py::call_guard<py::gil_scoped_release>())
      .def("flush", &ArrayWriter::flush, py::call_guard<py::gil_scoped_release>())
      .def("take_durable",
           [](ArrayWriter& w) {
             py::list out;
             for (const auto& r : w.take_durable()) out.append(shard_record_to_dict(r));
             return out;
           })
      .def_property_readonly("n_rows", &ArrayWriter::n_rows)
      .def_property_readonly("durable_rows", &ArrayWriter::durable_rows)
      .def_property_readonly("chunk_bytes", &ArrayWriter::chunk_bytes)
      .def_property_readonly("row_bytes", &ArrayWriter::row_bytes)
      .def_property_readonly("hook_point", [](const ArrayWriter& w) { return w.spec().hook_point; });
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
  } catch (py::error_already_set& e) {
    e.restore();
    return nullptr;
  } catch (...) {
    py::detail::try_translate_exceptions();  // the module's translators, then pybind11's
    return nullptr;
  }
}

}  // namespace

}  // namespace acs

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace acs;
  m.doc() = "activationscope native core: forward wrapper, capture sinks, reductions, store writer";
  m.attr("TORCH_VERSION") = ACS_TORCH_VERSION;

  // acs::UserError -> activationscope.errors.CaptureError
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const acs::UserError& e) {
      py::object cls = py::module_::import("activationscope.errors").attr("CaptureError");
      PyErr_SetString(cls.ptr(), e.what());
    }
  });

  // ---------------------------------------------------------------- capture core
  py::class_<Arena, std::shared_ptr<Arena>>(m, "Arena")
      .def(py::init<>())
      .def("reset", &Arena::reset)
      .def_property_readonly("reserved_bytes", &Arena::reserved_bytes);

  m.def("set_staging_pool_bytes", &set_pool_cap_bytes, py::arg("cap_bytes"));
  m.def("staging_pool_bytes", &pool_cap_bytes);
  m.def("pooled_staging_bytes", &pooled_bytes);
  m.def("trim_staging_pool", &trim_pool);
  m.def("set_staging_prefault", &set_prefault, py::arg("enabled"));

  py::class_<Sink, std::shared_ptr<Sink>>(m, "Sink")
      .def(py::init([](std::string name, bool snapshot, int keep, int placement, py::object storage_dtype,
                       std::shared_ptr<Arena> arena, int row_kind) {
             SinkOptions o;
             o.snapshot = snapshot;
             o.keep = static_cast<Keep>(keep);
             o.placement = static_cast<Placement>(placement);
             if (!storage_dtype.is_none()) o.storage_dtype = to_scalar_type(storage_dtype);
             auto sink = std::make_shared<Sink>(std::move(name), o, std::move(arena));
             sink->set_row_kind(row_kind);
             return sink;
           }),
           py::arg("name"), py::arg("snapshot") = true, py::arg("keep") = 0, py::arg("placement") = 0,
           py::arg("storage_dtype") = py::none(), py::arg("arena") = nullptr, py::arg("row_kind") = -1)
      .def_property_readonly("name", &Sink::name)
      .def("consume", &Sink::consume, py::arg("x"), py::arg("token_mask") = at::Tensor(),
           py::call_guard<py::gil_scoped_release>())
      .def("records", &Sink::records, py::call_guard<py::gil_scoped_release>())
      .def("clear_records", &Sink::clear_records, py::call_guard<py::gil_scoped_release>())
      .def("reference_changed", &Sink::reference_changed, py::arg("all") = false)
      .def("add_reduction", &Sink::add_reduction)
      .def_property_readonly("reductions", &Sink::reductions)
      .def("set_writer", &Sink::set_writer)
      .def_property_readonly("has_writer", &Sink::has_writer)
      .def_property_readonly("row_kind", &Sink::row_kind)
      .def_property_readonly("n_rows", &Sink::n_rows)
      .def_property_readonly("n_calls", &Sink::n_calls)
      .def_property_readonly("feature_shape", &Sink::feature_shape);

  py::class_<TrackerCore, std::shared_ptr<TrackerCore>>(m, "TrackerCore")
      .def(py::init([](py::object on_new, py::object on_start, py::object on_end) {
             auto c = std::make_shared<TrackerCore>();
             c->on_new_hook_point = std::move(on_new);
             c->on_forward_start = std::move(on_start);
             c->on_forward_end = std::move(on_end);
             return c;
           }),
           py::arg("on_new_hook_point"), py::arg("on_forward_start") = py::none(),
           py::arg("on_forward_end") = py::none())
      .def_readwrite("active", &TrackerCore::active)
      .def_readwrite("on_new_hook_point", &TrackerCore::on_new_hook_point)
      .def_readwrite("on_forward_start", &TrackerCore::on_forward_start)
      .def_readwrite("on_forward_end", &TrackerCore::on_forward_end)
      .def_property(
          "policy", [](const TrackerCore& c) { return static_cast<int>(c.policy); },
          [](TrackerCore& c, int p) { c.policy = static_cast<Policy>(p); })
      .def_readwrite("sample_every", &TrackerCore::sample_every)
      .def_readwrite("max_k", &TrackerCore::max_k)
      .def_readwrite("token_mask", &TrackerCore::token_mask)
      .def_readonly("n_forwards", &TrackerCore::n_forwards)
      .def_readonly("capturing", &TrackerCore::capturing)
      .def_readonly("batch_size", &TrackerCore::batch_size)
      .def("sinks", [](const TrackerCore& c) {
        py::dict d;
        for (const auto& kv : c.sinks)
          if (kv.second) d[py::str(kv.first)] = kv.second;
        return d;
      })
      .def("changed_references",
           [](TrackerCore& c, bool all) {
             // Hook points whose REFERENCE records were changed in place since capture.
             std::vector<std::string> names;
             for (const auto& kv : c.sinks)
               if (kv.second && kv.second->reference_changed(all)) names.push_back(kv.first);
             return names;
           },
           py::arg("all") = false)
      .def("release_callbacks", [](TrackerCore& c) {
        c.on_new_hook_point = py::none();
        c.on_forward_start = py::none();
        c.on_forward_end = py::none();
      });

  py::class_<Site, std::shared_ptr<Site>>(m, "Site")
      .def(py::init([](std::shared_ptr<TrackerCore> core, std::string path, bool cap_in, bool cap_out, bool root) {
             auto s = std::make_shared<Site>();
             s->core = std::move(core);
             s->path = std::move(path);
             s->capture_input = cap_in;
             s->capture_output = cap_out;
             s->is_root = root;
             return s;
           }),
           py::arg("core"), py::arg("path"), py::arg("capture_input"), py::arg("capture_output"),
           py::arg("is_root") = false)
      .def_readonly("path", &Site::path);

  auto forward_wrapper_cls = py::class_<ForwardWrapper>(m, "ForwardWrapper", py::dynamic_attr());
  forward_wrapper_cls
      .def(py::init<py::object>(), py::arg("original"))
      .def("__call__", &ForwardWrapper::call)
      .def("add_site", &ForwardWrapper::add_site)
      .def("remove_site", &ForwardWrapper::remove_site)
      .def_property_readonly("n_sites", &ForwardWrapper::n_sites)
      .def_property_readonly("original", &ForwardWrapper::original);
  reinterpret_cast<PyTypeObject*>(forward_wrapper_cls.ptr())->tp_call = forward_wrapper_tp_call;
  PyType_Modified(reinterpret_cast<PyTypeObject*>(forward_wrapper_cls.ptr()));

  // ---------------------------------------------------------------- reductions
  py::class_<Reduction, PyReduction, std::shared_ptr<Reduction>>(m, "Reduction", py::dynamic_attr())
      .def(py::init<>())
      .def("update", &Reduction::update, py::arg("rows"), py::arg("row_offset") = 0,
           py::call_guard<py::gil_scoped_release>())
      .def("merge", &Reduction::merge, py::arg("other"), py::call_guard<py::gil_scoped_release>())
      .def("result", [](const Reduction& r) { return named_to_dict(r.result()); })
      .def("state", [](const Reduction& r) { return named_to_dict(r.state()); })
      .def("load_state", [](Reduction& r, const py::dict& d) { r.load_state(dict_to_named(d)); })
      .def("fresh", &Reduction::fresh)
      .def_property_readonly("kind", &Reduction::kind)
      .def_property_readonly("options", &Reduction::options);
  m.def("make_builtin_reduction", &make_builtin_reduction, py::arg("kind"),
        py::arg("options") = ReductionOptions{});
  m.def("make_script_reduction", &make_script_reduction, py::arg("path"),
        py::arg("options") = ReductionOptions{});
  m.def("builtin_reduction_kinds", &builtin_reduction_kinds);
  m.def("update_reductions", &update_reductions, py::arg("reductions"), py::arg("rows"),
        py::arg("row_offset") = 0, py::call_guard<py::gil_scoped_release>(),
        "Update several reductions with the same rows, as a capture sink does (built-in moments "
        "and extrema share their passes over the rows).");

  // ---------------------------------------------------------------- store writer
  py::class_<RowConsumer, std::shared_ptr<RowConsumer>>(m, "RowConsumer");
  m.def("map_files_contiguous", &map_files_contiguous, py::arg("paths"), py::arg("stride_bytes"),
        py::arg("total_bytes"), py::call_guard<py::gil_scoped_release>(),
        "Map files back to back into one contiguous copy-on-write uint8 tensor (see shard_map.h).");
  bind_store_writer(m);
}
