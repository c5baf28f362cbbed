#include "sink.h"

#include <limits>
#include <random>

#include <ATen/autocast_mode.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/irange.h>

#include <cstdio>
#include <cstring>


#include "errors.h"
#include "fast_copy.h"
#include "shard_writer.h"  // crc32c
#include "staging_pool.h"

namespace acs {

namespace {

constexpr int64_t kAlign = 64;

// The context of a snapshot's data pointer: one reference to the slab it lives in.
struct SlabRef {
  c10::Storage slab;
};
void release_slab_ref(void* ctx) { delete static_cast<SlabRef*>(ctx); }
constexpr int64_t kCopied = -1;  // versions_ entry of a REFERENCE record that is a copy

// Whether any element's exponent bits are all ones (inf or NaN) in a contiguous buffer of
// IEEE floats seen as unsigned integers: one pass, no allocation, vectorised by the compiler.
template <typename U>
bool any_exponent_all_ones(const void* data, int64_t n, U mask) {
  const U* p = static_cast<const U*>(data);
  unsigned char found = 0;
  for (int64_t i = 0; i < n; ++i) found |= static_cast<unsigned char>((p[i] & mask) == mask);
  return found != 0;
}

// The largest finite value of a dtype (0 when unknown: always checked).
double largest_finite(at::ScalarType t) {
  switch (t) {
    case at::kHalf: return 65504.0;
    case at::kBFloat16: return 3.3895313892515355e38;
    case at::kFloat: case at::kComplexFloat: return 3.4028234663852886e38;
    case at::kDouble: case at::kComplexDouble: return 1.7976931348623157e308;
    case at::kBool: return 1.0;
    case at::kByte: return 255.0;
    case at::kChar: return 127.0;
    case at::kShort: return 32767.0;
    case at::kInt: return 2147483647.0;
    case at::kLong: return 9.2233720368547758e18;
    default: return 0.0;
  }
}

}  // namespace

at::Tensor Sink::cast_checked(const at::Tensor& src, at::ScalarType dtype) {
  at::Tensor cast = src.to(dtype);
  check_cast(src, cast);
  return cast;
}

namespace {
// Whether a cast from -> to can turn a finite value into inf (a narrower floating dtype).
bool cast_may_overflow(at::ScalarType from, at::ScalarType to) {
  if (!(at::isFloatingType(to) || at::isComplexType(to))) return false;
  const double room = largest_finite(to);
  return !(room > 0 && room >= largest_finite(from));
}
}  // namespace

namespace {
// The largest integer n such that every integer in [-n, n] is a value of a floating dtype
// (2^(significand bits)); 0 for other dtypes.
double exact_integers_up_to(at::ScalarType t) {
  switch (t) {
    case at::kHalf: return 2048.0;
    case at::kBFloat16: return 256.0;
    case at::kFloat: case at::kComplexFloat: return 16777216.0;
    case at::kDouble: case at::kComplexDouble: return 9007199254740992.0;
    default: return 0.0;
  }
}

// Whether a cast from -> to can turn an integer into another one (a floating dtype with too
// few significand bits for the integer dtype's range: int16 and wider in bfloat16, int64 in
// float64). uint16, uint32 and uint64 have no entry in largest_finite: always checked.
bool cast_may_round_integers(at::ScalarType from, at::ScalarType to) {
  if (!at::isIntegralType(from, /*includeBool=*/false)) return false;
  if (!(at::isFloatingType(to) || at::isComplexType(to))) return false;
  const double widest = largest_finite(from);
  return !(widest > 0 && widest <= exact_integers_up_to(to));
}
}  // namespace

bool Sink::cast_may_change(at::ScalarType from, at::ScalarType to) {
  return cast_may_overflow(from, to) || cast_may_round_integers(from, to);
}

void Sink::check_cast(const at::Tensor& src, const at::Tensor& cast) {
  check_overflow(src, cast);
  check_integers(src, cast);
}

void Sink::check_integers(const at::Tensor& src, const at::Tensor& cast) {
  const at::ScalarType from = src.scalar_type();
  const at::ScalarType dtype = cast.scalar_type();
  if (!cast_may_round_integers(from, dtype) || src.numel() == 0) return;
  // Compared as int64 bits: the cast's values (float64 holds every float16 / bfloat16 / float32
  // value) back to integers where they are in the source dtype's range. uint64 values from 2^63
  // are int64 bits v - 2^64: a cast value c in [2^63, 2^64) is compared as (c - 2^63) - 2^63
  // (c - 2^63 is exact in float64: c is a multiple of 2^11 there), so that an exact cast
  // (2^63 to float64 or float32) is kept and only a changed value is refused.
  const bool u64 = from == at::kUInt64;
  const at::Tensor s = src.to(at::kLong);
  const at::Tensor c = (at::isComplexType(dtype) ? at::real(cast) : cast).to(at::kDouble);
  const double two63 = 9223372036854775808.0;
  const at::Tensor in_range = u64 ? at::logical_and(c >= 0.0, c < 2.0 * two63) : at::logical_and(c >= -two63, c < two63);
  const at::Tensor zero = at::zeros({}, c.options());
  at::Tensor back = at::where(in_range, c, zero);
  if (u64) {
    const at::Tensor high = back >= two63;
    back = at::where(high, back - two63, back).to(at::kLong);
    back = at::where(high, back + std::numeric_limits<int64_t>::min(), back);
  } else {
    back = back.to(at::kLong);
  }
  const at::Tensor changed = at::logical_or(at::logical_not(in_range), back != s);
  if (!changed.any().item<bool>()) return;
  const int64_t first = changed.flatten().nonzero().select(1, 0).min().item<int64_t>();
  const int64_t bits = s.flatten()[first].item<int64_t>();  // (item<int64_t> of a uint64 from 2^63 throws)
  const std::string before = u64 ? std::to_string(static_cast<uint64_t>(bits)) : std::to_string(bits);
  char after[40];
  std::snprintf(after, sizeof after, "%.17g", c.flatten()[first].item<double>());
  const double exact = exact_integers_up_to(dtype);
  char bound[40];
  std::snprintf(bound, sizeof bound, "%.17g", exact);
  // (the advice in the words the CLI rewrites: cli._CLI_SPELLINGS)
  const bool input = name_.find(".input") != std::string::npos;
  // storage_dtype casts floating-point hook points only (the Python side gives an integer or
  // bool one no storage_dtype); an integer reaches a cast in two cases: a hook point whose first
  // call (an empty batch too) was floating-point (its rows have one dtype), or a resumed store
  // that holds the hook point cast (in an array, or as the rows a store that keeps reductions
  // only reduced: its first call in the resumed capture was floating-point, or it was written by
  // a version that cast every hook point).
  const std::optional<at::ScalarType> first_dtype = first_call_dtype_ ? first_call_dtype_ : seen_dtype_;
  const bool first_float = first_dtype && (at::isFloatingType(*first_dtype) || at::isComplexType(*first_dtype));
  const std::string why =
      first_float ? c10::str("its first call was ", dtype_name(*first_dtype), " and a hook point's rows have one ",
                             "dtype: leave the hook point out ")
                  : c10::str(writer_ ? "its store array holds "
                                     : "the store it resumes (it keeps reductions only) reduced its rows as ",
                             dtype_name(dtype), " (a store written by an earlier version, which cast integer hook ",
                             "points too, or one whose first call of the hook point was floating-point): capture ",
                             "into a new store (or overwrite=True), where it keeps its own dtype, or leave the hook ",
                             "point out ");
  ACS_CHECK(false, "hook point '", name_, "' is ", dtype_name(from), " and storage_dtype=", dtype_name(dtype),
            " changes its integers (", before, " would be stored as ", after, "; ", dtype_name(dtype),
            " holds every integer only up to ", bound, "), so the stored rows and their reductions would not be ",
            "the captured values (token ids, indices). storage_dtype casts floating-point hook points only; this ",
            "one is cast because ", why,
            input ? "(exclude= its module, or capture=\"output\": it is an input of its module)" : "(exclude= its module)");
}

void Sink::check_overflow(const at::Tensor& src, const at::Tensor& cast) {
  const at::ScalarType dtype = cast.scalar_type();
  if (!cast_may_overflow(src.scalar_type(), dtype)) return;
  bool maybe = true;  // some value is inf or NaN after the cast
  if (cast.device().is_cpu() && cast.is_contiguous()) {
    const int64_t n = cast.numel();
    switch (dtype) {
      case at::kHalf: maybe = any_exponent_all_ones<uint16_t>(cast.const_data_ptr(), n, 0x7C00u); break;
      case at::kBFloat16: maybe = any_exponent_all_ones<uint16_t>(cast.const_data_ptr(), n, 0x7F80u); break;
      case at::kFloat: maybe = any_exponent_all_ones<uint32_t>(cast.const_data_ptr(), n, 0x7F800000u); break;
      default: maybe = !at::isfinite(cast).all().item<bool>();
    }
  } else {
    maybe = !at::isfinite(cast).all().item<bool>();
  }
  if (!maybe) return;
  // inf / NaN after the cast: an error only where the value was finite before it (overflow)
  const at::Tensor finite = at::isfinite(src);
  if (!at::logical_and(at::isinf(cast), finite).any().item<bool>()) return;
  const double biggest = at::where(finite, src.abs(), at::zeros({}, src.abs().options())).max().item<double>();
  const double limit = largest_finite(dtype);
  // (9 significant digits: float32's values, told apart; 6 showed 3.40282e+38 for both a value
  // just past float32's largest and the largest itself)
  auto g9 = [](double v) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.9g", v);
    return std::string(buf);
  };
  ACS_CHECK(false, "hook point '", name_, "': storage_dtype=", dtype_name(dtype), " turns finite values into inf ",
            "(max |value| ", g9(biggest), limit > 0 ? c10::str(", the largest ", dtype_name(dtype), " is ", g9(limit)) : "",
            "), so the stored rows and their reductions would not be the captured values; pass a wider ",
            "storage_dtype (torch.bfloat16 keeps float32's range, or torch.float32), or none");
}

