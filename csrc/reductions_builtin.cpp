// Online reductions: the built-in statistics (pure ATen, float64 accumulators). The fast
// path loops live in reduction_kernels.cpp, the TorchScript runner in reductions_script.cpp.
//
// Every built-in keeps a flat state over F "columns": F = prod(feature_shape) in per-feature
// mode (option per_feature=1, the default), F = 1 in whole-tensor mode (per_feature=0, every
// value of the batch is one observation). A batch is first turned into a float64 matrix
// (n, F) on the accumulators' device (min, max and topk: integer rows into an int64 matrix,
// exact beyond 2**53; see work_dtype), then reduced to a batch state, which is folded into the
// running state by the same `combine` that `merge` uses. Streaming and merging therefore share
// one code path: the pairwise update of Chan, Golub & LeVeque (1979, 1983) for moments and
// co-moments (Welford 1962 is its one-row special case), plain sums / extrema / top-k merges
// for the rest. The ATen path replaces accumulators, never modifies them in place, so the
// tensors returned by state() and result() stay valid after further updates.
//
// Fast path (reduction_kernels.h): a per-feature update of a contiguous CPU batch of float32 / float64 / float16 /
// bfloat16 for mean, var, std, min, max, absmax, l2 and nonzero skips the float64 copy and the
// ATen ops. Plain loops read the rows in their own dtype (exactly widened to double) and fold
// them into the state tensors in place (allocated once, at the first update): the same
// per-batch two-pass moments and Chan merge, the same sums and NaN-propagating extrema, in
// float64, so results agree with the ATen path to rounding (summation order within a batch;
// extrema and nonzero counts are exact). Copy on write keeps earlier state() / result()
// tensors unchanged (see own_slots). Nuance: when a column holds both +0.0 and -0.0 as its
// extremum, which zero is kept may differ from torch.amin / amax (they compare equal). Whole-
// tensor mode, other devices, non-contiguous rows and the other kinds use the ATen path.
//
// Fused path (update_reductions, what a capture sink calls): when a hook point has several
// of mean / var / std / min / max / absmax, one sweep computes the batch's column sums,
// minima and maxima, one more its centred squares, and each reduction folds these shared
// batch statistics in (the same Chan merge; extrema folded exactly): one or two passes over
// the rows instead of one or two per reduction, with the same results.
//
// Options (all numbers): per_feature (0/1, default 1) for every kind; ddof (default 0) for
// var / std / cov; bins (default 64), lo, hi (required) for hist; k (default 10) for topk.
#include "reductions.h"

#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <sstream>
#include <vector>

#include "errors.h"
#include "reduction_kernels.h"

namespace acs {

namespace {

using kernels::fast_dtype;
using kernels::RowsView;

std::string options_str(const ReductionOptions& o) {
  std::ostringstream s;
  s << "{";
  bool first = true;
  for (const auto& kv : o) {
    s << (first ? "" : ", ") << kv.first << ": " << kv.second;
    first = false;
  }
  s << "}";
  return s.str();
}

// An option value as given: whole numbers in full (16777217, not 1.67772e+07).
std::string number_str(double v) {
  std::ostringstream s;
  if (std::isfinite(v) && v == std::floor(v) && std::fabs(v) < 9007199254740992.0) {
    s << static_cast<int64_t>(v);
  } else {
    s << v;
  }
  return s.str();
}

std::string join(const std::vector<std::string>& v) {
  std::string out;
  for (size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + v[i];
  return out;
}

const std::vector<std::string>& kinds() {
  static const std::vector<std::string> k = {"mean", "var", "std", "min", "max", "absmax",
                                             "l2", "nonzero", "hist", "cov", "topk"};
  return k;
}

// Integer rows that min, max and topk keep exact, in int64 (float64 holds every integer only
// up to 2**53): not bool, and not uint64, whose values past 2**63 int64 cannot hold (they
// stay float64, in order but rounded; torch has no amin / topk of uint64 at all).
bool integer_rows(at::ScalarType t) {
  return at::isIntegralType(t, /*includeBool=*/false) && t != at::kUInt64;
}

// a and b in one dtype: as they are when they agree, else both float64 (an int64 state of
// integer rows meeting a float64 one of float rows, as torch promotes int64 with float64).
std::pair<at::Tensor, at::Tensor> promoted(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() == b.scalar_type()) return {a, b};
  return {a.to(at::kDouble), b.to(at::kDouble)};
}

at::Tensor count_tensor(int64_t n) { return at::scalar_tensor(n, at::TensorOptions().dtype(at::kLong)); }

// How a flat state / result tensor maps back to the feature shape.
enum class Layout {
  kFeat,       // (F,)          <-> feature_shape
  kFeatTrail,  // (F, m)        <-> (*feature_shape, m)
  kLeadFeat,   // (m, F)        <-> (m, *feature_shape)
  kRaw,        // kept as is (e.g. the (D, D) co-moment matrix, histogram edges)
};

struct Slot {
  std::string name;
  at::Tensor t;
  Layout layout;
};
using Slots = std::vector<Slot>;

at::Tensor* find_slot(Slots& s, const std::string& name) {
  for (auto& x : s)
    if (x.name == name) return &x.t;
  return nullptr;
}

std::shared_ptr<Reduction> make_builtin(const std::string& kind, const ReductionOptions& o);

// Per-column statistics of one contiguous CPU batch (n, d), shared by the built-ins that
// update together (see update_reductions). Pointers are null for statistics not computed.
struct BatchStats {
  int64_t n = 0, d = 0;
  const double* mean = nullptr;  // x.mean(0)
  const double* m2 = nullptr;    // ((x - mean) ** 2).sum(0)
  const double* min = nullptr;   // x.amin(0), NaN-propagating
  const double* max = nullptr;   // x.amax(0)
  const double* absmax = nullptr;
};
enum StatBits : unsigned { kStatMean = 1, kStatM2 = 2, kStatMin = 4, kStatMax = 8, kStatAbsMax = 16 };

// A batch's column means, x.mean(0), kept within the column's [min, max]: sum / n may round
// out of it (three rows of 0.1 sum to 0.30000000000000004, whose third is above 0.1), and a
// constant column then has a mean off its value and a sum of squared deviations > 0 where
// torch.var gives 0 (and, with ddof >= n, NaN, not inf). Clamped, a constant column's mean is
// its value and its deviations are exactly 0. A mean that is not finite stays as it is: NaN,
// and +-inf, also that of finite values whose sum overflows (torch.mean gives inf there too).
at::Tensor batch_means(const at::Tensor& x) {
  const at::Tensor mean = x.mean(0);
  return at::where(at::isfinite(mean), at::clamp(mean, x.amin(0), x.amax(0)), mean);
}
void clamp_means(double* mean, const double* mn, const double* mx, int64_t d) {
  for (int64_t j = 0; j < d; ++j) {
    double m = mean[j];
    if (!std::isfinite(m)) continue;
    if (m < mn[j]) m = mn[j];
    if (m > mx[j]) m = mx[j];
    mean[j] = m;
  }
}

// Mean of na + nb observations from the means of two parts. Chan et al.'s form
// ma + (mb - ma) * nb / n where both and their difference are finite (it keeps precision when
// the means are close); the weighted sum ma * na / n + mb * nb / n where one is +-inf or NaN,
// so that an infinite part stays infinite (Chan's delta would make inf - inf = NaN), and +inf
// with -inf or any NaN gives NaN, as torch.mean over all the values does; and where finite
// means of opposite signs differ by more than float64 holds (+-1e308), whose delta would
// overflow to inf.
at::Tensor merge_means(const at::Tensor& ma, const at::Tensor& mb, double na, double nb) {
  const double n = na + nb;
  at::Tensor chan = ma + (mb - ma) * (nb / n);
  at::Tensor finite = at::isfinite(mb - ma);  // (finite: so are ma and mb)
  return at::where(finite, chan, ma * (na / n) + mb * (nb / n));
}

// ------------------------------------------------------------------ base of the built-ins
class Builtin : public Reduction {
 public:
  Builtin(std::string kind, ReductionOptions opts, std::vector<std::string> allowed)
      : kind_(std::move(kind)), opts_(std::move(opts)) {
    allowed.push_back("per_feature");
    for (const auto& kv : opts_) {
      ACS_CHECK(std::find(allowed.begin(), allowed.end(), kv.first) != allowed.end(),
                "reduction '", kind_, "' has no option '", kv.first, "'; its options are [",
                join(allowed), "]");
      ACS_CHECK(std::isfinite(kv.second), "option '", kv.first, "' of reduction '", kind_,
                "' must be a finite number, got ", kv.second);
    }
    if (!opts_.count("per_feature")) opts_["per_feature"] = 1;
    const double pf = opts_["per_feature"];
    ACS_CHECK(pf == 0 || pf == 1, "option 'per_feature' of reduction '", kind_,
              "' must be 0 or 1, got ", pf);
    per_feature_ = pf == 1;
  }

