#include "row_gather.h"

#include <Python.h>

#include <algorithm>
#include <atomic>
#include <optional>
#include <cstdint>
#include <cstring>

#ifdef __linux__
#include <sys/mman.h>
#include <unistd.h>
#endif

#include "gil.h"
#include "py_tensor.h"
#include "shard_map.h"

namespace py = pybind11;

namespace acs {

namespace {

// Ask for the cache line at p ahead of its read (a hint: nothing where the compiler has none).
inline void prefetch(const void* p) {
#if defined(__GNUC__) || defined(__clang__)
  __builtin_prefetch(p);
#else
  (void)p;
#endif
}

// Store rows of the positions, or false when a position is not an in-range int.
bool store_rows(const py::handle& index, int64_t n, int64_t start, std::vector<int64_t>& rows) {
  auto to_row = [&](int64_t p, int64_t& out) {
    if (p < -n || p >= n) return false;
    out = start + (p < 0 ? p + n : p);
    return true;
  };
  if (PyList_Check(index.ptr()) || PyTuple_Check(index.ptr())) {
    PyObject* seq = index.ptr();
    const Py_ssize_t k = PySequence_Fast_GET_SIZE(seq);
    PyObject** items = PySequence_Fast_ITEMS(seq);
    rows.resize(static_cast<size_t>(k));
    for (Py_ssize_t i = 0; i < k; ++i) {
      PyObject* o = items[i];
      if (!PyLong_CheckExact(o)) return false;  // bools, numpy ints, floats: the general path
      int overflow = 0;
      const long long p = PyLong_AsLongLongAndOverflow(o, &overflow);
      if (overflow || (p == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return false;
      }
      if (!to_row(static_cast<int64_t>(p), rows[static_cast<size_t>(i)])) return false;
    }
    return true;
  }
  if (is_tensor_object(index.ptr())) {
    const at::Tensor t = THPVariable_Unpack(index.ptr());
    if (t.dim() != 1 || t.scalar_type() != at::kLong || !t.device().is_cpu() || t.layout() != at::kStrided)
      return false;
    const int64_t k = t.size(0);
    const int64_t* p = t.data_ptr<int64_t>();
    const int64_t step = t.stride(0);
    rows.resize(static_cast<size_t>(k));
    for (int64_t i = 0; i < k; ++i)
      if (!to_row(p[i * step], rows[static_cast<size_t>(i)])) return false;
    return true;
  }
  return false;
}

// Cold rows of a file mapping: ask the kernel to read the batch's rows, all at once
// (madvise(MADV_WILLNEED) per row: many reads in flight), before the copy touches them. A
// touched cold row is otherwise faulted in with a read-around of the device's read-ahead
// (read_ahead_kb: 128 KiB to several MiB) around it, one fault at a time: a shuffled batch of
// 16 KiB rows from a store larger than the page cache read up to 500 times its bytes, one
// request after another. `block` > 0 widens each row's range to the aligned blocks of that
// many bytes around it (a store that fits in memory: an epoch reads it all anyway, in fewer,
// larger reads); 0 reads each row's own pages; < 0 gives no hint. A warm batch (the first
// page of up to 4 rows spread over it all in the page cache: a store read before, or one in
// memory) costs those mincore calls only, and with `state` (see gather_rows) fewer: after
// warm batches in a row, the next 1, 3, 7, ... up to 63 batches are taken as warm unchecked
// (a warm epoch checks one batch in 64; a store evicted meanwhile faults its pages in, as
// without hints, until the next check). Hints only: a failing call changes nothing but
// speed. Called without the GIL.
void advise_cold_rows(const std::vector<int64_t>& rows, const std::vector<int32_t>& seg_of,
                      const std::vector<const char*>& base, const std::vector<int64_t>& bounds,
                      int64_t row_bytes, int64_t block, int64_t* state) {
#ifdef __linux__
  static const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  if (block < 0 || row_bytes <= 0 || rows.empty() || page == 0 || (page & (page - 1))) return;
  uintptr_t blk = page;
  while (blk < static_cast<uintptr_t>(block) && blk < (uintptr_t{1} << 30)) blk <<= 1;  // a power of two
  auto addr = [&](size_t i) {
    const size_t j = static_cast<size_t>(seg_of[i]);
    return reinterpret_cast<uintptr_t>(base[j] + (rows[i] - bounds[j]) * row_bytes);
  };
  // state (the caller's, per array): {batches left to take as warm unchecked, warm streak}
  std::optional<std::atomic_ref<int64_t>> skip, streak;
  if (state) {
    skip.emplace(state[0]);
    streak.emplace(state[1]);
    const int64_t left = skip->load(std::memory_order_relaxed);
    if (left > 0) {  // warm lately: checked again in a few batches
      skip->store(left - 1, std::memory_order_relaxed);
      return;
    }
  }
  const size_t k = rows.size();
  const size_t step = (k + 3) / 4;  // at most 4 mincore calls (a few us)
  bool cold = false;
  unsigned char vec = 0;
  for (size_t i = 0; i < k && !cold; i += step) {
    const uintptr_t lo = addr(i) & ~(page - 1);
    if (mincore(reinterpret_cast<void*>(lo), page, &vec) != 0) return;  // not a mapping to ask about
    cold = !(vec & 1);
  }
  if (state) {  // warm batches in a row: the next 1, 3, 7, ... up to 63 are not checked
    const int64_t last = std::clamp<int64_t>(streak->load(std::memory_order_relaxed), 0, 63);  // (any caller's value)
    const int64_t next = cold ? 0 : std::min<int64_t>(2 * last + 1, 63);
    streak->store(next, std::memory_order_relaxed);
    skip->store(next, std::memory_order_relaxed);
  }
  if (!cold) return;
  for (size_t i = 0; i < k; ++i) {
    // (a block is clipped to the row's segment: the mapping may end inside it)
    const size_t j = static_cast<size_t>(seg_of[i]);
    const uintptr_t seg_lo = reinterpret_cast<uintptr_t>(base[j]) & ~(page - 1);
    const uintptr_t seg_hi = reinterpret_cast<uintptr_t>(base[j]) +
                             static_cast<uintptr_t>((bounds[j + 1] - bounds[j]) * row_bytes);
    const uintptr_t a = addr(i);
    const uintptr_t lo = std::max(a & ~(blk - 1), seg_lo);
    const uintptr_t hi = std::min((a + static_cast<uintptr_t>(row_bytes) + blk - 1) & ~(blk - 1), seg_hi);
    if (hi > lo) madvise(reinterpret_cast<void*>(lo), static_cast<size_t>(hi - lo), MADV_WILLNEED);
  }
#else
  (void)rows, (void)seg_of, (void)base, (void)bounds, (void)row_bytes, (void)block, (void)state;
#endif
}

}  // namespace

py::object gather_rows(const py::handle& index, int64_t n, int64_t start, const std::vector<int64_t>& bounds,
                       const py::list& segments, bool want_ids, const py::object& out_arg, const py::object& hint) {
  const size_t n_seg = bounds.size() < 2 ? 0 : bounds.size() - 1;
  if (n_seg == 0 || static_cast<size_t>(py::len(segments)) != n_seg || n <= 0) return py::none();
  int64_t hint_block = -1;
  int64_t* hint_state = nullptr;
  if (PyLong_CheckExact(hint.ptr())) {
    int overflow = 0;
    const long long b = PyLong_AsLongLongAndOverflow(hint.ptr(), &overflow);
    hint_block = overflow > 0 ? (int64_t{1} << 30) : overflow < 0 ? -1 : static_cast<int64_t>(b);  // (clipped to 1 GiB)
  } else if (is_tensor_object(hint.ptr())) {
    at::Tensor h = THPVariable_Unpack(hint.ptr());
    if (h.device().is_cpu() && h.scalar_type() == at::kLong && h.dim() == 1 && h.size(0) == 3 && h.is_contiguous()) {
      hint_block = h.data_ptr<int64_t>()[0];
      hint_state = h.data_ptr<int64_t>() + 1;
    }
  }
  std::vector<int64_t> rows;
  if (!store_rows(index, n, start, rows) || rows.empty()) return py::none();
  const int64_t k = static_cast<int64_t>(rows.size());

  // Segment of every row (consecutive rows usually share one: check the last one first).
  std::vector<int32_t> seg_of(rows.size());
  size_t s = 0;
  bool consecutive = true;
  for (size_t i = 0; i < rows.size(); ++i) {
    const int64_t r = rows[i];
    if (r < bounds[s] || r >= bounds[s + 1]) {
      auto it = std::upper_bound(bounds.begin(), bounds.end(), r);
      if (it == bounds.begin() || it == bounds.end()) return py::none();  // outside the array
      s = static_cast<size_t>(it - bounds.begin()) - 1;
    }
    seg_of[i] = static_cast<int32_t>(s);
    if (i && (r != rows[i - 1] + 1 || seg_of[i] != seg_of[i - 1])) consecutive = false;
  }

  // The segments touched, all mapped, contiguous, with one row layout.
  std::vector<at::Tensor> segs(n_seg);
  std::vector<const char*> base(n_seg, nullptr);
  int64_t row_bytes = -1;
  at::Tensor first;
  for (size_t i = 0; i < rows.size(); ++i) {
    const size_t j = static_cast<size_t>(seg_of[i]);
    if (base[j]) continue;
    py::handle h = segments[j];
    if (h.is_none()) return py::int_(static_cast<int64_t>(j));
    if (!is_tensor_object(h.ptr())) return py::none();
    at::Tensor t = THPVariable_Unpack(h.ptr());
    if (!t.device().is_cpu() || t.dim() < 1 || !t.is_contiguous() || t.size(0) != bounds[j + 1] - bounds[j])
      return py::none();
    const int64_t rb = t.size(0) ? t.numel() / t.size(0) * static_cast<int64_t>(t.element_size()) : 0;
    if (!first.defined()) {
      first = t;
      row_bytes = rb;
    } else if (t.scalar_type() != first.scalar_type() || t.sizes().slice(1) != first.sizes().slice(1)) {
      return py::none();
    }
    segs[j] = t;
    base[j] = static_cast<const char*>(t.data_ptr());
  }

  py::object ids = py::none();
  if (want_ids) {
    at::Tensor id_t = at::empty({k}, at::kLong);
    std::memcpy(id_t.data_ptr<int64_t>(), rows.data(), rows.size() * sizeof(int64_t));
    ids = py::reinterpret_steal<py::object>(THPVariable_Wrap(id_t));
  }
  at::Tensor out;
  if (!out_arg.is_none()) {  // the caller's tensor: exactly the batch's dtype, shape and layout
    if (!is_tensor_object(out_arg.ptr())) return py::none();
    out = THPVariable_Unpack(out_arg.ptr());
    if (!out.device().is_cpu() || out.layout() != at::kStrided || !out.is_contiguous() ||
        out.scalar_type() != first.scalar_type() || out.dim() != first.dim() || out.size(0) != k ||
        out.sizes().slice(1) != first.sizes().slice(1))
      return py::none();
    consecutive = false;  // copied into out like any other batch
  }
  if (consecutive) {  // one run within one segment: a view, as a contiguous read gives
    const size_t j = static_cast<size_t>(seg_of[0]);
    at::Tensor v = segs[j].narrow(0, rows[0] - bounds[j], k);
    return py::make_tuple(py::reinterpret_steal<py::object>(THPVariable_Wrap(v)), rows[0], rows[0] + k, ids);
  }
  if (!out.defined()) {
    std::vector<int64_t> shape = first.sizes().vec();
    shape[0] = k;
    out = at::empty(shape, first.options());
  }
  const uint64_t faults = mapped_fault_count();
  {
    // One loop on the calling thread, whatever the segments (one of them, a whole mapped
    // array, is the common case). Not on the intra-op threads: waking them took 4-8 ms (a
    // scheduler time slice) on busy cores, against 20-50 us for 256 rows of 1 KiB here, and
    // two threads copied no faster than this loop on one, from 4 MiB to 64 MiB batches
    // (random rows are bound by memory latency; figures of a 2-core machine, 1 KiB rows).
    ReleaseGil nogil;
    advise_cold_rows(rows, seg_of, base, bounds, row_bytes, hint_block, hint_state);
    char* dst = static_cast<char*>(out.data_ptr());
    // (the first line of the row 8 ahead asked for now: its page-table walk and cache miss
    // overlap the copies before it; 10-20% faster on 1 KiB rows, 16 ahead no better)
    constexpr size_t kAhead = 8;
    auto src = [&](size_t i) { return base[seg_of[i]] + (rows[i] - bounds[seg_of[i]]) * row_bytes; };
    for (size_t i = 0; i < std::min(kAhead, rows.size()); ++i) prefetch(src(i));
    for (size_t i = 0; i < rows.size(); ++i) {
      if (i + kAhead < rows.size()) prefetch(src(i + kAhead));
      const size_t j = static_cast<size_t>(seg_of[i]);
      std::memcpy(dst + static_cast<int64_t>(i) * row_bytes, base[j] + (rows[i] - bounds[j]) * row_bytes,
                  static_cast<size_t>(row_bytes));
    }
  }
  if (mapped_fault_count() != faults) {  // a page past a shard's end read as zeros: raise here, in this thread
    std::vector<std::pair<const void*, size_t>> ranges;
    for (size_t j = 0; j < segs.size(); ++j)
      if (base[j]) ranges.emplace_back(base[j], static_cast<size_t>(segs[j].nbytes()));
    check_mapped_faults(faults, ranges);
  }
  return py::make_tuple(py::reinterpret_steal<py::object>(THPVariable_Wrap(out)), -1, -1, ids);
}

}  // namespace acs