bool is_token_rows(const at::Tensor& x, const at::Tensor& token_mask) {
  // (a nested tensor has no fixed sizes to compare: a jagged one refuses size())
  return token_mask.defined() && token_mask.dim() == 2 && fixed_sizes(x) && x.dim() >= 2 &&
         x.size(0) == token_mask.size(0) &&
         x.size(1) == token_mask.size(1);
}

// `waiter` waits (on the device) for the work queued so far on `done`; the host does not wait.
void stream_waits(const c10::Stream& done, const c10::Stream& waiter) {
  if (done == waiter || done.device_type() != waiter.device_type()) return;
  c10::Event event(done.device_type());
  event.record(done);
  event.block(waiter);
}

// `*event` recorded on `stream` (made anew where there is none yet, or one of another device:
// an event records on streams of one device only).
static void record_event(std::unique_ptr<c10::Event>& event, const c10::Stream& stream) {
  if (!event || event->device_type() != stream.device_type() ||
      (event->device_index() != -1 && event->device_index() != stream.device_index())) {
    event = std::make_unique<c10::Event>(stream.device_type());
  }
  event->record(stream);
}

std::shared_ptr<c10::Event> device_to_host(const at::Tensor& x, const at::Tensor& dst) {
  // 1. Snapshot on the device, on the compute stream: ordered before any later in-place op
  //    of the model on that stream, and fast (device bandwidth).
  // 2. The side stream waits for the snapshot, then copies it to pinned host memory
  //    asynchronously, overlapping the model's next kernels.
  // 3. The snapshot's memory is recorded on the side stream so the caching allocator does
  //    not hand it out again before the copy is done; the returned event marks `dst` ready.
  const c10::Device dev = x.device();
  c10::impl::VirtualGuardImpl impl(dev.type());
  const c10::Stream compute = impl.getStream(dev);
  at::Tensor snap = at::empty(x.sizes(), x.options().dtype(dst.scalar_type()));
  snap.copy_(x);
  c10::Event snapped(dev.type());
  snapped.record(compute);
  const c10::Stream side = impl.getStreamFromGlobalPool(dev, /*isHighPriority=*/false);
  snapped.block(side);
  {
    c10::StreamGuard on_side(side);
    dst.copy_(snap, /*non_blocking=*/true);
  }
  impl.recordDataPtrOnStream(snap.storage().data_ptr(), side);
  auto done = std::make_shared<c10::Event>(dev.type());
  done->record(side);
  return done;
}

char* Arena::alloc(int64_t nbytes, c10::Storage* slab) {
  if (nbytes * 4 > kSlabBytes) return nullptr;
  const int64_t aligned = (nbytes + kAlign - 1) / kAlign * kAlign;
  std::lock_guard<std::mutex> lock(mu_);
  if (!slab_ || used_ + aligned > capacity_) {
    slab_ = acquire_slab(/*expect_more=*/reserved_bytes_ > 0);
    used_ = 0;
    capacity_ = kSlabBytes;
    reserved_bytes_ += kSlabBytes;
  }
  char* data = static_cast<char*>(slab_.mutable_data()) + used_;
  *slab = slab_;
  used_ += aligned;
  return data;
}

at::Tensor Arena::tensor_at(const c10::Storage& slab, char* data, at::IntArrayRef sizes, at::ScalarType dtype) {
  const int64_t nbytes = c10::multiply_integers(sizes) * static_cast<int64_t>(c10::elementSize(dtype));
  // A storage of exactly nbytes whose deleter drops one reference to the slab.
  auto ref = std::make_unique<SlabRef>(SlabRef{slab});
  c10::DataPtr ptr(data, ref.release(), &release_slab_ref, c10::Device(c10::kCPU));
  c10::Storage storage(c10::Storage::use_byte_size_t(), nbytes, std::move(ptr), /*allocator=*/nullptr,
                       /*resizable=*/false);
  auto t = at::detail::make_tensor<c10::TensorImpl>(
      std::move(storage), c10::DispatchKeySet(c10::DispatchKey::CPU), caffe2::TypeMeta::fromScalarType(dtype));
  t.unsafeGetTensorImpl()->set_sizes_contiguous(sizes);
  return t;
}

at::Tensor Arena::empty(at::IntArrayRef sizes, at::ScalarType dtype) {
  const int64_t nbytes = c10::multiply_integers(sizes) * static_cast<int64_t>(c10::elementSize(dtype));
  c10::Storage slab;
  char* data = alloc(nbytes, &slab);
  if (!data) return at::empty(sizes, at::TensorOptions().dtype(dtype));
  return tensor_at(slab, data, sizes, dtype);
}

void Arena::reset() {
  std::lock_guard<std::mutex> lock(mu_);
  slab_ = c10::Storage();
  used_ = capacity_ = 0;
}

Sink::Sink(std::string name, SinkOptions options, std::shared_ptr<Arena> arena, std::optional<std::string> module)
    : name_(std::move(name)), module_(std::move(module)), options_(options), arena_(std::move(arena)) {}

