// Fast path kernels of the built-in reductions (reduction_kernels.h): the per-column loops
// and their drivers, compiled for the baseline ISA and, on x86, for AVX2; the float32 sums,
// extrema and centred squares of the fused path also for AVX-512F, and the merge of batch
// means (chan_fold) for AVX2. Every ISA's kernel rounds alike (no FMA: -ffp-contract=off).
#include "reduction_kernels.h"

#include <algorithm>
#include <atomic>
#include <bit>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace acs::kernels {

namespace {

// ------------------------------------------------------------------ fast path kernels
// Per-feature updates of a contiguous CPU batch: plain loops over (n, d) that fold the rows
// into the float64 / int64 state in place, with no ATen op and no allocation per update.
// float32 and float64 rows are read directly and widened to double on load; float16 and
// bfloat16 rows are first widened (exactly) to float32, a few thousand values at a time, into
// a small per-thread buffer, and then go through the float32 kernels.
//
// Two drivers, both compiled for the baseline ISA and, on x86, for AVX2 (picked at run time;
// no FMA, so both round alike):
//  * col_reduce: blocks of kBlock adjacent columns keep their accumulators in registers while
//    running down the rows (sums);
//  * row_fold: acc[j] = step(acc[j], x[i][j]) row after row (extrema: the loop vectoriser
//    turns the NaN-aware selects into compares and blends, the block form would not).
// Every op accumulates (init reads the running value, done writes it back), so a batch can
// be fed in row chunks.
#if defined(__GNUC__)
#define ACS_INLINE inline __attribute__((always_inline))
#else
#define ACS_INLINE inline
#endif
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define ACS_AVX2_DISPATCH 1
// GCC 12 warns in its own AVX-512 header (_mm512_undefined_pd's self-initialised value, which
// the conversions pass as the unused merge source): a false positive, silenced for this file.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#define ACS_TARGET_AVX2 __attribute__((target("avx2")))
#define ACS_TARGET_AVX512 __attribute__((target("avx512f")))
#else
#define ACS_AVX2_DISPATCH 0
#endif

constexpr int64_t kBlock = 16;
constexpr int64_t kConvertChunk = 4096;  // values widened per chunk (half / bfloat16 rows)

// Op: using Acc; static constexpr bool kRowFold; Acc init(j); Acc step(Acc a, double v, j);
// void done(j, Acc a); kRowFold ops instead have fold_row(const T* row, d) (state in place).
template <typename T, typename Op>
ACS_INLINE void col_reduce(const T* __restrict x, int64_t n, int64_t d, Op& op) {
  using Acc = typename Op::Acc;
  if constexpr (Op::kRowFold) {
    for (int64_t i = 0; i < n; ++i) op.fold_row(x + i * d, d);
  } else {
    int64_t j0 = 0;
    for (; j0 + kBlock <= d; j0 += kBlock) {
      Acc a[kBlock];
      for (int64_t k = 0; k < kBlock; ++k) a[k] = op.init(j0 + k);
      for (int64_t i = 0; i < n; ++i) {
        const T* r = x + i * d + j0;
        for (int64_t k = 0; k < kBlock; ++k) a[k] = op.step(a[k], static_cast<double>(r[k]), j0 + k);
      }
      for (int64_t k = 0; k < kBlock; ++k) op.done(j0 + k, a[k]);
    }
    for (; j0 < d; ++j0) {  // the last d % kBlock columns
      Acc a = op.init(j0);
      for (int64_t i = 0; i < n; ++i) a = op.step(a, static_cast<double>(x[i * d + j0]), j0);
      op.done(j0, a);
    }
  }
}

// IEEE half bits -> float, exact, branch-free so that it vectorises (the method of
// c10::detail::fp16_ieee_to_fp32_value, whose conversion loop does not vectorise).
ACS_INLINE float half_bits_to_float(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const float normalized = std::bit_cast<float>((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const float denormalized = std::bit_cast<float>((two_w >> 17) | (126u << 23)) - 0.5f;
  const uint32_t sub = 0u - static_cast<uint32_t>(two_w < (1u << 27));  // zero or subnormal
  const uint32_t bits =
      (std::bit_cast<uint32_t>(denormalized) & sub) | (std::bit_cast<uint32_t>(normalized) & ~sub);
  return std::bit_cast<float>(sign | bits);
}
ACS_INLINE void widen(const c10::Half* __restrict x, int64_t m, float* __restrict out) {
  const uint16_t* h = reinterpret_cast<const uint16_t*>(x);
  for (int64_t k = 0; k < m; ++k) out[k] = half_bits_to_float(h[k]);
}
ACS_INLINE void widen(const c10::BFloat16* __restrict x, int64_t m, float* __restrict out) {
  const uint16_t* h = reinterpret_cast<const uint16_t*>(x);
  for (int64_t k = 0; k < m; ++k) out[k] = std::bit_cast<float>(static_cast<uint32_t>(h[k]) << 16);
}

template <typename T, typename Op>
ACS_INLINE void reduce_rows(const T* x, int64_t n, int64_t d, Op& op) {
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
    col_reduce(x, n, d, op);
  } else {
    thread_local std::vector<float> buf;
    const int64_t chunk = std::max<int64_t>(1, kConvertChunk / std::max<int64_t>(d, 1));
    if (static_cast<int64_t>(buf.size()) < chunk * d) buf.resize(chunk * d);
    for (int64_t i = 0; i < n; i += chunk) {
      const int64_t m = std::min(chunk, n - i);
      widen(x + i * d, m * d, buf.data());
      col_reduce(static_cast<const float*>(buf.data()), m, d, op);
    }
  }
}

template <typename T, typename Op>
void reduce_rows_base(const T* x, int64_t n, int64_t d, Op& op) {
  reduce_rows(x, n, d, op);
}
#if ACS_AVX2_DISPATCH
template <typename T, typename Op>
ACS_TARGET_AVX2 void reduce_rows_avx2(const T* x, int64_t n, int64_t d, Op& op) {
  reduce_rows(x, n, d, op);
}
bool cpu_has_avx2() {
  static const bool yes = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") != 0;
  }();
  return yes;
}
std::atomic<bool> g_avx512_off{false};  // set_avx512_kernels(false): the AVX2 kernels only (tests)
bool avx512_off() { return g_avx512_off.load(std::memory_order_relaxed); }
// AVX-512F (the OS saving the 512-bit state is part of the check, as for AVX2).
bool cpu_has_avx512() {
  static const bool yes = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") != 0 && __builtin_cpu_supports("avx2") != 0;
  }();
  return yes;
}
#endif

