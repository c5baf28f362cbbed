// Custom reductions from TorchScript files, run from C++ (no Python, no GIL).
#include "reductions.h"

#include <c10/core/InferenceMode.h>
#include <torch/csrc/jit/ir/alias_analysis.h>
#include <torch/script.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "errors.h"

namespace acs {

namespace {

// ------------------------------------------------------------------ TorchScript reductions
// acc = fn(acc, x) per batch, run from C++ (no Python, no GIL). x is passed as given (dtype,
// device); acc starts as None unless load_state({"acc": t}) pre-seeded it. A module that also
// defines merge(a: Tensor, b: Tensor) -> Tensor can be merged.
class ScriptReduction : public Reduction {
 public:
  ScriptReduction(std::string path, ReductionOptions opts, std::shared_ptr<torch::jit::Module> m,
                  std::string name = {})
      : path_(std::move(path)), name_(std::move(name)), opts_(std::move(opts)), module_(std::move(m)) {
    auto fwd = module_->find_method("forward");
    ACS_CHECK(fwd.has_value(), "custom reduction '", label(),
              "' has no forward; save a scripted function or a module whose forward is "
              "(acc: Optional[Tensor], x: Tensor) -> Tensor");
    const auto& schema = fwd->function().getSchema();
    const auto& args = schema.arguments();  // self, acc, x
    ACS_CHECK(args.size() == 3, "custom reduction '", label(), "' must take exactly two arguments ",
              "(acc: Optional[Tensor], x: Tensor) -> Tensor, got ", schema);
    acc_optional_ = args[1].type()->kind() == c10::TypeKind::OptionalType;
    has_merge_ = module_->find_method("merge").has_value();
    writes_acc_ = may_write_acc(*fwd);
  }

