// The capture sink of one hook point: staging copy, in-memory records, reductions and the
// hand-off to a store writer. Pure ATen; every method here runs without the GIL.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/util/SmallVector.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "reductions.h"
#include "row_consumer.h"

namespace acs {

// Whether t has fixed integer sizes to read: not a nested tensor (a jagged one refuses
// size(), its ragged dimension being symbolic) nor one whose sizes are symbolic.
inline bool fixed_sizes(const at::Tensor& t) {
  return !t.is_nested() && !t.unsafeGetTensorImpl()->has_symbolic_sizes_strides();
}

// Bump allocator over pooled staging slabs (staging_pool.h): one snapshot lives in a
// slab, so capturing pays neither a large malloc nor fresh page faults per tensor. Each
// snapshot has a storage of its own bytes only (its data pointer points into the slab and
// keeps the slab alive), so a record handed to the user owns exactly its bytes
// (untyped_storage().nbytes() == nbytes, torch.save writes only those). Thread-safe: the
// sinks of one tracker share one arena and consume without the GIL.
class Arena {
 public:
  Arena() = default;
  // A contiguous, uninitialised CPU tensor of `sizes` and `dtype`, in arena memory.
  at::Tensor empty(at::IntArrayRef sizes, at::ScalarType dtype);
  // `nbytes` of arena memory: its address, and the slab it lies in in `*slab` (nullptr when
  // too large for a slab: the caller allocates on its own).
  char* alloc(int64_t nbytes, c10::Storage* slab);
  // The tensor of `sizes` and `dtype` at `data` (from alloc) in `slab`, with a storage of
  // exactly its bytes that keeps the slab alive.
  static at::Tensor tensor_at(const c10::Storage& slab, char* data, at::IntArrayRef sizes, at::ScalarType dtype);
  void reset();  // drop the arena's own reference to the current slab
  int64_t reserved_bytes() const { return reserved_bytes_; }

 private:
  std::mutex mu_;
  c10::Storage slab_;
  int64_t used_ = 0;
  int64_t capacity_ = 0;
  int64_t reserved_bytes_ = 0;
};

// Asynchronous device-to-host copy of x into pinned host memory `dst` (same shape; dtype
// of dst), on a side stream, ordered after the compute stream's work up to now. Returns
// the event after which `dst` may be read.
std::shared_ptr<c10::Event> device_to_host(const at::Tensor& x, const at::Tensor& dst);

// The token-row rule: x (batch, pos, ...) holds one row per token when a (batch, pos) token
// mask is set and x's first two dims are the mask's; otherwise one row per sample. The one
// definition of the rule (the Python side calls it through _C.is_token_rows).
bool is_token_rows(const at::Tensor& x, const at::Tensor& token_mask);

enum class Keep : int { ALL = 0, LAST = 1, NONE = 2 };
enum class Placement : int { AUTO = 0, CPU = 1, GPU = 2, DISK = 3 };

struct SinkOptions {
  bool snapshot = true;            // SNAPSHOT (copy now) vs REFERENCE (keep the tensor)
  Keep keep = Keep::ALL;           // STORE_ALL / FINAL_ONLY / STREAMING
  Placement placement = Placement::AUTO;
  std::optional<at::ScalarType> storage_dtype;  // cast stored rows (e.g. to bfloat16)
};

// The calls of a tracker's alias hook points against their targets', in one number: every
// call of an alias adds its weight (a random 64-bit number), every call of a target subtracts
// the sum of its aliases' weights (mod 2**64). Between two checks the sum stays the same when
// every alias got as many calls as its target (and, but for a chance of about 2**-64 per
// forward, only then), so the per-forward check reads one number instead of every sink.
struct AliasTally {
  std::atomic<uint64_t> sum{0};
};

class Sink {
 public:
  // module: the module path of the hook point, as exclude= takes it (for error messages;
  // none when unknown).
  Sink(std::string name, SinkOptions options, std::shared_ptr<Arena> arena,
       std::optional<std::string> module = std::nullopt);