template <typename T, typename Op>
void reduce_rows_dispatch(const T* x, int64_t n, int64_t d, Op& op) {
#if ACS_AVX2_DISPATCH
  if (cpu_has_avx2()) return reduce_rows_avx2(x, n, d, op);
#endif
  reduce_rows_base(x, n, d, op);
}

template <typename Op>
void run_cols(const RowsView& r, Op& op) {
  switch (r.dtype) {
    case at::kFloat: return reduce_rows_dispatch(static_cast<const float*>(r.data), r.n, r.d, op);
    case at::kDouble: return reduce_rows_dispatch(static_cast<const double*>(r.data), r.n, r.d, op);
    case at::kHalf: return reduce_rows_dispatch(static_cast<const c10::Half*>(r.data), r.n, r.d, op);
    case at::kBFloat16:
      return reduce_rows_dispatch(static_cast<const c10::BFloat16*>(r.data), r.n, r.d, op);
    default: TORCH_CHECK(false, "internal: no fast reduction path for dtype ", r.dtype);
  }
}

// out[j] += column sum (out zeroed by the caller: the batch sums, as x.sum(0)).
struct SumOp {
  using Acc = double;
  static constexpr bool kRowFold = false;
  double* out;
  ACS_INLINE double init(int64_t j) const { return out[j]; }
  ACS_INLINE double step(double a, double v, int64_t) const { return a + v; }
  ACS_INLINE void done(int64_t j, double a) const { out[j] = a; }
};
// out[j] += sum of squared deviations from mean[j] (out zeroed by the caller).
struct CentredSqOp {
  using Acc = double;
  static constexpr bool kRowFold = false;
  const double* mean;
  double* out;
  ACS_INLINE double init(int64_t j) const { return out[j]; }
  ACS_INLINE double step(double a, double v, int64_t j) const {
    const double c = v - mean[j];
    return a + c * c;
  }
  ACS_INLINE void done(int64_t j, double a) const { out[j] = a; }
};
// acc[j] += sum of squares of the batch (chunk) column, summed apart first as acc + batch.
struct SumSqAddOp {
  using Acc = double;
  static constexpr bool kRowFold = false;
  double* acc;
  ACS_INLINE double init(int64_t) const { return 0.0; }
  ACS_INLINE double step(double a, double v, int64_t) const { return a + v * v; }
  ACS_INLINE void done(int64_t j, double a) const { acc[j] += a; }
};
// acc[j] += number of values != 0 (NaN != 0 is true: counted, as torch.count_nonzero).
struct NonZeroAddOp {
  using Acc = int64_t;
  static constexpr bool kRowFold = false;
  int64_t* acc;
  ACS_INLINE int64_t init(int64_t j) const { return acc[j]; }
  ACS_INLINE int64_t step(int64_t a, double v, int64_t) const { return a + static_cast<int64_t>(v != 0.0); }
  ACS_INLINE void done(int64_t j, int64_t a) const { acc[j] = a; }
};
// Running extremum folded in place; NaN sticks (a NaN value replaces the accumulator and
// nothing replaces a NaN accumulator), as torch.amin / amax and at::minimum / maximum.
template <Ext E>
struct ExtremumOp {
  using Acc = double;
  static constexpr bool kRowFold = true;
  double* acc;
  ACS_INLINE double step(double a, double v, int64_t) const {
    if constexpr (E == Ext::kAbsMax) v = std::fabs(v);
    double m;
    if constexpr (E == Ext::kMin)
      m = v < a ? v : a;
    else
      m = v > a ? v : a;
    return v != v ? v : m;
  }
  ACS_INLINE void fold(int64_t j, double v) const { acc[j] = step(acc[j], v, j); }
  template <typename T>
  ACS_INLINE void fold_row(const T* __restrict r, int64_t d) const {
    double* __restrict a = acc;
    for (int64_t j = 0; j < d; ++j) a[j] = step(a[j], static_cast<double>(r[j]), j);
  }
};
// The shared first pass of the fused path (update_reductions): column sums, minima and
// maxima of a batch in one sweep (sum[] zeroed, mn[] = +inf, mx[] = -inf by the caller).
// Each column is summed in row order from 0, as SumOp, so the batch mean is the same.
struct SumMinMaxOp {
  using Acc = double;
  static constexpr bool kRowFold = true;
  double* sum;
  double* mn;
  double* mx;
  // A row at a time, through restrict-qualified parameters so that the loop vectorises: the
  // compiler must know that the three state arrays do not overlap. (Folding four rows per
  // load / store of the state measured slower: the dependent selects then bound the loop.)
  template <typename T>
  static ACS_INLINE void row(const T* __restrict r, int64_t d, double* __restrict s, double* __restrict lo,
                             double* __restrict hi) {
    for (int64_t j = 0; j < d; ++j) {
      const double v = static_cast<double>(r[j]);
      s[j] += v;
      const double a = lo[j], b = hi[j];
      const double m = v < a ? v : a, M = v > b ? v : b;
      lo[j] = v != v ? v : m;
      hi[j] = v != v ? v : M;
    }
  }
  template <typename T>
  ACS_INLINE void fold_row(const T* r, int64_t d) const { row(r, d, sum, mn, mx); }
};