namespace {

// A layout as Python writes it (torch.sparse_coo -> "sparse_coo").
std::string layout_name(c10::Layout layout) {
  switch (layout) {
    case c10::kStrided: return "strided";
    case c10::kSparse: return "sparse_coo";
    case c10::kSparseCsr: return "sparse_csr";
    case c10::kSparseCsc: return "sparse_csc";
    case c10::kSparseBsr: return "sparse_bsr";
    case c10::kSparseBsc: return "sparse_bsc";
    case c10::kMkldnn: return "_mkldnn";
    case c10::kJagged: return "jagged";
    default: return c10::str(layout);
  }
}

// A __torch_dispatch__ wrapper subclass (torch.Tensor._make_wrapper_subclass: DTensor,
// torchao's quantized and float8 tensors, a tensor of your own) has sizes and strides but no
// bytes: its values are what its Python code computes, and its data pointer is null (a copy
// of its memory read address 0).
bool has_no_bytes(const at::Tensor& x) {
  c10::TensorImpl* impl = x.unsafeGetTensorImpl();
  if (!impl->is_python_dispatch() || x.numel() == 0) return false;
  if (!impl->has_storage()) return true;
  try {
    return impl->storage().data() == nullptr;
  } catch (const c10::Error&) {  // a storage that refuses to give its pointer holds none we may read
    return true;
  }
}

// Whether the storage of `x` (a dense strided tensor with a storage of bytes) holds fewer
// bytes than its shape reads, from its storage offset to its last element: its memory was
// freed under it (untyped_storage().resize_(0), as FSDP does with a parameter it reshards), and
// a copy of it would read past the storage's end. *have, *need: the two numbers.
bool storage_freed(const at::Tensor& x, int64_t* have, int64_t* need) {
  c10::TensorImpl* impl = x.unsafeGetTensorImpl();
  if (impl->is_python_dispatch() || !impl->has_storage()) return false;
  int64_t last = x.storage_offset();
  for (int64_t d = 0; d < x.dim(); ++d) {
    const int64_t size = x.size(d);
    if (size == 0) return false;  // (no element: nothing read)
    last += (size - 1) * x.stride(d);
  }
  *need = (last + 1) * static_cast<int64_t>(x.element_size());
  *have = static_cast<int64_t>(impl->storage().nbytes());
  return *have < *need;
}

// Whether `x` (a tensor of has_no_bytes) is a FakeTensor (torch._subclasses.fake_tensor, what a
// forward under FakeTensorMode makes): its storage is on the meta device, while a wrapper
// subclass's (torch.Tensor._make_wrapper_subclass) is on the tensor's own device. Only for
// the message of a refused call.
bool is_fake(const at::Tensor& x) {
  c10::TensorImpl* impl = x.unsafeGetTensorImpl();
  if (!impl->has_storage()) return false;
  try {
    return impl->storage().device_type() == c10::DeviceType::Meta && !x.is_meta();
  } catch (const c10::Error&) {
    return false;
  }
}

// Whether `x` holds bits (bits8, uint4, int2, float4_e2m1fn_x2, ...: a dtype without arithmetic),
// which torch cannot always copy: it has no strided copy of uint1 ... uint7 or int1 ... int7
// (NotImplementedError). bits_as_integers(x) is x viewed as the integers of its element size
// (any strides), which any copy takes.
bool is_bits(const at::Tensor& x) {
  const at::ScalarType t = x.scalar_type();
  return !has_real_numbers(t) && !x.is_complex() && !x.is_quantized() && c10::elementSize(t) <= 2;
}
at::Tensor bits_as_integers(const at::Tensor& x) {
  return x.view(c10::elementSize(x.scalar_type()) == 1 ? at::kByte : at::kShort);
}

}  // namespace

void Sink::check_layout(const at::Tensor& x) const {
  // The test of every call: a few bits of the tensor's dispatch key set and layout. The
  // message is the first call's (ActivationScope._check_layout), which the Python side
  // raises before this sink exists; this one covers the calls after it.
  const bool nested = !fixed_sizes(x);  // (a jagged nested tensor: its sizes are symbolic)
  const bool strided = x.layout() == c10::kStrided;
  const bool quantized = x.is_quantized();
  const bool complex_to_real = x.is_complex() && options_.storage_dtype &&
                               !c10::isComplexType(*options_.storage_dtype);
  static const c10::DispatchKeySet kFuncTorch(
      {c10::DispatchKey::FuncTorchGradWrapper, c10::DispatchKey::FuncTorchBatched});
  const bool functorch = x.key_set().has_any(kFuncTorch);
  const bool no_bytes = !nested && strided && !x.is_meta() && !quantized && has_no_bytes(x);
  // bits (float4_e2m1fn_x2, or bits8 ... in a hook point whose first call was floating-point):
  // torch has no conversion of them to storage_dtype (a floating-point dtype of numbers)
  const bool uncastable = options_.storage_dtype && is_bits(x);
  // (a few integers of the tensor: no value is read)
  int64_t have = 0, need = 0;
  const bool freed = !nested && strided && !x.is_meta() && !quantized && !functorch && !no_bytes &&
                     storage_freed(x, &have, &need);
  if (!nested && strided && !x.is_meta() && !quantized && !complex_to_real && !functorch && !no_bytes &&
      !uncastable && !freed)
    return;
  // A tensor of a torch.func transform (grad, vmap, jacrev, ...): a wrapper without storage
  // of its own, valid inside the transform only; refused in every mode (the first call's
  // message: ActivationScope._check_layout).
  ACS_CHECK(!functorch, "hook point '", name_, "' is a tensor inside a torch.func transform (grad, vmap, jacrev, ",
            "...) in its call ", n_calls_ + 1, ": such a tensor has no values of its own outside the transform, so ",
            "a capture cannot keep, store or reduce it. Run the tracked model outside the transform (capture with ",
            "a plain forward, then apply torch.func to the model), or pass exclude= its module to track()");
  // Memory freed before the capture saw it: no values to copy, store or reduce, and a record
  // kept by reference would read whatever the storage holds once it is given memory again
  // (FSDP gathers the parameter into it at its next use). Refused in every mode.
  ACS_CHECK(!freed, "hook point '", name_, "' is a tensor whose memory was freed in its call ", n_calls_ + 1,
            ": its storage holds ", have, " bytes, its shape ", shape_str(x.sizes()), " of ", dtype_name(x.scalar_type()),
            " needs ", need, " (the model or its training called untyped_storage().resize_(0) on it, as FSDP does ",
            "when it reshards a parameter), so it has no values to copy, store, reduce or keep, and reading it would ",
            "read past the end of its memory. Capture it before it is freed (for FSDP, a module whose output is ",
            "not a resharded parameter, or fully_shard(..., reshard_after_forward=False)), or pass exclude=",
            module_ ? "['" + *module_ + "']" : std::string("its module"), " to track()");
  const bool copied = options_.snapshot || x.is_inference();
  const bool stored = writer_ != nullptr;
  const bool reduced = !reductions_.empty();
  if (complex_to_real) {  // the first call's message (ActivationScope._check_dtype)
    ACS_CHECK(false, "hook point '", name_, "' is complex (", dtype_name(x.scalar_type()), ") in its call ",
              n_calls_ + 1, " but storage_dtype=", dtype_name(*options_.storage_dtype),
              " is real: the cast would drop the imaginary part; drop storage_dtype or exclude= the module of '",
              name_, "'");
  }
  ACS_CHECK(!uncastable, "hook point '", name_, "' is ", dtype_name(x.scalar_type()), " in its call ", n_calls_ + 1,
            ", which storage_dtype=", dtype_name(*options_.storage_dtype), " cannot cast: torch keeps it as bits, ",
            "with no arithmetic or conversion; drop storage_dtype or exclude= the module of '", name_, "'");
  if (!copied && !stored && !reduced) return;  // kept by reference as it is
  std::string what, convert;
  if (quantized) {
    what = "a quantized tensor (" + dtype_name(x.scalar_type()) + ")";
    convert = "x.dequantize()";
  } else if (nested) {
    what = "a nested tensor";
    convert = "x.to_padded_tensor(0.0)";
  } else if (!strided) {
    what = "a " + layout_name(x.layout()) + " tensor (not strided)";
    convert = "x.to_dense()";
  } else if (no_bytes && is_fake(x)) {  // (no values at all: a forward traced under FakeTensorMode)
    what = "a FakeTensor (a shape without values, made under torch._subclasses.FakeTensorMode)";
    convert = "the forward run outside FakeTensorMode, on real tensors";
  } else if (no_bytes) {
    what = "a tensor subclass with no bytes of its own (a __torch_dispatch__ wrapper: its values are computed by "
           "its Python code)";
    convert = "a plain torch.Tensor of its values";
  } else {
    what = "on the meta device (it has a shape but no values)";
    convert = "a model on a real device";
  }
  std::string uses;
  using Use = std::pair<bool, const char*>;
  // (storage_dtype: a cast is a copy, under REFERENCE too, which options_.snapshot does not tell
  // apart; REFERENCE copies an inference tensor: it has no version counter to tell later changes by)
  const std::string cast_copy = options_.storage_dtype
                                    ? "copied (CaptureMode.SNAPSHOT, or storage_dtype=" +
                                          dtype_name(*options_.storage_dtype) + ", whose cast is a copy)"
                                    : std::string();
  for (auto [on, use] : {Use{options_.snapshot && !options_.storage_dtype, "copied (CaptureMode.SNAPSHOT)"},
                         Use{options_.snapshot && options_.storage_dtype, cast_copy.c_str()},
                         Use{copied && !options_.snapshot,
                             "copied (an inference tensor, made under torch.inference_mode(), which "
                             "CaptureMode.REFERENCE copies)"},
                         Use{stored, "stored"}, Use{reduced, "reduced"}}) {
    if (!on) continue;
    if (!uses.empty()) uses += " or ";
    uses += use;
  }
  const std::string exclude = module_ ? "Pass exclude=['" + *module_ + "'] to track()"
                                      : "Pass exclude= the module of '" + name_ + "' to track()";
  ACS_CHECK(false, "hook point '", name_, "' is ", what, ", shape ",
            nested ? std::string("(nested)") : shape_str(x.sizes()), ", in its call ", n_calls_ + 1,
            ", which cannot be ", uses,
            ": a capture records dense strided tensors with values. ", exclude,
            " (or give the capture a dense tensor: ", convert, "); an in-memory capture with ",
            "capture_mode=CaptureMode.REFERENCE and no reductions keeps such a tensor as it is, in a forward under "
            "torch.no_grad() (not torch.inference_mode()) and without storage_dtype=");
}