  // Rows a built-in reduction can read: real numbers torch converts to float64 (not complex,
  // not bits). Sink::run_reductions tells these refusals by their words.
  void check_rows_dtype(const at::Tensor& rows_in) const {
    ACS_CHECK(rows_in.defined(), "reduction '", kind_, "' got an undefined tensor");
    ACS_CHECK(!rows_in.is_complex(), "reduction '", kind_,
              "' needs real-valued rows, got dtype ", dtype_name(rows_in.scalar_type()));
    ACS_CHECK(has_real_numbers(rows_in.scalar_type()), "reduction '", kind_,
              "' needs rows of numbers torch converts to float64, got dtype ", dtype_name(rows_in.scalar_type()),
              ", which torch keeps as bits without arithmetic");
  }

  void check(const at::Tensor& rows_in) const override {
    check_rows_dtype(rows_in);
    if (per_feature_ && has_feat_ && rows_in.dim() >= 1 && rows_in.size(0) > 0) {
      const auto feat = rows_in.sizes().slice(1);
      ACS_CHECK(feat == at::IntArrayRef(feat_), "reduction '", kind_,
                "' (per_feature=1) got rows with feature shape ", shape_str(feat),
                " after ", shape_str(feat_),
                "; per-feature statistics need one feature shape (use per_feature=0 for a "
                "whole-tensor statistic; for sequences of varying length in a capture, pass attention_mask= to "
                "tracker.set_batch(), or rows=\"token\", so that rows are tokens of one feature shape)");
    }
  }

  void update(const at::Tensor& rows_in, int64_t row_offset) override {
    at::AutoGradMode no_grad(false);
    check_rows_dtype(rows_in);
    at::Tensor rows = rows_in.dim() == 0 ? rows_in.reshape({1}) : rows_in;
    const int64_t n = rows.size(0);
    if (n == 0) return;  // an empty batch is a no-op
    at::Tensor x;
    int64_t width = 1;  // values per row (whole-tensor mode: for row ids)
    if (per_feature_) {
      check_feature_shape(rows.sizes().slice(1));
      follow_rows(rows.device());
      if (fast_path_applies(rows)) {
        own_slots();
        fast_update(RowsView{rows.const_data_ptr(), rows.scalar_type(), n, rows.numel() / n});
        count_ += n;
        return;
      }
      x = rows.detach().to(device_, work_dtype(rows.scalar_type())).reshape({n, -1});
    } else {
      if (rows.numel() == 0) return;
      follow_rows(rows.device());
      width = rows.numel() / n;
      x = rows.detach().to(device_, work_dtype(rows.scalar_type())).reshape({-1, 1});
    }
    Slots batch = batch_state(x, row_offset, width);
    combine(x.size(0), batch);
    count_ += x.size(0);
  }

  void merge(const Reduction& other_r) override {
    at::AutoGradMode no_grad(false);
    ACS_CHECK(other_r.kind() == kind(), "cannot merge a '", other_r.kind(),
              "' reduction into a '", kind(), "' reduction; merge needs the same kind");
    ACS_CHECK(other_r.options() == options(), "cannot merge '", kind_,
              "' reductions with different options: ", options_str(options()), " vs ",
              options_str(other_r.options()));
    const auto* other = dynamic_cast<const Builtin*>(&other_r);
    TORCH_CHECK(other != nullptr, "internal: reduction kind '", kind_, "' is not a built-in");
    if (other->count_ == 0) return;
    if (per_feature_) check_feature_shape(other->feat_);
    if (!device_set_) set_device(other->device_);
    Slots s = other->acc_;  // shallow copies; accumulators are never modified in place
    for (auto& x : s)
      if (x.t.device() != device_) x.t = x.t.to(device_);
    const int64_t nb = other->count_;
    combine(nb, s);
    count_ += nb;
  }

  NamedTensors result() const override {
    NamedTensors out;
    if (count_ > 0) {
      for (auto& s : result_slots()) out.emplace_back(s.name, unflatten(s.t, s.layout));
    }
    out.emplace_back("count", count_tensor(count_));
    return out;
  }

  // The fast-path kinds update their slots in place: the slots are copied into buffers kept
  // from one checkpoint to the next (no allocation per forward, and no copy on write at the
  // next update). The others replace their slots at each update: handles are enough.
  void checkpoint() override {
    saved_count_ = count_;
    saved_feat_ = feat_;
    saved_has_feat_ = has_feat_;
    saved_device_ = device_;
    saved_device_set_ = device_set_;
    saved_device_from_rows_ = device_from_rows_;
    saved_acc_.resize(acc_.size());
    for (size_t i = 0; i < acc_.size(); ++i) {
      const at::Tensor& t = acc_[i].t;
      Slot& b = saved_acc_[i];
      b.name = acc_[i].name;
      b.layout = acc_[i].layout;
      const bool copy = has_fast_path() && t.defined() && t.device().is_cpu() && t.is_contiguous() &&
                        t.layout() == at::kStrided && !t.is_neg() && !t.is_conj();
      if (!copy) {
        b.t = t;
        continue;
      }
      const bool reuse = b.t.defined() && b.t.use_count() == 1 && b.t.storage().use_count() == 1 &&
                         b.t.device().is_cpu() && b.t.scalar_type() == t.scalar_type() &&
                         b.t.sizes() == t.sizes() && b.t.is_contiguous();
      if (!reuse) b.t = at::empty(t.sizes(), t.options());
      if (t.nbytes()) std::memcpy(b.t.data_ptr(), t.const_data_ptr(), t.nbytes());
    }
  }
  void restore_checkpoint() override {
    count_ = saved_count_;
    feat_ = saved_feat_;
    has_feat_ = saved_has_feat_;
    device_ = saved_device_;
    device_set_ = saved_device_set_;
    device_from_rows_ = saved_device_from_rows_;
    acc_ = saved_acc_;  // (shared with the buffers now: the next update or checkpoint copies)
  }