#if ACS_AVX2_DISPATCH
// SumMinMaxOp on float32 rows with AVX2 intrinsics: blocks of 8 columns keep their sums,
// minima, maxima, a "saw a NaN" mask and the last NaN seen in registers down the rows (the row
// fold above keeps them in memory, one load and store per row). The same results, bit for bit:
// each column summed in row order in double (no FMA), min / max picked by the same comparisons
// (v < lo ? v : lo), and a column that saw a NaN (or started as one) ends as the last NaN it
// saw, sign and payload kept, as the row fold's lo = v != v ? v : m does.
//
// Blocks of 16 columns first take a path without the NaN bookkeeping: four independent sum
// chains per row instead of two (the latency of the additions bounds this loop, not its
// count of instructions). A NaN anywhere in a column makes its sum NaN, so when any of the
// block's sums ends NaN (or the block started from a NaN state) nothing is stored and the
// block is done again by the exact 8-column path below; otherwise the results are those of
// that path, bit for bit (the same additions in the same order, the same min / max).
ACS_TARGET_AVX2 ACS_INLINE void store16(double* p, __m256d a, __m256d b, __m256d c, __m256d e) {
  _mm256_storeu_pd(p, a);
  _mm256_storeu_pd(p + 4, b);
  _mm256_storeu_pd(p + 8, c);
  _mm256_storeu_pd(p + 12, e);
}

ACS_TARGET_AVX2 ACS_INLINE bool unordered(__m256d a, __m256d b, __m256d c, __m256d e) {
  const __m256d u = _mm256_or_pd(_mm256_or_pd(_mm256_cmp_pd(a, a, _CMP_UNORD_Q), _mm256_cmp_pd(b, b, _CMP_UNORD_Q)),
                                 _mm256_or_pd(_mm256_cmp_pd(c, c, _CMP_UNORD_Q), _mm256_cmp_pd(e, e, _CMP_UNORD_Q)));
  return _mm256_movemask_pd(u) != 0;
}