  void update(const at::Tensor& rows, int64_t) override {
    at::AutoGradMode no_grad(false);
    if (rows.dim() >= 1 && rows.size(0) == 0) return;  // an empty batch is a no-op
    ACS_CHECK(acc_.defined() || acc_optional_, "custom reduction '", label(),
              "' declares acc as Tensor, so it cannot start from None: annotate it "
              "acc: Optional[Tensor] or pre-seed the accumulator (init=...)");
    // An accumulator that did not come from rows of this device follows the rows: an init=
    // or a stored state (resume) is on the CPU, committed rows read back from a store are on
    // the CPU while a CUDA model's rows are not, and init= is one tensor for hook points that
    // may live on several devices. One made from rows of this device stays where the function
    // put it.
    if (acc_.defined() && acc_.device() != rows.device() && rows_device_ != rows.device()) {
      c10::InferenceMode normal(false);
      acc_ = acc_.to(rows.device());
    }
    // The accumulator as it was: put back when this batch fails (the function raises, writes
    // into x or returns no tensor). A function whose program may write into acc (may_write_acc)
    // works on a copy at every batch, so that what is put back is untouched: a write seen by
    // nothing (through acc.data, or under inference_mode: no version counter moves, and the
    // function may return another tensor) followed by an error would otherwise stay in the
    // accumulator. The copy goes into the memory of an accumulator no longer in use (spare_),
    // so a batch allocates nothing for it. One whose program writes into nothing is given the
    // accumulator itself, shared or not: the handles the checkpoint, `kept` and the caller hold
    // stay as they are, so a forward copies nothing (its checkpoint is a handle, not a copy of
    // the state).
    const bool copy = in_place_ || writes_acc_;
    undo_from_state_ = acc_from_state_;  // (undo_update)
    undo_rows_device_ = rows_device_;
    undo_made_ = made_;
    undo_made_dev_ = made_dev_;
    undo_acc_finite_ = acc_finite_;
    const at::Tensor kept = acc_;
    if (copy) copy_acc();
    const at::Tensor acc_in = acc_;
    const bool acc_versioned = acc_in.defined() && !acc_in.is_inference();
    const uint32_t acc_version = acc_versioned ? acc_in._version() : 0;
    try {
      std::vector<c10::IValue> in;
      in.emplace_back(acc_in.defined() ? c10::IValue(acc_in) : c10::IValue());
      in.emplace_back(rows.detach());  // (shares the rows' version counter)
      // (inference tensors have no version counter: nothing to compare there)
      const bool versioned = !rows.is_inference();
      const uint32_t version = versioned ? rows._version() : 0;
      c10::IValue out;
      try {
        out = module_->forward(std::move(in));
      } catch (const std::exception& e) {
        ACS_CHECK(false, "custom reduction '", label(), "' failed on rows of shape ",
                  shape_str(rows.sizes()), " (", dtype_name(rows.scalar_type()), "): ", e.what());
      }
      // The rows are the model's activations (or the rows a store keeps): a reduction that
      // writes into them changes the model's forward and what is stored.
      ACS_CHECK(!versioned || rows._version() == version, "custom reduction '", label(),
                "' changed its input x in place (rows of shape ", shape_str(rows.sizes()),
                "): x holds the model's activations, so the forward and the stored rows would change; "
                "use out-of-place ops (x = x.clamp(min=0.0), not x.clamp_(min=0.0)) or work on x.clone()");
      ACS_CHECK(out.isTensor(), "custom reduction '", label(), "' must return a Tensor, got ",
                out.tagKind());
      at::Tensor acc = out.toTensor().detach();
      // An accumulator of another shape broadcasts (a () sum plus a (d,) one is (d,), every
      // feature holding the earlier batches' total), and one of another dtype rounds what was
      // folded in: each batch would be folded in unlike the others, without an error.
      ACS_CHECK(!acc_in.defined() || (acc.sizes() == acc_in.sizes() && acc.scalar_type() == acc_in.scalar_type()),
                "custom reduction '", label(), "' was given an accumulator of shape ", shape_str(acc_in.sizes()),
                " (", dtype_name(acc_in.scalar_type()), ") and returned one of shape ", shape_str(acc.sizes()),
                " (", dtype_name(acc.scalar_type()), "), on rows of shape ", shape_str(rows.sizes()), " (",
                dtype_name(rows.scalar_type()),
                "): the accumulator must keep its shape and dtype from batch to batch (one of another shape "
                "broadcasts, so the batches would not be folded in alike); ",
                acc_from_state_ ? "give init= (or the stored state) the shape and dtype the function returns"
                                : "make the function return a tensor of its accumulator's shape and dtype");
      // A program said to write into nothing that still moved acc's version counter (an op
      // whose schema hides its write): from the next batch on, on a copy, as any that may write.
      if (acc_versioned && acc_in._version() != acc_version) in_place_ = true;
      // An accumulator that is x itself (`return x` for the first batch) or a view of it would
      // change with the model's memory: keep a copy.
      if (acc.has_storage() && rows.has_storage() && acc.storage().is_alias_of(rows.storage())) acc = acc.clone();
      acc_ = std::move(acc);
      note_nonfinite(acc_, rows);
      acc_from_state_ = false;
      rows_device_ = rows.device();
      // What the next batch's copy (copy_acc) goes into instead of a new allocation: the
      // accumulator before this batch when the function updated its copy in place, or when the
      // checkpoint (the capture's state before this forward) holds it until the next one anyway;
      // else the copy this batch was given (the function returned another tensor), the
      // accumulator before it then freed. copy_acc takes it only once no one else holds it.
      // An accumulator that came from outside (init=, a stored or loaded state) is never taken:
      // its memory may be kept by other means than a tensor (torch.from_numpy of an array the
      // caller holds), which no use count shows.
      if (copy && acc_in.defined()) {
        const bool returned = acc_.has_storage() && acc_in.has_storage() && acc_.storage().is_alias_of(acc_in.storage());
        const bool kept_ours = kept.defined() && !undo_from_state_;
        if (returned) {
          spare_ = kept_ours ? kept : at::Tensor();
        } else {
          spare_ = kept_ours && kept.is_same(saved_acc_) ? kept : acc_in;
        }
      } else {
        spare_ = at::Tensor();
      }
    } catch (...) {
      acc_ = kept;
      throw;
    }
  }