  NamedTensors state() const override {
    NamedTensors out{{"count", count_tensor(count_)}};
    if (count_ > 0)
      for (auto& s : acc_) out.emplace_back(s.name, unflatten(s.t, s.layout));
    return out;
  }

  void load_state(const NamedTensors& st) override {
    at::AutoGradMode no_grad(false);
    std::map<std::string, at::Tensor> m(st.begin(), st.end());
    auto it = m.find("count");
    ACS_CHECK(it != m.end() && it->second.numel() == 1, "state of reduction '", kind_,
              "' must have a one-element 'count' tensor");
    const int64_t count = it->second.item<int64_t>();
    ACS_CHECK(count >= 0, "state 'count' of reduction '", kind_, "' must be >= 0, got ", count);
    reset();
    if (count == 0) return;
    Slots s = empty_slots();
    std::vector<std::string> names;
    for (auto& x : s) names.push_back(x.name);
    bool have_feat = false;
    std::vector<int64_t> feat;
    for (auto& x : s) {
      auto f = m.find(x.name);
      ACS_CHECK(f != m.end() && f->second.defined(), "state of reduction '", kind_,
                "' lacks '", x.name, "'; a state needs [count, ", join(names), "]");
      at::Tensor t = f->second.detach();
      std::vector<int64_t> tf;
      at::IntArrayRef sz = t.sizes();
      switch (x.layout) {
        case Layout::kFeat: tf.assign(sz.begin(), sz.end()); break;
        case Layout::kFeatTrail:
          ACS_CHECK(t.dim() >= 1, "state '", x.name, "' must have at least one dimension");
          tf.assign(sz.begin(), sz.end() - 1);
          break;
        case Layout::kLeadFeat:
          ACS_CHECK(t.dim() >= 1, "state '", x.name, "' must have at least one dimension");
          tf.assign(sz.begin() + 1, sz.end());
          break;
        case Layout::kRaw: break;
      }
      if (x.layout != Layout::kRaw) {
        if (!have_feat) {
          feat = tf;
          have_feat = true;
        } else {
          ACS_CHECK(feat == tf, "state tensors of reduction '", kind_,
                    "' disagree on the feature shape: ", shape_str(feat), " vs ", shape_str(tf));
        }
      }
      x.t = t;
    }
    if (have_feat && !per_feature_)
      ACS_CHECK(feat.empty(), "state of whole-tensor reduction '", kind_,
                "' must hold scalars per slot, got feature shape ", shape_str(feat));
    int64_t F = 1;
    for (auto d : feat) F *= d;
    set_device(s.front().t.device());
    for (auto& x : s) {
      at::Tensor t = x.t.to(device_);
      switch (x.layout) {
        case Layout::kFeat: t = t.reshape({F}); break;
        case Layout::kFeatTrail: t = t.reshape({F, t.size(-1)}); break;
        case Layout::kLeadFeat: t = t.reshape({t.size(0), F}); break;
        case Layout::kRaw: break;
      }
      x.t = t.to(loaded_dtype(x.name, t.scalar_type())).contiguous();
    }
    validate_loaded(s, F);
    if (per_feature_) {
      feat_ = feat;
      has_feat_ = true;
    }
    acc_ = std::move(s);
    count_ = count;
  }

  // Fused path (update_reductions). stats_needed(): the StatBits this kind can be updated
  // from (0: none). fused_begin(rows): the checks and preparation of update() for the fast
  // path; true when this reduction takes the shared statistics of `rows`, false when it
  // must go through update(). fused_end(stats): fold them in, as fast_update would.
  virtual unsigned stats_needed() const { return 0; }
  bool fused_begin(const at::Tensor& rows) {
    if (!per_feature_ || stats_needed() == 0 || rows.dim() == 0 || rows.size(0) == 0 || rows.is_complex())
      return false;
    check_feature_shape(rows.sizes().slice(1));
    follow_rows(rows.device());
    if (!fast_path_applies(rows)) return false;
    own_slots();
    return true;
  }
  void fused_end(const BatchStats& s) {
    fold_stats(s);
    count_ += s.n;
  }

  // options() holds the defaults too, so fresh() reproduces the same options exactly.
  std::shared_ptr<Reduction> fresh() const override { return make_builtin(kind_, opts_); }
  std::string kind() const override { return kind_; }
  ReductionOptions options() const override { return opts_; }

 protected:
  // One batch x: (n, F) float64 -> batch state with the slots of empty_slots().
  virtual Slots batch_state(const at::Tensor& x, int64_t row_offset, int64_t width) const = 0;
  // Fold a state of nb observations into acc_ (acc_ may be empty when count_ == 0).
  virtual void combine(int64_t nb, const Slots& b) = 0;
  // Final values (count is added by the base).
  virtual Slots result_slots() const = 0;
  // Names and layouts of the state slots (tensors undefined).
  virtual Slots empty_slots() const = 0;
  virtual at::ScalarType slot_dtype(const std::string&) const { return at::kDouble; }
  // The dtype a batch of `rows` dtype is reduced in (ATen path): float64, or int64 for the
  // kinds that keep integer rows exact (min, max, topk).
  virtual at::ScalarType work_dtype(at::ScalarType) const { return at::kDouble; }
  // The dtype a state slot given to load_state is kept in (a stored state of such a kind may
  // hold int64 values: of integer rows).
  virtual at::ScalarType loaded_dtype(const std::string& name, at::ScalarType) const { return slot_dtype(name); }
  virtual void validate_loaded(const Slots&, int64_t) const {}
  // Fast path (per-feature mode, see the kernels above): fold the batch into acc_ in place.
  // own_slots() has run: every slot is a contiguous CPU (F,) tensor of slot_dtype owned by
  // this reduction alone, allocated but uninitialised when count_ == 0.
  virtual bool has_fast_path() const { return false; }
  virtual void fast_update(const RowsView&) {}
  virtual void fold_stats(const BatchStats&) {}

  double opt(const std::string& k) const { return opts_.at(k); }

  // The divisor of var / std / cov: count - ddof, or 0 where ddof >= count, as torch.var,
  // torch.std and torch.cov take max(0, n - correction): a sum of squares (co-moment) > 0
  // over it is then inf (< 0: -inf), and 0 / 0 (a constant column, or a single row) NaN.
  double dof_denominator() const { return std::max(0.0, static_cast<double>(count_) - opt("ddof")); }

  at::Tensor unflatten(const at::Tensor& t, Layout layout) const {
    std::vector<int64_t> shape = per_feature_ ? feat_ : std::vector<int64_t>{};
    switch (layout) {
      case Layout::kFeat: return t.reshape(shape);
      case Layout::kFeatTrail: shape.push_back(t.size(-1)); return t.reshape(shape);
      case Layout::kLeadFeat: shape.insert(shape.begin(), t.size(0)); return t.reshape(shape);
      case Layout::kRaw: return t;
    }
    return t;
  }