namespace {
constexpr size_t kPrunePending = 64;  // events kept before the done ones are let go
}  // namespace

Sink::Record Sink::snapshot(const at::Tensor& x, bool check_overflow) {
  const at::ScalarType own = x.scalar_type();
  if (!options_.storage_dtype && is_bits(x)) {  // (copied as integers, the record seen as the bits again)
    Record rec = snapshot(bits_as_integers(x), check_overflow);
    if (rec.t.defined()) rec.t = rec.t.view(own);
    rec.dtype = own;
    return rec;
  }
  Record rec;
  const at::ScalarType dtype = options_.storage_dtype.value_or(x.scalar_type());
  const bool on_device = !x.device().is_cpu();
  if (on_device && options_.placement == Placement::GPU) {
    rec.t = at::empty(x.sizes(), x.options().dtype(dtype));
    rec.t.copy_(x);
    return rec;
  }
  if (on_device) {
    if (pending_.size() >= kPrunePending) {
      // Copies already done need no event: a long capture that reads its records rarely
      // (the last record only, over many forwards) would otherwise hold one per call. Only a done
      // prefix goes, so the last record's event (shared with an alias) stays while in flight.
      size_t done = 0;
      while (done < pending_.size() && pending_[done]->query()) ++done;
      pending_.erase(pending_.begin(), pending_.begin() + static_cast<std::ptrdiff_t>(done));
    }
    rec.t = at::empty(x.sizes(), at::TensorOptions().dtype(dtype).pinned_memory(true));
    if (check_overflow && dtype != x.scalar_type() && cast_may_change(x.scalar_type(), dtype)) {
      // A narrowing storage_dtype (float32 -> float16): checked for overflow on the device
      // before the copy, as a record cast on the CPU is (the check waits for the cast); not
      // when the call has rows (a store or reductions), whose values are checked as rows
      // (a record's padding positions are not), as on the CPU.
      const at::Tensor cast = x.to(dtype);
      check_cast(x, cast);
      pending_.push_back(device_to_host(cast, rec.t));
    } else {
      pending_.push_back(device_to_host(x, rec.t));
    }
    return rec;
  }
  const bool plain = dtype == x.scalar_type() && x.is_contiguous() && x.layout() == at::kStrided && !x.is_conj() &&
                     !x.is_neg();
  if (plain && options_.keep == Keep::ALL && arena_) {
    // The common case: one memcpy into the arena, no tensor object until the records are read.
    const int64_t nbytes = static_cast<int64_t>(x.nbytes());
    rec.data = arena_->alloc(nbytes, &rec.slab);
    if (rec.data) {
      copy_bytes(rec.data, x.const_data_ptr(), nbytes);
      rec.sizes.assign(x.sizes().begin(), x.sizes().end());
      rec.dtype = dtype;
      return rec;
    }
  }
  rec.t = (options_.keep == Keep::ALL && arena_) ? arena_->empty(x.sizes(), dtype)
                                                  : at::empty(x.sizes(), at::TensorOptions().dtype(dtype));
  if (plain) {
    copy_bytes(rec.t.data_ptr(), x.const_data_ptr(), x.nbytes());
  } else {
    rec.t.copy_(x);
  }
  return rec;
}

at::Tensor Sink::rows_of(const at::Tensor& x, const at::Tensor& token_mask) {
  if (row_kind_ == 1) {
    ACS_CHECK(is_token_rows(x, token_mask),
              "hook point '", name_, "' stores token rows and needs an attention mask of shape ",
              "(batch, pos) = the first two dims of its activation; got activation ",
              shape_str(x.sizes()), " and mask ",
              token_mask.defined() ? shape_str(token_mask.sizes()) : std::string("None"),
              token_mask.defined()
                  ? ". The mask is the one last given to tracker.set_batch() (it stays until the next call): "
                    "give each forward of another (batch, pos) its own, also each step of generate() with a "
                    "key-value cache, whose forwards after the prompt's are (batch, 1) (call "
                    "set_batch(attention_mask=..., same_samples=True) from a forward pre-hook of the model, see "
                    "docs/usage/capture.md, \"Generation with a key-value cache\")."
                  : ". Pass attention_mask= to tracker.set_batch() for every batch.");
    if (token_mask.device().is_cpu() && token_mask.all().item<bool>()) {
      return x.flatten(0, 1);  // every position is a token (rows="token" without a mask): a view
    }
    at::Tensor m = token_mask.device() == x.device() ? token_mask : token_mask.to(x.device());
    return x.index({m});
  }
  if (x.dim() == 0) return x.reshape({1});
  return x;
}

bool Sink::can_refer(const at::Tensor& x) {
  const c10::TensorImpl* impl = x.unsafeGetTensorImpl();
  return typeid(*impl) == typeid(c10::TensorImpl) && x.layout() == at::kStrided && x.has_storage() &&
         (x.is_cpu() || x.is_cuda()) && !impl->is_python_dispatch() && !x.is_inference() &&
         !x._is_zerotensor() && !impl->has_symbolic_sizes_strides() &&
         !x.key_set().has_any(c10::DispatchKeySet({c10::DispatchKey::FuncTorchBatched, c10::DispatchKey::FuncTorchGradWrapper,
                                                   c10::DispatchKey::Functionalize}));
}

Sink::Record Sink::refer(const at::Tensor& x) {
  Record rec;
  rec.reference = true;
  rec.slab = x.storage();
  rec.sizes.assign(x.sizes().begin(), x.sizes().end());
  rec.strides.assign(x.strides().begin(), x.strides().end());
  rec.offset = x.storage_offset();
  rec.dtype = x.scalar_type();
  rec.keys = x.key_set();
  rec.version = x.unsafeGetTensorImpl()->version_counter();
  return rec;
}

at::Tensor Sink::referred(const Record& r) {
  // as TensorImpl::shallow_copy_and_detach makes a detached tensor of the same storage
  auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(r.slab), r.keys, c10::scalarTypeToTypeMeta(r.dtype));
  impl->set_sizes_and_strides(r.sizes, r.strides, r.offset);
  impl->set_version_counter(r.version);
  impl->set_allow_tensor_metadata_change(false);
  return at::Tensor(std::move(impl));
}