ACS_TARGET_AVX2 bool sum_min_max_f32_avx2_16(const float* __restrict x, int64_t n, int64_t d,
                                             double* __restrict sum, double* __restrict mn,
                                             double* __restrict mx) {
  __m256d s0 = _mm256_loadu_pd(sum), s1 = _mm256_loadu_pd(sum + 4);
  __m256d s2 = _mm256_loadu_pd(sum + 8), s3 = _mm256_loadu_pd(sum + 12);
  __m256d l0 = _mm256_loadu_pd(mn), l1 = _mm256_loadu_pd(mn + 4);
  __m256d l2 = _mm256_loadu_pd(mn + 8), l3 = _mm256_loadu_pd(mn + 12);
  __m256d h0 = _mm256_loadu_pd(mx), h1 = _mm256_loadu_pd(mx + 4);
  __m256d h2 = _mm256_loadu_pd(mx + 8), h3 = _mm256_loadu_pd(mx + 12);
  if (unordered(s0, s1, s2, s3) || unordered(l0, l1, l2, l3) || unordered(h0, h1, h2, h3)) return false;
  const float* p = x;
  for (int64_t i = 0; i < n; ++i, p += d) {
    const __m256 va = _mm256_loadu_ps(p), vb = _mm256_loadu_ps(p + 8);
    const __m256d v0 = _mm256_cvtps_pd(_mm256_castps256_ps128(va));
    const __m256d v1 = _mm256_cvtps_pd(_mm256_extractf128_ps(va, 1));
    const __m256d v2 = _mm256_cvtps_pd(_mm256_castps256_ps128(vb));
    const __m256d v3 = _mm256_cvtps_pd(_mm256_extractf128_ps(vb, 1));
    s0 = _mm256_add_pd(s0, v0);
    s1 = _mm256_add_pd(s1, v1);
    s2 = _mm256_add_pd(s2, v2);
    s3 = _mm256_add_pd(s3, v3);
    l0 = _mm256_min_pd(v0, l0);
    l1 = _mm256_min_pd(v1, l1);
    l2 = _mm256_min_pd(v2, l2);
    l3 = _mm256_min_pd(v3, l3);
    h0 = _mm256_max_pd(v0, h0);
    h1 = _mm256_max_pd(v1, h1);
    h2 = _mm256_max_pd(v2, h2);
    h3 = _mm256_max_pd(v3, h3);
  }
  if (unordered(s0, s1, s2, s3)) return false;  // a NaN (or inf - inf) in some column
  store16(sum, s0, s1, s2, s3);
  store16(mn, l0, l1, l2, l3);
  store16(mx, h0, h1, h2, h3);
  return true;
}

// CentredSqOp on float32 rows, 16 columns a block: out[j] += (x[i][j] - mean[j])^2 down the
// rows in row order, as the op does (subtract, multiply, add: no FMA), four independent
// chains per row.
ACS_TARGET_AVX2 void centred_squares_f32_avx2(const float* __restrict x, int64_t n, int64_t d,
                                              const double* __restrict mean, double* __restrict out,
                                              int64_t j0 = 0) {
  for (; j0 + 16 <= d; j0 += 16) {
    const __m256d m0 = _mm256_loadu_pd(mean + j0), m1 = _mm256_loadu_pd(mean + j0 + 4);
    const __m256d m2 = _mm256_loadu_pd(mean + j0 + 8), m3 = _mm256_loadu_pd(mean + j0 + 12);
    __m256d a0 = _mm256_loadu_pd(out + j0), a1 = _mm256_loadu_pd(out + j0 + 4);
    __m256d a2 = _mm256_loadu_pd(out + j0 + 8), a3 = _mm256_loadu_pd(out + j0 + 12);
    const float* p = x + j0;
    for (int64_t i = 0; i < n; ++i, p += d) {
      const __m256 va = _mm256_loadu_ps(p), vb = _mm256_loadu_ps(p + 8);
      const __m256d c0 = _mm256_sub_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(va)), m0);
      const __m256d c1 = _mm256_sub_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(va, 1)), m1);
      const __m256d c2 = _mm256_sub_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(vb)), m2);
      const __m256d c3 = _mm256_sub_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(vb, 1)), m3);
      a0 = _mm256_add_pd(a0, _mm256_mul_pd(c0, c0));
      a1 = _mm256_add_pd(a1, _mm256_mul_pd(c1, c1));
      a2 = _mm256_add_pd(a2, _mm256_mul_pd(c2, c2));
      a3 = _mm256_add_pd(a3, _mm256_mul_pd(c3, c3));
    }
    store16(out + j0, a0, a1, a2, a3);
  }
  for (; j0 < d; ++j0) {  // the last d % 16 columns: CentredSqOp's steps
    double a = out[j0];
    for (int64_t i = 0; i < n; ++i) {
      const double c = static_cast<double>(x[i * d + j0]) - mean[j0];
      a = a + c * c;
    }
    out[j0] = a;
  }
}