  const at::Tensor& get(const std::string& name) const {
    for (auto& s : acc_)
      if (s.name == name) return s.t;
    TORCH_CHECK(false, "internal: no state slot '", name, "' in reduction '", kind_, "'");
  }
  static const at::Tensor& get(const Slots& slots, const std::string& name) {
    for (auto& s : slots)
      if (s.name == name) return s.t;
    TORCH_CHECK(false, "internal: no slot '", name, "'");
  }
  void set(const std::string& name, at::Tensor t) {
    at::Tensor* p = find_slot(acc_, name);
    TORCH_CHECK(p != nullptr, "internal: no state slot '", name, "'");
    *p = std::move(t);
  }
  // Start acc_ from a batch state (the first batch or the first merge).
  bool adopt_if_empty(const Slots& b) {
    if (count_ > 0) return false;
    acc_ = b;
    return true;
  }

  std::string kind_;
  ReductionOptions opts_;
  bool per_feature_ = true;
  int64_t count_ = 0;  // observations per column (rows, or values in whole-tensor mode)
  Slots acc_;
  // (checkpoint) the state it remembers
  int64_t saved_count_ = 0;
  Slots saved_acc_;
  std::vector<int64_t> saved_feat_;
  bool saved_has_feat_ = false;
  at::Device saved_device_{at::kCPU};
  bool saved_device_set_ = false;
  bool saved_device_from_rows_ = false;
  std::vector<int64_t> feat_;
  bool has_feat_ = false;
  at::Device device_{at::kCPU};
  bool device_set_ = false;
  bool device_from_rows_ = false;  // device_ is that of rows seen (not of a loaded or merged state)

 private:
  void set_device(const at::Device& d) {
    device_ = d;
    device_set_ = true;
  }
  // The accumulators live on the device of the first rows. A state loaded (a resumed store's,
  // on the CPU) or merged in before any rows moves to the rows' device at the first rows, once,
  // as a custom reduction's accumulator does: else every later batch of a CUDA model would be
  // copied to the host (synchronously) to be reduced there. Rows of another device after that
  // are moved to the accumulators' device.
  void follow_rows(const at::Device& d) {
    if (device_set_ && !device_from_rows_ && d != device_) {
      for (auto& x : acc_) x.t = x.t.to(d);
    }
    if (!device_from_rows_) set_device(d);
    device_from_rows_ = true;
  }
  void reset() {
    count_ = 0;
    acc_.clear();
    feat_.clear();
    has_feat_ = false;
    device_set_ = false;
    device_from_rows_ = false;
  }
  bool fast_path_applies(const at::Tensor& rows) const {
    return has_fast_path() && device_.is_cpu() && rows.device().is_cpu() &&
           rows.layout() == at::kStrided && fast_dtype(rows.scalar_type()) && rows.is_contiguous() &&
           !rows.is_neg() && !rows.is_conj() && !rows._is_zerotensor();
  }
  // Make every state slot writable in place: allocate it (first batch), or copy it when it is
  // shared -- handed out by state() / result() (views of the slot), adopted by or from a
  // merge, or aliasing the tensor given to load_state -- so that earlier results never
  // change (copy on write). A shared slot costs one copy on the next update; after that the
  // slot is private again and updates run without allocating.
  void own_slots() {
    int64_t F = 1;
    for (auto v : feat_) F *= v;
    const auto cpu = at::TensorOptions().device(at::kCPU);
    if (count_ == 0) {
      acc_ = empty_slots();
      for (auto& s : acc_) s.t = at::empty({F}, cpu.dtype(slot_dtype(s.name)));
      return;
    }
    for (auto& s : acc_) {
      const at::ScalarType dt = slot_dtype(s.name);
      const bool own = s.t.use_count() == 1 && s.t.storage().use_count() == 1 &&
                       s.t.device().is_cpu() && s.t.scalar_type() == dt && s.t.is_contiguous() &&
                       s.t.numel() == F;
      if (own) continue;
      at::Tensor c = at::empty({F}, cpu.dtype(dt));
      c.copy_(s.t.reshape({F}));
      s.t = std::move(c);
    }
  }
  void check_feature_shape(at::IntArrayRef feat) {
    if (!has_feat_) {
      feat_.assign(feat.begin(), feat.end());
      has_feat_ = true;
      return;
    }
    ACS_CHECK(feat == at::IntArrayRef(feat_), "reduction '", kind_,
              "' (per_feature=1) got rows with feature shape ", shape_str(feat),
              " after ", shape_str(feat_),
              "; per-feature statistics need one feature shape (use per_feature=0 for a "
              "whole-tensor statistic; for sequences of varying length in a capture, pass attention_mask= to "
              "tracker.set_batch(), or rows=\"token\", so that rows are tokens of one feature shape)");
  }
};

// ------------------------------------------------------------------ mean / var / std
// Moments: count, mean (F), m2 (F) = sum of squared deviations from the mean. A batch is
// reduced two-pass (mean, then centred squares, in float64) and folded in with
//   delta = mean_b - mean_a,  mean = mean_a + delta * nb / n,
//   m2 = m2_a + m2_b + delta^2 * na * nb / n                 (Chan, Golub & LeVeque 1979).
class Moments : public Builtin {
 public:
  Moments(std::string kind, ReductionOptions o, bool with_m2)
      : Builtin(std::move(kind), std::move(o), with_m2 ? std::vector<std::string>{"ddof"}
                                                        : std::vector<std::string>{}),
        with_m2_(with_m2) {
    if (with_m2_ && !opts_.count("ddof")) opts_["ddof"] = 0;
    if (with_m2_)
      ACS_CHECK(opt("ddof") >= 0 && opt("ddof") == std::floor(opt("ddof")), "option 'ddof' of reduction '",
                kind_, "' must be a non-negative integer, got ", number_str(opt("ddof")));
  }

 protected:
  Slots empty_slots() const override {
    Slots s{{"mean", {}, Layout::kFeat}};
    if (with_m2_) s.push_back({"m2", {}, Layout::kFeat});
    return s;
  }
  Slots batch_state(const at::Tensor& x, int64_t, int64_t) const override {
    at::Tensor mean = batch_means(x);
    Slots s{{"mean", mean, Layout::kFeat}};
    if (with_m2_) s.push_back({"m2", (x - mean).square().sum(0), Layout::kFeat});
    return s;
  }
  void combine(int64_t nb, const Slots& b) override {
    if (adopt_if_empty(b)) return;
    const double na = static_cast<double>(count_), n = na + static_cast<double>(nb);
    const at::Tensor& ma = get("mean");
    at::Tensor delta = get(b, "mean") - ma;
    set("mean", merge_means(ma, get(b, "mean"), na, static_cast<double>(nb)));
    if (with_m2_)
      set("m2", get("m2") + get(b, "m2") + delta.square() * (na * static_cast<double>(nb) / n));
  }
  bool has_fast_path() const override { return true; }
  // The same two-pass batch state and Chan merge as batch_state + combine, per column.
  void fast_update(const RowsView& r) override {
    const int64_t d = r.d;
    if (static_cast<int64_t>(scratch_.size()) < 4 * d) scratch_.resize(4 * d);
    double* mb = scratch_.data();  // batch mean
    double* m2b = mb + d;          // batch sum of squared deviations from mb
    double* mn = m2b + d;          // batch minima and maxima (batch_means)
    double* mx = mn + d;
    std::fill(mb, mb + 2 * d, 0.0);
    std::fill(mn, mn + d, INFINITY);
    std::fill(mx, mx + d, -INFINITY);
    kernels::add_sums_fold_min_max(r, mb, mn, mx);
    const double nb = static_cast<double>(r.n);
    for (int64_t j = 0; j < d; ++j) mb[j] /= nb;  // x.mean(0): sum / n
    clamp_means(mb, mn, mx, d);                    // within [min, max], as batch_means
    if (with_m2_) {
      kernels::add_centred_squares(r, mb, m2b);
    }
    fold_batch(mb, m2b, r.n, d);
  }
  unsigned stats_needed() const override { return with_m2_ ? kStatMean | kStatM2 : kStatMean; }
  void fold_stats(const BatchStats& s) override { fold_batch(s.mean, s.m2, s.n, s.d); }
  void fold_batch(const double* mb, const double* m2b, int64_t n_batch, int64_t d) {
    double* mean = acc_[0].t.mutable_data_ptr<double>();
    double* m2 = with_m2_ ? acc_[1].t.mutable_data_ptr<double>() : nullptr;
    if (count_ == 0) {  // adopt the batch state
      std::copy(mb, mb + d, mean);
      if (with_m2_) std::copy(m2b, m2b + d, m2);
      return;
    }
    const double nb = static_cast<double>(n_batch);
    const double na = static_cast<double>(count_), n = na + nb;
    const double wb = nb / n, wm = na * nb / n;
    const double wa = na / n;
    kernels::chan_fold(mean, m2, mb, m2b, d, wa, wb, wm);
  }
  Slots result_slots() const override {
    Slots s{{"mean", get("mean"), Layout::kFeat}};
    if (with_m2_) {
      at::Tensor var = get("m2") / dof_denominator();
      if (kind_ == "std")
        s.push_back({"std", var.sqrt(), Layout::kFeat});
      else
        s.push_back({"var", var, Layout::kFeat});
    }
    return s;
  }