// The store array of a hook point is opened at its first call, with that call's dtype and
// feature shape. When that call was an empty batch (nothing of it kept; a placeholder such as
// x.new_zeros(0) or torch.empty(0, 3, dtype=torch.float16)), the first rows may be of another
// dtype or feature shape: cast to the array's dtype they would be stored changed (float32
// values rounded to float16, or turned into inf, and reduced uncast). Refused here, before
// anything of this call is kept, reduced or written. (A call with rows opened the array
// itself: nothing to check; a resumed array was checked when it was opened, and after an empty
// first call its rows are held to the stored shape and dtype, set_stored.) The same for a
// store that keeps reductions only, which records the first call's dtype and feature shape
// (set_one_layout): rows of another would be reduced as rows the store does not describe.
void Sink::check_first_rows_fit_writer(const at::Tensor& x) {
  at::ScalarType dtype;
  std::vector<int64_t> feat;
  const bool array = writer_ && writer_->row_spec(&dtype, &feat);
  if (!array) {
    if (!one_layout_ || !layout_dtype_) return;
    dtype = *layout_dtype_;
    feat = layout_feature_shape_;
  }
  const at::ScalarType rows_dtype = options_.storage_dtype.value_or(x.scalar_type());
  const size_t lead = row_kind_ == 1 ? 2 : 1;  // (batch, pos) of token rows, batch of sample rows
  c10::IntArrayRef rows_feat = x.dim() < static_cast<int64_t>(lead) ? c10::IntArrayRef() : x.sizes().slice(lead);
  const bool same_shape = rows_feat == c10::IntArrayRef(feat);
  if (rows_dtype == dtype && same_shape) return;
  count_call(-1);
  seen_dtype_.reset();
  // storage_dtype casts floating-point hook points only, which the first call decides: it makes
  // these rows fit where that call was floating-point, the dtype alone differs and the rows are
  // numbers it casts (not complex, not bits). (Given, it cast them already: their dtype is the
  // array's.) After an integer, bool or complex first call it changes nothing: named, as no fix.
  // A hook point the resumed store holds (stored_): its shape and dtype are the store's, which a
  // resume keeps (it refuses another storage_dtype): neither an empty tensor of the rows' shape
  // nor storage_dtype= makes these rows fit.
  const bool other_dtype = rows_dtype != dtype;
  const bool cast_fits =
      !stored_ && other_dtype && same_shape && at::isFloatingType(dtype) && !x.is_complex() && !is_bits(x);
  const bool cast_cannot = !stored_ && other_dtype && !at::isFloatingType(dtype);
  ACS_CHECK(false, "hook point '", name_, "' returned an empty batch at its first call (rows of shape ",
            shape_str(feat), ", ", dtype_name(dtype), "), ",
            stored_ ? (array ? "the row shape and dtype of its store array in the store this capture resumes"
                             : "the row shape and dtype the store this capture resumes (it keeps reductions only) "
                               "records for it")
                    : (array ? "which fixed its store array's row shape and dtype"
                             : "which fixed the row shape and dtype the store (it keeps reductions only) records for it"),
            "; its first rows are ", shape_str(rows_feat), ", ", dtype_name(rows_dtype),
            array ? c10::str(", and would be stored cast to ", dtype_name(dtype), " or refused")
                  : std::string(", and would be reduced as rows the store does not describe"),
            stored_ ? ". A resume keeps the store's row shape and dtype: resume with rows of the stored shape and "
                      "dtype, capture again with overwrite=True, or exclude= its module"
                    : c10::str(". Return an empty tensor of the rows' shape and dtype ",
                               "(x.new_empty((0, *rows.shape[1:]))), ",
                               cast_fits ? "pass storage_dtype= to store every row as one dtype, " : "",
                               "or exclude= its module"),
            cast_cannot ? c10::str(" (storage_dtype casts floating-point hook points only, decided at their first call, ",
                                   "which was ", dtype_name(dtype), " here, so it does not make these rows fit)")
                        : std::string());
}