  void merge(const Reduction& other_r) override {
    at::AutoGradMode no_grad(false);
    const auto* other = dynamic_cast<const ScriptReduction*>(&other_r);
    ACS_CHECK(other != nullptr, "cannot merge a '", other_r.kind(),
              "' reduction into a custom ('script') reduction");
    ACS_CHECK(other->path_ == path_, "cannot merge custom reductions from different files: '",
              path_, "' and '", other->path_, "'");
    ACS_CHECK(has_merge_, "custom reduction '", label(),
              "' cannot merge: a plain function has no merge rule. Register it as a scripted "
              "module with forward(acc, x) and merge(a: Tensor, b: Tensor) -> Tensor methods, "
              "or merge the states yourself");
    if (other->made_nonfinite()) made_ = true;  // (what the other's batches made stays in the merged state)
    at::Tensor b = other->acc_;
    if (!b.defined()) return;
    if (!acc_.defined()) {
      acc_ = b;
      note_acc_finite();
      return;
    }
    // (merge(a, b) of other shapes may broadcast: a () accumulator plus a (d,) one)
    ACS_CHECK(b.sizes() == acc_.sizes() && b.scalar_type() == acc_.scalar_type(), "merge of custom reduction '",
              label(), "' failed on accumulators of shapes ", shape_str(acc_.sizes()), " and ", shape_str(b.sizes()),
              " (", dtype_name(acc_.scalar_type()), ", ", dtype_name(b.scalar_type()),
              "): they must have the same shape and dtype (states "
              "of rows of other shapes, or of another hook point, do not merge)");
    own_acc();
    c10::IValue out;
    try {
      out = module_->get_method("merge")({acc_, b});
    } catch (const std::exception& e) {
      ACS_CHECK(false, "merge of custom reduction '", label(), "' failed on accumulators of shapes ",
                shape_str(acc_.sizes()), " and ", shape_str(b.sizes()), " (", dtype_name(acc_.scalar_type()), ", ",
                dtype_name(b.scalar_type()), "): ", e.what());
    }
    ACS_CHECK(out.isTensor(), "merge of custom reduction '", label(), "' must return a Tensor");
    at::Tensor merged = out.toTensor().detach();
    ACS_CHECK(merged.sizes() == acc_.sizes() && merged.scalar_type() == acc_.scalar_type(), "merge of custom reduction '",
              label(), "' was given accumulators of shape ", shape_str(acc_.sizes()), " (",
              dtype_name(acc_.scalar_type()), ") and returned one of shape ", shape_str(merged.sizes()), " (",
              dtype_name(merged.scalar_type()),
              "): merge(a, b) must return a tensor of the accumulators' shape and dtype");
    acc_ = std::move(merged);
    note_acc_finite();
  }

  NamedTensors result() const override {
    if (!acc_.defined()) return {};
    return {{"value", acc_}};
  }
  NamedTensors state() const override {
    if (!acc_.defined()) return {};
    return {{"acc", acc_}};
  }
  void load_state(const NamedTensors& st) override {
    at::Tensor a;
    for (const auto& kv : st) {
      ACS_CHECK(kv.first == "acc", "state of custom reduction '", label(),
                "' has only the key 'acc', got '", kv.first, "'");
      a = kv.second;
    }
    acc_ = a.defined() ? a.detach() : a;
    spare_ = at::Tensor();
    note_acc_finite();
    acc_from_state_ = a.defined();
    rows_device_ = std::nullopt;  // (moved to the rows' device at the next update)
  }
  // (a handle: an update that may write into acc works on a copy, a merge copies a shared acc_
  // first, acc_needs_copy)
  void checkpoint() override {
    saved_acc_ = acc_;
    saved_from_state_ = acc_from_state_;
    saved_rows_device_ = rows_device_;
    saved_made_ = made_;
    saved_made_dev_ = made_dev_;
    saved_acc_finite_ = acc_finite_;
  }
  void restore_checkpoint() override {
    acc_ = saved_acc_;
    acc_from_state_ = saved_from_state_;
    rows_device_ = saved_rows_device_;
    made_ = saved_made_;  // (NaN or inf the taken-out forward made is not in the state either)
    made_dev_ = saved_made_dev_;
    acc_finite_ = saved_acc_finite_;
  }
  // (the accumulator from `before`, the rest as the last update found it)
  void undo_update(const NamedTensors& before) override {
    load_state(before);
    acc_from_state_ = undo_from_state_;
    rows_device_ = undo_rows_device_;
    made_ = undo_made_;  // (NaN or inf the batch taken out made is not in the state either)
    made_dev_ = undo_made_dev_;
    acc_finite_ = undo_acc_finite_;
  }
  std::shared_ptr<Reduction> fresh() const override {
    return std::make_shared<ScriptReduction>(path_, opts_, module_, name_);
  }
  std::string kind() const override { return "script"; }
  ReductionOptions options() const override { return opts_; }
  bool made_nonfinite() const override {
    return made_ || (made_dev_.defined() && made_dev_.item<bool>());
  }

