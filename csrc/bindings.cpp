// The Python bindings of the native core, and nothing else: the capture side (forward
// wrapper, sinks, staging), the reductions and the store writer. The code they bind lives in
// forward_wrapper.cpp, sink.cpp, reductions_*.cpp, shard_writer.cpp; native exceptions reach
// Python through py_errors.cpp.
#include <torch/extension.h>

#include <torch/csrc/Dtype.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "errors.h"
#include "forward_wrapper.h"
#include "gil.h"
#include "py_errors.h"
#include "reductions.h"
#include "reduction_kernels.h"
#include "row_consumer.h"
#include "row_gather.h"
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
  // A Python reduction may keep more than its state (the eager reduction's made_nonfinite
  // flags): its own checkpoint() / restore_checkpoint() when it has them, else the default's.
  void checkpoint() override {
    py::gil_scoped_acquire gil;
    py::function f = py::get_override(static_cast<const Reduction*>(this), "checkpoint");
    if (f) {
      f();
      return;
    }
    Reduction::checkpoint();
  }
  void restore_checkpoint() override {
    py::gil_scoped_acquire gil;
    py::function f = py::get_override(static_cast<const Reduction*>(this), "restore_checkpoint");
    if (f) {
      f();
      return;
    }
    Reduction::restore_checkpoint();
  }
  // (likewise the eager reduction's undo_update, which puts its made_nonfinite flags back too)
  void undo_update(const NamedTensors& before) override {
    py::gil_scoped_acquire gil;
    py::function f = py::get_override(static_cast<const Reduction*>(this), "undo_update");
    if (f) {
      py::dict d;
      for (const auto& kv : before) d[py::str(kv.first)] = kv.second;
      f(d);
      return;
    }
    Reduction::undo_update(before);
  }
  // A Python reduction's own made_nonfinite (the eager reduction's property), else the default's
  // (the property Reduction binds calls this very method: not asked again).
  bool made_nonfinite() const override {
    py::gil_scoped_acquire gil;
    py::object self_type = py::type::of(self());
    py::object base = py::type::of<Reduction>();
    if (py::getattr(self_type, "made_nonfinite").is(py::getattr(base, "made_nonfinite")))
      return Reduction::made_nonfinite();
    return py::getattr(self(), "made_nonfinite").cast<bool>();
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

// The enum value of code `code` of a Python-side enum with `n` members 0..n-1 (`names` for
// the message); TORCH_CHECK fails on any other code instead of casting it blindly.
template <typename E>
E enum_from_int(int code, int n, const char* what, const char* names) {
  TORCH_CHECK(code >= 0 && code < n, what, " must be ", names, ", got ", code);
  return static_cast<E>(code);
}

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

// The row counts of a store writer's arrays at each recorded batch, read in one call: the
// per-forward bookkeeping of add_batch (rows each array got since the last batch, against
// the batch's samples or tokens) without one Python attribute access per array.
class RowCounts {
 public:
  void add(std::shared_ptr<ArrayWriter> w, bool token_rows, int64_t last) {
    ACS_CHECK(w, "RowCounts.add: no array writer");
    writers_.push_back(std::move(w));
    token_.push_back(token_rows ? 1 : 0);
    last_.push_back(last);
  }
  // Each array's rows now, as a tuple in the order added, and the positions of the arrays
  // whose rows since the last step differ from n_samples (sample rows) or n_tokens (token
  // rows), each with the rows it got; the rows now become the last step's.
  py::tuple step(int64_t n_samples, int64_t n_tokens) {
    const size_t k = writers_.size();
    py::tuple cums(k);
    py::list off;
    for (size_t i = 0; i < k; ++i) {
      const int64_t cum = writers_[i]->n_rows();
      const int64_t got = cum - last_[i];
      if (got != (token_[i] ? n_tokens : n_samples)) off.append(py::make_tuple(i, got));
      last_[i] = cum;
      cums[i] = py::int_(cum);
    }
    return py::make_tuple(std::move(cums), std::move(off));
  }
  // Rows each array got since the last step (in the order added).
  std::vector<int64_t> since_last() const {
    std::vector<int64_t> out(writers_.size());
    for (size_t i = 0; i < writers_.size(); ++i) out[i] = writers_[i]->n_rows() - last_[i];
    return out;
  }
  size_t size() const { return writers_.size(); }

 private:
  std::vector<std::shared_ptr<ArrayWriter>> writers_;
  std::vector<uint8_t> token_;
  std::vector<int64_t> last_;
};

void bind_store_writer(py::module_& m) {
  m.def(
      "crc32c",
      [](py::buffer b, uint32_t crc) {
        py::buffer_info info = b.request();
        const size_t n = static_cast<size_t>(info.size * info.itemsize);
        ReleaseGil nogil;
        return crc32c(crc, info.ptr, n);
      },
      py::arg("data"), py::arg("crc") = 0, "CRC-32C (Castagnoli) of a contiguous buffer.");

  py::class_<StoreCore, std::shared_ptr<StoreCore>>(m, "StoreCore")
      .def(py::init([](int64_t max_pending_bytes, bool fsync) {
             ACS_CHECK(max_pending_bytes > 0, "max_pending_bytes must be positive, got ", max_pending_bytes);
             return StoreCore::make(max_pending_bytes, fsync);
           }),
           py::arg("max_pending_bytes"), py::arg("fsync") = false)
      .def("drain", &StoreCore::drain, py::call_guard<ReleaseGil>())
      .def("close", &StoreCore::close, py::call_guard<ReleaseGil>())
      .def("check", &StoreCore::check)
      .def("refuse", &StoreCore::refuse, py::arg("why"))
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
               ReleaseGil nogil;
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
             ReleaseGil nogil;
             c.submit_encoded(id, std::move(bytes));
           })
      .def("fail_encoded", &StoreCore::fail_encoded);

  py::class_<ArrayWriter, RowConsumer, std::shared_ptr<ArrayWriter>>(m, "ArrayWriter")
      .def(py::init([](std::shared_ptr<StoreCore> core, std::string hook_point, std::string dir,
                       std::string tmp_dir, py::object dtype, std::vector<int64_t> feature_shape,
                       int64_t chunk_rows, int64_t shard_chunks, int64_t start_row, bool encoded,
                       int64_t hold_shard, std::string root) {
             ArraySpec s;
             s.hook_point = std::move(hook_point);
             s.dir = std::move(dir);
             s.tmp_dir = std::move(tmp_dir);
             s.root = std::move(root);
             s.dtype = to_scalar_type(dtype);
             s.feature_shape = std::move(feature_shape);
             s.chunk_rows = chunk_rows;
             s.shard_chunks = shard_chunks;
             s.start_row = start_row;
             s.encoded = encoded;
             s.hold_shard = hold_shard;
             return std::make_shared<ArrayWriter>(std::move(core), std::move(s));
           }),
           py::arg("core"), py::arg("hook_point"), py::arg("dir"), py::arg("tmp_dir"), py::arg("dtype"),
           py::arg("feature_shape"), py::arg("chunk_rows"), py::arg("shard_chunks"), py::arg("start_row") = 0,
           py::arg("encoded") = false, py::arg("hold_shard") = -1, py::arg("root") = "")
      .def(
          "append", [](ArrayWriter& w, const at::Tensor& rows) { w.append(rows, nullptr); }, py::arg("rows"),
          py::call_guard<ReleaseGil>())
      .def("flush", &ArrayWriter::flush, py::call_guard<ReleaseGil>())
      .def("snapshot", &ArrayWriter::snapshot, py::call_guard<ReleaseGil>())
      .def("held_shards", &ArrayWriter::held_shards, py::call_guard<ReleaseGil>())
      .def("install_held",
           [](ArrayWriter& w, std::vector<int64_t> shards) {
             std::vector<ShardRecord> recs;
             {
               ReleaseGil nogil;
               recs = w.install_held(shards);
             }
             py::list out;
             for (const auto& r : recs) out.append(shard_record_to_dict(r));
             return out;
           })
      .def("drop_held", &ArrayWriter::drop_held, py::call_guard<ReleaseGil>())
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

  py::class_<RowCounts>(m, "RowCounts")
      .def(py::init<>())
      .def("add", &RowCounts::add, py::arg("writer"), py::arg("token_rows"), py::arg("last"))
      .def("step", &RowCounts::step, py::arg("n_samples"), py::arg("n_tokens"))
      .def("since_last", &RowCounts::since_last)
      .def("__len__", &RowCounts::size);
}