void Sink::consume(const at::Tensor& x_arg, const at::Tensor& token_mask) {
  at::AutoGradMode no_grad(false);
  // A ZeroTensor (torch._efficientzerotensor, as autograd makes for gradients known to be zero)
  // reads as zeros but has no bytes: its data pointer is null, so a copy, a store write or a
  // byte comparison of its memory would read address 0. Its values are made a tensor of their own.
  const at::Tensor x_in = x_arg._is_zerotensor() ? at::zeros(x_arg.sizes(), x_arg.options()) : x_arg;
  // A record kept by reference must not hold the autograd graph: detach it (a REFERENCE
  // record of its storage alone holds none). Copies made under no-grad never record a graph,
  // so the snapshot path skips the detach.
  const bool refer_only = !options_.snapshot && writer_ == nullptr && reductions_.empty() && can_refer(x_in);
  const at::Tensor x = (!options_.snapshot && x_in.requires_grad() && !refer_only) ? x_in.detach() : x_in;
  std::lock_guard<std::mutex> lock(mu_);
  check_layout(x);  // before the call is counted or anything of it kept
  count_call(1);
  if (!first_call_dtype_) first_call_dtype_ = x.scalar_type();
  if (x.dim() >= 1 && fixed_sizes(x) && x.size(0) == 0) {
    // An empty batch: no rows, reductions or store writes. An in-memory capture still keeps
    // its (empty) record, so records stay one per call (record i is call i's; the last
    // record of keep="last" is the last call's), an alias too (its target's are not this call's).
    if (options_.keep != Keep::NONE && options_.placement != Placement::DISK) {
      Record rec;
      rec.t = at::empty(x.sizes(), x.options().dtype(options_.storage_dtype.value_or(x.scalar_type())));
      if (options_.keep == Keep::LAST) {
        records_.clear();
        versions_.clear();
        checked_ = 0;
      }
      if (!options_.snapshot) versions_.push_back(kCopied);
      records_.push_back(std::move(rec));
      ++records_made_;
    }
    return;
  }
  if (row_kind_ < 0) {
    row_kind_ = is_token_rows(x, token_mask) ? 1 : 0;
  }
  const bool first_rows = !seen_dtype_;
  if (first_rows) {
    seen_dtype_ = x.scalar_type();
    check_first_rows_fit_writer(x);
  } else if ((writer_ || one_layout_) && !options_.storage_dtype && x.scalar_type() != *seen_dtype_) {
    // A store array has one dtype: rows of another would be cast to it, silently losing
    // precision (float64 -> float32) or changing values (float -> int); a store that keeps
    // reductions only records one dtype per hook point, that of its first call. Checked before
    // this call keeps, reduces or writes anything.
    count_call(-1);
    auto half = [](at::ScalarType t) { return t == at::kBFloat16 || t == at::kHalf; };
    const bool floats = at::isFloatingType(x.scalar_type()) && at::isFloatingType(*seen_dtype_);
    const bool autocast_like = floats && half(x.scalar_type()) != half(*seen_dtype_);
    // integer or bool rows of a hook point whose first call was floating-point: storage_dtype
    // casts them too (an integer it cannot hold exactly is refused, check_integers)
    const bool ints_of_floats = at::isFloatingType(*seen_dtype_) &&
                                (at::isIntegralType(x.scalar_type(), /*includeBool=*/true));
    ACS_CHECK(false, "hook point '", name_, "' changed its dtype from ", dtype_name(*seen_dtype_), " to ",
              dtype_name(x.scalar_type()), " during the capture; ",
              writer_ ? "its store array holds " : "the store (it keeps reductions only) records its rows as ",
              dtype_name(*seen_dtype_), ". ",
              autocast_like ? "A forward under torch.autocast and one outside it (or under another autocast "
                              "dtype) give such a change: run every forward under the same autocast, or p"
                            : floats || ints_of_floats ? "P" : "",
              // (storage_dtype casts floating-point hook points only: no fix for an integer or bool one)
              floats ? "ass storage_dtype= to cast every row to one dtype, or capture each dtype into its own store."
              : ints_of_floats
                  ? "ass storage_dtype= to cast every row to one dtype (its first call was floating-point, so its "
                    "integer rows are cast too, and an integer the dtype cannot hold exactly is refused), or capture "
                    "each dtype into its own store, or exclude= its module."
                  : "storage_dtype casts floating-point hook points only: capture each dtype into its own store, "
                    "or exclude= its module.");
  }
  if (uncast_storage_dtype_ && !options_.storage_dtype && !writer_ && !one_layout_ &&
      (at::isFloatingType(x.scalar_type()) || at::isComplexType(x.scalar_type()))) {
    // storage_dtype casts floating-point hook points only, decided at their first call: this
    // one's was integer or bool, so a floating-point call would be kept (and reduced) as it is,
    // not as storage_dtype asks. (A store refuses any change of dtype, above.) Checked before
    // this call keeps or reduces anything.
    count_call(-1);
    if (first_rows) seen_dtype_.reset();  // (its first call with rows: the next one is again)
    ACS_CHECK(false, "hook point '", name_, "' is ", dtype_name(x.scalar_type()), " in its call ", n_calls_ + 1,
              " but its first call was ", dtype_name(uncast_first_dtype_), ": storage_dtype=",
              dtype_name(*uncast_storage_dtype_), " casts floating-point hook points only, decided at their first ",
              "call, so this call's record and reductions would keep ", dtype_name(x.scalar_type()),
              " values, not ", dtype_name(*uncast_storage_dtype_), " ones. Give the hook point one dtype in every ",
              "call (cast in the model, as .float() of its integer or bool output), drop storage_dtype (each record ",
              "then keeps its own dtype), or exclude= its module");
  }

  // The alias checks compare the model's tensor (the zeros made of a ZeroTensor are another
  // tensor every call; its bytes check reads them as zeros, bytes_crc)
  const at::Tensor& given = x_arg._is_zerotensor() ? x_arg : x;
  if (alias_of_) {
    // the target's tensor: handled; an in-memory alias's other calls are kept as its own below
    if (consume_alias(x, token_mask, given)) return;
  } else if (has_aliases_) {
    remember_for_aliases(given);
  }

  const bool need_rows = writer_ || !reductions_.empty();
  at::Tensor rows;
  if (need_rows) {
    rows = rows_of(x, token_mask);
    auto feat = rows.sizes().slice(1);
    if (n_rows_ == 0 && feature_shape_.empty()) {
      feature_shape_.assign(feat.begin(), feat.end());
    } else if ((writer_ || one_layout_) && at::IntArrayRef(feature_shape_) != feat && token_mask.defined() &&
               row_kind_ == 0 &&
               !(sample_rows_chosen_ && is_token_rows(x, token_mask))) {
      // A mask is given, but this hook point is stored one row per sample (its first activation
      // did not start with the mask's (batch, pos): an attention bias (batch, 1, pos, pos), a
      // sequence-first tensor; or token_rows= said so): its rows change shape with pos. Passing
      // a mask, the usual fix, is no fix here, also where this activation happens to start with
      // the mask (a generation step's (batch, 1, 1, pos + 1) bias under a (batch, 1) mask). Not
      // for sample rows chosen by token_rows=False of a token-shaped activation: there the
      // usual advice (token rows keep one feature shape) is the fix.
      count_call(-1);
      const bool is_input = name_.find(".input.") != std::string::npos;
      const bool starts = is_token_rows(x, token_mask);
      ACS_CHECK(false, "hook point '", name_, "' changed its feature shape from ", shape_str(feature_shape_),
                " to ", shape_str(feat), "; a store array needs one feature shape per hook point. The attention ",
                "mask given to set_batch (or taken from the input by rows=\"token\") is (batch, pos) = ",
                shape_str(token_mask.sizes()), " and this activation, of shape ", shape_str(x.sizes()),
                starts ? ", is stored one row per sample (its first captured activation did not start with "
                         "that forward's (batch, pos))"
                       : ", does not start with it, so it is stored one row per sample",
                ", and those rows change shape with pos: pad every batch to one length (a tokenizer's ",
                "padding=\"max_length\", max_length=N; the token rows of the other hook points still leave the ",
                "padding out), so that its rows keep one shape, or leave it out of the capture, alone with ",
                "exclude_hook_points=['", name_, "'] (the other hook points of its module still captured), or ",
                "with its module (exclude= its module",
                is_input ? ", or capture=\"output\": it is an input of its module)" : ")", ".");
    } else if (writer_ || one_layout_) {
      ACS_CHECK(at::IntArrayRef(feature_shape_) == feat, "hook point '", name_,
                "' changed its feature shape from ", shape_str(feature_shape_), " to ",
                shape_str(feat), writer_ ? "; a store array" : "; a store that keeps reductions only",
                " needs one feature shape per hook point. For sequences of "
                "varying length pass attention_mask= to tracker.set_batch() so rows are "
                "tokens; for images of varying size (conv maps (C, H, W) follow the input's "
                "size) feed one size (resize or crop), track a module after a global pooling "
                "(nn.AdaptiveAvgPool2d) instead, or capture each size into a store of its own; "
                "or exclude this hook point.");
    }
  }

  if (need_rows && options_.storage_dtype && rows.scalar_type() != *options_.storage_dtype) {
    // Reductions and the store see the stored (cast) values, checked for overflow before
    // anything of this call is kept.
    try {
      rows = cast_checked(rows, *options_.storage_dtype);
      if (rows.numel() != x.numel() && options_.keep != Keep::NONE && options_.placement != Placement::DISK) {
        // Token rows leave the padding positions out, a record keeps them: a record whose
        // padding turns into inf is refused as one without a mask is.
        (void)cast_checked(x, *options_.storage_dtype);
      }
    } catch (...) {
      count_call(-1);
      throw;
    }
  }

  if (need_rows) {
    // Reductions first: one that refuses these rows (another feature shape, a custom
    // reduction that raises) leaves this call without a record, as the other checks do.
    try {
      reduce(rows);
    } catch (...) {
      count_call(-1);
      throw;
    }
  }

  if (options_.keep != Keep::NONE && options_.placement != Placement::DISK) {
    // REFERENCE detects later in-place changes through the version counter; an inference
    // tensor (torch.inference_mode) has none, so it is copied instead: records stay exact.
    const bool copy = options_.snapshot || x.is_inference();
    Record rec;
    if (copy) {
      try {  // (a narrowing storage_dtype of a device tensor is checked for overflow there)
        rec = snapshot(x, /*check_overflow=*/!need_rows);
      } catch (...) {
        count_call(-1);
        throw;
      }
      if (!need_rows && options_.storage_dtype && x.scalar_type() != *options_.storage_dtype && rec.t.defined() &&
          rec.t.device() == x.device()) {
        try {  // a cast record (not one copied to the host asynchronously): checked for overflow
          check_cast(x, rec.t);
        } catch (...) {
          count_call(-1);
          throw;
        }
      }
    } else if (refer_only || can_refer(x)) {  // (refer_only: checked above)
      // The model tensor's storage, layout and version counter (in-place changes are still
      // seen), made into a tensor of our own when read, not x's TensorImpl: holding that would
      // keep x's Python object alive after the model drops it, one garbage-collected object
      // per record (a full collection of the interpreter every few hundred forwards).
      rec = refer(x);
    } else if (!x_in.requires_grad() && !x.unsafeGetTensorImpl()->is_python_dispatch()) {
      // Another tensor (a sparse one, ...) through a TensorImpl of our own, as above.
      // (A detached x is ours already; a __torch_dispatch__ subclass is kept itself.)
      c10::TensorImpl* impl = x.unsafeGetTensorImpl();
      rec.t = at::Tensor(impl->shallow_copy_and_detach(impl->version_counter(), /*allow_tensor_metadata_change=*/false));
    } else {
      rec.t = x;
    }
    if (options_.keep == Keep::LAST) {
      records_.clear();
      versions_.clear();
      checked_ = 0;
    }
    if (!options_.snapshot) versions_.push_back(copy ? kCopied : x._version());
    records_.push_back(std::move(rec));
    ++records_made_;
  }

  if (need_rows) {
    if (writer_) {
      if (!rows.device().is_cpu()) {
        at::Tensor host = at::empty(rows.sizes(), rows.options().device(at::kCPU).pinned_memory(true));
        writer_->append(host, device_to_host(rows, host));
      } else {
        writer_->append(rows, nullptr);
      }
    }
    n_rows_ += rows.size(0);
  }
}

namespace {
uint32_t bytes_crc(const at::Tensor& x) {
  // (a ZeroTensor has no bytes: its values are zeros; bits are read as integers of their size)
  const at::Tensor c = x._is_zerotensor() ? at::zeros(x.sizes(), x.options())
                                          : (is_bits(x) ? bits_as_integers(x) : x).contiguous();
  return crc32c(0, c.const_data_ptr(), c.nbytes());
}
}  // namespace