ACS_TARGET_AVX2 void sum_min_max_f32_avx2(const float* __restrict x, int64_t n, int64_t d, double* __restrict sum,
                                          double* __restrict mn, double* __restrict mx, int64_t j0 = 0) {
  // up to the first block with a NaN; from there on the 8-column path (more are likely)
  while (j0 + 16 <= d && sum_min_max_f32_avx2_16(x + j0, n, d, sum + j0, mn + j0, mx + j0)) j0 += 16;
  for (; j0 + 8 <= d; j0 += 8) {
    __m256d s0 = _mm256_loadu_pd(sum + j0), s1 = _mm256_loadu_pd(sum + j0 + 4);
    __m256d l0 = _mm256_loadu_pd(mn + j0), l1 = _mm256_loadu_pd(mn + j0 + 4);
    __m256d h0 = _mm256_loadu_pd(mx + j0), h1 = _mm256_loadu_pd(mx + j0 + 4);
    // a NaN state (from an earlier chunk) is one value in mn and mx, as the row fold leaves it
    __m256d q0 = _mm256_cmp_pd(l0, l0, _CMP_UNORD_Q), q1 = _mm256_cmp_pd(l1, l1, _CMP_UNORD_Q);
    __m256d nv0 = l0, nv1 = l1;  // the last NaN seen (where q is set)
    const float* p = x + j0;
    for (int64_t i = 0; i < n; ++i, p += d) {
      const __m256 v = _mm256_loadu_ps(p);
      const __m256d v0 = _mm256_cvtps_pd(_mm256_castps256_ps128(v));
      const __m256d v1 = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
      s0 = _mm256_add_pd(s0, v0);
      s1 = _mm256_add_pd(s1, v1);
      l0 = _mm256_min_pd(v0, l0);  // v < l ? v : l (l when either is NaN: the mask keeps it)
      l1 = _mm256_min_pd(v1, l1);
      h0 = _mm256_max_pd(v0, h0);  // v > h ? v : h
      h1 = _mm256_max_pd(v1, h1);
      const __m256d u0 = _mm256_cmp_pd(v0, v0, _CMP_UNORD_Q), u1 = _mm256_cmp_pd(v1, v1, _CMP_UNORD_Q);
      q0 = _mm256_or_pd(q0, u0);
      q1 = _mm256_or_pd(q1, u1);
      nv0 = _mm256_blendv_pd(nv0, v0, u0);
      nv1 = _mm256_blendv_pd(nv1, v1, u1);
    }
    _mm256_storeu_pd(sum + j0, s0);
    _mm256_storeu_pd(sum + j0 + 4, s1);
    _mm256_storeu_pd(mn + j0, _mm256_blendv_pd(l0, nv0, q0));
    _mm256_storeu_pd(mn + j0 + 4, _mm256_blendv_pd(l1, nv1, q1));
    _mm256_storeu_pd(mx + j0, _mm256_blendv_pd(h0, nv0, q0));
    _mm256_storeu_pd(mx + j0 + 4, _mm256_blendv_pd(h1, nv1, q1));
  }
  for (; j0 < d; ++j0) {  // the last d % 8 columns: SumMinMaxOp's steps, one column at a time
    double s = sum[j0], a = mn[j0], b = mx[j0];
    for (int64_t i = 0; i < n; ++i) {
      const double v = static_cast<double>(x[i * d + j0]);
      s += v;
      const double m = v < a ? v : a, M = v > b ? v : b;
      a = v != v ? v : m;
      b = v != v ? v : M;
    }
    sum[j0] = s;
    mn[j0] = a;
    mx[j0] = b;
  }
}

// The same two kernels with AVX-512F, 32 columns a block (four chains of 8 doubles per row:
// twice the columns per instruction of the AVX2 blocks, and as many independent additions
// per row). The same additions in the same order, the same min / max, no FMA: the results of
// the AVX2 kernels bit for bit. The columns after the last block of 32 go to the AVX2 kernels.
ACS_TARGET_AVX512 ACS_INLINE void store32(double* p, __m512d a, __m512d b, __m512d c, __m512d e) {
  _mm512_storeu_pd(p, a);
  _mm512_storeu_pd(p + 8, b);
  _mm512_storeu_pd(p + 16, c);
  _mm512_storeu_pd(p + 24, e);
}