  // Capture one activation. x: any shape / dtype / device / strides. token_mask: optional
  // bool (batch, pos); when it matches x's first two dims, rows are the masked tokens
  // (n_tokens, *x.shape[2:]), else rows are x's first dimension. A sparse, nested or
  // meta-device x that this sink would copy, store or reduce raises CaptureError before
  // anything of the call is kept (as the first call's check in Python does). Thread: no
  // GIL needed.
  void consume(const at::Tensor& x, const at::Tensor& token_mask);

  const std::string& name() const { return name_; }
  std::vector<at::Tensor> records();        // waits for pending device copies
  void clear_records();
  // REFERENCE mode: true once when a record kept by reference was changed in place after
  // its capture (version counter moved). `all` rescans every record, else only new ones.
  bool reference_changed(bool all);

  // Alias: this hook point's activation is the very tensor `target` captured just before it
  // in the same forward (a container returning its last child's output). Each call checks
  // it is still the same tensor, unchanged since the target took it (same storage, offset,
  // sizes, strides, dtype; same version counter, or for inference tensors same bytes).
  // Reductions of the alias still run. In a store (`shares_records` false) its rows are
  // neither copied nor written (the reader resolves the alias to the target's array), so a
  // call that is not the target's tensor raises CaptureError. In memory (`shares_records`
  // true) a call that is the target's tensor keeps the target's record (the same bytes, not
  // copied); any other call (a branch not taken, a loop of another length, a target called
  // on its own) is kept as the alias's own record: its records are always its own calls'.
  void set_alias_of(std::shared_ptr<Sink> target, bool shares_records = false);
  std::shared_ptr<Sink> alias_of() const { return alias_of_; }
  // An in-memory alias (set_alias_of's shares_records): its calls need not pair with its
  // target's (not counted in the tracker's alias tally).
  bool shares_records() const { return shares_records_; }
  // Keep (a reference to) the tensor of each call, so an alias can be checked against it.
  // Off releases the kept tensor.
  void watch_aliases(bool on);
  // Whether x is the tensor of this sink's last call, unchanged since (see set_alias_of).
  bool matches_last(const at::Tensor& x);

  // src cast to storage_dtype; CaptureError naming the hook point when the cast turns a
  // finite value into inf (overflow) or an integer into another one (token ids in bfloat16).
  // check_cast checks a cast made elsewhere.
  at::Tensor cast_checked(const at::Tensor& src, at::ScalarType dtype);
  void check_cast(const at::Tensor& src, const at::Tensor& cast);
  // Whether check_cast can refuse a cast from -> to (else it checks nothing).
  static bool cast_may_change(at::ScalarType from, at::ScalarType to);