void Sink::set_alias_of(std::shared_ptr<Sink> target, bool shares_records) {
  ACS_CHECK(target && target.get() != this && !target->alias_of_, "hook point '", name_,
            "': an alias needs another, non-alias hook point as its target");
  int64_t offset = 0;
  {
    std::lock_guard<std::mutex> lock(target->mu_);
    target->has_aliases_ = true;
    offset = target->last_call_ - 1;  // the alias's first call pairs with the target's last
  }
  std::lock_guard<std::mutex> lock(mu_);
  ACS_CHECK(n_calls_ == 0, "hook point '", name_, "' already captured rows; it cannot become an alias");
  shares_records_ = shares_records;
  if (!shares_records) {  // (an in-memory alias's calls need not pair with its target's: no tally)
    // a random odd weight per alias (splitmix64 of a random seed and a counter)
    static std::atomic<uint64_t> counter{std::random_device{}() | (uint64_t{std::random_device{}()} << 32)};
    uint64_t z = counter.fetch_add(0x9E3779B97F4A7C15ull, std::memory_order_relaxed) + 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    alias_weight_ = (z ^ (z >> 31)) | 1;
    std::lock_guard<std::mutex> target_lock(target->mu_);
    target->aliases_weight_ += alias_weight_;
  }
  alias_of_ = std::move(target);
  call_offset_ = offset;
}

void Sink::attach_tally(std::shared_ptr<AliasTally> tally) {
  std::lock_guard<std::mutex> lock(mu_);
  tally_ = std::move(tally);
}

void Sink::watch_aliases(bool on) {
  std::lock_guard<std::mutex> lock(mu_);
  has_aliases_ = on;
  if (!on) last_storage_.reset();
}

bool Sink::matches_last(const at::Tensor& x) {
  int64_t call;
  {
    std::lock_guard<std::mutex> lock(mu_);
    call = last_call_;
  }
  return same_as_last(x, call, /*release=*/false);
}

void Sink::remember_for_aliases(const at::Tensor& x) {
  if (!x.has_storage()) {
    last_storage_.reset();
    return;
  }
  last_storage_.emplace(x.storage().getWeakStorageImpl());
  last_offset_ = x.storage_offset();
  last_sizes_.assign(x.sizes().begin(), x.sizes().end());
  last_strides_.assign(x.strides().begin(), x.strides().end());
  last_dtype_ = x.scalar_type();
  last_device_ = x.device();
  last_conj_ = x.is_conj();
  last_neg_ = x.is_neg();
  last_call_ = n_calls_;
  last_record_ = records_made_;
  if (x.is_inference()) {
    last_version_ = -1;
    last_crc_ = x.device().is_cpu() ? bytes_crc(x) : 0;
  } else {
    last_version_ = x._version();
  }
}

bool Sink::same_as_last(const at::Tensor& x, int64_t call, bool release) {
  std::lock_guard<std::mutex> lock(mu_);
  // No call counting: a forward that raised may have run the target without the alias. The
  // weak reference expires when the target's storage is freed, so memory reused by another
  // tensor is never taken for the target's; identity plus an unchanged version (or bytes) is
  // the whole test.
  (void)call;
  return same_as_last_locked(x, release);
}

bool Sink::share_last_record(const at::Tensor& x, Record* rec, std::shared_ptr<c10::Event>* event) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!same_as_last_locked(x, /*release=*/true)) return false;
  return last_record_locked(rec, event);
}

bool Sink::last_record(Record* rec, std::shared_ptr<c10::Event>* event) {
  std::lock_guard<std::mutex> lock(mu_);
  return last_record_locked(rec, event);
}

bool Sink::last_record_locked(Record* rec, std::shared_ptr<c10::Event>* event) {
  // the last remembered call's record is the last one kept (no later call, no failed keep, no
  // clear since)
  if (records_.empty() || records_made_ != last_record_ + 1) return false;
  *rec = records_.back();  // (shares the slab, or the tensor, of the target's record)
  if (!pending_.empty()) *event = pending_.back();  // (waited for again by the alias's read: harmless)
  return true;
}

bool Sink::same_as_last_locked(const at::Tensor& x, bool release) {
  std::optional<c10::weak_intrusive_ptr<c10::StorageImpl>> weak;
  weak.swap(last_storage_);
  if (!release) last_storage_ = weak;  // an alias checks each call once
  if (!weak || !x.has_storage()) return false;
  c10::intrusive_ptr<c10::StorageImpl> alive = weak->lock();
  if (!alive || alive.get() != x.storage().unsafeGetStorageImpl() || x.storage_offset() != last_offset_ ||
      x.sizes() != c10::IntArrayRef(last_sizes_) || x.strides() != c10::IntArrayRef(last_strides_) ||
      x.scalar_type() != last_dtype_ || x.device() != last_device_ ||
      // a conjugate or negative view (x.conj() of a complex tensor) reads the same memory as
      // other values
      x.is_conj() != last_conj_ || x.is_neg() != last_neg_) {
    return false;
  }
  if (last_version_ >= 0) return !x.is_inference() && x._version() == last_version_;
  return x.device().is_cpu() && bytes_crc(x) == last_crc_;
}

NamedTensors Sink::reduction_result(int64_t index) {
  std::lock_guard<std::mutex> lock(mu_);
  ACS_CHECK(index >= 0 && index < static_cast<int64_t>(reductions_.size()), "hook point '", name_,
            "' has ", reductions_.size(), " reduction(s), no reduction ", index);
  wait_reductions_locked();  // (the copies below run on the current stream)
  NamedTensors out = reductions_[index]->result();
  for (auto& kv : out) kv.second = kv.second.clone();
  if (reduce_stream_) {
    // and the next update waits for these copies: it changes the accumulators read here (in
    // place, or frees them, and its stream may reuse their memory)
    c10::impl::VirtualGuardImpl impl(reduce_stream_->device_type());
    record_event(read_, impl.getStream(reduce_stream_->device()));
  }
  return out;
}

bool Sink::reduction_made_nonfinite(int64_t index) {
  std::lock_guard<std::mutex> lock(mu_);
  ACS_CHECK(index >= 0 && index < static_cast<int64_t>(reductions_.size()), "hook point '", name_,
            "' has ", reductions_.size(), " reduction(s), no reduction ", index);
  wait_reductions_locked();  // (a flag kept on the device is read on the current stream)
  return reductions_[index]->made_nonfinite();
}

namespace {

// A capture reduces inside the model's forward, so under its torch.autocast: there a custom
// reduction's matmul of float32 rows ran in bfloat16, and TorchScript's executor, which
// specialises on the autocast state, computed one batch unlike the next. A reduction describes
// the rows themselves: it runs as make_reduction(...).update(rows) runs outside any autocast.
class NoAutocast {
 public:
  NoAutocast()
      : cpu_(at::autocast::is_autocast_enabled(at::kCPU)), cuda_(at::autocast::is_autocast_enabled(at::kCUDA)) {
    at::autocast::set_autocast_enabled(at::kCPU, false);
    at::autocast::set_autocast_enabled(at::kCUDA, false);
  }
  ~NoAutocast() {
    at::autocast::set_autocast_enabled(at::kCPU, cpu_);
    at::autocast::set_autocast_enabled(at::kCUDA, cuda_);
  }
  NoAutocast(const NoAutocast&) = delete;
  NoAutocast& operator=(const NoAutocast&) = delete;

 private:
  c10::impl::ExcludeDispatchKeyGuard keys_{c10::autocast_dispatch_keyset};  // (every device's)
  bool cpu_, cuda_;
};

}  // namespace

void Sink::wait_reductions() {
  std::lock_guard<std::mutex> lock(mu_);
  wait_reductions_locked();
}

void Sink::wait_reductions_locked() {
  if (!reduce_stream_ || !reduced_) return;
  c10::impl::VirtualGuardImpl impl(reduce_stream_->device_type());
  const c10::Stream current = impl.getStream(reduce_stream_->device());
  if (current != *reduce_stream_) reduced_->block(current);  // (not reduce_stream_ itself: reduced_)
}

void Sink::set_keep_forward_start(bool on) {
  std::lock_guard<std::mutex> lock(mu_);
  keep_forward_start_ = on;
  start_forward_ = -1;
}

bool Sink::rollback_forward(int64_t forward) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!keep_forward_start_ || start_forward_ != forward) return false;
  for (const auto& r : reductions_) r->restore_checkpoint();
  n_rows_ = start_rows_;
  start_forward_ = -1;
  return true;
}