 private:
  bool with_m2_;
  std::vector<double> scratch_;  // batch mean, m2, min and max of the fast path (4 * F), kept
};

// ------------------------------------------------------------------ min / max / absmax
class Extremum : public Builtin {
 public:
  Extremum(std::string kind, ReductionOptions o) : Builtin(std::move(kind), std::move(o), {}) {}

 protected:
  Slots empty_slots() const override { return {{"value", {}, Layout::kFeat}}; }
  // min / max of integer rows are kept in int64, exact (absmax in float64: |-2**63| does
  // not fit int64); float rows (and bool) in float64.
  at::ScalarType work_dtype(at::ScalarType t) const override {
    return kind_ != "absmax" && integer_rows(t) ? at::kLong : at::kDouble;
  }
  at::ScalarType loaded_dtype(const std::string&, at::ScalarType t) const override { return work_dtype(t); }
  Slots batch_state(const at::Tensor& x, int64_t, int64_t) const override {
    at::Tensor v;
    if (kind_ == "min")
      v = x.amin(0);
    else if (kind_ == "max")
      v = x.amax(0);
    else
      v = x.abs().amax(0);
    return {{"value", v, Layout::kFeat}};
  }
  void combine(int64_t, const Slots& b) override {
    if (adopt_if_empty(b)) return;
    // at::minimum / at::maximum propagate NaN, like torch.amin / amax.
    auto [a, v] = promoted(get("value"), get(b, "value"));
    set("value", kind_ == "min" ? at::minimum(a, v) : at::maximum(a, v));
  }
  Slots result_slots() const override { return {{kind_, get("value"), Layout::kFeat}}; }
  bool has_fast_path() const override { return true; }
  kernels::Ext ext() const {
    return kind_ == "min" ? kernels::Ext::kMin : kind_ == "max" ? kernels::Ext::kMax : kernels::Ext::kAbsMax;
  }
  void fast_update(const RowsView& r) override {
    double* v = acc_[0].t.mutable_data_ptr<double>();
    if (count_ == 0) std::fill(v, v + r.d, kind_ == "min" ? INFINITY : -INFINITY);
    kernels::fold_extremum(ext(), r, v);
  }
  unsigned stats_needed() const override {
    return kind_ == "min" ? kStatMin : kind_ == "max" ? kStatMax : kStatAbsMax;
  }
  // Fold the batch extremum into the running one (exact: min / max do not round; NaN sticks).
  void fold_stats(const BatchStats& s) override {
    double* v = acc_[0].t.mutable_data_ptr<double>();
    const double* b = kind_ == "min" ? s.min : kind_ == "max" ? s.max : s.absmax;
    if (count_ == 0) {
      std::copy(b, b + s.d, v);
    } else {  // absmax: b already holds |x| maxima
      kernels::fold_extremum_values(ext(), b, s.d, v);
    }
  }
};

// ------------------------------------------------------------------ l2
class L2 : public Builtin {
 public:
  explicit L2(ReductionOptions o) : Builtin("l2", std::move(o), {}) {}

 protected:
  Slots empty_slots() const override { return {{"sumsq", {}, Layout::kFeat}}; }
  Slots batch_state(const at::Tensor& x, int64_t, int64_t) const override {
    return {{"sumsq", x.square().sum(0), Layout::kFeat}};
  }
  void combine(int64_t, const Slots& b) override {
    if (adopt_if_empty(b)) return;
    set("sumsq", get("sumsq") + get(b, "sumsq"));
  }
  Slots result_slots() const override { return {{"l2", get("sumsq").sqrt(), Layout::kFeat}}; }
  bool has_fast_path() const override { return true; }
  void fast_update(const RowsView& r) override {
    double* acc = acc_[0].t.mutable_data_ptr<double>();
    if (count_ == 0) std::fill(acc, acc + r.d, 0.0);
    kernels::add_sum_squares(r, acc);
  }
};

// ------------------------------------------------------------------ nonzero
// Fraction of values != 0 (NaN counts as non-zero, as in torch.count_nonzero).
class NonZero : public Builtin {
 public:
  explicit NonZero(ReductionOptions o) : Builtin("nonzero", std::move(o), {}) {}

 protected:
  Slots empty_slots() const override { return {{"n_nonzero", {}, Layout::kFeat}}; }
  at::ScalarType slot_dtype(const std::string&) const override { return at::kLong; }
  Slots batch_state(const at::Tensor& x, int64_t, int64_t) const override {
    return {{"n_nonzero", x.ne(0).sum(0, false, at::kLong), Layout::kFeat}};
  }
  void combine(int64_t, const Slots& b) override {
    if (adopt_if_empty(b)) return;
    set("n_nonzero", get("n_nonzero") + get(b, "n_nonzero"));
  }
  Slots result_slots() const override {
    return {{"nonzero", get("n_nonzero").to(at::kDouble) / static_cast<double>(count_), Layout::kFeat}};
  }
  bool has_fast_path() const override { return true; }
  void fast_update(const RowsView& r) override {
    int64_t* acc = acc_[0].t.mutable_data_ptr<int64_t>();
    if (count_ == 0) std::fill(acc, acc + r.d, int64_t{0});
    kernels::add_nonzero_counts(r, acc);
  }
};

// ------------------------------------------------------------------ hist
// Fixed bins over [lo, hi] between the edges the result reports, linspace(lo, hi, bins + 1) in
// float64 (about lo + i*w, w = (hi - lo) / bins): bin i holds edges[i] <= x < edges[i + 1],
// and x == hi falls in the last bin (as torch.histc). x < lo and x > hi are counted in
// underflow / overflow, NaN in nan; +-inf are under/overflow.
class Hist : public Builtin {
 public:
  explicit Hist(ReductionOptions o) : Builtin("hist", std::move(o), {"bins", "lo", "hi"}) {
    if (!opts_.count("bins")) opts_["bins"] = 64;
    ACS_CHECK(opts_.count("lo") && opts_.count("hi"),
              "reduction 'hist' needs options 'lo' and 'hi' (the histogram range), got ",
              options_str(opts_));
    const double b = opt("bins");
    ACS_CHECK(b >= 1 && b == std::floor(b) && b <= (1 << 24),
              "option 'bins' of reduction 'hist' must be an integer in [1, 2**24], got ", number_str(b));
    ACS_CHECK(opt("lo") < opt("hi"), "options of reduction 'hist' must satisfy lo < hi, got lo=",
              opt("lo"), " hi=", opt("hi"));
    bins_ = static_cast<int64_t>(b);
  }