 private:
  // After a batch: did the function turn finite rows and a finite accumulator (none for the
  // first batch; acc_finite_ says, as noted when it was made: the function may have changed it
  // in place since) into one (`after`) holding NaN or inf? On the CPU the accumulator is looked
  // at (its size, not the rows'), the rows only when it is not finite; elsewhere the answer is
  // kept on the device (no synchronisation per batch) and read by made_nonfinite(). Only dense
  // tensors of values are looked at (a sparse or meta accumulator or rows: never counted).
  void note_nonfinite(const at::Tensor& after, const at::Tensor& rows) {
    if (made_ || !checkable(after) || !checkable(rows)) return;
    try {
      at::Tensor finite = at::isfinite(after).all();
      if (after.is_cpu()) {
        made_ = !finite.item<bool>() && (!acc_finite_.defined() || acc_finite_.item<bool>()) &&
                at::isfinite(rows).all().item<bool>();
      } else {
        at::Tensor made = finite.logical_not().logical_and(at::isfinite(rows).all().to(after.device()));
        if (acc_finite_.defined()) made = made.logical_and(acc_finite_.to(after.device()));
        made_dev_ = made_dev_.defined() ? made_dev_.logical_or(made) : made;
      }
      acc_finite_ = finite;
    } catch (const c10::Error&) {  // (a device or tensor kind without isfinite: nothing is said)
      acc_finite_ = at::Tensor();
    }
  }
  // acc_finite_ of an accumulator that did not come from a batch (init=, a stored state, a merge)
  void note_acc_finite() {
    acc_finite_ = at::Tensor();
    if (!acc_.defined() || !checkable(acc_)) return;
    try {
      acc_finite_ = at::isfinite(acc_).all();
    } catch (const c10::Error&) {
    }
  }
  static bool checkable(const at::Tensor& t) {
    return t.layout() == at::kStrided && !t.is_meta() && !t.is_nested() && (t.is_floating_point() || t.is_complex());
  }