void Sink::reduce(const at::Tensor& rows) {
  if (keep_forward_start_ && claimed_forward_ != start_forward_) {
    // this sink's first call in a root forward: the states before it (set_keep_forward_start),
    // replacing those of the forward before
    for (const auto& r : reductions_) r->checkpoint();
    start_rows_ = n_rows_;
    start_forward_ = claimed_forward_;
  }
  std::optional<c10::Stream> before;  // (the stream the accumulators were made on, when another)
  if (rows.is_cuda() && !reductions_.empty()) {
    // The accumulators were last made on reduce_stream_: an update on another stream (a forward
    // under another torch.cuda.stream) reads them only once that stream's kernels are done.
    c10::impl::VirtualGuardImpl impl(rows.device().type());
    // (through the event of that update: the stream itself may be gone, reduced_)
    const c10::Stream now = impl.getStream(rows.device());
    if (reduce_stream_ && *reduce_stream_ != now) {
      before = reduce_stream_;
      if (reduced_) reduced_->block(now);
    }
    if (read_) {  // (copies of the accumulators a reduction_result made: done before they change)
      read_->block(now);
      read_.reset();
    }
    reduce_stream_ = now;
  }
  // ... and that stream waits for the update: the accumulators it replaced go back to the
  // allocator, which may hand their memory to that stream's next kernels. The update's own
  // stream marks its end (reduced_), which the close and the next update wait for.
  auto release_before = [&] {
    if (before) stream_waits(*reduce_stream_, *before);
    if (rows.is_cuda() && reduce_stream_) record_event(reduced_, *reduce_stream_);
  };
  try {
    run_reductions(rows);
  } catch (...) {
    release_before();
    throw;
  }
  release_before();
}

void Sink::run_reductions(const at::Tensor& rows) {
  try {
    NoAutocast no_autocast;
    update_reductions(reductions_, rows, row_base_ + n_rows_);
  } catch (const StoreIOError&) {
    throw;
  } catch (const UserError& e) {
    // complex rows, or rows of bits (bits8, uint4, float4_e2m1fn_x2), refused by a built-in
    // reduction: the fix is to give it no reductions
    const std::string what = e.what();
    const bool complex_refused = rows.is_complex() && what.find("needs real-valued rows") != std::string::npos;
    const bool bits_refused = !has_real_numbers(rows.scalar_type()) && !rows.is_complex() &&
                              what.find("needs rows of numbers") != std::string::npos;
    throw UserError(c10::str("hook point '", name_, "': ", what,
                             complex_refused || bits_refused
                                 ? c10::str("; built-in reductions take ", complex_refused ? "real rows" : "rows of numbers",
                                            ": give reductions= as a dict of "
                                            "patterns that leaves '", name_, "' out ({\"pattern\": [...]}), or "
                                            "exclude= its module")
                                 : std::string()));
  }
}

bool Sink::consume_alias(const at::Tensor& x, const at::Tensor& token_mask, const at::Tensor& given) {
  Record shared;
  std::shared_ptr<c10::Event> event;
  if (shares_records_) {
    if (!alias_of_->share_last_record(given, &shared, &event)) return false;  // kept as its own
  } else {
    const bool same = alias_of_->same_as_last(given, n_calls_ + call_offset_, /*release=*/true);
    if (!same) count_call(-1);
    ACS_CHECK(same, "hook point '", name_, "' is stored once, as an alias of '", alias_of_->name(),
            "' (it was the same tensor when first captured), but in its call ", n_calls_ + 1,
            " (counting from 1) it is another tensor or was changed in place after '", alias_of_->name(),
            "' was taken (a branch, or a loop, that differs from forward to forward, or a switch between "
            "model.eval() and model.train(): a module that returns its input as it is in eval mode only, as "
            "a dropout or a noise layer does); pass exclude= for the module of one of them (or include= only "
            "one). The store keeps every forward before this one");
    if (options_.keep != Keep::NONE && options_.placement != Placement::DISK) {
      // a store capture that also keeps records in memory (storage=CPU or GPU): this call's
      // record is its target's (the same bytes), as for an in-memory alias; a copy of its own
      // when the target kept none of this call
      if (!alias_of_->last_record(&shared, &event)) shared = snapshot(x, /*check_overflow=*/false);  // (a store's rows)
    }
  }
  if (!reductions_.empty()) {
    at::Tensor rows = rows_of(x, token_mask);
    if (options_.storage_dtype && rows.scalar_type() != *options_.storage_dtype) {
      rows = rows.to(*options_.storage_dtype);  // as its target's: reductions of the stored values
    }
    try {  // (a reduction that refuses the rows leaves this call without a record)
      reduce(rows);
    } catch (...) {
      count_call(-1);
      throw;
    }
    n_rows_ += rows.size(0);
  } else {
    n_rows_ += (row_kind_ == 1 && token_mask.defined()) ? token_mask.sum().item<int64_t>()
                                                         : (x.dim() == 0 || !fixed_sizes(x) ? 1 : x.size(0));
  }
  if (options_.keep != Keep::NONE && options_.placement != Placement::DISK) {
    if (options_.keep == Keep::LAST) records_.clear();
    records_.push_back(std::move(shared));
    ++records_made_;
    if (event) pending_.push_back(std::move(event));
  }
  return true;
}

std::vector<at::Tensor> Sink::records() {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& ev : pending_) ev->synchronize();
  pending_.clear();
  std::vector<at::Tensor> out;
  out.reserve(records_.size());
  for (auto& r : records_) {
    if (!r.t.defined()) {  // made once, then the same tensor on every read
      // A tensor of the autograd world whatever mode the reader runs in: made under
      // torch.inference_mode() it would be an inference tensor, which cannot share the model
      // tensor's version counter (REFERENCE) and which no later autograd use accepts
      // ("Inference tensors cannot be saved for backward"), depending on where it was first read.
      c10::InferenceMode normal(false);
      if (r.reference) {
        // The storage may have been shrunk since the capture (untyped_storage().resize_(0),
        // as sharded training frees memory): a tensor over it would read past its end.
        int64_t last = r.offset;
        bool empty = false;
        for (size_t d = 0; d < r.sizes.size(); ++d) {
          if (r.sizes[d] == 0) empty = true;
          last += (r.sizes[d] - 1) * r.strides[d];
        }
        const int64_t need = empty ? 0 : (last + 1) * static_cast<int64_t>(c10::elementSize(r.dtype));
        ACS_CHECK(static_cast<int64_t>(r.slab.nbytes()) >= need, "hook point '", name_, "': a tensor kept by ",
                  "CaptureMode.REFERENCE lost its memory after it was captured (its storage now holds ",
                  r.slab.nbytes(), " bytes, the record needs ", need, "; the model or its training freed it, e.g. ",
                  "untyped_storage().resize_(0)): use CaptureMode.SNAPSHOT (the default) for this model");
        r.t = referred(r);
        r.reference = false;
        r.version = c10::VariableVersion();
      } else {
        r.t = Arena::tensor_at(r.slab, r.data, r.sizes, r.dtype);
      }
      r.slab = c10::Storage();
      r.data = nullptr;
    }
    out.push_back(r.t);
  }
  return out;
}

void Sink::clear_records() {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& ev : pending_) ev->synchronize();
  // swapped with empty vectors, not clear()ed: clear() keeps the capacity, so a tracker
  // cleared to free memory still held about 160 bytes per record it had kept
  std::vector<std::shared_ptr<c10::Event>>().swap(pending_);
  std::vector<Record>().swap(records_);
  std::vector<int64_t>().swap(versions_);
  checked_ = 0;
  warned_changed_ = false;  // the records kept from now on are checked (and warned about) again
}

bool Sink::reference_changed(bool all) {
  std::lock_guard<std::mutex> lock(mu_);
  if (warned_changed_ || options_.snapshot) return false;
  const size_t start = all ? 0 : std::min(checked_, versions_.size());
  checked_ = versions_.size();
  for (size_t i = start; i < versions_.size() && i < records_.size(); ++i) {
    if (versions_[i] != kCopied && records_[i].current_version() != versions_[i]) {
      warned_changed_ = true;
      return true;
    }
  }
  return false;
}

}  // namespace acs