ACS_TARGET_AVX512 ACS_INLINE bool unordered512(__m512d a, __m512d b, __m512d c, __m512d e) {
  return (_mm512_cmp_pd_mask(a, a, _CMP_UNORD_Q) | _mm512_cmp_pd_mask(b, b, _CMP_UNORD_Q) |
          _mm512_cmp_pd_mask(c, c, _CMP_UNORD_Q) | _mm512_cmp_pd_mask(e, e, _CMP_UNORD_Q)) != 0;
}

// As sum_min_max_f32_avx2_16 (no NaN bookkeeping; false, and nothing stored, when a sum ends
// NaN or the state holds a NaN): the caller does the block again on the exact path.
ACS_TARGET_AVX512 bool sum_min_max_f32_avx512_32(const float* __restrict x, int64_t n, int64_t d,
                                                 double* __restrict sum, double* __restrict mn,
                                                 double* __restrict mx) {
  __m512d s0 = _mm512_loadu_pd(sum), s1 = _mm512_loadu_pd(sum + 8);
  __m512d s2 = _mm512_loadu_pd(sum + 16), s3 = _mm512_loadu_pd(sum + 24);
  __m512d l0 = _mm512_loadu_pd(mn), l1 = _mm512_loadu_pd(mn + 8);
  __m512d l2 = _mm512_loadu_pd(mn + 16), l3 = _mm512_loadu_pd(mn + 24);
  __m512d h0 = _mm512_loadu_pd(mx), h1 = _mm512_loadu_pd(mx + 8);
  __m512d h2 = _mm512_loadu_pd(mx + 16), h3 = _mm512_loadu_pd(mx + 24);
  if (unordered512(s0, s1, s2, s3) || unordered512(l0, l1, l2, l3) || unordered512(h0, h1, h2, h3)) return false;
  const float* p = x;
  for (int64_t i = 0; i < n; ++i, p += d) {
    const __m512d v0 = _mm512_cvtps_pd(_mm256_loadu_ps(p));
    const __m512d v1 = _mm512_cvtps_pd(_mm256_loadu_ps(p + 8));
    const __m512d v2 = _mm512_cvtps_pd(_mm256_loadu_ps(p + 16));
    const __m512d v3 = _mm512_cvtps_pd(_mm256_loadu_ps(p + 24));
    s0 = _mm512_add_pd(s0, v0);
    s1 = _mm512_add_pd(s1, v1);
    s2 = _mm512_add_pd(s2, v2);
    s3 = _mm512_add_pd(s3, v3);
    l0 = _mm512_min_pd(v0, l0);
    l1 = _mm512_min_pd(v1, l1);
    l2 = _mm512_min_pd(v2, l2);
    l3 = _mm512_min_pd(v3, l3);
    h0 = _mm512_max_pd(v0, h0);
    h1 = _mm512_max_pd(v1, h1);
    h2 = _mm512_max_pd(v2, h2);
    h3 = _mm512_max_pd(v3, h3);
  }
  if (unordered512(s0, s1, s2, s3)) return false;  // a NaN (or inf - inf) in some column
  store32(sum, s0, s1, s2, s3);
  store32(mn, l0, l1, l2, l3);
  store32(mx, h0, h1, h2, h3);
  return true;
}

ACS_TARGET_AVX512 void sum_min_max_f32_avx512(const float* __restrict x, int64_t n, int64_t d,
                                              double* __restrict sum, double* __restrict mn,
                                              double* __restrict mx) {
  int64_t j0 = 0;
  // up to the first block with a NaN; from there on the AVX2 kernel (its exact 8-column path)
  while (j0 + 32 <= d && sum_min_max_f32_avx512_32(x + j0, n, d, sum + j0, mn + j0, mx + j0)) j0 += 32;
  if (j0 < d) sum_min_max_f32_avx2(x, n, d, sum, mn, mx, j0);
}