  void add_reduction(std::shared_ptr<Reduction> r) { reductions_.push_back(std::move(r)); }
  // Copies of the result of reduction `index` (in the order added), taken under the sink's
  // lock: never half of a batch's update, and later batches leave them alone.
  NamedTensors reduction_result(int64_t index);
  // Reduction::made_nonfinite of reduction `index`, read under the sink's lock (an update of a
  // forward still running in another thread writes the flags it reads) once the reductions'
  // kernels are done (wait_reductions).
  bool reduction_made_nonfinite(int64_t index);
  const std::vector<std::shared_ptr<Reduction>>& reductions() const { return reductions_; }
  // A store capture: keep the state of this hook point's reductions as it was before its first
  // call in each root forward (claimed_forward; Reduction::checkpoint), and its row count then,
  // so that a forward the store leaves out (one that raised, the last of the capture) can be
  // taken out of the reductions too (rollback_forward). Costs a copy of the in-place updated
  // states (mean, var, min, ...: a few feature vectors) per hook point and forward; on a device
  // (CUDA) no copy, but the state before the forward stays allocated until the next forward's
  // first call (an update there makes its new state next to the old one anyway).
  void set_keep_forward_start(bool on);
  // Put the reductions and n_rows back as they were before this sink's first call in root
  // forward `forward`; true when it was called in that forward (and so was put back), false
  // when it was not (nothing to take out) or keeps no forward start.
  bool rollback_forward(int64_t forward);
  // Make the calling thread's current stream (of the device the reductions last ran on) wait
  // for the reductions' kernels: a CUDA model run under torch.cuda.stream(s) reduces on s,
  // and the results, states and NaN flags read after it (the close, tracker.reductions) on
  // another stream would read accumulators not yet written. No-op for CPU rows and where the
  // reductions ran on the current stream. reduction_result() calls it itself.
  void wait_reductions();
  void set_writer(std::shared_ptr<RowConsumer> w) { writer_ = std::move(w); }
  bool has_writer() const { return writer_ != nullptr; }
  // A store that keeps reductions only records this hook point's dtype and feature shape from
  // its first call (it has no array): later calls are held to them as a store array's are.
  // dtype and feature_shape: those it records (checked at the first call with rows, where
  // the first call was an empty batch: check_first_rows_fit_writer).
  void set_one_layout(bool on, std::optional<at::ScalarType> dtype = std::nullopt,
                      std::vector<int64_t> feature_shape = {}) {
    one_layout_ = on;
    layout_dtype_ = dtype;
    layout_feature_shape_ = std::move(feature_shape);
  }
  // The hook point is one the store this capture resumes holds (its array, or the rows a store
  // that keeps reductions only reduced): its row shape and dtype are the stored ones, which a
  // resume cannot change (storage_dtype included). Named by check_first_rows_fit_writer.
  void set_stored(bool on) { stored_ = on; }
  // The capture's storage_dtype, where this hook point's first call (of dtype `first`) was
  // integer or bool and so is not cast (options_.storage_dtype unset): a later floating-point
  // or complex call is refused, as it would be kept and reduced uncast (a store array refuses
  // any change of dtype already).
  void set_uncast_storage_dtype(at::ScalarType dtype, at::ScalarType first) {
    uncast_storage_dtype_ = dtype;
    uncast_first_dtype_ = first;
  }
  // consume() only keeps a reference (no copy, reduction or store hand-off): callers need
  // not release the GIL for it.
  bool keeps_reference_only() const {
    return !options_.snapshot && reductions_.empty() && writer_ == nullptr && !alias_of_ && !has_aliases_;
  }

  // The root forward (TrackerCore::n_forwards) of this sink's last call inside one: a second
  // call in the same forward is two tensors of that forward under one name.
  int64_t claimed_forward() const { return claimed_forward_; }
  void set_claimed_forward(int64_t f) { claimed_forward_ = f; }

  int row_kind() const { return row_kind_; }
  // -1 unknown, 0 sample rows, 1 token rows; 0 given here is chosen (token_rows=False), not found
  void set_row_kind(int kind) {
    row_kind_ = kind;
    sample_rows_chosen_ = kind == 0;
  }
  int64_t n_rows() const { return n_rows_; }
  // Rows the reductions saw before this sink (a resumed store): the row ids they record
  // (topk) count from there.
  void set_row_base(int64_t base) { row_base_ = base; }
  int64_t row_base() const { return row_base_; }
  int64_t n_calls() const { return n_calls_; }
  // Count this sink's calls into the tracker's alias tally (from now on).
  void attach_tally(std::shared_ptr<AliasTally> tally);
  std::vector<int64_t> feature_shape() const { return feature_shape_; }
  std::optional<at::ScalarType> seen_dtype() const { return seen_dtype_; }
  const SinkOptions& options() const { return options_; }