 protected:
  Slots empty_slots() const override {
    return {{"counts", {}, Layout::kFeatTrail},
            {"underflow", {}, Layout::kFeat},
            {"overflow", {}, Layout::kFeat},
            {"nan", {}, Layout::kFeat}};
  }
  at::ScalarType slot_dtype(const std::string&) const override { return at::kLong; }
  void validate_loaded(const Slots& s, int64_t) const override {
    ACS_CHECK(get(s, "counts").size(-1) == bins_, "state 'counts' of reduction 'hist' must have ",
              bins_, " bins in its last dimension, got ", get(s, "counts").size(-1));
  }
  Slots batch_state(const at::Tensor& x, int64_t, int64_t) const override {
    const double lo = opt("lo"), hi = opt("hi");
    const int64_t F = x.size(1);
    at::Tensor nan = x.isnan();
    at::Tensor under = x.lt(lo), over = x.gt(hi);
    at::Tensor in = nan.logical_or(under).logical_or(over).logical_not();
    at::Tensor idx = ((x - lo) * (static_cast<double>(bins_) / (hi - lo))).floor();
    idx = idx.clamp(0, static_cast<double>(bins_ - 1)).masked_fill(in.logical_not(), 0).to(at::kLong);
    // The arithmetic above can miss by one bin for x on (or one ulp from) an edge: settle
    // each x against the very edges the result reports (edges[i] <= x < edges[i + 1], x == hi
    // in the last bin), as torch.histogram does.
    const at::Tensor e = edges();
    idx = idx - x.lt(e.take(idx)).to(at::kLong) +
          x.ge(e.take(idx + 1)).logical_and(idx.lt(bins_ - 1)).to(at::kLong);
    at::Tensor col = at::arange(F, x.options().dtype(at::kLong)).unsqueeze(0).expand_as(idx);
    at::Tensor flat = (col * bins_ + idx).masked_select(in);
    at::Tensor counts = at::bincount(flat, {}, F * bins_).to(at::kLong).reshape({F, bins_});
    return {{"counts", counts, Layout::kFeatTrail},
            {"underflow", under.sum(0, false, at::kLong), Layout::kFeat},
            {"overflow", over.sum(0, false, at::kLong), Layout::kFeat},
            {"nan", nan.sum(0, false, at::kLong), Layout::kFeat}};
  }
  void combine(int64_t, const Slots& b) override {
    if (adopt_if_empty(b)) return;
    for (const char* k : {"counts", "underflow", "overflow", "nan"}) set(k, get(k) + get(b, k));
  }
  Slots result_slots() const override {
    return {{"counts", get("counts"), Layout::kFeatTrail},
            {"edges", edges(), Layout::kRaw},
            {"underflow", get("underflow"), Layout::kFeat},
            {"overflow", get("overflow"), Layout::kFeat},
            {"nan", get("nan"), Layout::kFeat}};
  }

 private:
  // The bin edges a result reports (float64, (bins + 1,)); bins are settled against them.
  at::Tensor edges() const {
    return at::linspace(opt("lo"), opt("hi"), bins_ + 1, at::TensorOptions().dtype(at::kDouble).device(device_));
  }

  int64_t bins_ = 64;
};

// ------------------------------------------------------------------ cov
// Covariance over the flattened features: count, mean (D), comoment (D, D) = sum of outer
// products of deviations. Batch: C_b = (x - mean_b)^T (x - mean_b); merge:
//   C = C_a + C_b + outer(delta, delta) * na * nb / n      (Chan, Golub & LeVeque 1979).
class Cov : public Builtin {
 public:
  explicit Cov(ReductionOptions o) : Builtin("cov", std::move(o), {"ddof"}) {
    if (!opts_.count("ddof")) opts_["ddof"] = 0;
    ACS_CHECK(opt("ddof") >= 0 && opt("ddof") == std::floor(opt("ddof")),
              "option 'ddof' of reduction 'cov' must be a non-negative integer, got ", opt("ddof"));
  }