void bind_capture(py::module_& m) {
  py::class_<Arena, std::shared_ptr<Arena>>(m, "Arena")
      .def(py::init<>())
      .def("reset", &Arena::reset)
      .def_property_readonly("reserved_bytes", &Arena::reserved_bytes);

  m.def(
      "is_token_rows",
      [](const at::Tensor& x, const std::optional<at::Tensor>& mask) {
        return is_token_rows(x, mask.has_value() ? *mask : at::Tensor());
      },
      py::arg("x"), py::arg("token_mask"),
        "Whether x holds token rows under token_mask (the rule of the capture sink, sink.h).");
  m.def(
      "last_match",
      [](const at::Tensor& x, const std::vector<std::shared_ptr<Sink>>& sinks) -> int64_t {
        for (int64_t i = static_cast<int64_t>(sinks.size()) - 1; i >= 0; --i) {
          if (sinks[i]->matches_last(x)) return i;
        }
        return -1;
      },
      py::arg("x"), py::arg("sinks"), py::call_guard<ReleaseGil>(),
      "Index of the last of sinks whose last call's tensor x is (Sink.matches_last), or -1: one "
      "GIL release for the whole search.");
  m.def("set_staging_pool_bytes", &set_pool_cap_bytes, py::arg("cap_bytes"));
  m.def("staging_pool_bytes", &pool_cap_bytes);
  m.def("pooled_staging_bytes", &pooled_bytes);
  m.def("trim_staging_pool", &trim_pool);
  m.def("set_staging_prefault", &set_prefault, py::arg("enabled"));

  py::class_<Sink, std::shared_ptr<Sink>>(m, "Sink")
      .def(py::init([](std::string name, bool snapshot, int keep, int placement, py::object storage_dtype,
                       std::shared_ptr<Arena> arena, int row_kind, std::optional<std::string> module) {
             SinkOptions o;
             o.snapshot = snapshot;
             o.keep = enum_from_int<Keep>(keep, 3, "Sink keep", "0 (ALL), 1 (LAST) or 2 (NONE)");
             o.placement = enum_from_int<Placement>(placement, 4, "Sink placement",
                                                    "0 (AUTO), 1 (CPU), 2 (GPU) or 3 (DISK)");
             TORCH_CHECK(row_kind >= -1 && row_kind <= 1,
                         "Sink row_kind must be -1 (from the first tensor), 0 (sample rows) or 1 (token rows), got ",
                         row_kind);
             if (!storage_dtype.is_none()) o.storage_dtype = to_scalar_type(storage_dtype);
             auto sink = std::make_shared<Sink>(std::move(name), o, std::move(arena), std::move(module));
             sink->set_row_kind(row_kind);
             return sink;
           }),
           py::arg("name"), py::arg("snapshot") = true, py::arg("keep") = 0, py::arg("placement") = 0,
           py::arg("storage_dtype") = py::none(), py::arg("arena") = nullptr, py::arg("row_kind") = -1,
           py::arg("module") = py::none())
      .def_property_readonly("name", &Sink::name)
      .def("consume", &Sink::consume, py::arg("x"), py::arg("token_mask") = at::Tensor(),
           py::call_guard<ReleaseGil>())
      .def("records", &Sink::records, py::call_guard<ReleaseGil>())
      .def("clear_records", &Sink::clear_records, py::call_guard<ReleaseGil>())
      .def("reference_changed", &Sink::reference_changed, py::arg("all") = false, py::call_guard<ReleaseGil>())
      .def("add_reduction", &Sink::add_reduction)
      .def_property_readonly("reductions", &Sink::reductions)
      .def(
          "reduction_result",
          [](Sink& s, int64_t index) {
            NamedTensors r;
            {
              ReleaseGil nogil;  // (the sink's lock: a capturing thread may hold it, waiting for the GIL)
              r = s.reduction_result(index);
            }
            return named_to_dict(r);
          },
          py::arg("index"))
      .def("reduction_made_nonfinite", &Sink::reduction_made_nonfinite, py::arg("index"),
           py::call_guard<ReleaseGil>())  // (the sink's lock, as reduction_result)
      .def("set_writer", &Sink::set_writer)
      .def(
          "set_one_layout",
          [](Sink& s, bool on, py::object dtype, std::vector<int64_t> feature_shape) {
            s.set_one_layout(on, dtype.is_none() ? std::nullopt : std::optional<at::ScalarType>(to_scalar_type(dtype)),
                             std::move(feature_shape));
          },
          py::arg("on"), py::arg("dtype") = py::none(), py::arg("feature_shape") = std::vector<int64_t>{})
      .def(
          "set_uncast_storage_dtype",
          [](Sink& s, py::object dtype, py::object first) {
            s.set_uncast_storage_dtype(to_scalar_type(dtype), to_scalar_type(first));
          },
          py::arg("dtype"), py::arg("first"))
      .def("set_stored", &Sink::set_stored, py::arg("on"))
      .def("set_keep_forward_start", &Sink::set_keep_forward_start, py::arg("on"), py::call_guard<ReleaseGil>())
      .def("rollback_forward", &Sink::rollback_forward, py::arg("forward"), py::call_guard<ReleaseGil>())
      .def("wait_reductions", &Sink::wait_reductions, py::call_guard<ReleaseGil>())
      .def_property_readonly("has_writer", &Sink::has_writer)
      .def_property_readonly("row_kind", &Sink::row_kind)
      .def_property_readonly("n_rows", &Sink::n_rows)
      .def_property_readonly("n_calls", &Sink::n_calls)
      .def("set_row_base", &Sink::set_row_base, py::arg("base"))
      // (these take sink locks, which a capturing thread may hold while it waits for the GIL in
      // a Python reduction: they release the GIL first)
      .def("set_alias_of", &Sink::set_alias_of, py::arg("target"), py::arg("shares_records") = false,
           py::call_guard<ReleaseGil>())
      .def_property_readonly("shares_records", &Sink::shares_records)
      .def("watch_aliases", &Sink::watch_aliases, py::arg("on"), py::call_guard<ReleaseGil>())
      .def("matches_last", &Sink::matches_last, py::arg("x"), py::call_guard<ReleaseGil>())
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
      .def_readwrite("closing", &TrackerCore::closing)
      .def_readonly("in_flight", &TrackerCore::in_flight)
      .def_property_readonly("calls_elsewhere", &TrackerCore::calls_elsewhere)
      // a root forward of this tracker is running on the calling thread (the close is called inside it)
      .def_property_readonly("open_here",
                             [](const TrackerCore& c) { return c.depth > 0 && c.owner == std::this_thread::get_id(); })
      .def_readwrite("on_new_hook_point", &TrackerCore::on_new_hook_point)
      .def_readwrite("on_forward_start", &TrackerCore::on_forward_start)
      .def_readwrite("on_forward_end", &TrackerCore::on_forward_end)
      .def_property(
          "policy", [](const TrackerCore& c) { return static_cast<int>(c.policy); },
          [](TrackerCore& c, int p) { c.policy = policy_from_int(p); })
      .def_readwrite("sample_every", &TrackerCore::sample_every)
      .def_readwrite("max_k", &TrackerCore::max_k)
      .def_readwrite("token_mask", &TrackerCore::token_mask)
      .def_readwrite("token_rows", &TrackerCore::token_rows)
      .def_property_readonly("auto_token_mask",
                             [](const TrackerCore& c) { return c.auto_mask.defined() ? c.auto_mask : at::empty({0}); })
      .def_readwrite("stop_after_last", &TrackerCore::stop_after_last)
      .def_readwrite("roots_only", &TrackerCore::roots_only)
      .def_readonly("outside_calls", &TrackerCore::outside_calls)
      .def_property_readonly("stop_learnt", [](const TrackerCore& c) { return c.stop_count > 0; })
      .def_readonly("stopped", &TrackerCore::stopped)
      .def_readonly("past_stop", &TrackerCore::past_stop)
      .def_readonly("n_forwards", &TrackerCore::n_forwards)
      .def_readonly("capturing", &TrackerCore::capturing)
      .def_readonly("in_graph", &TrackerCore::in_graph)
      .def_readonly("batch_size", &TrackerCore::batch_size)
      .def_readonly("second_dim", &TrackerCore::second_dim)
      // (tests) entries of the cache of types the walk does not enter (UnwalkedTypes)
      .def_property_readonly("_unwalked_types_cached", [](const TrackerCore& c) { return c.unwalked_types.size(); })
      .def("sinks", [](const TrackerCore& c) {
        py::dict d;
        for (const auto& kv : c.sinks)
          if (kv.second) d[py::str(kv.first)] = kv.second;
        return d;
      })
      .def("alias_mismatch",
           [](TrackerCore& c) {
             // A store's alias hook point whose calls since the last check differ from its
             // target's (a forward in which one of them gave no tensor), else "": each such
             // alias is stored as its target's array, so the two must be captured alike. The sinks are scanned
             // only when the alias tally moved (or a sink was added) since the last check.
             const uint64_t tally = c.alias_tally->sum.load(std::memory_order_relaxed);
             if (!c.alias_scan_needed && tally == c.alias_checked) return std::string();
             c.alias_checked = tally;
             c.alias_scan_needed = false;
             std::string bad;
             for (const auto& kv : c.sinks) {
               const auto& s = kv.second;
               if (!s || !s->alias_of() || s->shares_records()) continue;  // (in memory: need not pair)
               const int64_t own = s->n_calls(), target = s->alias_of()->n_calls();
               auto& last = c.alias_rows[kv.first];
               if (own - last.first != target - last.second && bad.empty()) bad = kv.first;
               last = {own, target};
             }
             return bad;
           })
      .def("changed_references",
           [](TrackerCore& c, bool all) {
             // Hook points whose REFERENCE records were changed in place since capture.
             std::vector<std::pair<std::string, std::shared_ptr<Sink>>> sinks;
             for (const auto& kv : c.sinks)
               if (kv.second) sinks.emplace_back(kv.first, kv.second);
             std::vector<std::string> names;
             ReleaseGil nogil;  // (sink locks: see watch_aliases)
             for (const auto& [name, sink] : sinks)
               if (sink->reference_changed(all)) names.push_back(name);
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
      .def("set_kw_order", &ForwardWrapper::set_kw_order)
      .def_property_readonly("kw_order", &ForwardWrapper::kw_order)
      .def("remove_site", &ForwardWrapper::remove_site)
      .def_property_readonly("n_sites", &ForwardWrapper::n_sites)
      .def_property_readonly("original", &ForwardWrapper::original)
      .def_property_readonly("key", &ForwardWrapper::key)
      .def("plan", &ForwardWrapper::plan,
           "(any site captures inputs, any captures outputs, any is a root, any needs the eager path)")
      .def("paths", &ForwardWrapper::paths)
      .def("call_eager", [](py::object self, py::args args, py::kwargs kwargs) {
        // The traced __call__'s way out of the graph (a graph break) for a wrapper whose
        // capture cannot run in a graph (plan()[3]); says so once per wrapper.
        auto& w = self.cast<ForwardWrapper&>();
        w.warn_eager_once();
        return w.call(std::move(args), std::move(kwargs));
      });
  reinterpret_cast<PyTypeObject*>(forward_wrapper_cls.ptr())->tp_call = forward_wrapper_tp_call;
  PyType_Modified(reinterpret_cast<PyTypeObject*>(forward_wrapper_cls.ptr()));
  // The Python-level __call__ that TorchDynamo traces (capture/compiled.py): put in the type's
  // dict directly, so that the slot calls keep going to forward_wrapper_tp_call (setting it
  // as an attribute would repoint tp_call to the Python function).
  m.def("_set_traced_call", [forward_wrapper_cls](py::function fn) {
    auto* type = reinterpret_cast<PyTypeObject*>(forward_wrapper_cls.ptr());
    if (PyDict_SetItemString(type->tp_dict, "__call__", fn.ptr()) != 0) throw py::error_already_set();
    PyType_Modified(type);
    TORCH_CHECK(type->tp_call == forward_wrapper_tp_call, "ForwardWrapper.tp_call was repointed");
  });
}

void bind_reductions(py::module_& m) {
  py::class_<Reduction, PyReduction, std::shared_ptr<Reduction>>(m, "Reduction", py::dynamic_attr())
      .def(py::init<>())
      .def("update", &Reduction::update, py::arg("rows"), py::arg("row_offset") = 0,
           py::call_guard<ReleaseGil>())
      .def("merge", &Reduction::merge, py::arg("other"), py::call_guard<ReleaseGil>())
      .def("result", [](const Reduction& r) { return named_to_dict(r.result()); })
      .def("state", [](const Reduction& r) { return named_to_dict(r.state()); })
      .def("load_state", [](Reduction& r, const py::dict& d) { r.load_state(dict_to_named(d)); })
      .def("fresh", &Reduction::fresh)
      .def_property_readonly("kind", &Reduction::kind)
      .def_property_readonly("options", &Reduction::options)
      .def_property_readonly("made_nonfinite", &Reduction::made_nonfinite);
  m.def("make_builtin_reduction", &make_builtin_reduction, py::arg("kind"),
        py::arg("options") = ReductionOptions{});
  m.def("make_script_reduction", &make_script_reduction, py::arg("path"),
        py::arg("options") = ReductionOptions{}, py::arg("name") = std::string());
  m.def("builtin_reduction_kinds", &builtin_reduction_kinds);
  m.def("update_reductions", &update_reductions, py::arg("reductions"), py::arg("rows"),
        py::arg("row_offset") = 0, py::call_guard<ReleaseGil>(),
        "Update several reductions with the same rows, as a capture sink does (built-in moments "
        "and extrema share their passes over the rows).");
  m.def("_set_avx512_kernels", &kernels::set_avx512_kernels, py::arg("on"),
        "Let the float32 reduction kernels use AVX-512 where the CPU has it (on by default; off: "
        "the AVX2 kernels, the same results bit for bit). Returns whether the CPU has AVX-512 (tests).");
}

void bind_store(py::module_& m) {
  py::class_<RowConsumer, std::shared_ptr<RowConsumer>>(m, "RowConsumer");
  m.def("map_files_contiguous", &map_files_contiguous, py::arg("paths"), py::arg("stride_bytes"),
        py::arg("total_bytes"), py::call_guard<ReleaseGil>(),
        "Map files back to back into one contiguous copy-on-write uint8 tensor (see shard_map.h).");
  m.def("_hold_map_guard", &hold_map_guard_for_tests, py::arg("ready_fd"), py::arg("release_fd"),
        py::arg("then_s"), py::call_guard<ReleaseGil>(),
        "Hold the lock of the mapping registry until a byte is read from release_fd, then then_s seconds "
        "more (see shard_map.h; tests).");
  m.def("gather_rows", &gather_rows, py::arg("index"), py::arg("n"), py::arg("start"), py::arg("bounds"),
        py::arg("segments"), py::arg("want_ids") = false, py::arg("out") = py::none(), py::arg("hint") = py::none(),
        "Rows at dataset positions from an array's mapped segments, in one pass (see row_gather.h).");
  bind_store_writer(m);
}

}  // namespace

}  // namespace acs

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "activationscope native core: forward wrapper, capture sinks, reductions, store writer";
  m.attr("TORCH_VERSION") = ACS_TORCH_VERSION;
  m.attr("_StopForward") = py::handle(acs::stop_forward_type());
  m.attr("_UNWALKED_TYPES_CAP") = py::int_(acs::UnwalkedTypes::kCap);  // (tests)
  acs::register_error_translators();
  acs::bind_capture(m);
  acs::bind_reductions(m);
  acs::bind_store(m);
}