 private:
  // One kept record. A snapshot in arena memory is kept as its slab, address and layout
  // only (no tensor object): creating a TensorImpl and a StorageImpl per record during the
  // forward put small long-lived heap objects between the model's transient outputs, so
  // the heap could not reuse those and grew by the size of the capture (fresh pages for
  // every output). The tensor is made when the records are first read.
  // A REFERENCE record is kept the same way, as the model tensor's storage, layout, dispatch
  // keys and version counter (no TensorImpl of its own: one per record interleaved small
  // long-lived objects with the model's outputs, as above), made into a tensor sharing that
  // version counter when first read.
  struct Record {
    at::Tensor t;           // the record, once made (or a non-arena record)
    c10::Storage slab;      // arena snapshot / REFERENCE record not yet made into a tensor: its slab or storage,
    char* data = nullptr;   // its address (arena),
    c10::SmallVector<int64_t, 5> sizes;  // its shape
    at::ScalarType dtype = at::kFloat;   // and dtype
    bool reference = false;               // REFERENCE record not yet made: slab is the model tensor's storage,
    c10::SmallVector<int64_t, 5> strides;  // its strides,
    int64_t offset = 0;                    // storage offset,
    c10::DispatchKeySet keys;              // dispatch keys (conjugate / negative bits included)
    c10::VariableVersion version;          // and version counter (shared: in-place changes stay visible)
    // The version counter's value now (t's once made). Not for a copy (kCopied records).
    int64_t current_version() const {
      return t.defined() ? t._version() : static_cast<int64_t>(version.current_version());
    }
  };
  // A REFERENCE record of x (a dense CPU / CUDA tensor of a plain TensorImpl: can_refer(x)).
  static Record refer(const at::Tensor& x);
  static bool can_refer(const at::Tensor& x);
  static at::Tensor referred(const Record& r);
  // The two halves of check_cast: finite values turned into inf; integers turned into others.
  void check_overflow(const at::Tensor& src, const at::Tensor& cast);
  void check_integers(const at::Tensor& src, const at::Tensor& cast);
  // check_overflow: a narrowing storage_dtype of a device tensor is checked on the device
  Record snapshot(const at::Tensor& x, bool check_overflow);
  void check_layout(const at::Tensor& x) const;  // CaptureError for values it cannot read
  at::Tensor rows_of(const at::Tensor& x, const at::Tensor& token_mask);
  void remember_for_aliases(const at::Tensor& x);        // target side, under mu_
  bool same_as_last(const at::Tensor& x, int64_t call, bool release);  // target side, takes mu_
  bool same_as_last_locked(const at::Tensor& x, bool release);         // target side, under mu_
  // Target side, takes mu_: when x is the tensor of this sink's last call (as same_as_last)
  // and that call made the last record, a copy of that record (sharing its bytes) in *rec
  // and its pending device copy, if any, in *event; true then.
  bool share_last_record(const at::Tensor& x, Record* rec, std::shared_ptr<c10::Event>* event);
  // Target side, takes mu_: the record of the call last remembered for aliases, as
  // share_last_record, without the identity check (a store alias has made it already).
  bool last_record(Record* rec, std::shared_ptr<c10::Event>* event);
  bool last_record_locked(Record* rec, std::shared_ptr<c10::Event>* event);  // under mu_
  // An alias's call: true when it was its target's tensor (handled: reductions run, and in
  // memory the target's record kept); false when an in-memory alias must keep this call as
  // its own record. A store alias raises CaptureError instead. Under mu_. `given`: the tensor
  // the model gave, compared with the target's (x, unless x is the zeros made of a ZeroTensor).
  bool consume_alias(const at::Tensor& x, const at::Tensor& token_mask, const at::Tensor& given);
  // update_reductions on this hook point's rows; a CaptureError of a reduction (rows of
  // another feature shape, complex rows) is raised again naming the hook point. Under mu_.
  void reduce(const at::Tensor& rows);
  void run_reductions(const at::Tensor& rows);  // (reduce: update_reductions, errors naming the hook point)
  // The first rows fit the store array, opened at the first call (maybe an empty batch).
  void check_first_rows_fit_writer(const at::Tensor& x);