 protected:
  Slots empty_slots() const override {
    return {{"mean", {}, Layout::kFeat}, {"comoment", {}, Layout::kRaw}};
  }
  void validate_loaded(const Slots& s, int64_t F) const override {
    const at::Tensor& c = get(s, "comoment");
    ACS_CHECK(c.dim() == 2 && c.size(0) == F && c.size(1) == F,
              "state 'comoment' of reduction 'cov' must be (", F, ", ", F, "), got ",
              shape_str(c.sizes()));
  }
  Slots batch_state(const at::Tensor& x, int64_t, int64_t) const override {
    at::Tensor mean = batch_means(x);
    at::Tensor xc = x - mean;
    return {{"mean", mean, Layout::kFeat}, {"comoment", at::mm(xc.t(), xc), Layout::kRaw}};
  }
  void combine(int64_t nb, const Slots& b) override {
    if (adopt_if_empty(b)) return;
    const double na = static_cast<double>(count_), n = na + static_cast<double>(nb);
    const at::Tensor& ma = get("mean");
    at::Tensor delta = get(b, "mean") - ma;
    set("comoment", get("comoment") + get(b, "comoment") +
                        at::outer(delta, delta) * (na * static_cast<double>(nb) / n));
    set("mean", merge_means(ma, get(b, "mean"), na, static_cast<double>(nb)));
  }
  Slots result_slots() const override {
    return {{"mean", get("mean"), Layout::kFeat}, {"cov", get("comoment") / dof_denominator(), Layout::kRaw}};
  }
};

// ------------------------------------------------------------------ topk
// Per column, the k largest values (descending; NaN ranks above everything, as in
// torch.topk) with their global row ids. Whole-tensor mode also keeps the flat feature index
// of each value within its row. Ties go to the lower row (then the lower feature index):
// with that strict total order the top k of a split are the top k of the top k of its parts,
// so any batching, resume, rank split or merge order keeps the same rows.

namespace {

// Equal under the top-k order: the same number, or both NaN (x and t broadcast).
at::Tensor same_value(const at::Tensor& x, const at::Tensor& t) {
  return at::eq(x, t).logical_or_(at::isnan(x).logical_and_(at::isnan(t)));
}

// perm (m, C) reordered, stably, by key.gather(0, perm) (ascending, or descending with NaN
// first as torch.sort does).
at::Tensor stable_by(const at::Tensor& perm, const at::Tensor& key, bool descending) {
  auto order = std::get<1>(at::sort(key.gather(0, perm), /*stable=*/true, /*dim=*/0, descending));
  return perm.gather(0, order);
}

// Whether some column of the (m, C) sorted values v holds two equal values in a row.
bool has_ties(const at::Tensor& v) {
  if (v.size(0) < 2) return false;
  return same_value(v.narrow(0, 1, v.size(0) - 1), v.narrow(0, 0, v.size(0) - 1)).any().item<bool>();
}

// a ranks above b (value descending, NaN above every number): the strict part of the order.
template <typename T>
inline bool ranks_above(T a, T b) { return a > b || (a != a && b == b); }

// ordered_topk for a contiguous CPU float64 (or int64) x and a small k: one pass in row
// order keeping each column's k best sorted (a later row enters only when it ranks strictly
// above the column's k-th: of equal values the lower row stays).
template <typename T>
std::pair<at::Tensor, at::Tensor> ordered_topk_cpu(const at::Tensor& x, int64_t k) {
  const int64_t m = x.size(0), C = x.size(1);
  const T* xp = x.const_data_ptr<T>();
  std::vector<T> val(static_cast<size_t>(C * k));
  std::vector<int64_t> id(static_cast<size_t>(C * k));
  std::vector<T> kth(static_cast<size_t>(C));
  auto insert = [&](int64_t c, int64_t filled, T v, int64_t row) {
    T* cv = val.data() + c * k;
    int64_t* ci = id.data() + c * k;
    int64_t j = std::min(filled, k - 1);  // slot freed at the end (the k-th drops out)
    while (j > 0 && ranks_above(v, cv[j - 1])) {  // rows come in order: ties stay behind
      cv[j] = cv[j - 1];
      ci[j] = ci[j - 1];
      --j;
    }
    cv[j] = v;
    ci[j] = row;
  };
  for (int64_t i = 0; i < m; ++i) {
    const T* row = xp + i * C;
    if (i < k) {
      for (int64_t c = 0; c < C; ++c) insert(c, i, row[c], i);
      if (i == k - 1)
        for (int64_t c = 0; c < C; ++c) kth[c] = val[c * k + k - 1];
      continue;
    }
    for (int64_t c = 0; c < C; ++c) {
      if (!ranks_above(row[c], kth[c])) continue;
      insert(c, k, row[c], i);
      kth[c] = val[c * k + k - 1];
    }
  }
  // (C, k) column lists -> (k, C)
  at::Tensor v = at::from_blob(val.data(), {C, k}, x.scalar_type()).t().clone(at::MemoryFormat::Contiguous);
  at::Tensor ids = at::from_blob(id.data(), {C, k}, at::kLong).t().clone(at::MemoryFormat::Contiguous);  // (copies: the vectors go)
  return {v, ids};
}

// The first k rows of (m, C) x per column in the order (value descending, NaN first; then
// the lower index along dim 0): values and indices. torch.topk picks any of several rows
// tied at the k-th value; in a column where it left out a tied row, the rows above the k-th
// value and the first tied rows are picked again by index.
std::pair<at::Tensor, at::Tensor> ordered_topk(const at::Tensor& x, int64_t k) {
  if (x.is_cpu() && x.is_contiguous() && k <= 64) {
    if (x.scalar_type() == at::kDouble) return ordered_topk_cpu<double>(x, k);
    if (x.scalar_type() == at::kLong) return ordered_topk_cpu<int64_t>(x, k);
  }
  auto top = at::topk(x, k, 0, /*largest=*/true, /*sorted=*/true);
  at::Tensor v = std::get<0>(top), idx = std::get<1>(top);
  const at::Tensor kth = v.narrow(0, k - 1, 1);
  const bool nan_kth = at::isnan(kth).any().item<bool>();
  const at::Tensor tied_x = nan_kth ? same_value(x, kth) : at::eq(x, kth);
  const at::Tensor left_out = tied_x.sum(0).gt(same_value(v, kth).sum(0));
  bool reorder;
  if (left_out.any().item<bool>()) {
    const at::Tensor cols = left_out.nonzero().squeeze(1);
    const at::Tensor xs = x.index_select(1, cols), ks = kth.index_select(1, cols);
    const at::Tensor above = at::gt(xs, ks).logical_or_(at::isnan(xs).logical_and_(at::isnan(ks).logical_not_()));
    const at::Tensor pos = at::arange(xs.size(0), xs.options().dtype(at::kDouble)).view({-1, 1});
    // every row above the k-th value (key -1), then the tied rows by index (key = index)
    const at::Tensor key = at::where(above, -1.0, at::where(same_value(xs, ks), pos, INFINITY));
    const at::Tensor pick = std::get<1>(at::topk(key, k, 0, /*largest=*/false, /*sorted=*/true));
    v.index_copy_(1, cols, xs.gather(0, pick));
    idx.index_copy_(1, cols, pick);
    reorder = true;
  } else {
    reorder = has_ties(v);  // topk sorted by value: only ties can be out of order
  }
  if (!reorder) return {v, idx};
  at::Tensor perm = std::get<1>(at::sort(idx, /*stable=*/true, /*dim=*/0, /*descending=*/false));
  perm = stable_by(perm, v, /*descending=*/true);
  return {v.gather(0, perm), idx.gather(0, perm)};
}

}  // namespace

class TopK : public Builtin {
 public:
  explicit TopK(ReductionOptions o) : Builtin("topk", std::move(o), {"k"}) {
    if (!opts_.count("k")) opts_["k"] = 10;
    ACS_CHECK(opt("k") >= 1 && opt("k") == std::floor(opt("k")) && opt("k") <= (1 << 24),
              "option 'k' of reduction 'topk' must be an integer in [1, 2**24], got ", number_str(opt("k")));
    k_ = static_cast<int64_t>(opt("k"));
  }

 protected:
  Slots empty_slots() const override {
    Slots s{{"values", {}, Layout::kLeadFeat}, {"row_ids", {}, Layout::kLeadFeat}};
    if (!per_feature_) s.push_back({"feature_ids", {}, Layout::kLeadFeat});
    return s;
  }
  at::ScalarType slot_dtype(const std::string& name) const override {
    return name == "values" ? at::kDouble : at::kLong;
  }
  // Values of integer rows are kept in int64, exact; of float rows (and bool) in float64.
  at::ScalarType work_dtype(at::ScalarType t) const override { return integer_rows(t) ? at::kLong : at::kDouble; }
  at::ScalarType loaded_dtype(const std::string& name, at::ScalarType t) const override {
    return name == "values" ? work_dtype(t) : at::kLong;
  }
  void validate_loaded(const Slots& s, int64_t) const override {
    const auto& v = get(s, "values");
    for (auto& x : s)
      ACS_CHECK(x.t.sizes() == v.sizes(), "state '", x.name, "' of reduction 'topk' must have the shape of 'values' ",
                shape_str(v.sizes()), ", got ", shape_str(x.t.sizes()));
  }
  Slots batch_state(const at::Tensor& x, int64_t row_offset, int64_t width) const override {
    const int64_t n = x.size(0), k = std::min(k_, n);
    auto [v, local] = ordered_topk(x, k);
    if (per_feature_) return {{"values", v, Layout::kLeadFeat}, {"row_ids", local + row_offset, Layout::kLeadFeat}};
    return {{"values", v, Layout::kLeadFeat},
            {"row_ids", at::floor_divide(local, width) + row_offset, Layout::kLeadFeat},
            {"feature_ids", at::remainder(local, width), Layout::kLeadFeat}};
  }
  void combine(int64_t, const Slots& b) override {
    if (adopt_if_empty(b)) return;
    auto [va, vb] = promoted(get("values"), get(b, "values"));
    at::Tensor v = at::cat({va, vb}, 0);
    at::Tensor rows = at::cat({get("row_ids"), get(b, "row_ids")}, 0);
    at::Tensor feats = find_slot(acc_, "feature_ids") ? at::cat({get("feature_ids"), get(b, "feature_ids")}, 0)
                                                      : at::Tensor();
    const int64_t k = std::min(k_, v.size(0));
    // (value descending, NaN first; then the lower row, then the lower feature): the
    // candidates are each part's top k in that order, so the first k are the union's
    auto by_value = at::sort(v, /*stable=*/true, /*dim=*/0, /*descending=*/true);
    at::Tensor perm = std::get<1>(by_value);
    if (has_ties(std::get<0>(by_value))) {
      perm = at::arange(v.size(0), rows.options()).view({-1, 1}).expand_as(rows).contiguous();
      if (feats.defined()) perm = stable_by(perm, feats, /*descending=*/false);
      perm = stable_by(perm, rows, /*descending=*/false);
      perm = stable_by(perm, v, /*descending=*/true);
    }
    perm = perm.narrow(0, 0, k);
    set("values", v.gather(0, perm));
    set("row_ids", rows.gather(0, perm));
    if (feats.defined()) set("feature_ids", feats.gather(0, perm));
  }
  Slots result_slots() const override {
    Slots s{{"values", get("values"), Layout::kLeadFeat}, {"row_ids", get("row_ids"), Layout::kLeadFeat}};
    if (!per_feature_) s.push_back({"feature_ids", get("feature_ids"), Layout::kLeadFeat});
    return s;
  }