  // merge may update the accumulator in place (`a += b`): give it one no one else holds (the
  // function gets a copy at every batch, update). acc_ is shared after state() / result()
  // handed it out, load_state took it (init= is one tensor for the reductions of every hook
  // point), or a merge adopted the other side's: then it is copied first (once), so that no
  // other reduction, earlier result or the caller's tensor changes. An accumulator made under
  // torch.inference_mode (an inference tensor) is copied too when the merge comes outside it:
  // an in-place update of it there is an error. The copy is a normal tensor, so a capture may
  // mix forwards under inference_mode and not.
  bool acc_needs_copy() const {
    if (!acc_.defined()) return false;
    const bool shared = acc_.use_count() > 1 || (acc_.has_storage() && acc_.storage().use_count() > 1);
    const bool frozen = acc_.is_inference() && !c10::InferenceMode::is_enabled();
    return shared || frozen;
  }
  void copy_acc() {
    if (!acc_.defined()) return;
    c10::InferenceMode normal(false);
    at::Tensor spare = std::move(spare_);
    if (reusable(spare, acc_)) {  // (what clone() would give: the same sizes, strides and dtype)
      spare.copy_(acc_);
      acc_ = std::move(spare);
    } else {
      acc_ = acc_.clone();
    }
  }
  // Whether `spare`, an accumulator no longer in use, can take a copy of `acc` in place of a
  // clone: no one else holds it or a view of it (the checkpoint moved on), and it is a normal
  // dense tensor of acc's device, dtype, sizes and strides.
  static bool reusable(const at::Tensor& spare, const at::Tensor& acc) {
    return spare.defined() && spare.use_count() == 1 && spare.has_storage() && spare.storage().use_count() == 1 &&
           !spare.is_inference() && spare.layout() == at::kStrided && acc.layout() == at::kStrided &&
           !spare.is_neg() && !spare.is_conj() && !acc.is_neg() && !acc.is_conj() &&
           spare.device() == acc.device() && spare.scalar_type() == acc.scalar_type() &&
           spare.sizes() == acc.sizes() && spare.strides() == acc.strides() && spare.storage_offset() == 0 &&
           acc.is_non_overlapping_and_dense();
  }
  // Whether the program of `forward` may write into its acc argument: whether it writes into
  // anything at all (`acc += ...`, an in-place op on any tensor, a call that may write), by
  // TorchScript's alias analysis, which answers yes where it cannot tell. Its answer for acc
  // alone is not enough: it misses writes into acc reached through a loop that carries acc to
  // the next iteration, or through a List[Any] holding it. No means the function only reads.
  static bool may_write_acc(const torch::jit::Method& forward) {
    try {
      std::shared_ptr<torch::jit::Graph> graph = forward.graph();
      torch::jit::AliasDb db(graph);
      return writes(db, graph->block());
    } catch (const std::exception&) {
      return true;
    }
  }
  static bool writes(const torch::jit::AliasDb& db, torch::jit::Block* block) {
    for (torch::jit::Node* n : block->nodes()) {
      // (a fork's program is a graph of its own)
      if (n->hasAttribute(torch::jit::attr::Subgraph) || db.isMutable(n)) return true;
      for (torch::jit::Block* b : n->blocks()) {
        if (writes(db, b)) return true;
      }
    }
    return false;
  }
  // (an accumulator that came from outside, init= or a loaded state not yet updated, is copied
  // too: its memory may be kept by other means than a tensor, torch.from_numpy of an array the
  // caller holds, which no use count shows)
  void own_acc() {
    if (acc_needs_copy() || acc_from_state_) copy_acc();
  }

  // How errors name it: the name given (the function a capture compiled to a scratch file),
  // else the file's path.
  const std::string& label() const { return name_.empty() ? path_ : name_; }

  std::string path_;
  std::string name_;
  ReductionOptions opts_;
  std::shared_ptr<torch::jit::Module> module_;  // shared by fresh() copies; forward is const
  bool acc_optional_ = true;
  bool has_merge_ = false;
  bool writes_acc_ = true;  // the function's program may write into acc (may_write_acc)
  bool in_place_ = false;  // the function was seen updating acc in place, said to write into nothing
  bool acc_from_state_ = false;  // acc_ is an init= or a loaded state, not yet updated
  at::Tensor acc_;
  std::optional<c10::Device> rows_device_;  // the device of the rows acc_ was last made from
  bool made_ = false;      // a batch made NaN or inf of finite rows (note_nonfinite)
  at::Tensor made_dev_;    // the same, kept on the accumulator's device off the CPU
  at::Tensor acc_finite_;  // () bool: acc_ was finite when made (undefined: no accumulator)
  at::Tensor spare_;       // an earlier accumulator whose memory copy_acc may reuse (or none)
  // (checkpoint) what it remembers
  at::Tensor saved_acc_;
  bool saved_from_state_ = false;
  std::optional<c10::Device> saved_rows_device_;
  bool saved_made_ = false;
  at::Tensor saved_made_dev_;
  at::Tensor saved_acc_finite_;
  // (undo_update) what the last update found
  bool undo_from_state_ = false;
  std::optional<c10::Device> undo_rows_device_;
  bool undo_made_ = false;
  at::Tensor undo_made_dev_;
  at::Tensor undo_acc_finite_;
};

}  // namespace

std::shared_ptr<Reduction> make_script_reduction(const std::string& path, const ReductionOptions& options,
                                                 const std::string& name) {
  std::shared_ptr<torch::jit::Module> m;
  try {
    m = std::make_shared<torch::jit::Module>(torch::jit::load(path));
  } catch (const std::exception& e) {
    ACS_CHECK(false, "custom reduction file '", path, "' could not be loaded as TorchScript: ", e.what());
  }
  m->eval();
  return std::make_shared<ScriptReduction>(path, options, std::move(m), name);
}

}  // namespace acs