  std::string name_;
  std::optional<std::string> module_;
  SinkOptions options_;
  std::shared_ptr<Arena> arena_;
  std::mutex mu_;
  std::vector<Record> records_;
  std::vector<int64_t> versions_;  // REFERENCE: version counter at capture
  std::vector<std::shared_ptr<c10::Event>> pending_;  // device copies in flight
  std::vector<std::shared_ptr<Reduction>> reductions_;
  // (set_keep_forward_start) root forward whose start the reductions remember (checkpoint),
  // and n_rows_ then
  bool keep_forward_start_ = false;
  int64_t start_forward_ = -1;
  int64_t start_rows_ = 0;
  // The CUDA stream the reductions last ran on (the current stream of the rows' device at
  // their last update), known by its id only: an update on another stream, and wait_reductions,
  // wait for `reduced_`, an event recorded on it at the end of that update (while it ran the
  // forward), never for the stream itself, which its owner may have destroyed since (a
  // torch.cuda.ExternalStream of another library's stream, gone before the close). `read_`:
  // recorded by reduction_result on the stream that copied the results; the next update waits
  // for it before it changes the accumulators.
  std::optional<c10::Stream> reduce_stream_;
  std::unique_ptr<c10::Event> reduced_;
  std::unique_ptr<c10::Event> read_;
  void wait_reductions_locked();  // (under mu_)
  std::shared_ptr<RowConsumer> writer_;
  bool one_layout_ = false;  // (set_one_layout)
  std::optional<at::ScalarType> layout_dtype_;
  bool stored_ = false;  // (set_stored)
  std::vector<int64_t> layout_feature_shape_;
  std::optional<at::ScalarType> uncast_storage_dtype_;  // (set_uncast_storage_dtype)
  at::ScalarType uncast_first_dtype_ = at::kLong;
  int row_kind_ = -1;
  bool sample_rows_chosen_ = false;  // sample rows by choice (token_rows=False), whatever the shape
  int64_t claimed_forward_ = -1;
  int64_t n_rows_ = 0;
  int64_t row_base_ = 0;
  int64_t n_calls_ = 0;
  std::shared_ptr<AliasTally> tally_;
  uint64_t alias_weight_ = 0;    // an alias: its weight in the tally
  uint64_t aliases_weight_ = 0;  // a target: the sum of its aliases' weights
  // n_calls_ += d, and the tally (called with mu_ held)
  void count_call(int64_t d) {
    n_calls_ += d;
    if (tally_) tally_->sum.fetch_add(static_cast<uint64_t>(d) * (alias_weight_ - aliases_weight_), std::memory_order_relaxed);
  }
  std::vector<int64_t> feature_shape_;
  std::optional<at::ScalarType> seen_dtype_;
  // the dtype of its first call, an empty batch too (the Python side decided by it whether
  // storage_dtype casts the hook point): named by check_integers
  std::optional<at::ScalarType> first_call_dtype_;
  bool warned_changed_ = false;
  size_t checked_ = 0;
  // alias bookkeeping
  std::shared_ptr<Sink> alias_of_;
  bool has_aliases_ = false;
  // The tensor of the last call, known without keeping it alive: a weak reference to its
  // storage (expired once the model frees it, so a later tensor that reuses the memory is
  // never taken for it) and its layout. Keeping the tensor itself pinned the model's
  // outputs and kept the allocator from reusing their memory (fresh pages every forward).
  std::optional<c10::weak_intrusive_ptr<c10::StorageImpl>> last_storage_;
  int64_t last_offset_ = 0;
  std::vector<int64_t> last_sizes_, last_strides_;
  at::ScalarType last_dtype_ = at::kFloat;
  c10::Device last_device_ = c10::Device(c10::kCPU);
  bool last_conj_ = false;     // its conjugate and negative bits (lazy views of other values)
  bool last_neg_ = false;
  int64_t last_version_ = -1;  // its version counter then (-1: inference tensor)
  uint32_t last_crc_ = 0;      // inference tensors: crc32c of its bytes then
  int64_t last_call_ = 0;      // n_calls_ of that call
  int64_t last_record_ = -1;   // records_made_ before that call (its record, if made, is the next)
  int64_t records_made_ = 0;   // records kept so far (not reduced by keep="last" or clear)
  bool shares_records_ = false;  // an in-memory alias (see set_alias_of)
  int64_t call_offset_ = 0;    // alias side: target's calls before this alias's first call
};

}  // namespace acs