ACS_TARGET_AVX512 void centred_squares_f32_avx512(const float* __restrict x, int64_t n, int64_t d,
                                                  const double* __restrict mean, double* __restrict out) {
  int64_t j0 = 0;
  for (; j0 + 32 <= d; j0 += 32) {
    const __m512d m0 = _mm512_loadu_pd(mean + j0), m1 = _mm512_loadu_pd(mean + j0 + 8);
    const __m512d m2 = _mm512_loadu_pd(mean + j0 + 16), m3 = _mm512_loadu_pd(mean + j0 + 24);
    __m512d a0 = _mm512_loadu_pd(out + j0), a1 = _mm512_loadu_pd(out + j0 + 8);
    __m512d a2 = _mm512_loadu_pd(out + j0 + 16), a3 = _mm512_loadu_pd(out + j0 + 24);
    const float* p = x + j0;
    for (int64_t i = 0; i < n; ++i, p += d) {
      const __m512d c0 = _mm512_sub_pd(_mm512_cvtps_pd(_mm256_loadu_ps(p)), m0);
      const __m512d c1 = _mm512_sub_pd(_mm512_cvtps_pd(_mm256_loadu_ps(p + 8)), m1);
      const __m512d c2 = _mm512_sub_pd(_mm512_cvtps_pd(_mm256_loadu_ps(p + 16)), m2);
      const __m512d c3 = _mm512_sub_pd(_mm512_cvtps_pd(_mm256_loadu_ps(p + 24)), m3);
      a0 = _mm512_add_pd(a0, _mm512_mul_pd(c0, c0));
      a1 = _mm512_add_pd(a1, _mm512_mul_pd(c1, c1));
      a2 = _mm512_add_pd(a2, _mm512_mul_pd(c2, c2));
      a3 = _mm512_add_pd(a3, _mm512_mul_pd(c3, c3));
    }
    store32(out + j0, a0, a1, a2, a3);
  }
  if (j0 < d) centred_squares_f32_avx2(x, n, d, mean, out, j0);
}
#endif

// Chan's merge of one batch's column means (and sums of centred squares) into the running
// state (see chan_fold in the header). The scalar form is the definition; the AVX2 form does
// the same operations four columns at a time (both branches, then a select; no FMA).
ACS_INLINE void chan_fold_cols(double* __restrict mean, double* __restrict m2, const double* __restrict mb,
                               const double* __restrict m2b, int64_t j, int64_t d, double wa, double wb, double wm) {
  for (; j < d; ++j) {
    const double a = mean[j], b = mb[j];
    const double delta = b - a;
    mean[j] = std::isfinite(delta) ? a + delta * wb : a * wa + b * wb;  // (delta finite: a and b are)
    if (m2 != nullptr) m2[j] = m2[j] + m2b[j] + delta * delta * wm;
  }
}

#if ACS_AVX2_DISPATCH
ACS_TARGET_AVX2 void chan_fold_avx2(double* __restrict mean, double* __restrict m2, const double* __restrict mb,
                                    const double* __restrict m2b, int64_t d, double wa, double wb, double wm) {
  const __m256d va = _mm256_set1_pd(wa), vb = _mm256_set1_pd(wb), vm = _mm256_set1_pd(wm);
  const __m256d big = _mm256_set1_pd(DBL_MAX);
  const __m256d abs_mask = _mm256_castsi256_pd(_mm256_set1_epi64x(0x7FFFFFFFFFFFFFFFLL));
  int64_t j = 0;
  for (; j + 4 <= d; j += 4) {
    const __m256d a = _mm256_loadu_pd(mean + j), b = _mm256_loadu_pd(mb + j);
    const __m256d delta = _mm256_sub_pd(b, a);
    const __m256d chan = _mm256_add_pd(a, _mm256_mul_pd(delta, vb));
    const __m256d weighted = _mm256_add_pd(_mm256_mul_pd(a, va), _mm256_mul_pd(b, vb));
    // |delta| <= DBL_MAX: false for +-inf and NaN (an ordered comparison), as !std::isfinite;
    // a finite delta means both means are finite too
    const __m256d finite = _mm256_cmp_pd(_mm256_and_pd(delta, abs_mask), big, _CMP_LE_OQ);
    _mm256_storeu_pd(mean + j, _mm256_blendv_pd(weighted, chan, finite));
    if (m2 != nullptr) {
      const __m256d s = _mm256_add_pd(_mm256_loadu_pd(m2 + j), _mm256_loadu_pd(m2b + j));
      _mm256_storeu_pd(m2 + j, _mm256_add_pd(s, _mm256_mul_pd(_mm256_mul_pd(delta, delta), vm)));
    }
  }
  chan_fold_cols(mean, m2, mb, m2b, j, d, wa, wb, wm);
}
#endif

}  // namespace

void chan_fold(double* mean, double* m2, const double* mb, const double* m2b, int64_t d, double wa, double wb,
               double wm) {
#if ACS_AVX2_DISPATCH
  if (cpu_has_avx2()) return chan_fold_avx2(mean, m2, mb, m2b, d, wa, wb, wm);
#endif
  chan_fold_cols(mean, m2, mb, m2b, 0, d, wa, wb, wm);
}

