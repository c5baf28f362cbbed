// Online reductions: interface used by the capture sink (pure ATen, no Python).
//
// A reduction sees the rows of one hook point, batch after batch, and keeps a small state
// (float64 accumulators for the built-in statistics). States of the same reduction kind
// merge (workers, ranks, resumed runs), so every built-in is a mergeable monoid.
#pragma once

#include <ATen/ATen.h>

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace acs {

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

// Whether torch converts values of dtype `t` to float64 (what a built-in reduction reads):
// bool, integers, floating point. Not complex, and not the dtypes torch stores without any
// arithmetic or conversion (bits8 ... bits1x8, uint1 ... uint7, int1 ... int7, the packed
// float4_e2m1fn_x2), whose `.to(torch.float64)` raises NotImplementedError.
inline bool has_real_numbers(at::ScalarType t) {
  return at::isIntegralType(t, /*includeBool=*/true) || (at::isFloatingType(t) && t != at::kFloat4_e2m1fn_x2);
}

// Options of a reduction; keys depend on the kind (documented in reductions_builtin.cpp /
// activationscope/reductions.py): e.g. "per_feature" (0/1), "bins", "lo", "hi", "k".
using ReductionOptions = std::map<std::string, double>;

class Reduction {
 public:
  virtual ~Reduction() = default;

  // rows: (n_rows, *feature_shape), any dtype, any device. Called without the GIL,
  // from one thread at a time. row_offset: global row index of rows[0] (top-k row ids).
  virtual void update(const at::Tensor& rows, int64_t row_offset) = 0;

  // Throw now what update() would throw for these rows on its own checks (dtype, feature
  // shape), changing nothing: update_reductions checks every reduction of a hook point
  // before it updates any, so a refused batch leaves none of them half updated.
  virtual void check(const at::Tensor& /*rows*/) const {}

  // Fold another reduction of the same kind and options into this one (Chan et al. for
  // moments). Throws c10::Error (TORCH_CHECK) when kinds or options differ.
  virtual void merge(const Reduction& other) = 0;

  // Final values, e.g. {"mean": (d,), ...}; float64 unless documented otherwise.
  virtual NamedTensors result() const = 0;

  // Complete state, enough to merge later or to resume (load_state(state()) is identity).
  virtual NamedTensors state() const = 0;
  virtual void load_state(const NamedTensors& state) = 0;

  // A new, empty reduction with the same kind and options.
  virtual std::shared_ptr<Reduction> fresh() const = 0;

  // Remember the state as it is now (replacing the one remembered before), and put it back:
  // a capture takes out of its reductions a forward its store leaves out. Called with no
  // update running. The default keeps state() (handles: an implementation that updates a
  // state tensor in place copies a shared one first) and puts it back with load_state().
  virtual void checkpoint() { checkpoint_ = state(); }
  virtual void restore_checkpoint() { load_state(checkpoint_); }

  // Put back the state before the last update(), `before` (state() taken just before it):
  // update_reductions does when a later custom reduction of the hook point refuses the batch.
  // The default loads it; a custom reduction also puts back what made_nonfinite knew then.
  virtual void undo_update(const NamedTensors& before) { load_state(before); }

  // The kind ("mean", "var", ..., "script") and the options it was made with.
  virtual std::string kind() const = 0;
  virtual ReductionOptions options() const = 0;

  // Custom reductions: whether a batch turned finite rows, and a finite accumulator (or none),
  // into an accumulator holding NaN or inf (the function's own doing; NaN or inf of the rows is
  // carried along as the built-ins carry it, like torch, and does not count). False for the
  // built-ins. Reads a flag kept on the accumulator's device off the CPU (synchronises there).
  // Reads what update() writes: a capture asks with no update running, under the hook point's
  // lock (Sink::reduction_made_nonfinite).
  virtual bool made_nonfinite() const { return false; }

 private:
  NamedTensors checkpoint_;  // (the default checkpoint)
};

// Built-in reductions by kind; TORCH_CHECK fails with the list of kinds on an unknown one.
std::shared_ptr<Reduction> make_builtin_reduction(const std::string& kind,
                                                  const ReductionOptions& options);

// Custom reduction from a TorchScript file (`torch.jit.save` of a scripted function or
// module with signature (acc: Optional[Tensor], x: Tensor) -> Tensor), run from C++. Errors
// name it `name` when given (a function compiled to a scratch file), else by its path.
std::shared_ptr<Reduction> make_script_reduction(const std::string& pt_path,
                                                 const ReductionOptions& options,
                                                 const std::string& name = {});

// Update every reduction of a hook point with the same rows, in order. Built-in mean / var /
// std / min / max / absmax (per feature) on a contiguous CPU batch share one pass for the
// batch sums and extrema and one for the centred squares, instead of a pass each; results
// are the same as separate updates (same summation order; extrema are exact). The others,
// and batches off the fast path, go through update(). Every reduction's check() runs
// first: a batch one of them refuses updates none. Custom reductions run before the
// built-ins, and one that raises leaves every reduction as it was before the batch.
void update_reductions(const std::vector<std::shared_ptr<Reduction>>& reductions, const at::Tensor& rows,
                       int64_t row_offset);

// Names of the built-in kinds, for error messages and the Python side.
std::vector<std::string> builtin_reduction_kinds();

}  // namespace acs