 private:
  int64_t k_ = 10;
};

std::shared_ptr<Reduction> make_builtin(const std::string& kind, const ReductionOptions& o) {
  if (kind == "mean") return std::make_shared<Moments>("mean", o, false);
  if (kind == "var") return std::make_shared<Moments>("var", o, true);
  if (kind == "std") return std::make_shared<Moments>("std", o, true);
  if (kind == "min" || kind == "max" || kind == "absmax") return std::make_shared<Extremum>(kind, o);
  if (kind == "l2") return std::make_shared<L2>(o);
  if (kind == "nonzero") return std::make_shared<NonZero>(o);
  if (kind == "hist") return std::make_shared<Hist>(o);
  if (kind == "cov") return std::make_shared<Cov>(o);
  if (kind == "topk") return std::make_shared<TopK>(o);
  return nullptr;
}

}  // namespace


std::shared_ptr<Reduction> make_builtin_reduction(const std::string& kind, const ReductionOptions& options) {
  auto r = make_builtin(kind, options);
  ACS_CHECK(r != nullptr, "reduction kind must be one of [", join(kinds()), "], got '", kind, "'");
  return r;
}

std::vector<std::string> builtin_reduction_kinds() { return kinds(); }

namespace {

// update_reductions of reductions whose check() accepted the rows (built-ins: their update
// then does not throw).
void update_checked(const std::vector<std::shared_ptr<Reduction>>& reductions, const at::Tensor& rows,
                    int64_t row_offset) {
  std::vector<Builtin*> fused;
  bool grouped = false;  // every reduction was either updated or put in `fused`
  if (reductions.size() >= 2 && rows.defined()) {
    at::AutoGradMode no_grad(false);
    int n_candidates = 0;
    for (const auto& r : reductions) {
      auto* b = dynamic_cast<Builtin*>(r.get());
      if (b != nullptr && b->stats_needed() != 0) ++n_candidates;
    }
    if (n_candidates >= 2) {
      grouped = true;
      for (const auto& r : reductions) {
        auto* b = dynamic_cast<Builtin*>(r.get());
        if (b != nullptr && b->fused_begin(rows)) {
          fused.push_back(b);
        } else {
          r->update(rows, row_offset);
        }
      }
    }
  }
  if (!grouped) {
    for (const auto& r : reductions) r->update(rows, row_offset);
    return;
  }
  if (fused.empty()) return;
  // One pass for sums and extrema, one for centred squares, shared by every fused reduction.
  unsigned need = 0;
  for (auto* b : fused) need |= b->stats_needed();
  const int64_t n = rows.size(0), d = rows.numel() / n;
  thread_local std::vector<double> buf;
  if (static_cast<int64_t>(buf.size()) < 5 * d) buf.resize(5 * d);
  double* sum = buf.data();
  double* mn = sum + d;
  double* mx = mn + d;
  double* m2 = mx + d;
  double* ax = m2 + d;
  const RowsView view{rows.const_data_ptr(), rows.scalar_type(), n, d};
  BatchStats st;
  st.n = n;
  st.d = d;
  if (need & (kStatMean | kStatM2 | kStatMin | kStatMax)) {
    std::fill(sum, sum + d, 0.0);
    std::fill(mn, mn + d, INFINITY);
    std::fill(mx, mx + d, -INFINITY);
    kernels::add_sums_fold_min_max(view, sum, mn, mx);
    const double nb = static_cast<double>(n);
    for (int64_t j = 0; j < d; ++j) sum[j] /= nb;  // the batch mean, as Moments::fast_update
    clamp_means(sum, mn, mx, d);
    st.mean = sum;
    st.min = mn;
    st.max = mx;
  }
  if (need & kStatM2) {
    std::fill(m2, m2 + d, 0.0);
    kernels::add_centred_squares(view, sum, m2);
    st.m2 = m2;
  }
  if (need & kStatAbsMax) {
    std::fill(ax, ax + d, -INFINITY);
    kernels::fold_extremum(kernels::Ext::kAbsMax, view, ax);
    st.absmax = ax;
  }
  for (auto* b : fused) b->fused_end(st);
}

}  // namespace

void update_reductions(const std::vector<std::shared_ptr<Reduction>>& reductions, const at::Tensor& rows,
                       int64_t row_offset) {
  if (reductions.size() < 2) {
    for (const auto& r : reductions) r->update(rows, row_offset);
    return;
  }
  for (const auto& r : reductions) r->check(rows);
  // A custom reduction (TorchScript or Python) may raise on any batch check() accepted, or
  // refuse rows it wrote into: the custom ones go first, and when one raises, those before it
  // are put back to their state before this batch and no built-in has seen the rows. So a
  // batch refused by a custom reduction is in none of the hook point's reductions (a capture
  // keeps no record of it either), and top-k row ids never point at rows that are not there.
  const bool all_builtin = std::all_of(reductions.begin(), reductions.end(), [](const auto& r) {
    return dynamic_cast<Builtin*>(r.get()) != nullptr;
  });
  if (all_builtin) return update_checked(reductions, rows, row_offset);  // (no allocation per batch)
  std::vector<std::shared_ptr<Reduction>> custom, builtin;
  for (const auto& r : reductions) (dynamic_cast<Builtin*>(r.get()) != nullptr ? builtin : custom).push_back(r);
  std::vector<NamedTensors> before;
  if (custom.size() >= 2) {
    for (const auto& r : custom) before.push_back(r->state());  // (handles: a custom one replaces its acc)
  }
  for (size_t i = 0; i < custom.size(); ++i) {
    try {
      custom[i]->update(rows, row_offset);
    } catch (...) {
      for (size_t j = 0; j < i; ++j) custom[j]->undo_update(before[j]);
      throw;
    }
  }
  before.clear();
  update_checked(builtin, rows, row_offset);
}

}  // namespace acs