void add_column_sums(const RowsView& r, double* out) {
  SumOp op{out};
  run_cols(r, op);
}

void add_centred_squares(const RowsView& r, const double* mean, double* out) {
#if ACS_AVX2_DISPATCH
  if (r.dtype == at::kFloat && cpu_has_avx512() && !avx512_off())
    return centred_squares_f32_avx512(static_cast<const float*>(r.data), r.n, r.d, mean, out);
  if (r.dtype == at::kFloat && cpu_has_avx2())
    return centred_squares_f32_avx2(static_cast<const float*>(r.data), r.n, r.d, mean, out);
#endif
  CentredSqOp op{mean, out};
  run_cols(r, op);
}

void add_sum_squares(const RowsView& r, double* acc) {
  SumSqAddOp op{acc};
  run_cols(r, op);
}

void add_nonzero_counts(const RowsView& r, int64_t* acc) {
  NonZeroAddOp op{acc};
  run_cols(r, op);
}

void fold_extremum(Ext e, const RowsView& r, double* acc) {
  switch (e) {
    case Ext::kMin: {
      ExtremumOp<Ext::kMin> op{acc};
      return run_cols(r, op);
    }
    case Ext::kMax: {
      ExtremumOp<Ext::kMax> op{acc};
      return run_cols(r, op);
    }
    case Ext::kAbsMax: {
      ExtremumOp<Ext::kAbsMax> op{acc};
      return run_cols(r, op);
    }
  }
}

void fold_extremum_values(Ext e, const double* v, int64_t d, double* acc) {
  if (e == Ext::kMin) {
    ExtremumOp<Ext::kMin> op{acc};
    for (int64_t j = 0; j < d; ++j) op.fold(j, v[j]);
  } else {  // max, and absmax (v already holds |x| maxima)
    ExtremumOp<Ext::kMax> op{acc};
    for (int64_t j = 0; j < d; ++j) op.fold(j, v[j]);
  }
}

bool set_avx512_kernels(bool on) {
#if ACS_AVX2_DISPATCH
  g_avx512_off.store(!on, std::memory_order_relaxed);
  return cpu_has_avx512();
#else
  (void)on;
  return false;
#endif
}

#if ACS_AVX2_DISPATCH
// add_sums_fold_min_max of float16 / bfloat16 rows: widened (exactly) to float32 a chunk of
// rows at a time, as reduce_rows does, then the float32 kernels. Each chunk accumulates into
// sum / mn / mx in row order, so the results are the row fold's (SumMinMaxOp), bit for bit.
template <typename T>
void sum_min_max_widened(const T* x, int64_t n, int64_t d, double* sum, double* mn, double* mx) {
  thread_local std::vector<float> buf;
  const int64_t chunk = std::max<int64_t>(1, kConvertChunk / std::max<int64_t>(d, 1));
  if (static_cast<int64_t>(buf.size()) < chunk * d) buf.resize(chunk * d);
  const bool wide = cpu_has_avx512() && !avx512_off();
  for (int64_t i = 0; i < n; i += chunk) {
    const int64_t m = std::min(chunk, n - i);
    widen(x + i * d, m * d, buf.data());
    if (wide) {
      sum_min_max_f32_avx512(buf.data(), m, d, sum, mn, mx);
    } else {
      sum_min_max_f32_avx2(buf.data(), m, d, sum, mn, mx);
    }
  }
}
#endif

void add_sums_fold_min_max(const RowsView& r, double* sum, double* mn, double* mx) {
#if ACS_AVX2_DISPATCH
  if (r.dtype == at::kHalf && cpu_has_avx2())
    return sum_min_max_widened(static_cast<const c10::Half*>(r.data), r.n, r.d, sum, mn, mx);
  if (r.dtype == at::kBFloat16 && cpu_has_avx2())
    return sum_min_max_widened(static_cast<const c10::BFloat16*>(r.data), r.n, r.d, sum, mn, mx);
  if (r.dtype == at::kFloat && cpu_has_avx512() && !avx512_off())
    return sum_min_max_f32_avx512(static_cast<const float*>(r.data), r.n, r.d, sum, mn, mx);
  if (r.dtype == at::kFloat && cpu_has_avx2())
    return sum_min_max_f32_avx2(static_cast<const float*>(r.data), r.n, r.d, sum, mn, mx);
#endif
  SumMinMaxOp op{sum, mn, mx};
  run_cols(r, op);
}

}  // namespace acs::kernels
